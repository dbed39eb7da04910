"""A resumed run is the run it claims to be: a change of which rows a step trains is refused (naming the key, both values
and what to do) before Ray starts; an unchanged resume equals the uninterrupted run bitwise; lr and the step count may
change, and each change is recorded in the run folder."""
import json, shutil
from pathlib import Path
import pytest
import yaml
from sft_nb.config import ConfigError
from sft_nb.demo_data import identity_rows
from sft_nb.optim import lr_at
from sft_nb.trainer import SFTTrainer, LR_RULE
from helpers import cli, run_cfg

ROWS = identity_rows()['train']  # 56 rows: 7 steps an epoch at a global batch of 8
BASE = dict(train__num_steps=4, checkpoint__save_every=2, checkpoint__keep_last=3, optim__schedule='cosine')


def _write(path: Path, rows) -> Path:
    path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    return path


def _cfg(tiny_path, run, data, **kw):
    return run_cfg(tiny_path, run, data__train=[{'path': str(data)}], **{**BASE, **kw})


@pytest.fixture(scope='module')
def straight(tiny_path, tmp_path_factory, ray_session):
    "A 4-step run from a JSONL file with checkpoints at steps 2 and 4: (run folder, data file, its step metrics)."
    d = tmp_path_factory.mktemp('identity')
    data = _write(d / 'rows.jsonl', ROWS)
    with SFTTrainer(_cfg(tiny_path, d / 'run', data)) as t:
        h = t.fit(); t.save()
    return d / 'run', data, h


def _copy(straight, tmp_path) -> tuple[Path, Path]:
    "The reference run folder and its data file, copied for one test (the copy's data file is the one the test edits)."
    run = tmp_path / 'run'
    shutil.copytree(straight[0], run, ignore=shutil.ignore_patterns('.lock'))
    return run, shutil.copy(straight[1], tmp_path / 'rows.jsonl')


def _edited(rows):
    "The same number of rows, one answer changed (the probe: a file edited in place between the runs)."
    rows = json.loads(json.dumps(rows))
    rows[5]['messages'][-1]['content'] = 'Something else entirely.'
    return rows


@pytest.mark.parametrize('change, message', [
    ('edited', r"data\.train\[0\] \(.*rows\.jsonl\) content: '[0-9a-f]+' in the checkpoint's run, '[0-9a-f]+' now \(the examples' tokens or masks differ"),
    ('half', r"data\.train\[0\] \(.*rows\.jsonl\) examples: 56 in the checkpoint's run, 28 now \(another number of examples"),
    ('global_batch_size', r"train\.global_batch_size: 8 in the checkpoint's run, 4 in this config"),
], ids=['edited_same_row_count', 'lost_half_its_rows', 'global_batch_size_8_to_4'])
def test_resume_refuses_a_changed_data_stream(tiny_path, tmp_path, straight, change, message):
    """A resume whose data stream differs from the checkpoint's run is refused before any worker starts, naming the key,
    both values and what to do; the run folder is left as it was."""
    run, data = _copy(straight, tmp_path)
    if change == 'edited': _write(data, _edited(ROWS))
    if change == 'half': _write(data, ROWS[:28])
    kw = {'train__global_batch_size': 4} if change == 'global_batch_size' else {}
    before = {p: p.read_bytes() for p in run.rglob('*') if p.is_file() and p.name != '.lock'}
    t = SFTTrainer(_cfg(tiny_path, run, data, checkpoint__resume='latest', **kw))
    with pytest.raises(ConfigError, match=message) as e:
        t.setup()
    assert 'would train some rows twice and skip others' in str(e.value) and 'checkpoint.overwrite=true' in str(e.value)
    assert t.group is None  # refused before the workers
    assert {p: p.read_bytes() for p in run.rglob('*') if p.is_file() and p.name != '.lock'} == before


def test_cli_refuses_a_changed_batch_in_one_line(tiny_path, tmp_path, straight):
    "`sft-nb train … checkpoint.resume=latest` with another global batch is one line naming the key, no traceback."
    run, data = _copy(straight, tmp_path)
    cfg = tmp_path / 'c.yaml'
    cfg.write_text(yaml.safe_dump(_cfg(tiny_path, run, data)))
    code, _, err = cli('train', cfg, 'checkpoint.resume=latest', 'train.global_batch_size=4')
    assert code != 0 and 'Traceback' not in err
    assert "train.global_batch_size: 8 in the checkpoint's run, 4 in this config" in err


