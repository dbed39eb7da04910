"""Row-level errors, file-level honesty and honest mixing, end to end.

A broken JSONL line, undecodable bytes, a non-object line and an assistant `content: null` are each ONE bad row
(file, line, reason, row index in the report); the good rows of the same file are tokenized and trained. Empty
files, empty JSON lists and empty folders are errors that name them. Two sources of 1000 and 10 rows mix under
`all_exhausted`: every row of the large one once per epoch, and the per-source counts equal what the trainer holds.
"""
import json, re
import pytest
from sft_nb.formats import BadRow
from sft_nb.data import load_source
from sft_nb.mix import mix_counts
from sft_nb.report import DataReport
from sft_nb.config import DataConfig, SourceConfig
from sft_nb.demo_data import identity_rows
from sft_nb.config import TokenizeConfig
from sft_nb.tokenize import tokenize_dataset
from helpers import run_cfg

GOOD = identity_rows()['train'][:10]
NULL = {'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': None}]}
BAD_AT = [3, 6, 9, 12]  # row indices of the bad rows in `bad_file` (= line numbers - 1: no blank lines)
GOOD_AT = [i for i in range(14) if i not in BAD_AT]


def line(r) -> bytes:
    return json.dumps(r, ensure_ascii=False).encode()


def bad_file(tmp_path, name='bad.jsonl'):
    "10 good rows with a truncated line (row 3), a latin-1 byte (row 6), assistant content null (row 9), a list (row 12)."
    lines = [line(r) for r in GOOD]
    lines.insert(3, line(GOOD[0])[:25])
    lines.insert(6, line(GOOD[1]).replace(b'"role"', b'"r\xf4le"', 1))
    lines.insert(9, line(NULL))
    lines.insert(12, b'[1, 2]')
    p = tmp_path / name
    p.write_bytes(b'\n'.join(lines) + b'\n')
    return p


def check_bad_report(rep: DataReport, p):
    assert rep.n_rows == 14 and rep.n_kept == 10
    assert rep.dropped == {'bad_json': 2, 'bad_encoding': 1, 'empty_assistant': 1}
    assert [b[0] for b in rep.bad_rows] == BAD_AT
    reasons = [b[2] for b in rep.bad_rows]
    assert reasons[0].startswith(f"{p}: line 4 is not valid JSON")
    assert reasons[1].startswith(f"{p}: line 7 is not valid UTF-8 (byte 0xf4")
    assert reasons[2].startswith("message 1: assistant content is null")
    assert reasons[3] == f"{p}: line 13: expected a JSON object, got list"
    assert 'rows 3, 12' in rep.bad_rows_summary() and 'empty_assistant: 1 (row 9;' in rep.bad_rows_summary()


def test_bad_lines_are_rows_good_rows_kept(tiny_tok, tmp_path):
    p = bad_file(tmp_path)
    ds, rep = tokenize_dataset(p, tiny_tok, TokenizeConfig(max_length=512), cache_dir=tmp_path / 'cache')
    check_bad_report(rep, p)
    assert sorted(set(ds['index'])) == GOOD_AT and rep.n_trained > 0
    ds2, rep2 = tokenize_dataset(p, tiny_tok, TokenizeConfig(max_length=512), cache_dir=tmp_path / 'cache')  # a cache hit says the same
    assert rep2 == rep and ds2['index'] == ds['index']


def test_on_bad_row_raise_names_file_and_line(tiny_tok, tmp_path):
    p = bad_file(tmp_path)
    with pytest.raises(BadRow, match=re.escape(f"row 3: {p}: line 4 is not valid JSON")):
        tokenize_dataset(p, tiny_tok, TokenizeConfig(max_length=512), cache_dir=tmp_path, on_bad_row='raise')


def test_json_list_with_bad_elements(tiny_tok, tmp_path):
    "A JSON list: an element with undecodable bytes or of the wrong type is one bad row; the others train."
    p = tmp_path / 'list.json'
    p.write_bytes(b'[\n' + b',\n'.join([line(GOOD[0]), line(GOOD[1]).replace(b'"role"', b'"r\xf4le"', 1), b'"text"', line(GOOD[2])]) + b'\n]')
    ds, rep = tokenize_dataset(p, tiny_tok, TokenizeConfig(max_length=512), cache_dir=tmp_path)
    assert sorted(set(ds['index'])) == [0, 3] and rep.dropped == {'bad_encoding': 1, 'bad_json': 1}
    assert [b[0] for b in rep.bad_rows] == [1, 2] and rep.bad_rows[0][2] == f"{p}: line 3: the row is not valid UTF-8"


@pytest.mark.parametrize('name, content, message', [
    ('empty.jsonl', b'', 'an empty file (no rows)'), ('blank.jsonl', b'\n  \n', 'holds only blank lines (no rows)'),
    ('list.json', b'[]', 'an empty JSON list (no rows)'), ('folder', None, 'an empty folder (no rows)')])
def test_empty_sources_are_named(tiny_tok, tmp_path, name, content, message):
    p = tmp_path / name
    p.mkdir() if content is None else p.write_bytes(content)
    with pytest.raises(BadRow, match=re.escape(f"{p}: {message}")):
        tokenize_dataset(p, tiny_tok, cache_dir=tmp_path / 'cache')


