"""Checkpoints that cannot execute code or lie, a trainer that survives interrupts and dead workers."""
import _thread, hashlib, io, json, pickle, shutil, threading, warnings
from pathlib import Path
import pytest
import torch
from sft_nb.config import CheckpointConfig
from sft_nb.demo_data import identity_rows
from sft_nb.trainer import SFTTrainer
from sft_nb.workers import WorkerError
from helpers import run_cfg

ROWS = identity_rows()['train']
BASE = dict(train__num_steps=4, checkpoint__save_every=2, checkpoint__keep_last=3)


def _forge_digests(folder: Path):
    "What someone who crafts a checkpoint does: digests.json rewritten to match the crafted files (no digests.json: nothing)."
    f = folder / 'digests.json'
    if f.exists():
        files = {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in sorted(folder.rglob('*')) if p.is_file() and p.name != 'digests.json'}
        f.write_text(json.dumps({'sha256': files}))


class _Payload:
    def __init__(self, marker): self.marker = str(marker)
    def __reduce__(self): return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.fixture(scope='module')
def straight(tiny_path, tmp_path_factory, ray_session):
    "A 4-step run with checkpoints at steps 2 and 4, and its step metrics (the uninterrupted reference)."
    run = tmp_path_factory.mktemp('straight') / 'run'
    with SFTTrainer(run_cfg(tiny_path, run, **BASE), train_data=ROWS) as t:
        h = t.fit()
    return run, h


def _copy_run(straight, tmp_path) -> Path:
    run = tmp_path / 'run'
    shutil.copytree(straight[0], run, ignore=shutil.ignore_patterns('.lock'))
    return run


# ---- resuming runs nothing a checkpoint contains ------------------------------------------------------------------
def test_dcp_metadata_payload_never_runs(tiny_path, tmp_path, straight):
    "A `.metadata` carrying a `__reduce__` payload is refused, never run (torch DCP would `pickle.load` it in the worker)."
    run, marker = _copy_run(straight, tmp_path), tmp_path / 'pwned'
    ck = run / 'checkpoints' / 'step_000002'
    (ck / '.metadata').write_bytes(pickle.dumps(_Payload(marker)))
    _forge_digests(ck)
    with pytest.raises(Exception) as e:
        SFTTrainer(run_cfg(tiny_path, tmp_path / 'other', checkpoint__resume=str(ck), **BASE), train_data=ROWS).setup()
    assert not marker.exists()  # the payload never ran, in the driver or in a worker
    assert e.match(r"\.metadata: refused, loading it could run code.*builtins\.exec is not a torch checkpoint metadata class")


def test_shard_bytes_payload_never_runs(tiny_path, tmp_path, straight):
    "A payload in a shard's optimizer param_groups entry (which DCP reads with torch.load(weights_only=False)) never runs."
    from torch.distributed.checkpoint import FileSystemReader
    run, marker = _copy_run(straight, tmp_path), tmp_path / 'pwned'
    ck = run / 'checkpoints' / 'step_000002'
    md = FileSystemReader(str(ck)).read_metadata()  # our own just-saved metadata: trusted here
    idx = next(i for i in md.storage_data if i.fqn.endswith('param_groups.0.lr'))
    info = md.storage_data[idx]
    buf = io.BytesIO(); torch.save(_Payload(marker), buf)
    shard = ck / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(buf.getvalue())  # the entry now points at the payload
    with open(shard, 'ab') as f: f.write(buf.getvalue())
    (ck / '.metadata').write_bytes(pickle.dumps(md))
    _forge_digests(ck)
    with pytest.raises(Exception) as e:
        SFTTrainer(run_cfg(tiny_path, tmp_path / 'other', checkpoint__resume=str(ck), **BASE), train_data=ROWS).setup()
    assert not marker.exists()
    assert e.match(r"\.metadata: refused, loading it could run code")


