"""Bad input gives a clear error before Ray starts; one run per run_dir (refuse / resume / overwrite, a lock);
non-finite steps stop (or are skipped); no pickle in checkpoints; a driver killed during a save resumes exactly."""
import json, os, pickle, signal, subprocess, sys, textwrap
from pathlib import Path
import pytest
import torch
from sft_nb.config import ConfigError, load_config
from sft_nb.demo_data import identity_rows
from sft_nb.trainer import SFTTrainer
from sft_nb.dataplan import Sampler, make_sampler
from sft_nb.callbacks import NonFiniteLoss
from sft_nb.checkpoint import RunDirBusy
from helpers import local_run, run_cfg
import sft_nb.trainer as trainer_mod

ROWS = identity_rows()['train']


# ---- configs: numbers, YAML, samplers (no Ray) -------------------------------------------------------------------
@pytest.mark.parametrize('override, message', [
    ('optim.lr=.inf', 'optim.lr: must be a finite number > 0, got inf'),
    ('optim.lr=.nan', 'optim.lr: must be a finite number > 0, got nan'),
    ('optim.weight_decay=-1', 'optim.weight_decay: must be a finite number >= 0'),
    ('optim.warmup_steps=-5', 'optim.warmup_steps: must be >= 0'),
    ('optim.min_lr_ratio=5', 'optim.min_lr_ratio: must be a finite number in [0, 1]'),
    ('optim.max_grad_norm=-1', 'optim.max_grad_norm: must be a finite number >= 0'),
    ('optim.eps=0', 'optim.eps: must be a finite number > 0'),
    ('checkpoint.save_every=-1', 'checkpoint.save_every: must be >= 0'),
    ('checkpoint.keep_last=0', 'checkpoint.keep_last: must be >= 1'),
    ('train.eval_every=-1', 'train.eval_every: must be >= 0'),
    ('placement.cpus_per_worker=0', 'placement.cpus_per_worker: must be >= 1'),
    ('logging.log_every=0', 'logging.log_every: must be >= 1'),
])
def test_numeric_fields_name_the_field(override, message):
    with pytest.raises(ConfigError) as e: load_config({}, [override])
    assert message in str(e.value)


def _cli(*argv):
    "Run the CLI in-process; returns (exit code, stderr text)."
    from sft_nb.cli import main
    import io, contextlib
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e: main([str(a) for a in argv])
    return e.value.code, err.getvalue()


@pytest.mark.parametrize('text, message', [('optim: {lr: 1e-3\ntrain: {num_steps: 2}\n', 'not valid YAML at line'),
                                           ('', 'the config is empty'), ('# just a comment\n', 'the config is empty')])
def test_cli_train_bad_config_file(tmp_path, text, message):
    (tmp_path / 'c.yaml').write_text(text)
    code, err = _cli('train', tmp_path / 'c.yaml')
    assert code == 2 and message in err and 'Traceback' not in err, err


def test_cli_pack_capacity_zero(shared):
    code, err = _cli('pack', shared / 'datasets' / 'identity.json', '--capacity', '0')
    assert code == 2 and '--capacity: must be >= 2, got 0' in err and 'Traceback' not in err, err


class NotASampler:
    calls = 0
    def __init__(self, *a): NotASampler.calls += 1


def test_sampler_must_be_a_sampler_subclass_before_it_is_called():
    with pytest.raises(ConfigError, match="is not a subclass of sft_nb.dataplan.Sampler"):
        make_sampler('test_reliability:NotASampler', 4, 0)
    with pytest.raises(ConfigError, match="is not a subclass"): make_sampler('os:getcwd', 4, 0)
    assert NotASampler.calls == 0


# ---- checks before Ray -------------------------------------------------------------------------------------------
@pytest.fixture
def no_ray(monkeypatch):
    "Any Ray start in the trainer fails the test: these errors must come before it."
    def boom(*a, **k): raise AssertionError('Ray was started before the input was checked')
    monkeypatch.setattr(trainer_mod, 'init_ray', boom)