def test_all_rows_bad_is_named(tiny_tok, tmp_path):
    p = tmp_path / 'all_bad.jsonl'
    p.write_bytes(b'{oops\n\xff\n')
    with pytest.raises(BadRow, match=re.escape(f"no readable row: all 2 rows are bad, e.g. row 0: {p}: line 1 is not valid JSON")):
        tokenize_dataset(p, tiny_tok, cache_dir=tmp_path)


def test_null_content_by_explicit_choice(tiny_tok, tmp_path):
    "data.null_content=empty trains the null turn as an empty turn; the cache does not serve the default reading's entry."
    p = tmp_path / 'null.jsonl'
    p.write_bytes(b'\n'.join([line(GOOD[0]), line(NULL)]) + b'\n')
    _, rep = tokenize_dataset(SourceConfig(str(p)), tiny_tok, cache_dir=tmp_path)
    assert rep.dropped == {'empty_assistant': 1} and rep.bad_rows[0][0] == 1
    src = DataConfig(train=[SourceConfig(str(p))], null_content='empty').train[0]
    ds, rep = tokenize_dataset(src, tiny_tok, cache_dir=tmp_path)
    assert rep.dropped == {} and rep.n_kept == 2
    trained = [i for i, m in zip(ds[1]['input_ids'], ds[1]['loss_mask']) if m]
    assert tiny_tok.decode(trained).strip() == '<|im_end|>'  # the empty turn trains only its end-of-turn
    ds2, rep2 = tokenize_dataset(load_source(p, null_content='empty'), tiny_tok, cache_dir=tmp_path)
    assert rep2.n_kept == 2 and ds2['input_ids'] == ds['input_ids']


def test_trainer_trains_the_good_rows(tiny_path, tmp_path, ray_session):
    "A short SFTTrainer run on the bad file: the 10 good rows are the whole first step; the report names the bad ones."
    from sft_nb.trainer import SFTTrainer
    p = bad_file(tmp_path)
    cfg = run_cfg(tiny_path, tmp_path / 'run', data__train=[{'path': str(p)}], train__global_batch_size=10,
                  tokenize__cache_dir=str(tmp_path / 'cache'))
    with SFTTrainer(cfg) as t:
        check_bad_report(t.data_report, p)
        assert sorted(int(t.data.train_sets[s]['index'][i]) for s, i in t.data.rows) == GOOD_AT
        m = t.step()
        assert m['n_trained'] == t.data_report.n_trained > 0  # every good row trained in the one step of 10
        assert m['loss'] == m['loss']  # finite


def test_mix_large_and_small_source_all_exhausted(tiny_path, tmp_path, ray_session):
    "1000 + 10 rows, equal weights: each row of the large source once per epoch; the small one repeats; counts match."
    from sft_nb.trainer import SFTTrainer
    rows = lambda tag, n: [{'messages': [{'role': 'user', 'content': f'{tag} question {i}'},
                                         {'role': 'assistant', 'content': f'{tag} answer {i}'}]} for i in range(n)]
    for tag, n in (('big', 1000), ('small', 10)):
        (tmp_path / f'{tag}.jsonl').write_text('\n'.join(json.dumps(r) for r in rows(tag, n)))
    cfg = run_cfg(tiny_path, tmp_path / 'run', data__train=[{'path': str(tmp_path / 'big.jsonl')}, {'path': str(tmp_path / 'small.jsonl')}],
                  tokenize__cache_dir=str(tmp_path / 'cache'))
    assert DataConfig().mix_stop == 'all_exhausted'
    with SFTTrainer(cfg) as t:
        sizes = [len(d) for d in t.data.train_sets]
        assert sizes == [1000, 10]
        epoch = [t.data.rows[k] for step in range(t.data.steps_per_epoch) for k in t.data.global_batch(step)]
        assert sorted(epoch) == sorted(t.data.rows)  # one epoch = every mixed pair once
        assert sorted(i for s, i in epoch if s == 0) == list(range(1000))  # each large-source row exactly once
        counts = mix_counts(t.data.rows, sizes, ['big', 'small'])
        assert [c['n_drawn'] for c in counts] == [sum(s == k for s, _ in epoch) for k in (0, 1)]
        assert counts[0] == {'source': 'big', 'weight': 1.0, 'share': 0.5, 'n_rows': 1000, 'n_kept': 1000, 'n_examples': 1000,
                             'n_used': 1000, 'n_cut': 0, 'n_drawn': 1000, 'repeat': 1.0}
        assert counts[1]['n_used'] == 10 and counts[1]['n_cut'] == 0 and counts[1]['n_drawn'] > 10  # oversampled
        trained = [sum(s == k for s, _ in epoch) for k in (0, 1)]  # what one epoch of steps trains, per source
        assert [c['n_drawn'] for c in t.data_report.sources] == trained  # the report the panel and summary.json show
        assert [c['source'] for c in t.data_report.sources] == [str(tmp_path / 'big.jsonl'), str(tmp_path / 'small.jsonl')]
        assert t.data_report.to_dict()['sources'] == t.data_report.sources and 'small.jsonl repeats each example' in str(t.data_report)
