"Issue 15: the driver split: the Backend protocol the workers implement, the trainer's size, and the names it keeps."
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


def test_trainer_class_is_small_and_keeps_its_names():
    "SFTTrainer's class cell stays small; the attributes tests and notebooks read are still there, old imports still work."
    from sft_nb.trainer import SFTTrainer, Sampler, SequentialSampler, make_sampler, split_for_ranks, heldout_split, \
        synthetic_dataset, RunLock, RunDirBusy, run_outputs, RUN_OUTPUTS, TrainerBusy, NonFiniteLoss  # noqa: F401
    src = inspect.getsource(SFTTrainer)
    assert len(src.splitlines()) <= 150
    assert "getattr(self, '" not in src
    t = SFTTrainer({'model': {'path': 'tiny'}})
    for a in ('global_step', 'history', 'eval_history', 'rows_history', 'last_eval', 'train_sets', 'eval_sets', 'heldout', 'rows',
              'lengths', 'pack_plan', 'total_steps', 'steps_per_epoch', 'run_dir', 'ckpt_dir', 'group', 'workers', 'tokenizer',
              'processor', 'data_report', 'model_info', 'callbacks', 'control', 'running', 'profile_dir', '_pending'):
        getattr(t, a)
    assert t.total_steps == 0 and t.heldout == [] and t.group is None and str(t.run_dir) == t.cfg.checkpoint.run_dir
