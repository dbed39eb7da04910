"""Masks judged by LLaMA-Factory's and Axolotl's own mask tests, ported as facts: their conversations and
which text they train, checked against ours. Each case names its source file. Templates are the real ones of
`../shared/templates` (Llama 3, Gemma, Qwen2.5, Phi-3, ChatML), `tests/fixtures/templates/qwen3.jinja`, the two
that Axolotl's `tests/prompt_strategies/conftest.py` ships as text (Gemma 2 whole; Mistral v0.3 the part a tool-free
conversation takes), or ours written to the
layout the peer's test spells out (Llama 4, Phi-4). The tokenizer is the tests' tiny one with each family's special
tokens added.

Suite: 28 cases in `CASES` (asserted by `test_case_count`) + 8 ported test cases below (38 collected with the two counting tests), over 10 template families here and 15 with
`tests/test_peer_masks.py` (asserted by `test_families`). Axolotl's `tests/prompt_strategies/test_chat_template_utils.py`
is not ported: it tests choosing a template by name (no masks).

Stated differences from these peers (our contract, DESIGN.md, is kept; not failures):
- LLaMA-Factory's answer strings end with the newline after the end token (`<|im_end|>\\n`, `<end_of_turn>\\n`):
  we never train template text after the end-of-turn token (the model never generates it).
- LLaMA-Factory `train_on_prompt` labels every token: `labels_for` never has a target at position 0 (nothing predicts it).
- Axolotl `train_on_eos='none'` leaves the end-of-turn token untrained: we always train it (its default
  `train_on_eos='turn'` does too); `train_on_eos='all'` also trains the end tokens of user turns: we never do.
- Axolotl `roles_to_train=['human']` trains user turns: we train assistant turns only (user text is never trained).
- Axolotl `roles_to_train=[]` keeps a row with no label: we report it as a bad row (`empty_mask`), never train it.
- Axolotl's default (no `roles_to_train`) trains the last assistant turn: our `mode='last_assistant'`.
"""
import pytest
from pathlib import Path
from helpers import trained_runs
from transformers import AutoTokenizer
from sft_nb.formats import BadRow, normalize_row
from sft_nb.templates import add_family_specials, chat_ids, collapse_template
from sft_nb.config import TokenizeConfig
from sft_nb.renderers import tokenize_conversation, tokenize_turns, tokenize_rows

FIX = Path(__file__).parent / 'fixtures' / 'templates'
U = lambda c: {'role': 'user', 'content': c}
A = lambda c, **k: {'role': 'assistant', 'content': c, **k}
S = lambda c: {'role': 'system', 'content': c}


def untrained_runs(ex, tok) -> list[str]:
    runs, cur = [], []
    for i, m in zip(ex.input_ids, ex.loss_mask):
        if not m: cur.append(i)
        elif cur: runs.append(tok.decode(cur)); cur = []
    return runs + ([tok.decode(cur)] if cur else [])


# ---- templates: (family, template text, special tokens, named tokens)
def shared_template(shared, name):
    text = (shared / 'templates' / f'{name}.jinja').read_text()
    return text if name == 'qwen2.5-instruct' else collapse_template(text)


# Axolotl tests/prompt_strategies/conftest.py: fixture_gemma2_chat_template_jinja_w_system (its text)
GEMMA2 = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}"
          "{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
# Axolotl tests/prompt_strategies/conftest.py: fixture_mistralv03_chat_template_jinja_w_system, the part a tool-free
# conversation takes (system merged into the first user turn, ' ' + trimmed answer + eos_token), in its own words
MISTRAL3 = ("{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
            "{%- else %}{%- set loop_messages = messages %}{%- endif %}{{- bos_token }}{%- for message in loop_messages %}"
            "{%- if message['role'] == 'user' %}{%- if loop.first and system_message is defined %}"
            "{{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
            "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}{%- endif %}{%- endfor %}")
# LLaMA-Factory tests/data/test_template.py::test_llama4_template spells this layout out; the template is ours
LLAMA4 = ("{{ bos_token }}{% for m in messages %}<|header_start|>{{ m.role }}<|header_end|>\n\n{{ m.content | trim }}<|eot|>{% endfor %}"
          "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}")
