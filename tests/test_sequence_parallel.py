"""Ulysses sequence parallelism (`placement.sequence_parallel`, sft_nb.backends.ulysses) on real 2- and 4-process gloo
groups: sp=2 equals sp=1 (losses, every gradient, trained-token counts, per-token losses) on packed multi-document rows
with fractional loss weights and a length sp does not divide, also with fewer KV heads than sp and with activation
checkpointing; sp=3 equals sp=1 on SmolLM2-135M's head layout (9 heads, 3 KV heads); a whole trainer step with sp=2 and with sp=2 × dp=2 on 4
workers equals 1 worker; exact resume with sp=2."""
import dataclasses
import pytest
import torch
import torch.multiprocessing as mp
from sft_nb.config import ModelConfig, OptimConfig, PlacementConfig, ConfigError
from sft_nb.collate import collate_padded, collate_packed
from sft_nb.demo_data import identity_rows
from sft_nb.numerics import assert_rel_close, rel_gap
from sft_nb.trainer import SFTTrainer
from helpers import local_run, one_rank, run_cfg, spawn, view_warnings

ROWS = identity_rows()['train']
WROWS = [{'messages': [{**m, 'loss_weight': [0.25, 1, 2.5, 0.5][k % 4]} if m['role'] == 'assistant' else m for m in r['messages']]}
         for k, r in enumerate(ROWS)]
TOL = 2e-6  # of the magnitude: the sums run in another order (attention over the same keys, the loss in sp parts)
GRAD_TOL = 1e-5  # every gradient of the model: attention's and the head's rounding pass through each layer's backward


@pytest.fixture(scope='module')
def gqa1_path(tiny_path, tmp_path_factory):
    "The tiny model with one KV head (4 query heads): fewer KV heads than sp=2, repeated for the exchange."
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from sft_nb.models import tiny_model_config
    tok = AutoTokenizer.from_pretrained(tiny_path)
    cfg = tiny_model_config(len(tok), kv_heads=1)
    cfg.eos_token_id, cfg.pad_token_id = tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(1)
    d = tmp_path_factory.mktemp('gqa1')
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d); tok.save_pretrained(d)
    return d


def batches(tok):
    "Micro-batches of two replicas: packed multi-document rows with fractional weights (odd lengths), and a padded batch."
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    ds, _ = tokenize_dataset(WROWS[:10], tok, TokenizeConfig(max_length=64))
    exs = [dict(r) for r in ds]
    packed = collate_packed([exs[0:3], exs[3:5]], tok.pad_token_id)
    if packed['input_ids'].shape[1] % 2 == 0: packed = collate_packed([exs[0:3], exs[3:4]], tok.pad_token_id)
    padded = collate_padded(exs[5:8], tok.pad_token_id)
    if padded['input_ids'].shape[1] % 2 == 0: padded = collate_padded(exs[5:7], tok.pad_token_id)
    mbs = [[packed], [padded]]
    n_global = sum(b['weight_sum'] for r in mbs for b in r)
    for b in (b for r in mbs for b in r):
        for k in ('n_trained', 'n_real', 'weight_sum', 'seq_lens', 'cu_seqlens'): b.pop(k, None)
    return mbs, n_global


@pytest.mark.parametrize('model', ['tiny', 'kv_heads=1 + checkpointing'])
def test_sp2_equals_sp1(tiny_path, tiny_tok, gqa1_path, model):
    """One replica's micro-batches on sp=2 ranks == on one rank: Σ NLL, Σ weight, every gradient, eval, per-token losses.
    With checkpointing, sp=2 also runs with the MLP in tiles of 8 tokens (`model.tiled_mlp`: each rank tiles its half of
    the row, the DTensor gradients reduce-scattered) and equals the untiled rank all the same."""
    path, ac = (tiny_path, 'none') if model == 'tiny' else (gqa1_path, 'full')
    mbs, n_global = batches(tiny_tok)
    assert mbs[0][0]['input_ids'].shape[1] % 2 and mbs[1][0]['input_ids'].shape[1] % 2  # sp=2 pads both
    assert mbs[0][0]['position_ids'].eq(0).sum() > 1 and 'loss_weights' in mbs[0][0]  # several documents, fractional weights
    mcfg = ModelConfig(path=str(path), activation_checkpointing=ac, loss_chunk=5)
    for d in range(2):  # each replica's micro-batch alone
        (r1, g1, e1, t1), = one_rank([mcfg], mbs[d:d + 1], n_global)
        sp2 = spawn(2, 2, [mcfg] + ([dataclasses.replace(mcfg, tiled_mlp=8)] if ac == 'full' else []), mbs[d:d + 1], n_global)
        for (r2, g2, e2, t2), tiled in zip(sp2, ('', ' tiled MLP')):
            sp2_equals_one_rank(r1, g1, e1, t1, r2, g2, e2, t2, f'{model}{tiled}, replica {d}')