def test_latest_marker_cannot_leave_the_run(tmp_path):
    "`latest` holding '../../other/checkpoints/step_000006' never resumes another run's checkpoint: it falls back, warning."
    from sft_nb.checkpoint import Checkpointer
    other = Checkpointer(CheckpointConfig(run_dir=str(tmp_path / 'other'), keep_last=9)); other.claim()
    mine = Checkpointer(CheckpointConfig(run_dir=str(tmp_path / 'mine'), keep_last=9)); mine.claim()
    try:
        state = lambda s: {'global_step': s, 'total_steps': 6, 'step_metrics': []}
        other.save(6, lambda tmp: None, state(6))
        mine.save(2, lambda tmp: None, state(2))
        (mine.dir / 'latest').write_text('../../other/checkpoints/step_000006')
        with pytest.warns(UserWarning, match='not a checkpoint folder of'):
            assert mine.resolve('latest') == mine.dir / 'step_000002'
        with pytest.raises(Exception, match='is not a checkpoint folder'):
            mine.resolve(str(tmp_path / 'other'))  # a resume path names a step folder, not anything
    finally: other.release(); mine.release()


# ---- checkpoints that cannot lie ----------------------------------------------------------------------------------
def test_flipped_floats_fall_back_with_a_warning(tiny_path, tmp_path, straight):
    "256 flipped floats in the newest shard are caught by its digest: 'latest' falls back to step 2, naming the file."
    run = _copy_run(straight, tmp_path)
    shard = next((run / 'checkpoints' / 'step_000004').glob('*.distcp'))
    raw = bytearray(shard.read_bytes())
    for i in range(4096, 4096 + 256 * 4, 4): raw[i + 3] ^= 0x40
    shard.write_bytes(bytes(raw))
    with pytest.raises(Exception, match=r'__0_0\.distcp: its content differs'):  # a path names one checkpoint: no fallback
        SFTTrainer(run_cfg(tiny_path, tmp_path / 'o', checkpoint__resume=str(shard.parent), **BASE), train_data=ROWS).setup()
    with pytest.warns(UserWarning, match=r'skipping step_000004: .*__0_0\.distcp: its content differs from what was saved'):
        with SFTTrainer(run_cfg(tiny_path, run, checkpoint__resume='latest', **BASE), train_data=ROWS) as t:
            assert t.global_step == 2
            resumed = t.fit()
    torch.testing.assert_close(torch.tensor(resumed['loss'].tolist()), torch.tensor(straight[1]['loss'].tolist()), rtol=1e-5, atol=1e-6)


def test_checkpoint_of_another_model_is_refused(tiny_path, tmp_path, straight):
    "A 3-layer model's checkpoint is refused by the 2-layer tiny model, naming the differing config field, before any load."
    big = tmp_path / 'tiny3'
    shutil.copytree(tiny_path, big)
    cfg = json.loads((big / 'config.json').read_text())
    cfg['num_hidden_layers'] += 1
    if 'layer_types' in cfg: cfg['layer_types'] = cfg['layer_types'] + cfg['layer_types'][-1:]
    (big / 'config.json').write_text(json.dumps(cfg))
    from transformers import AutoConfig, AutoModelForCausalLM
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(big)).save_pretrained(big)  # weights of 3 layers: a whole model
    with SFTTrainer(run_cfg(big, tmp_path / 'big', **BASE), train_data=ROWS) as t:
        t.fit(2)
    ck = tmp_path / 'big' / 'checkpoints' / 'step_000002'
    t = SFTTrainer(run_cfg(tiny_path, tmp_path / 'small', checkpoint__resume=str(ck), **BASE), train_data=ROWS)
    with pytest.raises(Exception, match=rf"is of another model \(num_hidden_layers {cfg['num_hidden_layers']} there, "
                                        rf"{cfg['num_hidden_layers'] - 1} here"):
        t.setup()
    assert t.group is None


@pytest.mark.parametrize('field, value, message', [('global_step', -1, 'out of range'),
                                                   ('global_step', 2, 'global_step 2 in the folder of step 4'),
                                                   ('total_steps', '4', "field 'total_steps' is '4'")])