# LLaMA-Factory tests/data/test_template.py::test_phi4_template (and Axolotl's phi_4) layout; the template is ours
PHI4 = ("{% for m in messages %}<|im_start|>{{ m.role }}<|im_sep|>{{ m.content }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant<|im_sep|>{% endif %}")


@pytest.fixture(scope='module')
def fam(tiny_path, shared):
    "family → (tokenizer, template text)."
    def tok(*specials, **named):
        t = AutoTokenizer.from_pretrained(tiny_path)
        t.add_special_tokens({**named, 'additional_special_tokens': list(specials)})
        return t
    def shipped(name):
        return add_family_specials(AutoTokenizer.from_pretrained(tiny_path), name), shared_template(shared, name)
    return {'llama-3': shipped('llama-3-instruct'), 'gemma': shipped('gemma-it'), 'qwen2.5': shipped('qwen2.5-instruct'),
            'phi-3': shipped('phi-3'), 'chatml': shipped('chatml'),
            'qwen3': (tok('<|im_start|>', '<|im_end|>'), (FIX / 'qwen3.jinja').read_text()),
            'gemma-2': (tok('<start_of_turn>', '<end_of_turn>', bos_token='<bos>', eos_token='<eos>'), GEMMA2),
            'mistral-v0.3': (tok('[INST]', '[/INST]', bos_token='<s>', eos_token='</s>'), MISTRAL3),
            'llama-4': (tok('<|header_start|>', '<|header_end|>', '<|eot|>', bos_token='<|begin_of_text|>'), LLAMA4),
            'phi-4': (tok('<|im_start|>', '<|im_sep|>', '<|im_end|>'), PHI4)}


# ---- LLaMA-Factory tests/data/test_template.py: MESSAGES, MESSAGES_WITH_THOUGHT and the prompt/answer strings it expects
LF = 'LLaMA-Factory tests/data/test_template.py'
MESSAGES = [U('How are you'), A('I am fine!'), U('你好'), A('很高兴认识你！')]
THOUGHT = [U('How are you'), A('<think>\nModel thought here\n</think>\n\nI am fine!'), U('你好'), A('<think>\n模型思考内容\n</think>\n\n很高兴认识你！')]
LLAMA3_P1 = '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHow are you<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
LLAMA3_P2 = '<|start_header_id|>user<|end_header_id|>\n\n你好<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'

# ---- Axolotl tests/prompt_strategies/conftest.py datasets
AX = 'Axolotl tests/prompt_strategies/test_chat_templates.py'
AXA = 'Axolotl tests/prompt_strategies/test_chat_templates_advanced.py'
ASSISTANT = [U('hello'), A('hello'), U('goodbye'), A('goodbye')]  # fixture_assistant_dataset
BASIC = [S('You are an AI assistant.'), U('Hello'), A('Hi there!'), U('How are you?'), A("I'm doing well, thank you!")]  # fixture_basic_dataset