def sp2_equals_one_rank(r1, g1, e1, t1, r2, g2, e2, t2, what):
    assert r2['weight_sum'] == r1['weight_sum'] and e2['weight_sum'] == e1['weight_sum']  # Σ weight: binary fractions, exact
    assert_rel_close(r2['nll_sum'], r1['nll_sum'], TOL, 'Σ NLL'); assert_rel_close(e2['nll_sum'], e1['nll_sum'], TOL, 'eval Σ NLL')
    assert g2.keys() == g1.keys()
    assert not view_warnings(r2), view_warnings(r2)  # no sharded module returns a view under sp either
    assert_rel_close(g2, g1, GRAD_TOL, f'{what}: gradients')
    for a, b in zip(t2, t1):
        assert (a['top_ids'][:, 0] == b['top_ids'][:, 0]).mean() > 0.99
        assert_rel_close(torch.as_tensor(a['nll']), torch.as_tensor(b['nll']), 1e-5, 'per-token NLL')
    print(f"{what}: Σ NLL gap {rel_gap(r2['nll_sum'], r1['nll_sum']):.1e}, gradients {rel_gap(g2, g1):.1e}")


def test_sp2_dp2_equals_one_rank_worker(tiny_path, tiny_tok):
    "4 ranks, 2 replicas of sp=2: the gradient of the global-token loss of both replicas' micro-batches == one rank doing both."
    mbs, n_global = batches(tiny_tok)
    mcfg = ModelConfig(path=str(tiny_path))
    (r1, g1, _, _), = one_rank([mcfg], [[b for r in mbs for b in r]], n_global)
    (r4, g4, _, _), = spawn(4, 2, [mcfg], mbs, n_global)
    assert_rel_close(g4, g1, GRAD_TOL, 'sp=2 × dp=2 gradients')


def test_heads_sp_does_not_divide(tiny_path):
    "sp=3 on 3 ranks and 4 attention heads: a ConfigError naming the parameter, not a shape error in attention."
    from sft_nb.backends.ulysses import check_heads
    from transformers import AutoConfig
    with pytest.raises(ConfigError, match="placement.sequence_parallel: 3 does not divide the model's 4 attention heads"):
        check_heads(AutoConfig.from_pretrained(tiny_path), 3)


def _cfg(tiny_path, run_dir, **kw):
    return run_cfg(tiny_path, run_dir, **{'optim__max_grad_norm': 0.0, 'optim__lr': 1e-3, 'optim__eps': 1e-5, 'packing__enabled': True,
                                          'packing__capacity': 127, 'tokenize__max_length': 64, 'train__global_batch_size': 4,
                                          'train__micro_batch_size': 1, **kw})


def test_trainer_sp(tiny_path, tmp_path, ray_session):
    """Whole trainer steps, packed rows with fractional weights: sp=2 × dp=2 on 4 workers == 1 worker (in this process): loss,
    grad norm, Σ weight, weights. (sp=2 on 2 workers: the resume below.)"""
    steps, w0 = local_run(_cfg(tiny_path, tmp_path / '1', train__num_steps=2), WROWS)
    l0, g0, n0 = [m['loss'] for m in steps], [m['grad_norm'] for m in steps], [m['n_trained'] for m in steps]
    with SFTTrainer(_cfg(tiny_path, tmp_path / 'sp2dp2', train__num_steps=2, placement__workers_per_node=4, placement__sequence_parallel=2),
                    train_data=WROWS) as t:
        h = t.fit()
        l, g, n, w = h['loss'].tolist(), h['grad_norm'].tolist(), h['n_trained'].tolist(), t.group.call('full_state')[0]
    assert n == n0
    assert_rel_close(l, l0, TOL, 'sp2dp2 losses'); assert_rel_close(g, g0, 1e-5, 'sp2dp2 grad norms')
    assert_rel_close(w, w0, 1e-2, 'sp2dp2 weights', scale=1e-3 * 2)  # of 2 updates of lr (Adam)
    print(f"sp2dp2: loss gap {rel_gap(l, l0):.1e}, grad norm {rel_gap(g, g0):.1e}, weights {rel_gap(w, w0, scale=2e-3):.1e} of 2 updates")


