"""Our shipped training templates: each renders byte-for-byte what the family's original template renders, on
many conversations, and its `{% generation %}` masks equal the prefix-rendering masks of the original.

Originals: `../shared/templates/` (the chat_templates repository, MIT; collapsed as its README says) and
`tests/fixtures/templates/qwen3.jinja` (Qwen3's own template, sources in that folder's README); SmolLM2-135M-Instruct's
own template (`sft_nb.models.smollm2_chat_template`, from the model's GGUF).
"""
import random
from pathlib import Path
import pytest
from transformers import AutoTokenizer
from sft_nb.models import tiny_chat_model, smollm2_chat_template
from sft_nb.templates import CHAT_TEMPLATES, add_family_specials, collapse_template, load_template, probe_template, render
from sft_nb.formats import BadRow
from sft_nb.renderers import tokenize_turns

SHARED = Path(__file__).resolve().parents[2] / 'shared'
ORIGINAL = {'chatml': 'chatml', 'llama3': 'llama-3-instruct', 'mistral': 'mistral-instruct', 'gemma': 'gemma-it', 'phi3': 'phi-3',
            'qwen2.5': 'qwen2.5-instruct'}

def original(name: str) -> str:
    if name == 'qwen3': return (Path(__file__).parent / 'fixtures' / 'templates' / 'qwen3.jinja').read_text()
    if name == 'smollm2': return smollm2_chat_template()
    text = (SHARED / 'templates' / f'{ORIGINAL[name]}.jinja').read_text()
    return text if name == 'qwen2.5' else collapse_template(text)

@pytest.fixture(scope='module')
def toks():
    return {n: add_family_specials(AutoTokenizer.from_pretrained(tiny_chat_model()), fam) for n, (fam, _) in CHAT_TEMPLATES.items()}

TEXTS = ['Hi', ' leading space', 'trailing space ', 'two\nlines', '\nnewline first', 'Seven.', 'a <b> c', 'naïve café', '  ', 'x' * 40,
         '{"json": 1}', 'The answer is 4.\n\n']

def conversation(rng: random.Random, features) -> tuple[list[dict], list | None]:
    "A random conversation the template accepts: alternating user/assistant, maybe a system turn, tools and reasoning where rendered."
    msgs = [{'role': 'system', 'content': rng.choice(TEXTS)}] if 'system' in features and rng.random() < 0.5 else []
    tools = None
    if 'tools' in features and rng.random() < 0.5:
        tools = [{'type': 'function', 'function': {'name': 'get_weather', 'description': 'weather', 'parameters': {
                  'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}}]
    for _ in range(rng.randint(1, 3)):
        msgs.append({'role': 'user', 'content': rng.choice(TEXTS).strip() or 'q'})
        if 'tool_calls' in features and rng.random() < 0.4:
            call = {'role': 'assistant', 'content': rng.choice(['', 'Let me check.']),
                    'tool_calls': [{'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': rng.choice(['Oslo', 'Rome'])}}}]}
            if 'reasoning' in features and rng.random() < 0.5: call['reasoning_content'] = rng.choice(TEXTS).strip() or 'r'
            msgs += [call, {'role': 'tool', 'content': '{"temp_c": 3}'}]
        a = {'role': 'assistant', 'content': rng.choice(TEXTS).strip() or 'a'}
        if 'reasoning' in features and rng.random() < 0.5: a['reasoning_content'] = rng.choice(TEXTS).strip() or 'r'
        msgs.append(a)
    return msgs, tools

@pytest.mark.parametrize('name', list(CHAT_TEMPLATES))
def test_shipped_template_renders_as_the_original(name, toks):
    tok, shipped, orig = toks[name], load_template(name), original(name)
    assert '{% generation %}' in shipped or '{%- generation %}' in shipped or '{%-  generation  %}' in shipped
    assert probe_template(tok, shipped).mechanism == 'tags'
    rng, features = random.Random(name), CHAT_TEMPLATES[name][1]
    for k in range(150):
        msgs, tools = conversation(rng, features)
        for gen in (False, True):
            assert render(tok, msgs, tools, template=shipped, add_generation_prompt=gen) == \
                   render(tok, msgs, tools, template=orig, add_generation_prompt=gen), (name, k, msgs)

def without_twin(template: str) -> str:
    """The template with a branch only the twin probes reach (their contents hold 'qzx'; these conversations never do): it
    renders every conversation here byte for byte like `template`, has no tagged twin (`sft_nb.templates.tagged_twin`), so its masks come
    from prefix renders, the judge of the tags."""
    return "{% if messages[0]['content'] is string and 'qzx' in messages[0]['content'] %}-{% endif %}" + template

@pytest.mark.parametrize('name', list(CHAT_TEMPLATES))
def test_tag_masks_equal_prefix_masks(name, toks):
    """Same ids and the same trained tokens from the shipped template's tags as from prefix-rendering the original, in every
    mode; on Qwen3 (it rewrites history) with rewritten_turns='expand' (the default: one example per turn) and 'final' (the full
    render; where the original's prefix renders can place every turn: 'final' refuses some rows the tags handle)."""
    tok, shipped, orig = toks[name], load_template(name), without_twin(original(name))
    assert probe_template(tok, orig).twin == ''
    rewrites = probe_template(tok, orig).rewrites_history
    rng, features = random.Random(name + 'mask'), CHAT_TEMPLATES[name][1]
    n, compared = 0, 0
    for k in range(60):
        msgs, tools = conversation(rng, features)
        for mode in ('all_assistant', 'last_assistant'):
            for rewritten_turns in (('expand', 'final') if rewrites else ('error',)):
                a = tokenize_turns(msgs, tok, mode=mode, tools=tools, template=shipped, rewritten_turns=rewritten_turns)
                try: b = tokenize_turns(msgs, tok, mode=mode, tools=tools, template=orig, rewritten_turns=rewritten_turns)
                except BadRow:
                    assert rewritten_turns == 'final'; continue
                assert [x.input_ids for x in a] == [x.input_ids for x in b] and [x.text for x in a] == [x.text for x in b]
                assert [x.loss_mask for x in a] == [x.loss_mask for x in b], (name, k, mode, rewritten_turns, msgs)
                n += all(sum(x.loss_mask) > 0 for x in a); compared += 1
    assert n == compared >= (120 if not rewrites else 200)  # every example trains something; Qwen3: most 'final' rows compared too