# (source, family, conversation, mode, trained runs we expect, untrained runs we expect or None)
CASES = [
    (LF + '::test_encode_multiturn', 'llama-3', MESSAGES, 'all_assistant', ['I am fine!<|eot_id|>', '很高兴认识你！<|eot_id|>'], [LLAMA3_P1, LLAMA3_P2]),
    (LF + '::test_encode_oneturn', 'llama-3', MESSAGES, 'last_assistant', ['很高兴认识你！<|eot_id|>'],
     [LLAMA3_P1 + 'I am fine!<|eot_id|>' + LLAMA3_P2]),
    (LF + '::test_llama4_template', 'llama-4', MESSAGES, 'last_assistant', ['很高兴认识你！<|eot|>'],
     ['<|begin_of_text|><|header_start|>user<|header_end|>\n\nHow are you<|eot|><|header_start|>assistant<|header_end|>\n\nI am fine!<|eot|>'
      '<|header_start|>user<|header_end|>\n\n你好<|eot|><|header_start|>assistant<|header_end|>\n\n']),
    (LF + '::test_phi4_template', 'phi-4', MESSAGES, 'last_assistant', ['很高兴认识你！<|im_end|>'],
     ['<|im_start|>user<|im_sep|>How are you<|im_end|><|im_start|>assistant<|im_sep|>I am fine!<|im_end|><|im_start|>user<|im_sep|>你好<|im_end|>'
      '<|im_start|>assistant<|im_sep|>']),
    (LF + '::test_gemma_template', 'gemma', MESSAGES, 'last_assistant', ['很高兴认识你！<end_of_turn>'],  # LF: '…<end_of_turn>\n' (stated)
     ['<start_of_turn>user\nHow are you<end_of_turn>\n<start_of_turn>model\nI am fine!<end_of_turn>\n<start_of_turn>user\n你好<end_of_turn>\n'
      '<start_of_turn>model\n', '\n']),  # LF's prompt opens with '<bos>': the shared gemma-it.jinja writes none
    (LF + '::test_gemma2_template', 'gemma-2', MESSAGES, 'last_assistant', ['很高兴认识你！<end_of_turn>'], None),
    (LF + '::test_qwen2_5_template', 'qwen2.5', MESSAGES, 'last_assistant', ['很高兴认识你！<|im_end|>'],  # LF: '…<|im_end|>\n' (stated)
     ['<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHow are you<|im_end|>\n'
      '<|im_start|>assistant\nI am fine!<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n', '\n']),
    (LF + '::test_qwen3_template[cot_messages=False]', 'qwen3', MESSAGES, 'last_assistant', ['<think>\n\n</think>\n\n很高兴认识你！<|im_end|>'],
     ['<|im_start|>user\nHow are you<|im_end|>\n<|im_start|>assistant\nI am fine!<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n', '\n']),
    (LF + '::test_qwen3_template[cot_messages=True]', 'qwen3', THOUGHT, 'last_assistant', [THOUGHT[3]['content'] + '<|im_end|>'],
     ['<|im_start|>user\nHow are you<|im_end|>\n<|im_start|>assistant\nI am fine!<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n', '\n']),
    # ---- LLaMA-Factory tests/data/processor/test_supervised.py (system_chat rows: system + turns; llama3)
    ('LLaMA-Factory tests/data/processor/test_supervised.py::test_supervised_multi_turn', 'llama-3',
     [S('You are a helpful assistant.'), *MESSAGES], 'all_assistant', ['I am fine!<|eot_id|>', '很高兴认识你！<|eot_id|>'], None),
    # ---- Axolotl tests/prompt_strategies/test_chat_templates.py
    (AX + '::TestAssistantChatTemplateLlama3::test_llama3_with_training_data', 'llama-3', ASSISTANT, 'all_assistant',
     ['hello<|eot_id|>', 'goodbye<|eot_id|>'], None),  # Axolotl train_on_eos='none': 'hello', 'goodbye' (stated)
    (AX + '::TestAssistantChatTemplateLlama3::test_phi35', 'phi-3', ASSISTANT, 'last_assistant', ['goodbye<|end|>'], None),
    (AX + '::TestSharegptChatTemplateLlama3::test_llama3_system_human', 'llama-3', BASIC, 'all_assistant',
     ['Hi there!<|eot_id|>', "I'm doing well, thank you!<|eot_id|>"], None),
] + [  # Axolotl test_chat_templates_advanced.py: TestChatTemplateConfigurations over its families, train_on_inputs=False,
       # roles_to_train=['assistant'], train_on_eos='turn' (each trained turn's end token trained), on fixture_basic_dataset
    (AXA + f'::TestChatTemplateConfigurations::test_train_on_eos_turn[{f}]', f, BASIC, 'all_assistant',
     [(' ' if f == 'mistral-v0.3' else '') + 'Hi there!' + end, (' ' if f == 'mistral-v0.3' else '') + "I'm doing well, thank you!" + end], None)
    for f, end in (('llama-3', '<|eot_id|>'), ('chatml', '<|im_end|>'), ('mistral-v0.3', '</s>'), ('gemma-2', '<end_of_turn>'),
                   ('phi-3', '<|end|>'), ('phi-4', '<|im_end|>'))
] + [
    (AX + f'::test_phi35 (the default of Axolotl trains the last assistant turn), on fixture_basic_dataset with {f}', f, BASIC, 'last_assistant',
     [(' ' if f == 'mistral-v0.3' else '') + "I'm doing well, thank you!" + end], None)
    for f, end in (('llama-3', '<|eot_id|>'), ('chatml', '<|im_end|>'), ('mistral-v0.3', '</s>'), ('gemma-2', '<end_of_turn>'),
                   ('phi-3', '<|end|>'), ('phi-4', '<|im_end|>'))
] + [  # the tokenizer-shipped families of test_chat_templates_advanced on fixture_assistant_dataset (its labels: content + end token)
    (AXA + f'::fixture_assistant_dataset[{f}]', f, ASSISTANT, 'all_assistant', ['hello' + end, 'goodbye' + end], None)
    for f, end in (('gemma', '<end_of_turn>'), ('qwen2.5', '<|im_end|>'), ('llama-4', '<|eot|>'))
]


