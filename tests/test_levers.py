"""Memory levers (sft_nb.levers) inside the FSDP worker: `model.tiled_mlp` gives the loss and gradients of the untiled
MLP (fp32, relative bounds) on padded and packed rows, with activation checkpointing and LoRA adapters on the MLP, in one
process (on 2 FSDP2 ranks that share each row, Ulysses sp=2: tests/test_sequence_parallel.py::test_sp2_equals_sp1); the memory estimate, which builds the worker's
model on meta, sees the tiling; a tile longer than the row takes the plain path. `model.activation_offload` is refused by
name on CPU workers (its hooks' gradients are checked on CPU in nbs/06f_levers.ipynb)."""
import pytest
import torch
from sft_nb.config import ModelConfig, OptimConfig, ConfigError
from sft_nb.collate import collate_padded, collate_packed
from sft_nb.demo_data import identity_rows
from sft_nb.levers import TiledForward
from sft_nb.numerics import assert_rel_close
from helpers import run_cfg, spawn

TOL, GRAD_TOL = 1e-6, 1e-5  # only the order of the weight gradients' sums over tokens differs
MLP_LORA = dict(lora_r=4, lora_target_modules=['gate_proj', 'up_proj', 'down_proj', 'q_proj'])


def batches(tok) -> dict:
    "A padded batch of 3 rows and a packed row of 3 documents, 41-64 tokens each."
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    ds, _ = tokenize_dataset(identity_rows()['train'][:6], tok, TokenizeConfig(max_length=64))
    exs = [dict(r) for r in ds]
    return {'padded': collate_padded(exs[:3], tok.pad_token_id), 'packed': collate_packed([exs[3:6]], tok.pad_token_id)}


def worker_grads(mcfg, mb):
    "(Σ NLL, gradients) of one forward_backward of `mb` on a 1-rank, unsharded FSDP worker of `mcfg`; the worker too."
    from sft_nb.backends.fsdp import FSDPWorker
    w = FSDPWorker(0, 1, mcfg, OptimConfig(), total_steps=1)
    w.setup()
    r = w.forward_backward([mb], mb['n_trained'])
    return r['nll_sum'], {k: p.grad.clone() for k, p in w.model.named_parameters() if p.grad is not None}, w


@pytest.mark.parametrize('layout, case', [('padded', 'plain'), ('packed', 'checkpointed + LoRA on the MLP')])
def test_worker_tiled_equals_untiled(tiny_path, tiny_tok, layout, case):
    """Tiles of 16 tokens (the last one shorter) in the worker: Σ NLL and every gradient equal the untiled worker's (the
    other pairs of layout and case: nbs/06f_levers.ipynb, on the model alone)."""
    mb = batches(tiny_tok)[layout]
    assert mb['input_ids'].shape[1] % 16 and mb['input_ids'].shape[1] > 32
    kw = dict(activation_checkpointing='full', **MLP_LORA) if case != 'plain' else {}
    s0, g0, _ = worker_grads(ModelConfig(path=str(tiny_path), **kw), mb)
    s1, g1, w = worker_grads(ModelConfig(path=str(tiny_path), tiled_mlp=16, **kw), mb)
    mlps = [m for n, m in w.model.named_modules() if n.endswith('.mlp')]
    assert mlps and all(isinstance(m.__dict__.get('forward'), TiledForward) for m in mlps)
    assert g1.keys() == g0.keys() and (case == 'plain' or any('up_proj.lora_A' in k for k in g0))
    assert_rel_close(s1, s0, TOL, 'Σ NLL'); assert_rel_close(g1, g0, GRAD_TOL, f'{case}, {layout}: gradients')


def test_tile_longer_than_the_row_is_the_plain_call(tiny_path, tiny_tok):
    "A tile longer than every row: the MLP's own forward once (its output is no cat of tiles), the same gradients exactly."
    mb = batches(tiny_tok)['packed']
    s0, g0, _ = worker_grads(ModelConfig(path=str(tiny_path)), mb)
    s1, g1, w = worker_grads(ModelConfig(path=str(tiny_path), tiled_mlp=4096), mb)
    mlp = w.model.model.layers[0].mlp
    assert type(mlp(torch.randn(1, 100, w.model.config.hidden_size)).grad_fn).__name__ != 'CatBackward0'
    assert s1 == s0 and all(torch.equal(g1[k], g0[k]) for k in g0)


def test_estimate_sees_the_tiling(tiny_path, tmp_path):
    """The estimate's fake step (the worker's model built on meta) of one 1,024-token row peaks lower with the MLP in
    tiles of 128 tokens: its intermediates live one tile at a time."""
    from sft_nb.config import load_config
    from sft_nb.memory import step_memory
    def peak(tile):
        cfg = load_config(run_cfg(tiny_path, tmp_path, model__tiled_mlp=tile, tokenize__max_length=1024,
                                  train__global_batch_size=1))
        return sum(step_memory(cfg, 1)[0].values())
    untiled, tiled = peak(0), peak(128)
    # 2 blocks x (gate, up, act) x 1,024 tokens x 384 x 4 bytes, less one tile's: what the untiled forward keeps more
    assert untiled - tiled > 0.5 * 2 * 3 * (1024 - 128) * 384 * 4, (untiled, tiled)


@pytest.mark.parametrize('key', ['cpu_offload', 'activation_offload'])
def test_offload_on_cpu_workers_is_refused(tiny_path, key):
    from sft_nb.backends.fsdp import FSDPWorker
    w = FSDPWorker(0, 1, ModelConfig(path=str(tiny_path), **{key: True}), OptimConfig(), total_steps=1)
    with pytest.raises(ConfigError, match=rf'model.{key}: needs GPU workers \(placement.use_gpu\)') as e: w.setup()
    assert e.value.fix == f'set model.{key}: false'
