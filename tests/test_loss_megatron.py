"""Megatron's chunked vocab-parallel loss (`model.loss_chunk > 0`) equals megatron-core's own loss (`loss_chunk: 0`) in one
in-process worker (1-rank gloo group, no Ray): Σ NLL, counts and every parameter's gradient, padded and packed, with and
without fractional weights. TP/PP/DP against FSDP: tests/test_loss.py and tests/test_megatron.py (through Ray)."""
import pytest
import torch
pytest.importorskip('megatron.core')
from sft_nb.numerics import assert_rel_close, rel_gap
from sft_nb.config import ModelConfig, OptimConfig
from sft_nb.collate import collate_padded, collate_packed
from sft_nb.demo_data import identity_rows

ROWS = identity_rows()['train']
WROWS = [{'messages': [{**m, 'loss_weight': [0.25, 1, 2.5, 0.5][k % 4]} if m['role'] == 'assistant' else m for m in r['messages']]}
         for k, r in enumerate(ROWS)]


@pytest.fixture(scope='module')
def worker(tiny_path):
    from sft_nb.backends.megatron import MegatronWorker
    from sft_nb.workers import free_port
    w = MegatronWorker(0, 1, ModelConfig(path=str(tiny_path)), OptimConfig(), total_steps=1)
    w.init_dist('127.0.0.1', free_port())
    w.setup()
    yield w
    w.shutdown()


def grads_of(w, mb, chunk):
    w.loss_chunk = chunk
    w.opt.zero_grad(set_to_none=True)
    r = w.forward_backward([mb], mb.get('weight_sum', mb['n_trained']))
    g = {k: p.grad.clone() for k, p in w.model.named_parameters() if p.grad is not None}
    w.opt.zero_grad(set_to_none=True)
    return r, g


@pytest.mark.parametrize('weighted', [False, True])
def test_chunked_equals_megatron_loss(worker, tiny_tok, weighted):
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    ds, _ = tokenize_dataset((WROWS if weighted else ROWS)[:6], tiny_tok, TokenizeConfig(max_length=64))
    exs = [dict(r) for r in ds]
    for name, mb in (('padded', collate_padded(exs, tiny_tok.pad_token_id)),
                     ('packed', collate_packed([exs[:3], exs[3:]], tiny_tok.pad_token_id))):
        r0, g0 = grads_of(worker, mb, 0)
        r1, g1 = grads_of(worker, mb, 7)
        assert r1['weight_sum'] == r0['weight_sum'] and abs(r1['nll_sum'] - r0['nll_sum']) <= 1e-6 * r0['nll_sum'], (name, r0, r1)
        assert g0.keys() == g1.keys()
        print(f"megatron {name} weighted={weighted}: |ΔΣNLL| {abs(r1['nll_sum'] - r0['nll_sum']):.1e}, gradients {rel_gap(g1, g0):.1e} of their size")
        assert_rel_close(g1, g0, 4e-6, f'{name} gradients')  # a whole model's gradients: test_loss.GRAD_TOL
        with torch.no_grad():
            worker.loss_chunk = 7
            assert abs(worker.eval_loss([mb])['nll_sum'] - r0['nll_sum']) <= 1e-6 * r0['nll_sum']