def test_resume_with_an_unchanged_config_equals_uninterrupted(tiny_path, tmp_path, straight):
    "Resumed at step 2 under the same config (the data file moved, its content the same): steps 3–4 equal the straight run's bitwise."
    run, data = _copy(straight, tmp_path)
    with SFTTrainer(_cfg(tiny_path, run, data, checkpoint__resume=str(run / 'checkpoints' / 'step_000002'))) as t:
        h = t.fit()
    assert h.loss.tolist() == straight[2].loss.tolist() and h.grad_norm.tolist() == straight[2].grad_norm.tolist()
    ev = [json.loads(l) for l in (run / 'events.jsonl').read_text().splitlines()]
    assert [(e['event'], e['step'], e['checkpoint'], sorted(e['changed'])) for e in ev] == [('resume', 2, 'step_000002', ['checkpoint.run_dir', 'data.train'])]
    then, now = (json.loads(v) for v in ev[0]['changed']['data.train'])
    assert (then[0]['path'], now[0]['path']) == (str(straight[1]), str(data))  # the folder and the file moved: recorded, not refused
    assert ev[0]['changed']['checkpoint.run_dir'] == [str(straight[0]), str(run)]


def test_resume_with_a_changed_lr_is_allowed_and_recorded(tiny_path, tmp_path, straight):
    """optim.lr changed on resume at step 2: steps 3–4 take the new peak LR in the same schedule; events.jsonl and
    config.yaml record the change, and config.yaml still loads as this segment's config."""
    run, _ = _copy(straight, tmp_path)
    data = straight[1]
    with SFTTrainer(_cfg(tiny_path, run, data, optim__lr=5e-3, checkpoint__resume=str(run / 'checkpoints' / 'step_000002'))) as t:
        h = t.fit()
    assert h.loss.tolist()[:2] == straight[2].loss.tolist()[:2]
    assert h.lr.tolist() == pytest.approx([lr_at(s, 1e-2, 4, 'cosine') for s in (0, 1)] + [lr_at(s, 5e-3, 4, 'cosine') for s in (2, 3)])
    ev = json.loads((run / 'events.jsonl').read_text())
    assert ev['step'] == 2 and ev['changed'] == {'optim.lr': [1e-2, 5e-3], 'checkpoint.run_dir': [str(straight[0]), str(run)]}  # (this test's copy of the run)
    text = (run / 'config.yaml').read_text()
    assert '# resumed at step 2 from step_000002: optim.lr 0.01 -> 0.005' in text
    assert yaml.safe_load(text)['optim']['lr'] == 5e-3


def test_finished_run_is_extended_under_the_stated_lr_rule(tiny_path, tmp_path, straight):
    """A finished 4-step run resumed with train.num_steps=6 (`sft-nb train`) trains steps 5–6: steps 1–4 keep their
    records, steps 5–6 take the LR of the 6-step schedule; the rule is written into events.jsonl and config.yaml."""
    run, data = _copy(straight, tmp_path)
    cfg = tmp_path / 'c.yaml'
    cfg.write_text(yaml.safe_dump(_cfg(tiny_path, run, data)))
    code, _, err = cli('train', cfg, 'checkpoint.resume=latest', 'train.num_steps=6')
    assert code == 0, err[-3000:]
    recs = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()]
    train = [r for r in recs if r['kind'] == 'train']
    assert [r['step'] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r['loss'] for r in train[:4]] == straight[2].loss.tolist()
    assert [r['lr'] for r in train] == pytest.approx([lr_at(s, 1e-2, 4, 'cosine') for s in range(4)] + [lr_at(s, 1e-2, 6, 'cosine') for s in (4, 5)])
    ev = json.loads((run / 'events.jsonl').read_text())
    moved = ('checkpoint.run_dir', 'data.train')  # this test's copies of the run and its file
    assert (ev['step'], {k: v for k, v in ev['changed'].items() if k not in moved}, ev['lr_schedule']) == (4, {'train.num_steps': [4, 6]}, LR_RULE)
    assert LR_RULE in (run / 'config.yaml').read_text()
    assert sorted(p.name for p in (run / 'checkpoints').glob('step_*'))[-1] == 'step_000006'
