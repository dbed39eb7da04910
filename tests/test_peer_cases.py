"""Seven peer cases that used to be clear refusals, now trained as the peer expects (issue 38, item 2).

Each test names its source and ports the peer's inputs and expectation (facts, not code):

- TRL `trl/chat_templates/deepseekv3_training.jinja` on a tool conversation, both modes: the truth is transformers'
  `return_assistant_tokens_mask` over the template's `{% generation %}` blocks (TRL's `get_training_chat_template`
  tests use that mask), so the `<｜tool▁outputs▁end｜>` the block opens with is trained;
- a training template whose generation blocks mark two spans inside one assistant message (its content and end of turn
  trained, its tool call not), judged the same way;
- Axolotl `tests/prompt_strategies/test_chat_templates_advanced.py` (`test_content_parts_with_train_field`,
  `test_content_parts_with_weight`): content parts with `train: false` / `weight: 0` are not trained, the others are;
  a token that straddles the boundary is not trained (Axolotl's documented rule: "Tokens that straddle a boundary are
  conservatively masked");
- SkyRL's `encode_messages_subset` case, a conversation that opens with an assistant message: trained as the template
  renders it (its prompt is the template's render of no message), or refused by name where the template cannot;
- SkyRL `tests/train/test_sft_tokenization.py` (`test_chat_multi_turn_thinking`, `test_chat_multi_turn_no_thinking`):
  Qwen3 with inline `<think>` in every assistant turn under the default `tokenize.rewritten_turns` (expand), and with
  `enable_thinking=False`. SkyRL counts the `\\n` after `<|im_end|>` as trained; that newline is template text here and
  never trained (DESIGN: the span ends on the turn's end of turn), so the expectation is SkyRL's minus that newline.
"""
from pathlib import Path
import pytest
from transformers import AutoTokenizer
from sft_nb.config import TokenizeConfig
from sft_nb.formats import BadRow
from sft_nb.renderers import tokenize_conversation, tokenize_rows
from sft_nb.templates import chat_ids, shipped_template

FIX = Path(__file__).parent / 'fixtures' / 'templates'
DS_SPECIALS = ['<｜User｜>', '<｜Assistant｜>', '<｜tool▁calls▁begin｜>', '<｜tool▁call▁begin｜>', '<｜tool▁sep｜>', '<｜tool▁call▁end｜>',
               '<｜tool▁calls▁end｜>', '<｜tool▁outputs▁begin｜>', '<｜tool▁output▁begin｜>', '<｜tool▁output▁end｜>', '<｜tool▁outputs▁end｜>']
CALL = [{'type': 'function', 'function': {'name': 'multiply', 'arguments': {'a': 3, 'b': 4}}}]
TOOL_CONV = [{'role': 'user', 'content': 'Multiply 3 by 4.'}, {'role': 'assistant', 'content': 'I will call a tool.', 'tool_calls': CALL},
             {'role': 'tool', 'content': '12'}, {'role': 'assistant', 'content': 'It is 12.'}]  # TRL's test_chat_template_utils inputs


def runs(tok, ids, mask) -> list[str]:
    "The trained tokens, decoded run by run."
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m: cur.append(i)
        elif cur: out.append(tok.decode(cur)); cur = []
    return out + ([tok.decode(cur)] if cur else [])


