"""Other payloads, other faults, each refused at once with one line naming it: a YAML "billion laughs" (nine anchors of
nine aliases: 387M values in 400 bytes) in a `run -f` file, a config or a `-p` value is refused before it expands; JSON
nested past Python's reader is a bad row (JSONL) or a named error (a JSON list), never a RecursionError; links in a run
resume nothing from outside it."""
import json, os, subprocess, sys
from pathlib import Path
import pytest
from sft_nb.config import TokenizeConfig
from sft_nb.tokenize import tokenize_dataset

ROOT = Path(__file__).resolve().parents[1]
SFT_NB = str(Path(sys.executable).parent / 'sft-nb')
BOMB = "lol: &a [x, x, x, x, x, x, x, x, x]\n" + ''.join(f"l{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
                                                      for p, c in zip('abcdefgh', 'bcdefghi'))
ROW = {'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]}


def sft_nb(*args):
    return subprocess.run([SFT_NB, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, 'HF_HUB_OFFLINE': '1', 'RAY_USAGE_STATS_ENABLED': '0'})


def test_yaml_bomb_in_run_file_is_refused(tmp_path):
    "`sft-nb run -f` with a billion-laughs file whose expansion lands in a declared parameter (max_steps) is refused at once."
    f = tmp_path / 'params.yaml'
    f.write_text(BOMB + 'max_steps: *i\n')
    r = sft_nb('run', ROOT / 'examples' / 'train.ipynb', '-f', f, '--run-dir', tmp_path / 'run')
    assert r.returncode == 2 and f"-f {f}: its YAML aliases expand to more than 1,000,000 values" in r.stderr, r.stderr[-2000:]
    assert 'Traceback' not in r.stderr and not (tmp_path / 'run').exists()


def test_yaml_bomb_in_a_config_and_an_override_is_refused(tmp_path):
    cfg = tmp_path / 'cfg.yaml'
    cfg.write_text(BOMB.replace('\n', '\n  ').replace('lol:', 'data:\n  lol:', 1).rstrip() + '\n')  # inside a section
    r = sft_nb('train', cfg)
    assert r.returncode == 2 and f"{cfg}: its YAML aliases expand to more than 1,000,000 values" in r.stderr, r.stderr[-2000:]
    r = sft_nb('train', ROOT / 'examples' / 'tiny.yaml', 'optim.lr=' + '[' * 20000 + ']' * 20000)
    assert r.returncode == 2 and "the YAML nests deeper than it can be read" in r.stderr and 'Traceback' not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize('suffix', ['.jsonl', '.json'])
def test_json_nested_past_the_reader_is_named(tmp_path, tiny_tok, suffix):
    "A row nested 100k deep is one bad row naming its line (JSONL), or an error naming the file and line (JSON list)."
    deep = '{"messages": ' + '[' * 100000 + ']' * 100000 + '}'
    f = tmp_path / f'rows{suffix}'
    f.write_text(json.dumps(ROW) + '\n' + deep + '\n' if suffix == '.jsonl' else '[' + json.dumps(ROW) + ', ' + deep + ']')
    if suffix == '.json':  # a JSON list cannot be read past an element it cannot decode
        with pytest.raises(ValueError, match=f"{f}: line 1: JSON nested deeper than Python's JSON reader goes"):
            tokenize_dataset(str(f), tiny_tok, TokenizeConfig(), use_cache=False)
        return
    ds, rep = tokenize_dataset(str(f), tiny_tok, TokenizeConfig(), use_cache=False)
    assert len(ds) == 1 and rep.n_dropped == 1 and "line 2: JSON nested deeper than Python's JSON reader goes" in rep.bad_rows_summary()


def test_tool_call_arguments_nested_past_the_reader_are_a_bad_row(tiny_tok):
    row = {'messages': [{'role': 'user', 'content': 'u'}, {'role': 'assistant', 'content': '', 'tool_calls': [
        {'type': 'function', 'function': {'name': 'f', 'arguments': '[' * 100000 + ']' * 100000}}]}]}
    ds, rep = tokenize_dataset([ROW, row], tiny_tok, TokenizeConfig(chat_template='qwen2.5'), use_cache=False)
    assert len(ds) == 1 and "JSON nested deeper than Python's JSON reader goes" in rep.bad_rows_summary(), rep.bad_rows_summary()


def _run(root, steps):
    import warnings
    from sft_nb.checkpoint import Checkpointer
    from sft_nb.config import CheckpointConfig
    ck = Checkpointer(CheckpointConfig(run_dir=str(root), keep_last=5)); ck.dir.mkdir(parents=True)
    for s in steps: ck.save(s, lambda d: (d / 'model.bin').write_bytes(b'w' * 10), {'global_step': s, 'total_steps': 4, 'step_metrics': []})
    return ck


def test_links_in_a_run_resume_nothing_from_outside_it(tmp_path):
    """A `latest` marker that is a symbolic link (to a file naming step_000001, outside the run) is ignored with a warning and
    the newest step 2 resumed; a step folder linked to another run's checkpoint is never a candidate of 'latest'."""
    a, b = _run(tmp_path / 'a', (1, 2)), _run(tmp_path / 'b', (1, 2, 3))
    (tmp_path / 'outside').write_text('step_000001')
    (a.dir / 'latest').unlink(); (a.dir / 'latest').symlink_to(tmp_path / 'outside')
    with pytest.warns(UserWarning, match=r"latest: a symbolic link, not the marker file sft_nb writes; ignored"):
        assert a.resolve('latest') == a.dir / 'step_000002'
    (a.dir / 'latest').unlink(); (a.dir / 'step_000003').symlink_to(b.dir / 'step_000003')
    with pytest.warns(UserWarning, match=r"step_000003: a symbolic link to .*b/checkpoints/step_000003, not a checkpoint folder of"):
        assert a.resolve('latest') == a.dir / 'step_000002'


@pytest.mark.parametrize('fault', ['dir_link', 'metrics_step', 'deep_json'])
def test_crafted_checkpoint_contents_are_refused(tmp_path, fault):
    """A symbolic link to a folder inside a checkpoint, a step_metrics step of -5, a trainer_state.json nested 100k deep (digests
    rewritten to match, as a forger would): each a CheckpointError naming what is wrong, never a RecursionError."""
    from sft_nb.checkpoint import CheckpointError, verify_checkpoint, write_digests
    d = _run(tmp_path / 'a', (2,)).dir / 'step_000002'
    if fault == 'dir_link': (d / 'etc').symlink_to('/etc'); msg = r'step_000002: holds symbolic links \(etc\)'
    else:
        (d / 'trainer_state.json').write_text(json.dumps({'global_step': 2, 'total_steps': 4, 'step_metrics': [{'step': -5, 'loss': 1.0}]})
                                              if fault == 'metrics_step' else '[' * 100000 + ']' * 100000)
        (d / 'digests.json').unlink(); write_digests(d)
        msg = r"step_metrics\[0\] field 'step' is -5, expected a step 0 … 2" if fault == 'metrics_step' else "JSON nested deeper than Python's reader goes"
    with pytest.raises(CheckpointError, match=msg):
        verify_checkpoint(d)


def test_a_line_past_max_row_bytes_is_a_bad_row_never_read_whole(tmp_path, tiny_tok, monkeypatch):
    """A JSONL line is never read whole past `MAX_ROW_BYTES` (read whole, a 300 MB line takes 948 MB resident): it is a bad
    row naming it, read past in chunks (the limit is lowered here to keep the file small); the file's digest is still whole."""
    import sft_nb.jsonl, sft_nb.rows
    from sft_nb.jsonl import iter_json_rows
    from sft_nb.paths import file_digest, new_digest
    monkeypatch.setattr(sft_nb.jsonl, 'MAX_ROW_BYTES', 1000); monkeypatch.setattr(sft_nb.rows, 'MAX_ROW_BYTES', 1000)
    long = json.dumps({'messages': [{'role': 'user', 'content': 'a' * 5000}, {'role': 'assistant', 'content': 'b'}]})
    f = tmp_path / 'rows.jsonl'
    f.write_text('\n'.join([json.dumps(ROW), long, json.dumps(ROW)]) + '\n')
    h = new_digest()
    rows = [r for b in iter_json_rows(f, digest=h) for _, r in b]
    assert rows[0] == ROW and rows[2] == ROW and h.hexdigest() == file_digest(f)
    assert rows[1].reason == f"{f}: line 2 is over 0 MiB; a row that long is past any model's context: split or drop it"
    ds, rep = tokenize_dataset(str(f), tiny_tok, TokenizeConfig(), use_cache=False)
    assert len(ds) == 2 and rep.n_dropped == 1 and 'line 2 is over 0 MiB' in rep.bad_rows_summary()
