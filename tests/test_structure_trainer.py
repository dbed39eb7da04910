"The driver split: the Backend protocol the workers implement; the trainer's public surface."
import inspect
import pytest
from sft_nb.backends import Backend, BackendGroup, get_backend


def _protocol_methods():
    return [n for n, v in vars(Backend).items() if not n.startswith('_') and callable(v)]


@pytest.mark.parametrize('name', ['fsdp', 'megatron'])
def test_workers_implement_backend_protocol(name):
    "FSDPWorker and MegatronWorker have every Backend method, with the protocol's parameter names in order."
    cls = get_backend(name)
    for m in _protocol_methods():
        assert hasattr(cls, m), f"{cls.__name__} lacks Backend.{m}"
        want = list(inspect.signature(getattr(Backend, m)).parameters)
        got = [p for p in inspect.signature(getattr(cls, m)).parameters if p != '_ray_trace_ctx']  # Ray adds it once an actor of cls exists
        assert got == want, f"{cls.__name__}.{m}: not {want}"


def test_backend_group_covers_protocol():
    "The driver's typed view has a method for every protocol method but shutdown (WorkerGroup.shutdown does that)."
    assert set(_protocol_methods()) - {'shutdown'} <= {n for n in vars(BackendGroup) if not n.startswith('_')}


def test_trainer_surface():
    "What a user may read and call on a fresh SFTTrainer is there without importing anything else."
    import subprocess, sys
    code = """
import sys
from pathlib import Path
from sft_nb.trainer import SFTTrainer
t = SFTTrainer({'model': {'path': 'tiny'}})
assert 'sft_nb.lens' not in sys.modules
for a in ('global_step', 'metrics', 'eval_metrics', 'step_metrics', 'last_eval', 'total_steps', 'run_dir', 'group', 'backend',
          'tokenizer', 'processor', 'data_report', 'model_info', 'callbacks', 'control', 'running', 'action', 'profile_dir', 'data', 'ckpt'):
    getattr(t, a)
for m in ('setup', 'step', 'fit', 'train', 'evaluate', 'save', 'load', 'export', 'generate', 'shutdown', 'dry_run', 'restart_workers',
          'checkpoints', 'token_losses', 'rank_rows', 'request_stop'):
    assert callable(getattr(t, m)), m
assert t.total_steps == 0 and t.data.heldout == [] and t.group is None and t.run_dir == Path(t.cfg.checkpoint.run_dir).absolute()
assert t.running is False and t.action is None and t.checkpoints() == []
print('ok')
"""
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == 'ok', out.stderr[-2000:]


def test_no_forwarding_table():
    "The trainer's members are written out, not installed from a table after the class."
    import sft_nb.trainer as T
    assert 'attrgetter' not in inspect.getsource(T) and 'setattr(SFTTrainer' not in inspect.getsource(T)


def _trainer_lines() -> dict:
    "Non-blank lines of SFTTrainer in sft_nb/trainer.py: the class and each function patched onto it (decorators and docstrings included)."
    import ast, sft_nb.trainer as T
    text = inspect.getsource(T); lines, parts = text.splitlines(), {}
    for node in ast.parse(text).body:
        start = min([d.lineno for d in getattr(node, 'decorator_list', [])] + [node.lineno])
        seg = lines[start - 1:node.end_lineno]
        first = node.args.args[0].annotation if isinstance(node, ast.FunctionDef) and node.args.args else None
        if (isinstance(node, ast.ClassDef) and node.name == 'SFTTrainer') or (first is not None and ast.unparse(first) == 'SFTTrainer'):
            parts[getattr(node, 'name', f'line {start}')] = sum(1 for l in seg if l.strip())
    return parts


def test_every_action_is_guarded():
    "Every public action holds the trainer (one action at a time), and the trainer's parts are methods of its own."
    from sft_nb.trainer import SFTTrainer
    parts = _trainer_lines()
    assert {'SFTTrainer', 'setup', 'step', 'fit', 'evaluate', 'save', 'load', 'shutdown', 'dry_run', 'restart_workers'} <= set(parts), parts
    for name in ('step', 'fit', 'train', 'evaluate', 'save', 'load', 'export', 'generate', 'chat', 'shutdown', 'dry_run'):
        assert hasattr(getattr(SFTTrainer, name), '__wrapped__'), f"SFTTrainer.{name} is not an @action"