def transformers_mask(tok, conv, template):
    "transformers' own assistant mask from the template's generation blocks: the judge."
    out = tok.apply_chat_template(conv, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return out['input_ids'], out['assistant_masks']


@pytest.fixture(scope='module')
def ds_tok(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    tok.add_special_tokens({'additional_special_tokens': DS_SPECIALS, 'eos_token': '<｜end▁of▁sentence｜>', 'bos_token': '<｜begin▁of▁sentence｜>'})
    return tok


@pytest.mark.parametrize('mode', ['all_assistant', 'last_assistant'])
def test_trl_deepseekv3_training_template_on_a_tool_conversation(ds_tok, mode):
    template = (FIX / 'deepseekv3_training.jinja').read_text()
    ids, mask = transformers_mask(ds_tok, TOOL_CONV, template)
    ex = tokenize_conversation(TOOL_CONV, ds_tok, template=template, mode=mode)
    assert ex.input_ids == ids
    want = runs(ds_tok, ids, mask)
    assert want[-1] == '<｜tool▁outputs▁end｜>It is 12.<｜end▁of▁sentence｜>'  # the block's truth: the tool outputs' end is trained
    if mode == 'all_assistant': assert ex.loss_mask == mask
    else: assert runs(ds_tok, ex.input_ids, ex.loss_mask) == want[-1:]


TWO_BLOCKS = ("{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m.content }}{% endgeneration %}"
              "{% for tc in m.tool_calls or [] %}\n<tool_call>\n{{ tc.function | tojson }}\n</tool_call>{% endfor %}"
              "{% generation %}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_two_generation_blocks_in_one_message(tiny_tok):
    "Content and end of turn trained, the tool call between them not: what the blocks mark, exactly."
    ids, mask = transformers_mask(tiny_tok, TOOL_CONV, TWO_BLOCKS)
    ex = tokenize_conversation(TOOL_CONV, tiny_tok, template=TWO_BLOCKS)
    assert (ex.input_ids, ex.loss_mask) == (ids, mask)
    assert runs(tiny_tok, ex.input_ids, ex.loss_mask) == ['I will call a tool.', '<|im_end|>', 'It is 12.<|im_end|>']
    last_only = TWO_BLOCKS.replace("{% generation %}{{ m.content }}{% endgeneration %}",
                                   "{% if loop.last %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}")
    with pytest.raises(BadRow, match="message 1: the template's {% generation %} blocks move once later messages follow"):
        tokenize_conversation(TOOL_CONV, tiny_tok, template=last_only)  # which message a block belongs to is not stable: refused


def test_axolotl_content_parts_train_flag(tiny_tok):
    conv = [{'role': 'system', 'content': [{'type': 'text', 'text': 'You are an AI assistant.'}]},
            {'role': 'user', 'content': [{'type': 'text', 'text': 'What is 2+2?'}]},
            {'role': 'assistant', 'content': [{'type': 'text', 'text': 'Let me think...', 'train': False},
                                              {'type': 'text', 'text': 'The answer is 4.', 'train': True}]}]
    ex = tokenize_conversation(conv, tiny_tok)
    assert ex.input_ids == chat_ids(tiny_tok, [{'role': m['role'], 'content': ''.join(p['text'] for p in m['content'])} for m in conv])
    assert runs(tiny_tok, ex.input_ids, ex.loss_mask) == ['The answer is 4.<|im_end|>']
    assert [(ex.text[a:b], kind) for a, b, _, kind in ex.masked_parts] == [('Let me think...', 'weight 0')]


def test_axolotl_content_parts_weight_and_the_straddling_token(tiny_tok):
    conv = [{'role': 'user', 'content': [{'type': 'text', 'text': 'Hello'}]},
            {'role': 'assistant', 'content': [{'type': 'text', 'text': 'Thinking step by step: ', 'weight': 0},
                                              {'type': 'text', 'text': 'Hello! How can I help?', 'weight': 1}]}]
    ex = tokenize_conversation(conv, tiny_tok)
    pieces = [tiny_tok.decode([t]) for t in ex.input_ids]
    k = pieces.index(' Hello')  # the part-0 space and the part-1 word are one token: it holds a weight-0 character
    assert ex.loss_mask[k] == 0 and ex.loss_mask[k + 1] == 1
    assert runs(tiny_tok, ex.input_ids, ex.loss_mask) == ['! How can I help?<|im_end|>']
    split_before_space = [conv[0], {'role': 'assistant', 'content': [{'type': 'text', 'text': 'Thinking step by step:', 'weight': 0},
                                                                      {'type': 'text', 'text': ' Hello! How can I help?', 'weight': 1}]}]
    assert runs(tiny_tok, *(lambda e: (e.input_ids, e.loss_mask))(tokenize_conversation(split_before_space, tiny_tok))) == \
        [' Hello! How can I help?<|im_end|>']  # Axolotl's advice (split before the space) trains the whole answer
    with pytest.raises(BadRow, match=r'message 1: content parts carry different weights \[0.5, 1\]'):
        tokenize_conversation([conv[0], {'role': 'assistant', 'content': [{'type': 'text', 'text': 'a', 'weight': 0.5}, {'type': 'text', 'text': 'b'}]}], tiny_tok)


ASSISTANT_FIRST = [{'role': 'assistant', 'content': 'Hello! How can I help?'}, {'role': 'user', 'content': 'Hi'},
                   {'role': 'assistant', 'content': 'Hi there.'}]


@pytest.mark.parametrize('template', [None, 'qwen2.5', 'smollm2'])
def test_skyrl_conversation_opening_with_an_assistant_message(tiny_tok, template):
    "Trained as the template renders it: after the template's render of no message (a default system prompt, if any)."
    tpl = shipped_template(template) if template else None
    ex = tokenize_conversation(ASSISTANT_FIRST, tiny_tok, template=tpl)
    assert ex.input_ids == chat_ids(tiny_tok, ASSISTANT_FIRST, template=tpl)
    assert runs(tiny_tok, ex.input_ids, ex.loss_mask) == ['Hello! How can I help?<|im_end|>', 'Hi there.<|im_end|>']


def test_assistant_first_refused_by_a_template_that_cannot_render_it(tiny_tok):
    with pytest.raises(BadRow, match='Conversation roles must alternate'):
        tokenize_conversation(ASSISTANT_FIRST, tiny_tok, template=shipped_template('llama3'))


@pytest.fixture(scope='module')
def q3_tok(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    tok.add_special_tokens({'additional_special_tokens': ['<|im_start|>', '<|im_end|>', '<think>', '</think>']})
    return tok


def qwen3_examples(tok, msgs, **kw):
    spec = TokenizeConfig(chat_template=(FIX / 'qwen3.jinja').read_text(), max_length=None, **kw)  # rewritten_turns: the default, expand
    good, bad = tokenize_rows([{'messages': msgs}], tok, spec, 'messages')
    assert bad == []
    return [runs(tok, ex.input_ids, ex.loss_mask) for _, ex in good]


def test_skyrl_qwen3_inline_think_in_every_turn(q3_tok):
    think = "<think>\nThat's a tough one\n</think>\n\n"
    msgs = [{'role': 'system', 'content': 'You are helpful.'}, {'role': 'user', 'content': 'What is 2+2?'},
            {'role': 'assistant', 'content': think + '4'}, {'role': 'user', 'content': 'And 3+3?'}, {'role': 'assistant', 'content': think + '6'}]
    # one example per turn (Qwen3 drops an earlier turn's reasoning once a new user turn comes): each trains its reasoning
    assert qwen3_examples(q3_tok, msgs) == [[think + '4<|im_end|>'], [think + '6<|im_end|>']]  # SkyRL: think + '6<|im_end|>\n'


def test_skyrl_qwen3_no_thinking(q3_tok):
    msgs = [{'role': 'system', 'content': 'You are helpful.'}, {'role': 'user', 'content': 'What is 2+2?'}, {'role': 'assistant', 'content': '4'},
            {'role': 'user', 'content': 'And 3+3?'}, {'role': 'assistant', 'content': '6'}]
    assert qwen3_examples(q3_tok, msgs, chat_template_kwargs={'enable_thinking': False}, mode='last_assistant') == [['6<|im_end|>']]
