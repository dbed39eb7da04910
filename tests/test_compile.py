"""`model.compile`: decoder blocks compiled by inductor give the eager loss and gradients (fp32 rounding) on padded and
packed rows, on one rank and on 2 FSDP2 ranks, for full fine-tuning and LoRA. A padded run compiles once for all its
lengths; a second worker built in the same process compiles nothing (counted by dynamo's `unique_graphs`, not timed).
Each cold compile of the tiny model's block costs seconds of inductor's C++ builds, so the file compiles two graphs in
all (full fine-tuning, LoRA); the packed rows run on the padded run's dynamic graph."""
import dataclasses
import pytest
import torch
from sft_nb.config import ModelConfig, OptimConfig, TokenizeConfig
from sft_nb.collate import collate_padded, collate_packed
from sft_nb.demo_data import identity_rows
from sft_nb.numerics import assert_rel_close
from helpers import spawn, step_grads

LOSS_TOL = 1e-6  # of Σ NLL: inductor fuses and reorders fp32 sums, nothing else changes
GRAD_TOL = 1e-5


@pytest.fixture(scope='module')
def mbs(tiny_tok):
    """Padded batches of three lengths (each with padding), a packed micro-batch of 2 rows at a fixed capacity, and a
    padding-free one (`DataPlan.collate`'s layout: rows as long as the longest bin)."""
    from sft_nb.tokenize import tokenize_dataset
    ds, _ = tokenize_dataset(identity_rows()['train'][:8], tiny_tok, TokenizeConfig(max_length=64))
    exs = [dict(r) for r in ds]
    pad = tiny_tok.pad_token_id
    out = [collate_padded([exs[1], exs[6]], pad), collate_padded(exs[2:5], pad), collate_padded(exs[5:8], pad),
           collate_packed([exs[:3], exs[3:6]], pad, capacity=160), collate_packed([exs[:2], exs[2:3]], pad)]
    assert len({mb['input_ids'].shape[1] for mb in out[:3]}) == 3 and all((mb['attention_mask'] == 0).any() for mb in out[:3])
    return out


@pytest.fixture(scope='module')
def group():
    "This process's 1-rank gloo group (the in-process workers')."
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.workers import free_port
    w = FSDPWorker(0, 1, ModelConfig(), OptimConfig(), total_steps=1)
    w.init_dist('127.0.0.1', free_port())
    yield
    w.shutdown()


def worker(mcfg):
    from sft_nb.backends.fsdp import FSDPWorker
    w = FSDPWorker(0, 1, mcfg, OptimConfig(), total_steps=1)
    w.setup()
    return w


def graphs() -> int:
    from torch._dynamo.utils import counters
    return counters['stats']['unique_graphs']


def test_compiled_equals_eager_and_compiles_once_per_shape(group, tiny_path, mbs):
    """One rank: each micro-batch's Σ NLL and gradients equal eager's. Graphs: one for the first padded batch (its B and T
    dynamic), none for two more lengths, none for the packed and padding-free rows it also fits; a second compiled worker in this process:
    none. (A packed-only run compiles a static graph of its capacity: `CompiledBlocks.rows` in nbs/07a.)"""
    full = ModelConfig(path=str(tiny_path), loss_chunk=7)
    eager, comp = worker(full), worker(dataclasses.replace(full, compile=True))
    assert eager.compiled is None and len(comp.compiled.forwards) == 2  # one per block
    new = []
    for mb in mbs:
        g0 = graphs()
        (r0, ref), (r1, got) = step_grads(eager, [mb], mb['n_trained']), step_grads(comp, [mb], mb['n_trained'])
        new.append(graphs() - g0)
        s0, s1 = r0['nll_sum'], r1['nll_sum']
        assert abs(s1 - s0) <= LOSS_TOL * s0 and got.keys() == ref.keys()
        assert_rel_close(got, ref, GRAD_TOL, f"compiled vs eager, {tuple(mb['input_ids'].shape)}: gradients")
    assert new == [1, 0, 0, 0, 0], new  # one graph, B and T dynamic, for every length and for the packed rows after them
    assert comp.compiled.failed is None
    g0, again = graphs(), worker(dataclasses.replace(full, compile=True))
    for mb in mbs: step_grads(again, [mb], mb['n_trained'])
    assert graphs() == g0, 'a second worker in the same process compiled again'


def test_two_ranks_compiled_equal_one_rank_eager(group, tiny_path, mbs):
    """2 FSDP2 ranks (spawned, gloo), compiled, one padded micro-batch each: the reduced gradients equal one eager rank's
    of both micro-batches, full fine-tuning and LoRA (attention and MLP projections)."""
    full = ModelConfig(path=str(tiny_path), loss_chunk=7)
    lora = dataclasses.replace(full, lora_r=4, lora_target_modules=['q_proj', 'v_proj', 'up_proj'])
    two_mbs = mbs[:2]  # padded: both ranks compile the same (dynamic) graph, at the same time
    n = sum(mb['n_trained'] for mb in two_mbs)
    ws = [worker(m) for m in (full, lora)]
    one = [(step_grads(w, two_mbs[:1], n)[0]['nll_sum'], step_grads(w, two_mbs, n)[1]) for w in ws]  # (rank 0's Σ NLL, both's gradients)
    keep = ('input_ids', 'labels', 'attention_mask', 'position_ids')
    two = spawn(2, 1, [dataclasses.replace(m, compile=True) for m in (full, lora)],
                [[{k: mb[k] for k in keep if k in mb}] for mb in two_mbs], n)
    for (s1, g1), (r2, g2, _, _), what in zip(one, two, ('full', 'LoRA')):
        assert abs(r2['nll_sum'] - s1) <= LOSS_TOL * s1, (what, r2['nll_sum'], s1)
        assert g2.keys() == g1.keys() and (what == 'full' or all('lora_' in k for k in g1))
        assert_rel_close(g2, g1, GRAD_TOL, f'2 compiled ranks vs 1 eager, {what}: gradients')
        assert not [m for m in r2['warnings'] if 'model.compile' in m], r2['warnings']
