"""Tokenizing the shared real datasets: reports add up, parallel == serial, the cache is content-addressed."""
import json, shutil
from pathlib import Path
import pytest
from transformers import AutoTokenizer
from sft_nb.formats import BadRow
from sft_nb.templates import add_family_specials
from sft_nb.config import TokenizeConfig
from sft_nb.tokenize import tokenize_dataset
from sft_nb.cache import cache_root


@pytest.fixture()
def qwen_tok(tiny_path):
    return add_family_specials(AutoTokenizer.from_pretrained(tiny_path), 'qwen2.5-instruct')


@pytest.fixture()
def qwen_template(shared):
    return str(shared / 'templates' / 'qwen2.5-instruct.jinja')


def check_report(ds, rep, n_rows):
    assert rep.n_rows == n_rows and rep.n_kept + rep.n_dropped == n_rows
    assert len(ds) == rep.n_kept and min(ds['n_trained']) > 0
    assert sorted(set(ds['index'])) == ds['index']  # source order kept, each row once
    assert rep.n_real == sum(ds['length']) and rep.n_trained == sum(ds['n_trained'])


@pytest.mark.parametrize('mode', ['all_assistant', 'last_assistant'])
def test_alpaca(shared, tiny_tok, tmp_path, mode):
    ds, rep = tokenize_dataset(shared / 'datasets/alpaca_en_demo.json', tiny_tok, TokenizeConfig(mode=mode, max_length=256), cache_dir=tmp_path)
    check_report(ds, rep, 999)
    assert rep.dropped.get('too_long', 0) > 0 and max(ds['length']) <= 256
    ds2, rep2 = tokenize_dataset(shared / 'datasets/alpaca_en_demo.json', tiny_tok,
                                 TokenizeConfig(mode=mode, max_length=256, truncation='keep_start'), cache_dir=tmp_path)
    assert 'too_long' not in rep2.dropped and rep2.n_kept + rep2.dropped.get('empty_mask', 0) == 999 and rep2.max_length == 256


def test_glaive_tool_calls(shared, qwen_tok, qwen_template, tmp_path):
    ds, rep = tokenize_dataset(shared / 'datasets/glaive_toolcall_en_demo.json', qwen_tok,
                               TokenizeConfig(chat_template=qwen_template, max_length=4096), cache_dir=tmp_path)
    check_report(ds, rep, 300)
    row = ds[0]
    text = qwen_tok.decode([i for i, m in zip(row['input_ids'], row['loss_mask']) if m])
    assert '<tool_call>' in text and '<tool_response>' not in text and '<|im_start|>' not in text


def test_bad_rows_reported_not_fatal(tiny_tok, tmp_path):
    rows = [{'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'yo'}]},
            {'messages': [{'role': 'alien', 'content': 'hi'}]},
            {'conversations': 'nope'},
            {'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': None, 'tool_calls': '{"name": '}]}]
    ds, rep = tokenize_dataset(rows, tiny_tok, TokenizeConfig(format='messages'), cache_dir=tmp_path)
    assert len(ds) == 1 and rep.dropped == {'bad_format': 2, 'mixed_formats': 1}  # row 2 is ShareGPT: named as the other format
    assert [b[0] for b in rep.bad_rows] == [1, 2, 3] and 'ShareGPT' in rep.bad_rows[1][2]
    assert 'not valid JSON' in rep.bad_rows[2][2]
    with pytest.raises(BadRow, match="row 1: message 0: unknown role 'alien'"):
        tokenize_dataset(rows, tiny_tok, TokenizeConfig(format='messages'), cache_dir=tmp_path, on_bad_row='raise')


def test_parallel_equals_serial(shared, qwen_tok, qwen_template, tmp_path):
    src = shared / 'datasets/glaive_toolcall_en_demo.json'
    spec = TokenizeConfig(chat_template=qwen_template, max_length=4096)
    a, ra = tokenize_dataset(src, qwen_tok, spec, cache_dir=tmp_path / 'a', batch_size=64)
    b, rb = tokenize_dataset(src, qwen_tok, spec, cache_dir=tmp_path / 'b', num_proc=2, batch_size=64)
    assert a.to_dict() == b.to_dict() and ra == rb


