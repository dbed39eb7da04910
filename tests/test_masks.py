"""Exact masks on real chat templates, checked against an independent per-turn oracle.

Oracle: for assistant turn i, render(messages[:i], add_generation_prompt=True) is a prefix of
render(messages[:i+1]); what the turn adds, minus trailing newlines, is the assistant content
plus its end-of-turn token: exactly the text the trained tokens must decode to.
"""
import json
import pytest
from helpers import trained_runs
from transformers import AutoTokenizer
from sft_nb.formats import BadRow, normalize_row
from sft_nb.models import smollm2_chat_template
from sft_nb.templates import FAMILY_SPECIALS, add_family_specials, collapse_template, render, chat_ids
from sft_nb.renderers import tokenize_conversation

FAMILIES = [f for f in FAMILY_SPECIALS]
STRICT = {'chatml', 'llama-3-instruct', 'mistral-instruct', 'gemma-it', 'phi-3'}  # alternate user/assistant only

MULTI = [{'role': 'user', 'content': 'Hi there, who are you?'}, {'role': 'assistant', 'content': 'I am a tiny model.'},
         {'role': 'user', 'content': 'What is 2 + 2?'}, {'role': 'assistant', 'content': '  It is 4.\n'}]
SYSTEM = [{'role': 'system', 'content': 'You answer briefly.'}] + MULTI
TOOLS = [{'type': 'function', 'function': {'name': 'get_weather', 'description': 'Weather in a city',
          'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}}}}]
TOOL_CONV = [{'role': 'user', 'content': 'Weather in Paris?'},
             {'role': 'assistant', 'content': '', 'tool_calls': '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
             {'role': 'tool', 'content': '{"temp": 21}'},
             {'role': 'assistant', 'content': 'It is 21 degrees in Paris.'}]
CONVS = {'multi': (MULTI, None), 'system': (SYSTEM, None), 'tools': (TOOL_CONV, TOOLS)}


@pytest.fixture(scope='module')
def templates(tiny_path, shared):
    out = {}
    for fam in FAMILIES:
        tok = add_family_specials(AutoTokenizer.from_pretrained(tiny_path), fam)
        if fam == 'smollm2': text = smollm2_chat_template()
        else:
            text = (shared / 'templates' / f'{fam}.jinja').read_text()
            if fam != 'qwen2.5-instruct': text = collapse_template(text)
        out[fam] = (tok, text)
    return out


def oracle(tok, template, msgs, tools, mode):
    "Trained text per assistant turn, from per-turn re-rendering (slow, independent of our algorithm)."
    asst = [i for i, m in enumerate(msgs) if m['role'] == 'assistant']
    turns = asst[-1:] if mode == 'last_assistant' else asst
    out = []
    for i in turns:
        prefix = render(tok, msgs[:i], tools, template=template, add_generation_prompt=True)
        full = render(tok, msgs[:i + 1], tools, template=template)
        assert full.startswith(prefix), 'template is not append-only'
        out.append(full[len(prefix):].rstrip('\n'))
    return out


@pytest.mark.parametrize('mode', ['all_assistant', 'last_assistant', 'all'])
@pytest.mark.parametrize('conv', list(CONVS))
@pytest.mark.parametrize('family', FAMILIES)
def test_masks_on_real_templates(templates, family, conv, mode):
    tok, template = templates[family]
    raw, tools = CONVS[conv]
    canon = normalize_row({'messages': raw, 'tools': tools}, 'messages')
    msgs, tools = canon['messages'], canon['tools']
    if conv == 'tools' and family in STRICT:  # these templates refuse tool turns: a reported bad row, never a wrong mask
        with pytest.raises(BadRow, match='template'):
            from sft_nb.config import TokenizeConfig
            from sft_nb.renderers import tokenize_rows
            _, bad = tokenize_rows([{'messages': raw, 'tools': tools}], tok, TokenizeConfig(chat_template=template, mode=mode), 'messages')
            raise BadRow(bad[0][2], kind=bad[0][1])
        return
    ex = tokenize_conversation(raw, tok, mode=mode, tools=tools, template=template)
    assert ex.input_ids == chat_ids(tok, msgs, tools, template=template)
    assert len(ex.loss_mask) == len(ex.input_ids)
    if mode == 'all':
        assert all(ex.loss_mask)
        return
    expected = oracle(tok, template, msgs, tools, mode)
    assert trained_runs(ex, tok) == expected
    eot = tok.convert_ids_to_tokens(ex.input_ids[[i for i, m in enumerate(ex.loss_mask) if m][-1]])
    assert eot in tok.all_special_tokens, f'end-of-turn {eot!r} must be trained'


def test_tool_call_text_is_trained(templates):
    tok, template = templates['qwen2.5-instruct']
    ex = tokenize_conversation(TOOL_CONV, tok, tools=TOOLS, template=template)
    runs = trained_runs(ex, tok)
    assert runs[0].startswith('<tool_call>') and '"get_weather"' in runs[0] and runs[0].endswith('</tool_call><|im_end|>')
    # the tool output and the tool schema in the system turn are never trained
    trained = ''.join(runs)
    assert '"temp": 21' not in trained and 'Weather in a city' not in trained


def test_default_system_prompt_not_trained(templates):
    tok, template = templates['smollm2']
    ex = tokenize_conversation(MULTI, tok, template=template)
    assert 'SmolLM' in ex.text and 'SmolLM' not in ''.join(trained_runs(ex, tok))


def test_no_second_bos(templates):
    tok, template = templates['llama-3-instruct']
    ex = tokenize_conversation(MULTI, tok, template=template)
    assert ex.input_ids.count(tok.convert_tokens_to_ids('<|begin_of_text|>')) == 1