def test_checks_before_ray(tiny_path, tmp_path, no_ray):
    cases = [(dict(model__path=str(tmp_path / 'no_such_model')), ConfigError, "model.path: '%s' does not exist" % (tmp_path / 'no_such_model')),
             (dict(model__path=str(tmp_path)), ConfigError, 'is a folder without config.json'),
             (dict(checkpoint__resume=str(tmp_path / 'nothing_here')), FileNotFoundError, 'is not a complete checkpoint'),
             (dict(train__sampler='os:getcwd'), ConfigError, 'train.sampler'),
             ]
    for i, (kw, exc, msg) in enumerate(cases):
        run = tmp_path / f'run{i}'
        t = SFTTrainer(run_cfg(tiny_path, run, **kw), train_data=ROWS)
        with pytest.raises(exc) as e: t.setup()
        assert msg in str(e.value), (kw, str(e.value))
        assert not (run / '.lock').exists()  # a failed setup lets go of the run folder
    used = tmp_path / 'used'; used.mkdir(); (used / 'metrics.jsonl').write_text('{}\n')
    with pytest.raises(ConfigError, match=r"checkpoint.run_dir: .* already holds a run \(metrics.jsonl\); continue it with checkpoint.resume=latest"):
        SFTTrainer(run_cfg(tiny_path, used), train_data=ROWS).setup()


def test_run_lock_stale_and_live(tmp_path):
    from sft_nb.checkpoint import RunLock
    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
    try:
        (tmp_path / '.lock').write_text(json.dumps({'host': os.uname().nodename, 'pid': p.pid, 'start': None}))
        with pytest.raises(RunDirBusy, match=f'is in use by PID {p.pid}'): RunLock(tmp_path).acquire()
    finally: p.kill(); p.wait()
    RunLock(tmp_path).acquire().release()  # its owner is gone: taken over, then released
    assert not (tmp_path / '.lock').exists()


# ---- one run per run_dir (Ray) -----------------------------------------------------------------------------------
def _train_steps(run_dir):
    return [json.loads(l)['step'] for l in (run_dir / 'metrics.jsonl').read_text().splitlines() if '"train"' in l]


def test_run_dir_refused_resumed_overwritten_and_locked(tiny_path, tmp_path, ray_session):
    run = tmp_path / 'run'
    base = dict(train__num_steps=3, checkpoint__save_every=1, checkpoint__keep_last=1)
    with SFTTrainer(run_cfg(tiny_path, run, **base), train_data=ROWS) as t:
        t.fit(2)
    assert [p.name for p in t.checkpoints()] == ['step_000002'] and (run / 'checkpoints' / 'latest').read_text() == 'step_000002'
    with pytest.raises(ConfigError, match='already holds a run'):
        SFTTrainer(run_cfg(tiny_path, run, **base), train_data=ROWS).setup()
    with SFTTrainer(run_cfg(tiny_path, run, checkpoint__resume='latest', **base), train_data=ROWS) as t:
        assert t.global_step == 2
        with pytest.raises(RunDirBusy, match='in use by PID'):  # a second live trainer on the same folder
            SFTTrainer(run_cfg(tiny_path, run, checkpoint__resume='latest', **base), train_data=ROWS).setup()
        t.fit()
    assert _train_steps(run) == [1, 2, 3]
    with SFTTrainer(run_cfg(tiny_path, run, checkpoint__overwrite=True, **base), train_data=ROWS) as t:
        assert not (run / 'checkpoints').exists() and not (run / 'metrics.jsonl').exists()
        t.fit(1)
    assert _train_steps(run) == [1] and [p.name for p in t.checkpoints()] == ['step_000001']


