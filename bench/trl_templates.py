#!/usr/bin/env python
"""Masks against an independent ground truth (issue 26; a check, not a test): for every TRL template pair `X.jinja` /
`X_training.jinja` (TRL ships both; the training one adds `{% generation %}` tags), sft_nb's spans on the original
template vs transformers' `return_assistant_tokens_mask` on the training template, on conversations of several kinds,
with the tiny tokenizer plus the template's special tokens.

    pip install --no-deps -r bench/requirements.txt      # TRL, whose chat_templates/ folder this reads
    HF_HUB_OFFLINE=1 python bench/trl_templates.py [--templates DIR]

Per case it prints OK (identical trained text), ok~ (identical after the stated differences of our contract: the part of
the generation prompt a TRL tag covers is prompt to us; template text after the end-of-turn token, such as ChatML's
newline or Phi-3's final EOS, is never trained) or -- with both runs. Cases the template refuses, and pairs whose two
templates render different text, are counted apart.
"""
import sys
from pathlib import Path
_HERE = Path(__file__).resolve().parent  # bench/tokenize.py would shadow the stdlib module: drop this folder from sys.path
sys.path[:] = [p for p in sys.path if Path(p or '.').resolve() != _HERE]
import re, json, argparse
from transformers import AutoTokenizer
from sft_nb.models import tiny_chat_model
from sft_nb.renderers import tokenize_conversation, tokenize_turns
from sft_nb.templates import template_info, chat_ids
ap = argparse.ArgumentParser(); ap.add_argument('--templates', default=None, help="folder of TRL's chat templates (default: the installed trl's)")
args = ap.parse_args()
if args.templates: D = Path(args.templates)
else:
    import trl
    D = Path(trl.__file__).parent / 'chat_templates'
CALL = [{'type': 'function', 'function': {'name': 'multiply', 'arguments': {'a': 3, 'b': 4}}}]
TOOLS = [{'type': 'function', 'function': {'name': 'multiply', 'description': 'Multiply', 'parameters': {'type': 'object', 'properties': {'a': {'type': 'integer'}, 'b': {'type': 'integer'}}}}}]
U = lambda c: {'role': 'user', 'content': c}; A = lambda c, **k: {'role': 'assistant', 'content': c, **k}
CONVS = {'single': ([U('What color is the sky?'), A('It is blue.')], None),
         'multi': ([U('Hi'), A('Hello there.'), U('What is 2+2?'), A('It is 4.')], None),
         'system': ([{'role': 'system', 'content': 'You are helpful'}, U('Hello'), A('Hi, how can I help you?')], None),
         'quote': ([U('q1'), A('bar'), U('Earlier you wrote: bar'), A('Yes, bar.')], None),
         'tools': ([U('Multiply 3 by 4.'), A('I will call a tool.', tool_calls=CALL), {'role': 'tool', 'name': 'multiply', 'content': '12'}, A('It is 12.')], TOOLS),
         'reasoning': ([U('What color is the sky?'), A('It is blue.', reasoning_content='The sky scatters shorter wavelengths.')], None),
         'ends_user': ([U('Hi'), A('Hello.'), U('Bye')], None)}
SPECIAL = re.compile(r"<\|[A-Za-z0-9_./ -]+\|>|<｜[^｜]+｜>|<(?:start_of_turn|end_of_turn|bos|eos|think|/think|tool_call|/tool_call|tool_response|/tool_response)>|\[/?(?:INST|TOOL_CALLS|AVAILABLE_TOOLS|/AVAILABLE_TOOLS|TOOL_RESULTS|/TOOL_RESULTS|SYSTEM_PROMPT|/SYSTEM_PROMPT)\]|<\/s>|<s>|\[gMASK\]|<sop>|<BOS_TOKEN>|<\|END_OF_TURN_TOKEN\|>")
EOS = {'llama3': '<|eot_id|>', 'phi3': '<|endoftext|>', 'phi3_5': '<|endoftext|>', 'gemma': '<eos>', 'gemma3': '<eos>', 'qwen2_5': '<|im_end|>',
       'qwen3': '<|im_end|>', 'deepseekv3': '<｜end▁of▁sentence｜>', 'gptoss': '<|return|>', 'glm4moe': '<|endoftext|>', 'cohere': '<|END_OF_TURN_TOKEN|>',
       'cohere2': '<|END_OF_TURN_TOKEN|>', 'lfm2': '<|im_end|>'}