def test_trainer_state_is_validated_and_nothing_deleted(tiny_path, tmp_path, straight, field, value, message):
    "A trainer_state.json with `global_step: -1`, or `global_step: 2` in step_000004, is refused and deletes nothing."
    run = _copy_run(straight, tmp_path)
    ck = run / 'checkpoints' / 'step_000004'
    state = json.loads((ck / 'trainer_state.json').read_text())
    (ck / 'trainer_state.json').write_text(json.dumps({**state, field: value}))
    _forge_digests(ck)
    with pytest.raises(Exception, match=message):
        SFTTrainer(run_cfg(tiny_path, run, checkpoint__resume=str(ck), **BASE), train_data=ROWS).setup()
    assert sorted(p.name for p in (run / 'checkpoints').glob('step_*')) == ['step_000002', 'step_000004']
    with pytest.warns(UserWarning, match=rf'skipping step_000004: .*{message}'):  # 'latest' falls back to step 2
        with SFTTrainer(run_cfg(tiny_path, run, checkpoint__resume='latest', **BASE), train_data=ROWS) as t:
            assert t.global_step == 2


# ---- a dead worker group ------------------------------------------------------------------------------------------
def test_dead_group_refuses_every_action_and_restarts_from_last_good(tiny_path, tmp_path, straight):
    "After a killed worker every action is refused, save() prunes nothing, and restart_workers() resumes the last good one."
    import ray
    t = SFTTrainer(run_cfg(tiny_path, tmp_path / 'run', **{**BASE, 'checkpoint__keep_last': 1, 'checkpoint__save_every': 100}),
                   train_data=ROWS)
    try:
        t.fit(2); good = t.save(); t.fit(1)
        ray.kill(t.group.actors[0])
        with pytest.raises(WorkerError, match='worker rank 0 died during write_checkpoint'): t.save()
        for action in (t.save, t.step, t.fit, t.evaluate, t.export):
            with pytest.raises(WorkerError, match=r'the worker group is dead \(worker rank 0 died during write_checkpoint.*trainer\.restart_workers\(\)'):
                action()
        assert t.checkpoints() == [good] and (t.ckpt.dir / 'latest').read_text() == good.name
        assert not (tmp_path / 'run' / 'hf').exists() and not list(t.ckpt.dir.glob('.tmp_step_*'))
        assert t.restart_workers() == 2
        h = t.fit()
    finally: t.shutdown()
    for k in ('loss', 'grad_norm'):
        torch.testing.assert_close(torch.tensor(h[k].tolist()), torch.tensor(straight[1][k].tolist()), rtol=1e-5, atol=1e-6)


# ---- interrupts ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('after', ['forward_backward', 'optim_step'])
def test_interrupt_inside_a_step_finishes_it(tiny_path, tmp_path, straight, after):
    """A KeyboardInterrupt landing after the workers' forward_backward or optim_step lets the step finish, then is raised:
    no gradients left accumulated, no worker a step ahead, and the next fit() equals an uninterrupted run."""
    t = SFTTrainer(run_cfg(tiny_path, tmp_path / 'run', **BASE), train_data=ROWS)
    try:
        t.setup()
        for name in ('call', 'call_per_rank'):
            real = getattr(t.group, name)
            def hooked(method, *a, _real=real, **k):
                out = _real(method, *a, **k)
                if method == after and t.global_step == 1: _thread.interrupt_main()  # the kernel interrupt lands right here
                return out
            setattr(t.group, name, hooked)
        with pytest.raises(KeyboardInterrupt, match='interrupted during step 2, which finished first'):
            t.fit()
        assert t.global_step == 2 and len(t.metrics) == 2
        h = t.fit()
    finally: t.shutdown()
    for k in ('loss', 'grad_norm', 'lr'):
        torch.testing.assert_close(torch.tensor(h[k].tolist()), torch.tensor(straight[1][k].tolist()), rtol=1e-5, atol=1e-6)


def test_interrupt_timer_around_fit(tiny_path, tmp_path, straight):
    "An interrupt as a notebook user makes it: `threading.Timer(0.05, _thread.interrupt_main)` around fit(), then fit() again."
    t = SFTTrainer(run_cfg(tiny_path, tmp_path / 'run', **BASE), train_data=ROWS)
    try:
        t.setup()
        timer = threading.Timer(0.05, _thread.interrupt_main)
        timer.start()
        try: t.fit()
        except KeyboardInterrupt: pass
        finally: timer.cancel()
        assert len(t.metrics) == t.global_step
        h = t.fit()
    finally: t.shutdown()
    for k in ('loss', 'grad_norm'):
        torch.testing.assert_close(torch.tensor(h[k].tolist()), torch.tensor(straight[1][k].tolist()), rtol=1e-5, atol=1e-6)
