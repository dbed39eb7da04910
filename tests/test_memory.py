"""Memory options of the model config (activation checkpointing full/selective, reshard_after_forward): each trains 5
steps on 2 gloo ranks with the same losses and gradient norms as without it (fp32, relative bounds), and leaves the
same weights. cpu_offload (FSDP2 CPUOffloadPolicy) needs an accelerator: on CPU workers it is refused by name (no GPU
here to run its parity test)."""
import numpy as np
from test_sharded_load import run_ranks

OPTIONS = {'ac_full': dict(activation_checkpointing='full'), 'ac_selective': dict(activation_checkpointing='selective'),
           'keep_gathered': dict(reshard_after_forward=False)}


def test_memory_options_keep_losses_and_gradients(tiny_path):
    from sft_nb.config import ModelConfig
    cases = [('plain', ModelConfig(path=str(tiny_path)))]
    cases += [(k, ModelConfig(path=str(tiny_path), **kw)) for k, kw in OPTIONS.items()]
    got = run_ranks(cases)[0]
    ref = got['plain']
    for k in OPTIONS:
        print(k, got[k]['losses'], got[k]['grad_norms'])
        np.testing.assert_allclose(got[k]['losses'], ref['losses'], rtol=1e-5, err_msg=k)
        np.testing.assert_allclose(got[k]['grad_norms'], ref['grad_norms'], rtol=1e-4, err_msg=k)
        for n, v in ref['state'].items(): np.testing.assert_allclose(got[k]['state'][n], v, rtol=1e-4, atol=1e-6, err_msg=f'{k} {n}')
    assert ref['losses'][-1] < ref['losses'][0]


def test_cpu_offload_on_cpu_workers_is_refused(tiny_path):
    import pytest
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import ModelConfig, OptimConfig
    w = FSDPWorker(0, 2, ModelConfig(path=str(tiny_path), cpu_offload=True), OptimConfig(), total_steps=1)
    with pytest.raises(ValueError, match='model.cpu_offload: needs GPU workers'): w.setup()