def test_case_count():
    assert len(CASES) == 28  # the count the module docstring states


def test_families():
    from test_peer_masks import PEER_TEMPLATES
    here = {c[1] for c in CASES}
    assert here == {'llama-3', 'llama-4', 'phi-3', 'phi-4', 'gemma', 'gemma-2', 'qwen2.5', 'qwen3', 'chatml', 'mistral-v0.3'}
    there = {'qwen3', 'chatml', 'phi-3', 'gpt-oss', 'vicuna', 'deepseek-v3', 'glm-4', 'cohere2'}  # test_peer_masks.py's own
    assert {'phi3', 'gptoss', 'vicuna', 'glm4', 'cohere'} <= set(PEER_TEMPLATES) and len(here | there) == 15


@pytest.mark.parametrize('case', CASES, ids=[c[0].split('::')[-1] + f'-{c[1]}-{c[3]}' for c in CASES])
def test_peer_case(fam, case):
    source, family, conv, mode, want, want_untrained = case
    tok, template = fam[family]
    ex = tokenize_conversation(conv, tok, template=template, mode=mode)
    assert ex.input_ids == chat_ids(tok, normalize_row({'messages': conv}, 'messages')['messages'], template=template), source
    assert trained_runs(ex, tok) == want, source
    if want_untrained is not None: assert untrained_runs(ex, tok) == want_untrained, source
    untrained_text = ''.join(untrained_runs(ex, tok))
    for m in conv:  # Axolotl's test_train_on_inputs_false: no user/system content trained
        if m['role'] != 'assistant': assert m['content'] in untrained_text or m['role'] == 'system', (source, m)


# ---- LLaMA-Factory tests/data/test_template.py::test_reasoning_encode_multiturn: every turn's answer with its own thought
@pytest.mark.parametrize('conv,want', [(THOUGHT, [[THOUGHT[1]['content'] + '<|im_end|>'], [THOUGHT[3]['content'] + '<|im_end|>']]),
                                        (MESSAGES, [['<think>\n\n</think>\n\nI am fine!<|im_end|>'], ['<think>\n\n</think>\n\n很高兴认识你！<|im_end|>']])],
                         ids=['cot_messages=True', 'cot_messages=False-enable_thinking=True'])
def test_lf_reasoning_multiturn(fam, conv, want):
    "LF encodes each turn as the model wrote it (answers end '<|im_end|>\\n', stated); Qwen3 rewrites history: one example per turn."
    tok, q3 = fam['qwen3']
    assert [trained_runs(e, tok) for e in tokenize_turns(conv, tok, template=q3)] == want


# ---- LLaMA-Factory tests/data/processor/test_supervised.py: mask_history and train_on_prompt, token by token
def test_lf_mask_history_and_train_on_prompt(fam):
    tok, t = fam['llama-3']
    conv = [S('You are a helpful assistant.'), *MESSAGES]
    ids = chat_ids(tok, conv, template=t)
    prompt_len = len(chat_ids(tok, conv[:-1], template=t, add_generation_prompt=True))
    assert tokenize_conversation(conv, tok, template=t, mode='last_assistant').loss_mask == [0] * prompt_len + [1] * (len(ids) - prompt_len)
    assert tokenize_conversation(conv, tok, template=t, mode='all').loss_mask == [1] * len(ids)  # labels_for drops position 0 (stated)