def test_truncation_keeps_the_first_tokens_with_their_mask(tiny_tok):
    """truncation='keep_start' at every max_length that leaves a trained token: the example is the first max_length tokens of
    the uncut one, with the mask of exactly those tokens."""
    from sft_nb.renderers import tokenize_conversation
    msgs = [{'role': 'user', 'content': 'A question that takes a few tokens?'},
            {'role': 'assistant', 'content': 'An answer of several words, then a few more.'}]
    full = tokenize_conversation(msgs, tiny_tok)
    first = full.loss_mask.index(1)
    for n in range(first + 1, len(full)):
        cut = tokenize_conversation(msgs, tiny_tok, max_length=n)
        assert (cut.input_ids, cut.loss_mask, cut.truncated) == (full.input_ids[:n], full.loss_mask[:n], True), n


def test_cache_is_content_addressed(shared, tiny_tok, qwen_tok, qwen_template, tmp_path):
    src = shared / 'datasets/identity.json'
    ds, rep = tokenize_dataset(src, tiny_tok, cache_dir=tmp_path)
    hit, rep_hit = tokenize_dataset(src, tiny_tok, cache_dir=tmp_path)
    assert hit.to_dict() == ds.to_dict() and rep_hit == rep
    assert len(list(tmp_path.iterdir())) == 1
    other, _ = tokenize_dataset(src, qwen_tok, TokenizeConfig(chat_template=qwen_template), cache_dir=tmp_path)  # other template + tokenizer
    assert len(list(tmp_path.iterdir())) == 2 and other['input_ids'] != ds['input_ids']
    tokenize_dataset(src, tiny_tok, TokenizeConfig(chat_template_kwargs={'enable_thinking': False}), cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 3


def test_truncated_cache_entry_is_rebuilt(shared, tiny_tok, tmp_path):
    src = shared / 'datasets/identity.json'
    ds, _ = tokenize_dataset(src, tiny_tok, cache_dir=tmp_path)
    expected = ds.to_dict()
    entry = next(tmp_path.iterdir())
    arrow = next(entry.rglob('*.arrow'))
    del ds
    arrow.write_bytes(arrow.read_bytes()[:100])  # a partial write / corrupted file
    again, _ = tokenize_dataset(src, tiny_tok, cache_dir=tmp_path)
    assert again.to_dict() == expected
    (entry / 'MANIFEST.json').unlink()  # an interrupted writer leaves no manifest
    again, _ = tokenize_dataset(src, tiny_tok, cache_dir=tmp_path)
    assert again.to_dict() == expected and (entry / 'MANIFEST.json').exists()


def test_cache_altered_in_place_is_detected(shared, tiny_tok, tmp_path):
    "4 bytes overwritten in place (same size) in a cache entry are never served: digests catch it and the entry is rebuilt."
    import datasets
    src = shared / 'datasets/identity.json'
    ds, rep = tokenize_dataset(src, tiny_tok, cache_dir=tmp_path)
    expected = ds.to_dict()
    del ds
    entry = next(tmp_path.iterdir())
    arrow = next(entry.rglob('*.arrow'))
    b = bytearray(arrow.read_bytes()); k = len(b) // 2
    b[k:k + 4] = bytes(x ^ 0xFF for x in b[k:k + 4]); arrow.write_bytes(bytes(b))
    assert datasets.load_from_disk(str(entry / 'data')).to_dict() != expected  # what a size-only check served
    with pytest.warns(UserWarning, match='fails its content check'):
        again, rep2 = tokenize_dataset(src, tiny_tok, cache_dir=tmp_path)
    assert again.to_dict() == expected and rep2 == rep
    report = entry / 'report.json'
    text = report.read_text()
    n = f'"n_real": {rep.n_real}'
    report.write_text(text.replace(n, n[:-1] + str((int(n[-1]) + 1) % 10)))  # one digit changed, same size
    assert report.stat().st_size == len(text)
    with pytest.warns(UserWarning, match=r'fails its content check \(report.json\)'):
        again, rep3 = tokenize_dataset(src, tiny_tok, cache_dir=tmp_path)
    assert rep3 == rep and again.to_dict() == expected

def test_turns_reduced_to_end_of_turn_are_reported(shared, tiny_tok, qwen_tok, qwen_template, tmp_path):
    "A template that drops tool calls (plain ChatML) leaves turns that train only <|im_end|>: counted and warned about."
    src = shared / 'datasets/glaive_toolcall_en_demo.json'
    _, rep = tokenize_dataset(src, tiny_tok, TokenizeConfig(max_length=4096), cache_dir=tmp_path)
    assert rep.eot_only_turns > 100 and 'WARNING' in str(rep)
    _, rep = tokenize_dataset(src, qwen_tok, TokenizeConfig(chat_template=qwen_template, max_length=4096), cache_dir=tmp_path)
    assert rep.eot_only_turns == 0 and 'WARNING' not in str(rep)


@pytest.mark.parametrize('name', ['glaive_toolcall_en_demo.json', 'alpaca_en_demo.json'])
def test_fast_mask_equals_offset_overlap(shared, qwen_tok, qwen_template, name):
    "The char_to_token mask (hot path) equals the per-token offset-overlap definition on every real row."
    from sft_nb.formats import detect_format
    from sft_nb.data import load_source, row_dict, source_columns
    from sft_nb.renderers import tokenize_rows
    ds = load_source(shared / 'datasets' / name)
    rows = [row_dict(r) for r in ds] + [{'messages': [{'role': 'user', 'content': 'héllo 🙂'}, {'role': 'assistant', 'content': 'ça va 🙂🙂'}]}]
    good, _ = tokenize_rows(rows[:-1], qwen_tok, TokenizeConfig(chat_template=qwen_template, max_length=None), detect_format(source_columns(ds)))
    good += tokenize_rows(rows[-1:], qwen_tok, TokenizeConfig(chat_template=qwen_template, max_length=None), 'messages')[0]
    assert len(good) > 100
    for _, ex in good:
        assert ex.loss_mask == [int(any(a < e and b > s for s, e, _ in ex.spans)) for a, b in ex.offsets]  # a token overlapping a span


def test_duplicate_key_row_same_in_map_style_and_streamed(tiny_tok, tmp_path):
    "A JSONL row holding a key twice is one bad row with one reason whether the file is tokenized whole (the fast path) or streamed."
    from sft_nb.formats import BAD_ROW_KEY
    from sft_nb.stream import stream_rows
    row = lambda i: {'messages': [{'role': 'user', 'content': f'q{i}'}, {'role': 'assistant', 'content': f'a{i}'}]}
    dup = '{"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "content": "other"}]}'
    src = tmp_path / 'dup.jsonl'
    src.write_text('\n'.join([json.dumps(row(0)), dup, json.dumps(row(2))]) + '\n')
    ds, rep = tokenize_dataset(str(src), tiny_tok, use_cache=False)
    streamed = [r for _, r, _ in stream_rows(str(src))]
    reason = f"{src}: line 2: key 'content' appears twice in one object; keep one of them"
    assert streamed[1][BAD_ROW_KEY]['reason'] == reason and rep.bad_rows == [(1, 'bad_json', reason)] and ds['index'] == [0, 2]


def test_a_long_source_shows_tokenization_progress(tiny_tok, tmp_path, monkeypatch, capsys):
    "A source of PROGRESS_ROWS rows or more shows a tqdm bar counting rows while it is tokenized (one process and two); a short one shows none."
    import json
    import sft_nb.tokenize as tk
    from sft_nb.config import TokenizeConfig
    monkeypatch.setattr(tk, 'PROGRESS_ROWS', 40)
    rows = [{'messages': [{'role': 'user', 'content': f'q {i}'}, {'role': 'assistant', 'content': f'a {i}'}]} for i in range(50)]
    f = tmp_path / 'rows.jsonl'; f.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    for num_proc in (1, 2):
        tk.tokenize_dataset(str(f), tiny_tok, TokenizeConfig(max_length=64), num_proc=num_proc, batch_size=16, use_cache=False)
        err = capsys.readouterr().err
        assert 'tokenize: 100%' in err and '50/50' in err, (num_proc, err)
    tk.tokenize_dataset(rows[:10], tiny_tok, TokenizeConfig(max_length=64))
    assert 'tokenize' not in capsys.readouterr().err
