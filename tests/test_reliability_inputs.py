"""Bad input a user can type gives one clear line naming the field (no traceback), before Ray starts."""
import contextlib, io
from pathlib import Path
import pytest
import sft_nb.trainer as trainer_mod
from sft_nb.cli import main


class ReachedRay(Exception): pass


@pytest.fixture
def env(tmp_path, tiny_path, shared, monkeypatch):
    "A valid base config; Ray must not start (every check below comes first)."
    def no_ray(*a, **k): raise ReachedRay()
    monkeypatch.setattr(trainer_mod, 'init_ray', no_ray)
    data = shared / 'datasets' / 'identity.json'
    (tmp_path / 'base.yaml').write_text(f"model: {{path: {tiny_path}}}\ndata: {{train: [{{path: {data}}}]}}\n"
                                        "train: {num_steps: 1, global_batch_size: 8}\ncheckpoint: {export_hf: false}\n")
    return tmp_path, data


def cli(*argv):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e: main(list(map(str, argv)))
    return e.value.code, err.getvalue()


OVERRIDES = [
    ('optim.lr=.inf', 'optim.lr: must be a finite number > 0, got inf'), ('optim.lr=.nan', 'optim.lr: must be a finite number > 0, got nan'),
    ('optim.lr=0', 'optim.lr: must be'), ('optim.weight_decay=-1', 'optim.weight_decay: must be'),
    ('optim.warmup_steps=-5', 'optim.warmup_steps: must be >= 0'), ('optim.min_lr_ratio=5', 'optim.min_lr_ratio: must be'),
    ('optim.max_grad_norm=-1', 'optim.max_grad_norm: must be'), ('optim.eps=0', 'optim.eps: must be'),
    ('optim.betas=[0.9, 2]', 'optim.betas[1]: must be'), ('checkpoint.save_every=-1', 'checkpoint.save_every: must be >= 0'),
    ('checkpoint.keep_last=0', 'checkpoint.keep_last: must be >= 1'), ('train.eval_every=-1', 'train.eval_every: must be >= 0'),
    ('placement.cpus_per_worker=0', 'placement.cpus_per_worker: must be >= 1'), ('logging.log_every=0', 'logging.log_every: must be >= 1'),
    ('packing.capacity=0', 'packing.capacity: must be >= 2'), ('packing.scope=dataset', 'packing.scope: unknown key'),
    ('model.path=/nonexistent/model', "model.path: '/nonexistent/model' does not exist"), ("model.path=''", 'model.path: empty'),
    ('model.path=no-such-org/no-such-model', "model.path: cannot load 'no-such-org/no-such-model'"),
    ('model.lora_dropout=1.5', 'model.lora_dropout: must be'), ('data.train=[{path: /nonexistent/x.json}]', "'/nonexistent/x.json' does not exist"),
    ('data.train=[{path: x.json, weight: .nan}]', 'data.train[0].weight: must be'), ('train.sampler=os:getcwd', 'is not a subclass of sft_nb.dataplan.Sampler'),
    ('checkpoint.resume=/nonexistent/ckpt', 'checkpoint.resume: /nonexistent/ckpt is not a complete checkpoint'),
    ('train.on_nonfinite=ignore', "train.on_nonfinite: 'ignore' is not allowed"), ('data.train=[]', 'data.train: no train source given'),
]


@pytest.mark.parametrize('override, message', OVERRIDES)
def test_bad_override_is_one_clear_line(env, override, message):
    tmp, _ = env
    code, err = cli('train', tmp / 'base.yaml', override, f'checkpoint.run_dir={tmp / "run"}')
    assert code in (1, 2) and message in err and 'Traceback' not in err, err


def test_bad_files_and_folders(env):
    tmp, data = env
    used = tmp / 'used'; used.mkdir(); (used / 'metrics.jsonl').write_text('{"kind": "train", "step": 1}\n')
    (tmp / 'noconf').mkdir()
    for name, text in [('syntax.yaml', 'optim: {lr: 1e-3\n'), ('tabs.yaml', 'optim:\n\tlr: 1\n'), ('list.yaml', '- a\n')]:
        (tmp / name).write_text(text)
    cases = [(('train', tmp / 'syntax.yaml'), 'syntax.yaml: not valid YAML at line'), (('train', tmp / 'tabs.yaml'), 'not valid YAML at line 2'),
             (('train', tmp / 'list.yaml'), 'the YAML must be a mapping'), (('train', tmp / 'missing.yaml'), 'No such file'),
             (('train', tmp / 'base.yaml', f'checkpoint.run_dir={used}'), 'already holds a run (metrics.jsonl)'),
             (('train', tmp / 'base.yaml', f'model.path={tmp / "noconf"}'), 'is a folder without config.json'),
             (('pack', data, '--capacity', '0'), '--capacity: must be >= 2, got 0'), (('pack', data, '--dp', '0'), '--dp: must be >= 1'),
             (('pack', '/nonexistent/x.json'), "'/nonexistent/x.json' does not exist"), (('run', '/nonexistent/x.ipynb'), 'No such file')]
    for argv, message in cases:
        code, err = cli(*argv)
        assert code in (1, 2) and message in err and 'Traceback' not in err, (argv, err)