out = []
for tr in sorted(D.glob('*_training.jinja')):
    fam = tr.name[:-len('_training.jinja')]
    orig = D / f'{fam}.jinja'
    if not orig.exists() or any(k in fam for k in ('vl', 'llava', 'idefics', 'diffusion', 'smolvlm')): continue
    t_orig, t_tr = orig.read_text(), tr.read_text()
    tok = AutoTokenizer.from_pretrained(tiny_chat_model())
    sp = sorted(set(SPECIAL.findall(t_orig + t_tr)))
    named = {'eos_token': EOS.get(fam, sp[0] if sp else '</s>')}
    if '<bos>' in sp: named['bos_token'] = '<bos>'
    if '<｜begin▁of▁sentence｜>' in sp: named['bos_token'] = '<｜begin▁of▁sentence｜>'
    if '<|begin_of_text|>' in sp: named['bos_token'] = '<|begin_of_text|>'
    if '<BOS_TOKEN>' in sp: named['bos_token'] = '<BOS_TOKEN>'
    tok.add_special_tokens({**named, 'additional_special_tokens': sp})
    for name, (msgs, tools) in CONVS.items():
        row = {'family': fam, 'conv': name}
        try:
            ref = tok.apply_chat_template(msgs, tools=tools, chat_template=t_tr, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            same = tok.apply_chat_template(msgs, tools=tools, chat_template=t_orig, tokenize=False) == tok.apply_chat_template(msgs, tools=tools, chat_template=t_tr, tokenize=False)
        except Exception as e: row['ref'] = f'refused: {type(e).__name__}: {str(e)[:80]}'; out.append(row); continue
        row['byte_identical'] = same
        refruns = []; cur = []
        for i, m in zip(ref['input_ids'], ref['assistant_masks']):
            if m: cur.append(i)
            elif cur: refruns.append(tok.decode(cur)); cur = []
        if cur: refruns.append(tok.decode(cur))
        try:
            info = template_info(tok, t_orig)
            row['mechanism'] = info.mechanism
            hist = 'final' if info.rewrites_history else 'error'
            ex = tokenize_conversation(msgs, tok, tools=tools, template=t_orig, rewritten_turns=hist)
            ours = []; cur = []
            for i, m in zip(ex.input_ids, ex.loss_mask):
                if m: cur.append(i)
                elif cur: ours.append(tok.decode(cur)); cur = []
            if cur: ours.append(tok.decode(cur))
            row['ids_equal'] = ex.input_ids == list(ref['input_ids']) if same else None
        except Exception as e: ours = f'{type(e).__name__}: {str(e)[:160]}'
        row['ref'], row['ours'] = refruns, ours
        row['match'] = ours == refruns
        def norm(r):
            g = info.gen_prompt  # the part of the generation prompt a tag covers (TRL tags the header, or its newline, or '<think>')
            k = next((n for n in range(len(g), 0, -1) if r.startswith(g[len(g) - n:])), 0)
            r = r[k:]
            h = g[:g.index('<think>')] if '<think>' in g else ''
            if h and r.startswith(h): r = r[len(h):]
            if r.rstrip().endswith(info.specials): r = r.rstrip()
            if info.eot and info.after_eot and r.endswith(info.eot + info.after_eot.rstrip()): r = r[:len(r) - len(info.after_eot.rstrip())]
            return r
        row['match_contract'] = isinstance(ours, list) and [norm(r) for r in refruns] == ours
        out.append(row)
for r in out:
    flag = 'OK ' if r.get('match') else 'ok~' if r.get('match_contract') else '-- '
    print(flag, r['family'], r['conv'], r.get('mechanism'), 'bytes=' + str(r.get('byte_identical')))
    if not r.get('match'): print('     ref :', r.get('ref')); print('     ours:', r.get('ours'))
print(sum(1 for r in out if r.get('match')), 'of', len(out), 'match exactly;', sum(1 for r in out if r.get('match_contract')), 'match after the stated differences (header in the tag, trailing newline/EOS after the end token);',
      sum(1 for r in out if 'ref' in r and isinstance(r['ref'], str)), 'refused by the template;', sum(1 for r in out if r.get('byte_identical') is False), 'where TRL training template renders other text')
