"""Masks on real templates and real rows against an expectation found without sft_nb's span code.

For each template of `../shared/templates` (collapsed as its README says; Qwen2.5 as it is) and SmolLM2-135M-Instruct's
own, on the tiny tokenizer with the family's special tokens: every row of the shared identity set, the glaive rows
without tool calls (multi-turn chats) and the first alpaca rows are rendered to text with `apply_chat_template` and
tokenized with character offsets. Each assistant message is then found in that text as the family's generation prompt,
its content and its end-of-turn token, searched in order from the end of the previous one (a quoted answer in a user
turn lacks the header, so it is not taken for the answer). The expected mask trains each token that overlaps content +
end-of-turn (Mistral: the space before the answer too, which its generation prompt leaves to the model); with
`last_assistant`, only the last one. sft_nb's ids must equal that render's and its mask the expected one, row by row.
Tool calls are not covered here (their rendering is the template's own: tests/test_chat_templates.py,
tests/test_peer_masks*.py)."""
from pathlib import Path
import pytest

IM = ('<|im_start|>assistant\n', '', '<|im_end|>')
# family: (generation prompt, what the model writes before the content, end-of-turn) as the template renders them
TURN = {'smollm2': IM, 'qwen2.5-instruct': IM, 'chatml': IM,
        'llama-3-instruct': ('<|start_header_id|>assistant<|end_header_id|>\n\n', '', '<|eot_id|>'),
        'mistral-instruct': ('[/INST]', ' ', '</s>'), 'gemma-it': ('<start_of_turn>model\n', '', '<end_of_turn>'),
        'phi-3': ('<|assistant|>\n', '', '<|end|>')}
TEMPLATES = {'smollm2': None, 'qwen2.5-instruct': 'qwen2.5-instruct.jinja', 'chatml': 'chatml.jinja',
             'llama-3-instruct': 'llama-3-instruct.jinja', 'mistral-instruct': 'mistral-instruct.jinja',
             'gemma-it': 'gemma-it.jinja', 'phi-3': 'phi-3.jinja'}


@pytest.fixture(scope='module')
def shared_rows(shared) -> dict:
    "{dataset: (format, rows)}: identity (91 rows), glaive without tool calls (147 multi-turn chats), alpaca's first 100."
    from sft_nb.formats import detect_format
    from sft_nb.data import load_source, row_dict, source_columns
    out = {}
    for name, keep in (('identity.json', None), ('glaive_toolcall_en_demo.json', None), ('alpaca_en_demo.json', 100)):
        raw = load_source(str(shared / 'datasets' / name))
        rows = [row_dict(r) for r in raw]
        if name.startswith('glaive'): rows = [r for r in rows if not any(t['from'] in ('function_call', 'observation') for t in r['conversations'])]
        out[name] = detect_format(source_columns(raw)), rows[:keep]
    return out


def expected_mask(text: str, offsets: list, messages: list[dict], family: str, last_only: bool) -> list[int]:
    "1 for each token (by its character offsets) that overlaps an assistant message's trained text in the rendered `text`."
    head, pre, eot = TURN[family]
    spans, pos, answers = [], 0, [m for m in messages if m['role'] == 'assistant']
    for k, m in enumerate(answers):
        for content in dict.fromkeys((m['content'], m['content'].strip())):  # Llama 3 and Mistral trim it
            if (a := text.find(head + pre + content + eot, pos)) >= 0: break
        assert a >= 0, f'{family}: assistant message {k} not found after character {pos}: {m["content"][:80]!r}'
        pos = a + len(head + pre + content + eot)
        if not last_only or k == len(answers) - 1: spans.append((a + len(head), pos))
    return [int(any(x < e and y > s for s, e in spans)) for x, y in offsets]


@pytest.mark.parametrize('family', list(TEMPLATES))
def test_masks_equal_the_rendered_assistant_turns(family, shared, shared_rows, tiny_path):
    from transformers import AutoTokenizer
    from sft_nb.config import TokenizeConfig
    from sft_nb.formats import normalize_row
    from sft_nb.models import smollm2_chat_template
    from sft_nb.templates import add_family_specials, collapse_template
    from sft_nb.renderers import tokenize_rows
    tok = add_family_specials(AutoTokenizer.from_pretrained(tiny_path), family)
    name = TEMPLATES[family]
    template = smollm2_chat_template() if name is None else (shared / 'templates' / name).read_text()
    if family not in ('smollm2', 'qwen2.5-instruct'): template = collapse_template(template)
    checked = 0
    for mode in ('all_assistant', 'last_assistant'):
        spec = TokenizeConfig(mode=mode, chat_template=template, max_length=None, rewritten_turns='final')
        for dataset, (fmt, rows) in shared_rows.items():
            good, bad = tokenize_rows(rows, tok, spec, fmt, list(range(len(rows))), keep_offsets=False)
            assert not bad and len(good) == len(rows), (dataset, bad[:3])
            for i, ex in good:
                r = normalize_row(rows[i], fmt)
                text = tok.apply_chat_template(r['messages'], tools=r['tools'], chat_template=template, tokenize=False)
                enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
                where = f'{family} | {dataset} row {i} | {mode}'
                assert list(ex.input_ids) == enc['input_ids'], where
                want = expected_mask(text, enc['offset_mapping'], r['messages'], family, mode == 'last_assistant')
                if list(ex.loss_mask) != want:
                    j = next(j for j, (a, b) in enumerate(zip(ex.loss_mask, want)) if a != b)
                    pytest.fail(f'{where}: token {j} {tok.convert_ids_to_tokens(ex.input_ids[j])!r} trained={ex.loss_mask[j]}, '
                                f'expected {want[j]}; around it: {tok.decode(ex.input_ids[max(0, j - 8):j + 8])!r}')
                checked += 1
    assert checked == 2 * sum(len(rows) for _, rows in shared_rows.values())
