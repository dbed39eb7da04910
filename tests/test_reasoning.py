"""Reasoning and agent templates: exact masks on every template × conversation × mode × rewritten_turns strategy.

Oracle (independent of sft_nb's header probing): for assistant turn i of a render F, message i is replaced by a
marker assistant message and re-rendered: the text after the marker is the suffix S (end-of-turn onward); F must end
with S. The turn starts after G = render(messages[:i], add_generation_prompt=True) when F starts with G (what the model
produces at inference), else after the text P before the marker (the template's header for that turn); when F starts
with neither (reasoning given to Qwen3 in no-think mode), after P without its empty `<think>\n\n</think>\n\n`.
The trained text is F[start:len(F)-len(S)] plus the end-of-turn special token S starts with.
Trained token runs, decoded, must equal these texts; nothing else may be trained; ids must equal apply_chat_template.
"""
import json, re
import numpy as np
from pathlib import Path
import pytest
from helpers import trained_runs
from transformers import AutoTokenizer
from sft_nb.formats import BadRow, normalize_row
from sft_nb.models import smollm2_chat_template
from sft_nb.templates import FAMILY_SPECIALS, TemplateError, add_family_specials, collapse_template, render, chat_ids
from sft_nb.config import TokenizeConfig
from sft_nb.renderers import tokenize_conversation, tokenize_rows, tokenize_turns

FIX = Path(__file__).parent / 'fixtures' / 'templates'
DS_SPECIALS = ['<｜User｜>', '<｜Assistant｜>', '<｜tool▁calls▁begin｜>', '<｜tool▁calls▁end｜>', '<｜tool▁call▁begin｜>',
               '<｜tool▁call▁end｜>', '<｜tool▁sep｜>', '<｜tool▁outputs▁begin｜>', '<｜tool▁outputs▁end｜>',
               '<｜tool▁output▁begin｜>', '<｜tool▁output▁end｜>']
NEW = {  # name → (fixture file, chat_template_kwargs, special tokens the real tokenizer has)
    'qwen3': ('qwen3.jinja', {}, {'additional_special_tokens': ['<|im_start|>', '<|im_end|>']}),
    'qwen3-nothink': ('qwen3.jinja', {'enable_thinking': False}, {'additional_special_tokens': ['<|im_start|>', '<|im_end|>']}),
    'qwq': ('qwq.jinja', {}, {'additional_special_tokens': ['<|im_start|>', '<|im_end|>']}),
    'deepseek-r1-distill': ('deepseek-r1-distill.jinja', {}, {'bos_token': '<｜begin▁of▁sentence｜>',
                            'eos_token': '<｜end▁of▁sentence｜>', 'additional_special_tokens': DS_SPECIALS})}
TEMPLATES = list(FAMILY_SPECIALS) + list(NEW)
REWRITES = {'qwen3', 'qwen3-nothink', 'qwq'}