def test_resumed_run_replaces_checkpoint_of_same_step(tiny_path, tmp_path, ray_session):
    """Resume from step 1 with another LR: the earlier run's later checkpoints go (as its metrics do), and the new step-2
    checkpoint is this run's, never the earlier run's step 2, and keep_last never prunes the new ones."""
    run = tmp_path / 'run'
    base = dict(train__num_steps=3, checkpoint__save_every=1, checkpoint__keep_last=3)
    with SFTTrainer(run_cfg(tiny_path, run, **base), train_data=ROWS) as t: t.fit()
    step2 = lambda: json.loads((run / 'checkpoints' / 'step_000002' / 'trainer_state.json').read_text())['step_metrics'][-1]['lr']
    assert step2() == 1e-2
    with SFTTrainer(run_cfg(tiny_path, run, checkpoint__resume=str(run / 'checkpoints' / 'step_000001'), optim__lr=0.5, **base),
                    train_data=ROWS) as t:
        assert [p.name for p in t.checkpoints()] == ['step_000001']
        assert t.fit(1)['lr'].tolist() == [1e-2, 0.5]
        assert [p.name for p in t.checkpoints()] == ['step_000001', 'step_000002']
    assert step2() == 0.5 and not list((run / 'checkpoints').glob('.*step_*'))
    assert _train_steps(run) == [1, 2]


# ---- non-finite steps, final evaluation (Ray) --------------------------------------------------------------------
def test_nonfinite_loss_stops_naming_the_step_or_is_skipped(tiny_path, tmp_path, ray_session):
    t = SFTTrainer(run_cfg(tiny_path, tmp_path, train__num_steps=4), train_data=ROWS)
    try:
        t.step()
        after1 = t.group.call('full_state')[0]
        call = t.group.call_per_rank
        def nan_at_step_2(method, args):  # the workers' loss sum comes back NaN on step 2
            out = call(method, args)
            if method == 'forward_backward' and t.global_step == 1: out = [{**r, 'nll_sum': float('nan')} for r in out]
            return out
        t.group.call_per_rank = nan_at_step_2
        with pytest.raises(NonFiniteLoss, match=r'step 2: loss nan.*not finite; its update was not applied.*train.on_nonfinite=skip'):
            t.fit()
        w = t.group.call('full_state')[0]
        assert all(torch.equal(w[k], after1[k]) for k in w)  # the NaN step changed nothing
        t.cfg.train.on_nonfinite = 'skip'
        t.group.call_per_rank = call
        h = t.fit()
        assert list(h.step) == [1, 2, 3, 4] and h.skipped.fillna(False).tolist() == [False, True, False, False]
    finally: t.shutdown()


def test_train_evaluates_the_final_step_once(tiny_path, tmp_path, ray_session):
    with SFTTrainer(run_cfg(tiny_path, tmp_path, train__num_steps=2, train__eval_every=2, data__eval_fraction=0.2),
                    train_data=ROWS) as t:
        t.train()
    evals = [json.loads(l)['step'] for l in (tmp_path / 'metrics.jsonl').read_text().splitlines() if '"eval"' in l]
    assert evals == [2]


# ---- checkpoints run no code -------------------------------------------------------------------------------------
def test_checkpoint_rng_is_not_unpickled(tiny_path, tmp_path):
    "A crafted rng_rank0.pt in a checkpoint folder is never unpickled: RNG state is read from safetensors + JSON only."
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import ModelConfig
    from sft_nb.workers import free_port
    w = FSDPWorker(0, 1, ModelConfig(path=str(tiny_path)), load_config({}).optim, total_steps=1)
    w.init_dist('127.0.0.1', free_port())
    try:
        w.setup()
        w.save(str(tmp_path))
        assert not list(tmp_path.glob('*.pt')) and (tmp_path / 'rng_rank0.safetensors').exists()
        marker = tmp_path / 'pwned'
        class Payload:
            def __reduce__(self): return (exec, (f"open(r'{marker}', 'w').write('ran')",))
        (tmp_path / 'rng_rank0.pt').write_bytes(pickle.dumps({'torch': Payload()}))
        want = torch.rand(3)
        w.load(str(tmp_path))
        assert not marker.exists()
        assert torch.equal(torch.rand(3), want)  # the saved stream, restored
    finally: w.shutdown()