def test_lf_single_turn_alpaca_ids(fam, shared):
    "test_supervised_single_turn: instruction (+ '\\n' + input) as the user turn, output as the answer; ids equal apply_chat_template."
    import json
    tok, t = fam['llama-3']
    for r in json.loads((shared / 'datasets' / 'alpaca_en_demo.json').read_text())[:16]:
        conv = [U(r['instruction'] + ('\n' + r['input'] if r['input'] else '')), A(r['output'])]
        ex = tokenize_conversation(conv, tok, template=t)
        assert ex.input_ids == chat_ids(tok, conv, template=t) and trained_runs(ex, tok) == [r['output'].strip() + '<|eot_id|>']


# ---- Axolotl: ShareGPT rows (from/value, roles_to_train=['gpt']) and an empty roles_to_train
def test_axolotl_sharegpt_rows(fam):
    tok, t = fam['llama-3']
    row = {'conversations': [{'from': 'human', 'value': 'hello'}, {'from': 'gpt', 'value': 'hello'},
                             {'from': 'human', 'value': 'goodbye'}, {'from': 'gpt', 'value': 'goodbye'}]}
    (_, ex), = tokenize_rows([row], tok, TokenizeConfig(chat_template=t), 'sharegpt')[0]
    assert trained_runs(ex, tok) == ['hello<|eot_id|>', 'goodbye<|eot_id|>']


def test_axolotl_empty_roles_to_train_is_reported(fam):
    "Axolotl keeps a row whose labels are all ignored; we report it (stated difference): every turn marked untrained."
    tok, t = fam['llama-3']
    conv = [U('Hello'), A('Hi there!', train=False), U('How are you?'), A("I'm fine", train=False)]
    good, bad = tokenize_rows([{'messages': conv}], tok, TokenizeConfig(chat_template=t), 'messages')
    assert good == [] and bad == [(0, 'empty_mask', 'no trained token left')]


# ---- Axolotl tests/prompt_strategies/conftest.py fixture_toolcalling_dataset (inputs); the expectation is our contract:
# the tool call and the answer trained with their end tokens, the tool output and the system/user text never
def test_axolotl_toolcalling_row(fam):
    tok, t = fam['qwen2.5']
    conv = [S('You are a bot that responds to weather queries. You should reply with the unit used in the queried location.'),
            U("Hey, what's the temperature in Paris right now?"),
            {'role': 'assistant', 'tool_calls': [{'type': 'function', 'function': {'name': 'get_current_temperature',
                                                                                   'arguments': {'location': 'Paris, France', 'unit': 'celsius'}}}]},
            {'role': 'tool', 'name': 'get_current_temperature', 'content': '22.0'},
            A('The temperature in Paris is 22.0 degrees Celsius.')]
    ex = tokenize_conversation(conv, tok, template=t)
    runs = trained_runs(ex, tok)
    assert len(runs) == 2 and 'get_current_temperature' in runs[0] and runs[0].endswith('<|im_end|>')
    assert runs[1] == 'The temperature in Paris is 22.0 degrees Celsius.<|im_end|>' and '22.0' not in runs[0]


# ---- Axolotl tests/prompt_strategies/test_chat_templates_thinking.py: messages_w_reasoning on Qwen3
def test_axolotl_split_thinking(fam):
    """Its `<think>lorem</think>\\nwelcome` renders as its expected ids spell out ('<think>\\nlorem\\n</think>\\n\\nwelcome<|im_end|>\\n'),
    the answer trained with its thought. Stated difference: its split_thinking also turns `<|begin_of_thought|>…` and
    `<reasoning>…` into reasoning_content; we keep such content as written (Qwen3's template splits only `<think>`)."""
    tok, q3 = fam['qwen3']
    ex = tokenize_conversation([U('hello'), A('<think>lorem</think>\nwelcome')], tok, template=q3)
    assert ex.text == '<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\nlorem\n</think>\n\nwelcome<|im_end|>\n'
    assert trained_runs(ex, tok) == ['<think>\nlorem\n</think>\n\nwelcome<|im_end|>']
    other = tokenize_conversation([U('hello'), A('<reasoning>lorem</reasoning>\nwelcome')], tok, template=q3)
    assert trained_runs(other, tok) == ['<think>\n\n</think>\n\n<reasoning>lorem</reasoning>\nwelcome<|im_end|>']