WEATHER = [{'type': 'function', 'function': {'name': 'get_weather', 'description': 'Current weather in a city',
            'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}}]
text = lambda s: [{'type': 'text', 'text': s}]  # structured content parts
SINGLE = [{'role': 'user', 'content': 'Name a prime number.'}, {'role': 'assistant', 'content': 'Seven.'}]
MULTI = [{'role': 'system', 'content': 'You answer briefly.'}, {'role': 'user', 'content': text('Hi there, who are you?')},
         {'role': 'assistant', 'content': 'I am a tiny model.'}, {'role': 'user', 'content': 'What is 2 + 2?'},
         {'role': 'assistant', 'content': text('  It is 4.\n')}]
REASONING = [{'role': 'user', 'content': 'Is 91 prime?'},
             {'role': 'assistant', 'content': '<think>\n91 = 7 * 13, so it has divisors.\n</think>\n\nNo, 91 = 7 × 13.'},
             {'role': 'user', 'content': text('And 97?')},
             {'role': 'assistant', 'content': text('Yes, 97 is prime.'),
              'reasoning_content': 'Check 2, 3, 5, 7: none divides 97, and 11² > 97.'}]
AGENT = [{'role': 'system', 'content': 'You are a weather assistant.'},
         {'role': 'user', 'content': text('Should I take an umbrella in Paris today?')},
         {'role': 'assistant', 'content': 'Let me check the weather.', 'reasoning_content': 'I need the forecast for Paris.',
          'tool_calls': [{'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': 'Paris'}}}]},
         {'role': 'tool', 'content': '{"city": "Paris", "rain_probability": 0.8}'},
         {'role': 'assistant', 'content': 'Yes: an 80% chance of rain in Paris.', 'reasoning_content': 'Rain is likely.'},
         {'role': 'user', 'content': 'And in Rome?'},
         {'role': 'assistant', 'content': '', 'reasoning_content': 'Same tool, other city.',
          'tool_calls': '{"name": "get_weather", "arguments": {"city": "Rome"}}'},
         {'role': 'tool', 'content': '{"city": "Rome", "rain_probability": 0.1}'},
         {'role': 'assistant', 'content': 'No, only a 10% chance of rain in Rome.'}]


def glaive_row(shared):
    rows = json.loads((shared / 'datasets' / 'glaive_toolcall_en_demo.json').read_text())
    return next(r for r in rows if [t['from'] for t in r['conversations']].count('function_call') >= 2)


@pytest.fixture(scope='module')
def templates(tiny_path, shared):
    out = {}
    for name in TEMPLATES:
        tok = AutoTokenizer.from_pretrained(tiny_path)
        if name in NEW:
            f, kw, specials = NEW[name]
            tok.add_special_tokens(specials)
            out[name] = (tok, (FIX / f).read_text(), kw)
            continue
        add_family_specials(tok, name)
        if name == 'smollm2': t = smollm2_chat_template()
        else:
            t = (shared / 'templates' / f'{name}.jinja').read_text()
            if name != 'qwen2.5-instruct': t = collapse_template(t)
        out[name] = (tok, t, {})
    return out


@pytest.fixture(scope='module')
def convs(shared):
    g = glaive_row(shared)
    return {'single': ({'messages': SINGLE}, 'messages'), 'multi': ({'messages': MULTI}, 'messages'),
            'tools': (g, 'sharegpt'), 'reasoning': ({'messages': REASONING}, 'messages'),
            'agent': ({'messages': AGENT, 'tools': WEATHER}, 'messages')}


MARK = 'qzxORACLEmark'


def expected_turn(tok, tpl, kw, msgs, tools, i, full):
    "Trained text of assistant message i in the render `full` of `msgs` (see the module docstring)."
    r = lambda m, gen=False: render(tok, m, tools, template=tpl, add_generation_prompt=gen, **kw)
    v = r(msgs[:i] + [{'role': 'assistant', 'content': MARK}] + msgs[i + 1:])
    p, s = v[:v.index(MARK)], v[v.index(MARK) + len(MARK):]
    assert full.endswith(s), 'oracle: the turn is not isolated by its marker render'
    g = r(msgs[:i], True)
    if full.startswith(g) and (i == len(msgs) - 1 or len(g) <= len(p)): start = len(g)
    elif full.startswith(p): start = len(p)
    else:
        p = p.removesuffix('<think>\n\n</think>\n\n')
        assert full.startswith(p), 'oracle: no header of turn %d is a prefix of the render' % i
        start = len(p)
    eot = next(t for t in sorted(tok.all_special_tokens, key=len, reverse=True) if s.startswith(t))
    return full[start:len(full) - len(s)] + eot


def drop_parts(t, reasoning, tool_calls):
    "Independent split of an expected turn text into the runs that stay trained."
    if not reasoning: t = re.sub(r'^(<think>)?.*?</think>\n*', '', t, flags=re.S) if '</think>' in t else t
    if not tool_calls:  # the newline that separates an answer from the calls goes with the calls
        return [x for x in re.split(r'(?:(?<=[^\n])\n)?<tool_call>.*</tool_call>', t, flags=re.S) if x]
    return [t]


def check(tok, tpl, kw, msgs, tools, ex, trained, reasoning=True, tool_calls=True):
    "ids = apply_chat_template(msgs); trained runs = the oracle's texts of `trained` turns, nothing else."
    assert ex.input_ids == chat_ids(tok, msgs, tools, template=tpl, **kw)
    full = render(tok, msgs, tools, template=tpl, **kw)
    assert ex.text == full
    want = [x for i in trained for x in drop_parts(expected_turn(tok, tpl, kw, msgs, tools, i, full), reasoning, tool_calls)]
    assert trained_runs(ex, tok) == want


STRATEGIES = ['last_assistant', 'completion_only', 'expand', 'final', 'error']
FLAGS = [(True, True), (False, True), (True, False)]


@pytest.mark.parametrize('flags', FLAGS, ids=['train_all', 'mask_reasoning', 'mask_tool_calls'])
@pytest.mark.parametrize('strategy', STRATEGIES)
@pytest.mark.parametrize('conv', ['single', 'multi', 'tools', 'reasoning', 'agent'])
@pytest.mark.parametrize('name', TEMPLATES)
def test_mask_matrix(templates, convs, name, conv, strategy, flags):
    tok, tpl, kw = templates[name]
    row, fmt = convs[conv]
    c = normalize_row(row, fmt)
    msgs, tools = c['messages'], c['tools']
    mode = strategy if strategy in ('last_assistant', 'completion_only') else 'all_assistant'
    rewritten_turns = 'expand' if mode != 'all_assistant' else strategy
    reasoning, tool_calls = flags
    spec = TokenizeConfig(mode=mode, rewritten_turns=rewritten_turns, chat_template=tpl, chat_template_kwargs=kw, max_length=None,
                        train_on_reasoning=reasoning, train_on_tool_calls=tool_calls)
    try: render(tok, msgs, tools, template=tpl, **kw)
    except Exception:  # templates that refuse tool turns or roles: a reported bad row, never a wrong mask
        good, bad = tokenize_rows([{'messages': msgs, 'tools': tools}], tok, spec, 'messages')
        assert good == [] and bad[0][1] == 'template_error'
        return
    asst = [i for i, m in enumerate(msgs) if m['role'] == 'assistant']
    kwargs = dict(mode=mode, tools=tools, template=tpl, chat_template_kwargs=kw, rewritten_turns=rewritten_turns,
                  train_on_reasoning=reasoning, train_on_tool_calls=tool_calls)
    if strategy == 'error' and name in REWRITES and len(asst) > 1:
        with pytest.raises(TemplateError, match="rewritten_turns='expand'"): tokenize_turns(msgs, tok, **kwargs)
        return
    exs = tokenize_turns(msgs, tok, **kwargs)
    good, bad = tokenize_rows([{'messages': msgs, 'tools': tools}], tok, spec, 'messages')
    assert bad == [] and [e.input_ids for _, e in good] == [e.input_ids for e in exs]
    assert [e.loss_mask for _, e in good] == [e.loss_mask for e in exs]
    if strategy == 'expand' and name in REWRITES:  # one example per turn, each the render up to that turn
        assert len(exs) == len(asst)
        for i, ex in zip(asst, exs): check(tok, tpl, kw, msgs[:i + 1], tools, ex, [i], *flags)
        return
    assert len(exs) == 1
    check(tok, tpl, kw, msgs, tools, exs[0], asst if mode == 'all_assistant' else asst[-1:], *flags)


def test_qwen3_multiturn_last_assistant_regression(templates):
    "Qwen3 no-think, multi-turn, last_assistant: the row tokenizes; its empty think block is prompt (given, not trained)."
    tok, tpl, kw = templates['qwen3-nothink']
    msgs = normalize_row({'messages': MULTI}, 'messages')['messages']
    ex = tokenize_conversation(MULTI, tok, mode='last_assistant', template=tpl, chat_template_kwargs=kw)
    assert ex.input_ids == chat_ids(tok, msgs, template=tpl, **kw)
    assert ex.text.endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n  It is 4.\n<|im_end|>\n')
    assert trained_runs(ex, tok) == ['  It is 4.\n<|im_end|>']  # the empty think block is the generation prompt: given, not trained


def test_expanded_rows_keep_their_index(templates, tmp_path):
    from sft_nb.tokenize import tokenize_dataset
    tok, tpl, kw = templates['qwen3']
    rows = [{'messages': SINGLE}, {'messages': REASONING}, {'messages': [{'role': 'user', 'content': 'x'}]}, {'messages': MULTI}]
    ds, rep = tokenize_dataset(rows, tok, TokenizeConfig(chat_template=tpl, max_length=None), cache_dir=tmp_path)
    assert ds['index'] == [0, 1, 1, 3, 3]
    assert (rep.n_rows, rep.n_kept, rep.n_examples, rep.n_dropped) == (4, 3, 5, 1)
    assert '3 kept (5 examples)' in str(rep)
    ds, rep = tokenize_dataset(rows, tok, TokenizeConfig(chat_template=tpl, max_length=None, rewritten_turns='final'), cache_dir=tmp_path)
    assert ds['index'] == [0, 1, 3] and rep.n_examples == 3


def test_expanded_row_dropped_whole(templates):
    "One too-long turn drops the whole row (a row is kept or dropped as a unit), reported once."
    tok, tpl, kw = templates['qwen3']
    short = tokenize_turns(REASONING, tok, template=tpl)
    spec = TokenizeConfig(chat_template=tpl, max_length=len(short[0]) + 1, truncation='drop')
    good, bad = tokenize_rows([{'messages': REASONING}], tok, spec, 'messages')
    assert good == [] and [b[:2] for b in bad] == [(0, 'too_long')]


def test_bad_history_value(templates):
    tok, tpl, kw = templates['qwen3']
    with pytest.raises(ValueError, match="rewritten_turns: 'sometimes' is not allowed"): tokenize_turns(MULTI, tok, template=tpl, rewritten_turns='sometimes')


def _trainer_data(tiny_path, tmp_path, rows, **tokenize):
    "The trainer's tokenized train set and held-out split for a config, without starting Ray (only `_prepare_data`)."
    from helpers import run_cfg
    from sft_nb.trainer import SFTTrainer
    over = {f'tokenize__{k}': v for k, v in {'chat_template': str(FIX / 'qwen3.jinja'), 'max_length': 1024,
                                                 'cache_dir': str(tmp_path / 'cache'), **tokenize}.items()}
    t = SFTTrainer(run_cfg(tiny_path, tmp_path / 'run', **over), train_data=rows)
    t.tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    t._prepare_data()
    return t


@pytest.mark.parametrize('opts', [{}, {'rewritten_turns': 'final'}, {'train_on_reasoning': False}, {'train_on_tool_calls': False},
                                  {'rewritten_turns': 'final', 'train_on_reasoning': False}], ids=str)
def test_trainer_config_reaches_tokenization(tiny_path, tmp_path, opts):
    "tokenize.rewritten_turns / train_on_reasoning / train_on_tool_calls in a trainer config give the examples tokenize_turns gives."
    tok, tpl = AutoTokenizer.from_pretrained(tiny_path), (FIX / 'qwen3.jinja').read_text()
    ds = _trainer_data(tiny_path, tmp_path, [{'messages': REASONING}, {'messages': AGENT}], **opts).data.train_sets[0]
    want = [(i, e) for i, m in enumerate([REASONING, AGENT]) for e in tokenize_turns(m, tok, template=tpl, **opts)]
    assert ds['index'] == [i for i, _ in want]
    assert ds['input_ids'] == [e.input_ids for _, e in want] and ds['loss_mask'] == [e.loss_mask for _, e in want]
    default = [e for m in [REASONING, AGENT] for e in tokenize_turns(m, tok, template=tpl)]
    assert len(ds) == (2 if opts.get('rewritten_turns') == 'final' else 6)  # expand: one example per assistant turn (2 + 4)
    if opts.get('train_on_reasoning') is False or opts.get('train_on_tool_calls') is False:
        assert sum(ds['n_trained']) < sum(e.n_trained for e in default)  # the masked parts are seen, not trained


def test_heldout_split_keeps_expanded_row_on_one_side(tiny_path, tmp_path):
    "data.eval_fraction with rewritten_turns: expand draws source rows: a row's examples are all train or all held out."
    rows = [{'messages': [{'role': 'user', 'content': f'Is {n} prime?'}, {'role': 'assistant', 'content': 'Let me see.'},
                          {'role': 'user', 'content': 'Well?'}, {'role': 'assistant', 'content': f'{n} is odd.'}]} for n in range(1, 40, 2)]
    t = _trainer_data(tiny_path, tmp_path, rows)
    t.cfg.data.eval_fraction = 0.3
    t._prepare_data()
    index = np.asarray(t.data.train_sets[0]['index'])
    assert len(t.data.train_sets[0]) == 2 * len(rows)  # qwen3 rewrites history: two examples per row
    train, held = {int(index[i]) for _, i in t.data.rows}, {int(index[i]) for _, i in t.data.heldout}
    assert not train & held, f"rows on both sides: {sorted(train & held)}"
    assert len(held) == int(len(rows) * 0.3) and len(t.data.rows) + len(t.data.heldout) == 2 * len(rows)