def test_worker_counts_on_from_its_checkpoint_step(tiny_path, tmp_path):
    """A worker that saved after 2 optimizer steps and took a third resumes from that checkpoint at step 2: `load` says so and
    the next step's LR is the schedule's at step 2."""
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import ModelConfig, OptimConfig
    from sft_nb.optim import lr_at
    from sft_nb.workers import free_port
    w = FSDPWorker(0, 1, ModelConfig(path=str(tiny_path)), OptimConfig(lr=1.0, schedule='linear'), total_steps=5)
    w.init_dist('127.0.0.1', free_port())
    try:
        w.setup()
        assert [w.optim_step()['lr'] for _ in range(2)] == [lr_at(s, 1.0, 5, 'linear') for s in range(2)]
        w.save(str(tmp_path))
        w.optim_step()
        assert w.load(str(tmp_path)) == 2 and w.step == 2
        assert w.optim_step()['lr'] == lr_at(2, 1.0, 5, 'linear') == 0.5
    finally: w.shutdown()


# ---- kill -9 of the driver during a checkpoint save --------------------------------------------------------------
DRIVER = textwrap.dedent('''
    import json, os, signal, sys, shutil
    from pathlib import Path
    import sft_nb.trainer as T
    from sft_nb.workers import WorkerGroup
    from sft_nb.demo_data import identity_rows
    cfg, point, at = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    t = T.SFTTrainer(cfg, train_data=identity_rows()['train'])
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    armed = lambda: t.global_step == at
    if point == 'workers':  # the workers wrote their shards into the temp folder; no trainer_state.json yet
        call = WorkerGroup.call
        def patched(self, method, *a, **k):
            out = call(self, method, *a, **k)
            if method == 'write_checkpoint' and armed(): die()
            return out
        WorkerGroup.call = patched
    elif point == 'rename':  # trainer_state.json written; the folder not renamed into place
        rename = os.rename
        def patched(src, dst):
            if armed() and Path(src).name.startswith('.tmp_step'): die()
            return rename(src, dst)
        os.rename = patched
    elif point == 'marker':  # the checkpoint is in place; the 'latest' marker still names the one before (resumed from)
        replace = os.replace
        def patched(src, dst):
            if armed() and Path(dst).name == 'latest': die()
            return replace(src, dst)
        os.replace = patched
    elif point == 'prune':  # the marker names the new checkpoint; the old one is half deleted
        rmtree = shutil.rmtree
        def patched(p, *a, **k):
            if armed() and Path(p).name.startswith('step_'): (Path(p) / 'trainer_state.json').unlink(); die()
            return rmtree(p, *a, **k)
        shutil.rmtree = patched
    t.fit()
    sys.exit(3)  # not reached: the kill point was missed
''')


def test_driver_killed_during_save_resumes_exactly(tiny_path, tmp_path, ray_session):
    import ray
    gcs = ray.get_runtime_context().gcs_address
    base = dict(train__num_steps=4, checkpoint__save_every=1, checkpoint__keep_last=1, placement__ray_address=gcs)
    straight = [m['loss'] for m in local_run(run_cfg(tiny_path, tmp_path / 'straight', **base), ROWS)[0]]  # 1 rank, in this process
    env = {**os.environ, 'RAY_USAGE_STATS_ENABLED': '0', 'RAY_AUTH_MODE': 'disabled', 'HF_HUB_OFFLINE': '1',
           'PYTHONPATH': os.pathsep.join([str(Path(__file__).parent), os.environ.get('PYTHONPATH', '')])}
    points = [('workers', 1), ('rename', 2), ('marker', 2), ('prune', 3)]
    drivers = {point: subprocess.Popen([sys.executable, '-c', DRIVER, json.dumps(run_cfg(tiny_path, tmp_path / point, **base)), point, str(at)],
                                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for point, at in points}  # the four drivers at once, each on its own worker of the session's cluster
    for point, p in drivers.items():
        err = p.communicate(timeout=600)[1]
        assert p.returncode == -signal.SIGKILL, (point, p.returncode, err[-3000:])
    for point, _ in points:
        run = tmp_path / point
        assert (run / '.lock').exists()  # the dead driver's lock is left behind ...
        with SFTTrainer(run_cfg(tiny_path, run, checkpoint__resume='latest', **base), train_data=ROWS) as r:  # ... and taken over
            start = r.global_step
            resumed = r.fit()['loss'].tolist()
        assert start == {'workers': 0, 'rename': 1, 'marker': 1, 'prune': 3}[point], (point, start)
        assert resumed == straight, (point, resumed, straight)
        assert _train_steps(run) == [1, 2, 3, 4], point