def test_trainer_sp_exact_resume(tiny_path, tmp_path, ray_session):
    "sp=2: 4 steps straight (saving at step 2 on the way) == resumed from that save by new workers, 2 more (losses, Σ weight, weights)."
    sp = dict(train__num_steps=4, placement__workers_per_node=2, placement__sequence_parallel=2, optim__schedule='cosine')
    with SFTTrainer(_cfg(tiny_path, tmp_path / 'full', **sp), train_data=WROWS) as t:
        t.fit(2); ckpt = t.save()  # a save changes nothing of the run that goes on
        h = t.fit(); full, n_full, w_full = h['loss'].tolist(), h['n_trained'].tolist(), t.group.call('full_state')[0]
    with SFTTrainer(_cfg(tiny_path, tmp_path / 'resumed', checkpoint__resume=str(ckpt), **sp), train_data=WROWS) as r:
        assert r.global_step == 2
        h = r.fit(); resumed, n_res, w = h['loss'].tolist(), h['n_trained'].tolist(), r.group.call('full_state')[0]
    assert n_res == n_full and resumed[:2] == full[:2]  # the losses before the checkpoint, as logged
    assert resumed[2:] == full[2:], (resumed, full)
    assert_rel_close(w, w_full, 0, 'weights after resume')


def _setup_error(rank, world, sp, port, model_cfg, out):
    "One rank's setup; the type and message of what it raised (None when it went through)."
    from sft_nb.backends.fsdp import FSDPWorker
    w = FSDPWorker(rank, world, model_cfg, OptimConfig(), total_steps=1, placement=PlacementConfig(workers_per_node=world, sequence_parallel=sp))
    w.init_dist('127.0.0.1', port)
    try:
        w.setup(); out.put((rank, None, None))
    except Exception as e: out.put((rank, type(e).__name__, str(e)))
    finally: w.shutdown()


def test_moe_aux_loss_refused_at_setup(tiny_tok, tmp_path):
    "A MoE model whose config asks for the router aux loss with sp=2: a ConfigError from setup on every rank, before any step."
    from transformers import AutoModelForCausalLM
    from sft_nb.workers import free_port
    from test_moe import moe_config
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config(len(tiny_tok)), dtype=torch.float32).save_pretrained(tmp_path); tiny_tok.save_pretrained(tmp_path)
    ctx, port = mp.get_context('spawn'), free_port()
    out = ctx.Queue()
    ps = [ctx.Process(target=_setup_error, args=(r, 2, 2, port, ModelConfig(path=str(tmp_path)), out)) for r in range(2)]
    for p in ps: p.start()
    got = sorted(out.get(timeout=300) for _ in ps)
    for p in ps: p.join(timeout=60)
    for rank, kind, msg in got:
        assert kind == 'ConfigError', (rank, kind, msg)
        assert msg.startswith('placement.sequence_parallel: 2 with the MoE router aux loss') and 'router_aux_loss_coef=0.05' in msg, msg


def test_sp3_equals_sp1_on_nine_heads(tiny_tok, tiny_llama_path):
    """SmolLM2-135M-Instruct's head layout (9 heads, 3 KV heads, so sp=3; sp=2 is refused) on the tiny Llama: a packed
    multi-document row with fractional weights, its length not a multiple of 3, on 3 ranks == on 1 rank: Σ NLL, Σ weight,
    every gradient, eval. (The real SmolLM2 weights: bench/long_rows.py trains them with sp=3.)"""
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    ds, _ = tokenize_dataset(WROWS[:10], tiny_tok, TokenizeConfig(max_length=64))
    exs = [dict(r) for r in ds]
    row = next(b for k in range(3, 7) if (b := collate_packed([exs[:k]], tiny_tok.pad_token_id))['input_ids'].shape[1] % 3)
    n_global = row['weight_sum']
    for k in ('n_trained', 'n_real', 'weight_sum', 'seq_lens', 'cu_seqlens'): row.pop(k, None)
    assert row['position_ids'].eq(0).sum() > 2 and 'loss_weights' in row  # several documents, fractional weights; sp=3 pads
    mcfg = ModelConfig(path=str(tiny_llama_path), loss_chunk=512)
    (r1, g1, e1, _), = one_rank([mcfg], [[row]], n_global)
    (r3, g3, e3, _), = spawn(3, 3, [mcfg], [[row]], n_global)
    assert r3['weight_sum'] == r1['weight_sum'] and e3['weight_sum'] == e1['weight_sum']
    assert_rel_close(r3['nll_sum'], r1['nll_sum'], TOL, 'Σ NLL'); assert_rel_close(e3['nll_sum'], e1['nll_sum'], TOL, 'eval Σ NLL')
    assert g3.keys() == g1.keys()
    assert_rel_close(g3, g1, GRAD_TOL, 'gradients')  # an exchange that lost or misplaced heads or tokens is off by O(1)
    print(f"9 heads sp=3: Σ NLL gap {rel_gap(r3['nll_sum'], r1['nll_sum']):.1e}, gradients {rel_gap(g3, g1):.1e}")
