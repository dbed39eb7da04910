"""Megatron THD (issue 28): on CUDA with TransformerEngine in bf16 the megatron worker lays every micro-batch out as THD
segments (`PackedSeqParams` with cu_seqlens, no T×T mask; `sft_nb.backends.megatron.thd_batch`). Packed = padded through
that path, and THD = the dense-mask path (the local layer spec, the worker's choice on CPU) on the same weights: Σ NLL and
every gradient within bf16 tolerances (README.md), trained-token counts identical. With 2 GPUs, context_parallel=2 equals
context_parallel=1 through the trainer. Skipped without CUDA or transformer_engine (megatron-core's local attention
asserts `packed_seq_params is None`, so there is nothing to run on CPU)."""
import pytest
import torch
if not torch.cuda.is_available(): pytest.skip('needs CUDA', allow_module_level=True)
pytest.importorskip('megatron.core'); pytest.importorskip('transformer_engine')
from sft_nb.collate import collate_padded, collate_packed
from sft_nb.config import ModelConfig, OptimConfig
from sft_nb.demo_data import identity_rows
from sft_nb.numerics import rel_gap
from sft_nb.trainer import SFTTrainer
from helpers import run_cfg

ROWS = identity_rows()['train']
BF16_LOSS, BF16_GRAD = 1e-2, 5e-2  # README.md: bf16 layouts sum the same products in another order


def worker(path):
    "A 1-rank megatron worker on this GPU (its own nccl group), bf16 compute."
    from sft_nb.backends.megatron import MegatronWorker
    from sft_nb.workers import free_port
    w = MegatronWorker(0, 1, ModelConfig(path=str(path), dtype='bfloat16'), OptimConfig(), total_steps=1, use_gpu=True)
    w.init_dist('127.0.0.1', free_port(), use_gpu=True)
    return w, w.setup()


def batches(tok):
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    ds, _ = tokenize_dataset(ROWS[:6], tok, TokenizeConfig(max_length=64))
    exs = [dict(r) for r in ds]
    out = {'padded': collate_padded(exs, tok.pad_token_id), 'packed': collate_packed([exs[:3], exs[3:]], tok.pad_token_id)}
    n = out['padded']['n_trained']
    for b in out.values():
        for k in ('n_trained', 'n_real', 'seq_lens', 'cu_seqlens'): b.pop(k, None)
    return out, n


def grads_of(w, mb, n):
    r = w.forward_backward([mb], n)
    g = {k: p.grad.float().clone() for k, p in w.model.named_parameters()}
    for p in w.model.parameters(): p.grad = None
    return r, g


def test_thd_packed_equals_padded_and_dense(tiny_path, tiny_tok, monkeypatch):
    import sft_nb.backends.megatron as m
    mbs, n = batches(tiny_tok)
    w, info = worker(tiny_path)
    try:
        assert info['thd'] and w.thd
        got = {k: grads_of(w, mb, n) for k, mb in mbs.items()}
    finally: w.shutdown()
    monkeypatch.setattr(m, 'thd_available', lambda use_gpu, dtype: False)  # the local spec and the dense mask, same weights
    w, info = worker(tiny_path)
    try:
        assert not info['thd']
        dense = grads_of(w, mbs['packed'], n)
    finally: w.shutdown()
    (r0, g0) = got['padded']
    for name, (r, g) in {'thd packed': got['packed'], 'dense packed': dense}.items():
        assert r['weight_sum'] == r0['weight_sum'] == n, name
        g, g0n = m.te_names(g, back=True) if name == 'thd packed' else g, m.te_names(g0, back=True)  # the local spec's names
        keys = sorted(set(g) & set(g0n))
        assert len(keys) == len(g0n), (name, sorted(set(g0n) - set(g)))
        dl = rel_gap(r['nll_sum'], r0['nll_sum'])
        dg = max(rel_gap(g[k], g0n[k]) for k in keys)
        print(f"{name} vs thd padded: Σ NLL {dl:.2e}, gradients {dg:.2e}")
        assert dl <= BF16_LOSS and dg <= BF16_GRAD, (name, dl, dg)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='needs 2 GPUs')
def test_context_parallel_two_equals_one(tiny_path, tmp_path, ray_session):
    "2 GPUs: megatron context_parallel=2 (each rank half of every segment) vs 1 worker, bf16, packed rows, one step."
    kw = dict(placement__use_gpu=True, placement__backend='megatron', model__dtype='bfloat16', optim__max_grad_norm=0.0,
              packing__enabled=True, packing__capacity=128, tokenize__max_length=64, train__global_batch_size=4, train__micro_batch_size=2)
    with SFTTrainer(run_cfg(tiny_path, tmp_path / 'one', **kw), train_data=ROWS) as t: a = t.step()
    with SFTTrainer(run_cfg(tiny_path, tmp_path / 'cp2', placement__workers_per_node=2, placement__context_parallel=2, **kw), train_data=ROWS) as t:
        b = t.step()
    assert a['n_trained'] == b['n_trained']
    dl, dg = rel_gap(b['loss'], a['loss']), rel_gap(b['grad_norm'], a['grad_norm'])
    print(f"context_parallel=2 vs 1: loss {dl:.2e}, grad norm {dg:.2e}")
    assert dl <= BF16_LOSS and dg <= BF16_GRAD
