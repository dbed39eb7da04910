"""The whole shared datasets tokenize to the same ids, masks and bad rows as the span finder before the one-render path.

`tests/fixtures/mask_digests.json` holds, per (template, dataset, mode), a sha256 of every kept row's (index, input_ids,
loss_mask, loss_weights) and every dropped row's (index, kind). It was written by `python tests/test_mask_digests.py
--write` on main at 3fe3b79 (the prefix-render span finder, before tagged twins); a change that moves one token of one
mask on any of these ~7,000 rows fails here and names the (template, dataset, mode)."""
import hashlib, json, sys
from pathlib import Path
import pytest

FIXTURE = Path(__file__).parent / 'fixtures' / 'mask_digests.json'
DATASETS = ('alpaca_en_demo.json', 'glaive_toolcall_en_demo.json', 'identity.json')
# (name, template family for the tiny tokenizer's special tokens, template: a file of ../shared/templates, a shipped name, or
# 'smollm2' = SmolLM2-135M-Instruct's own template; the datasets; the modes)
CASES = [('smollm2', 'smollm2', 'smollm2', DATASETS, ('all_assistant', 'last_assistant')),
         ('qwen2.5-instruct', 'qwen2.5-instruct', 'qwen2.5-instruct.jinja', DATASETS[:2], ('all_assistant', 'last_assistant')),
         ('chatml', 'chatml', 'chatml.jinja', DATASETS[:2], ('all_assistant',)),
         ('llama-3-instruct', 'llama-3-instruct', 'llama-3-instruct.jinja', DATASETS[:2], ('all_assistant',)),
         ('mistral-instruct', 'mistral-instruct', 'mistral-instruct.jinja', DATASETS[:2], ('all_assistant',)),
         ('gemma-it', 'gemma-it', 'gemma-it.jinja', DATASETS[:2], ('all_assistant',)),
         ('phi-3', 'phi-3', 'phi-3.jinja', DATASETS[:2], ('all_assistant',)),
         ('qwen3 (shipped)', 'qwen2.5-instruct', 'qwen3', DATASETS[:2], ('all_assistant',))]


def _digests(shared: Path, tiny_path) -> dict:
    from transformers import AutoTokenizer
    from sft_nb.config import TokenizeConfig
    from sft_nb.data import load_source, row_dict, detect_format, source_columns
    from sft_nb.models import smollm2_chat_template
    from sft_nb.templates import add_family_specials
    from sft_nb.renderers import tokenize_rows
    rows = {}
    for name in DATASETS:
        raw = load_source(str(shared / 'datasets' / name))
        rows[name] = (detect_format(source_columns(raw)), [row_dict(r) for r in raw])
    out = {}
    for label, family, template, sets, modes in CASES:
        tok = add_family_specials(AutoTokenizer.from_pretrained(tiny_path), family)
        text = smollm2_chat_template() if template == 'smollm2' else \
            (shared / 'templates' / template).read_text() if template.endswith('.jinja') else template
        for mode in modes:
            spec = TokenizeConfig(mode=mode, chat_template=text, max_length=None, history='final')
            for name in sets:
                fmt, rs = rows[name]
                h, n_good, n_bad = hashlib.sha256(), 0, 0
                for s in range(0, len(rs), 256):
                    good, bad = tokenize_rows(rs[s:s + 256], tok, spec, fmt, list(range(s, min(s + 256, len(rs)))), keep_offsets=False)
                    for i, ex in good: h.update(json.dumps([i, ex.input_ids, ex.loss_mask, ex.loss_weights]).encode())
                    for i, kind, _ in sorted(bad): h.update(json.dumps([i, kind]).encode())
                    n_good, n_bad = n_good + len(good), n_bad + len(bad)
                out[f'{label} | {name} | {mode}'] = {'sha256': h.hexdigest(), 'kept': n_good, 'dropped': n_bad}
    return out


def test_shared_datasets_masks_unchanged(shared, tiny_path):
    "Every row of the shared datasets keeps its ids, mask and weights (or its drop kind) under every listed template and mode."
    want, got = json.loads(FIXTURE.read_text()), _digests(shared, tiny_path)
    assert set(got) == set(want)
    assert {k: v for k, v in got.items() if v != want[k]} == {}


if __name__ == '__main__' and '--write' in sys.argv:
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import SHARED
    from sft_nb.models import tiny_chat_model
    FIXTURE.write_text(json.dumps(_digests(SHARED, tiny_chat_model()), indent=1) + '\n')
    print(FIXTURE.read_text())
