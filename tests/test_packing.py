"""Packing: planner properties (hypothesis) and packed == padded on the tiny model with real alpaca rows."""
import json
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from sft_nb.numerics import assert_rel_close
from sft_nb.loss import token_nll_sum
from sft_nb.collate import collate_packed, collate_padded, model_inputs
from sft_nb.packing import STRATEGIES, PackPlan, bin_examples, deal, lower_bound, pack


@st.composite
def plans(draw):
    capacity = draw(st.integers(1, 300))
    lengths = draw(st.lists(st.integers(1, capacity), max_size=120))
    return dict(lengths=lengths, capacity=capacity, strategy=draw(st.sampled_from(STRATEGIES)), dp=draw(st.integers(1, 8)),
                seed=draw(st.integers(0, 2**32 - 1)), rows_per_step=draw(st.one_of(st.none(), st.integers(1, 40))))


@settings(max_examples=300, deadline=None)
@given(plans())
def test_plan_properties(kw):
    p = pack(**kw)
    lengths, capacity, dp = kw['lengths'], kw['capacity'], kw['dp']
    assert sorted(i for b in p.bins for i in b) == list(range(len(lengths)))  # every row exactly once
    assert all(sum(lengths[i] for i in b) <= capacity for b in p.bins)
    assert p.tokens == [sum(lengths[i] for i in b) for b in p.bins]
    assert len(p) % dp == 0 and len(p) >= p.lower_bound
    steps = p.global_batches() if kw['rows_per_step'] else p.global_batches(dp * 2)
    assert all(len(s) % dp == 0 and len(s) >= dp for s in steps)  # every rank gets a bin in every step
    assert [b for s in steps for b in s] == p.bins
    assert [[b for s in steps for b in deal(s, dp)[r]] for r in range(dp)] == deal(p.bins, dp)  # dealt per step = dealt once: rank_tokens holds
    assert pack(**kw) == p  # same seed, same plan
    assert PackPlan.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    if kw['rows_per_step']:  # a plan per global batch only mixes rows of that batch
        n = kw['rows_per_step']
        assert [sorted(i for b in s for i in b) for s in steps] == [list(range(a, min(a + n, len(lengths)))) for a in range(0, len(lengths), n)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=80), st.integers(10, 200), st.sampled_from(STRATEGIES))
def test_truncation(lengths, capacity, strategy):
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        with pytest.raises(ValueError, match=f'row {too_long[0]} has {lengths[too_long[0]]} tokens > capacity {capacity}'):
            pack(lengths, capacity, strategy)
    p = pack(lengths, capacity, strategy, truncation='truncate')
    assert p.truncated == too_long
    assert p.tokens == [sum(min(lengths[i], capacity) for i in b) for b in p.bins]
    assert p.lower_bound == lower_bound(lengths, capacity)


def test_whole_dataset_bfd_near_bound():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 0.9, 20000).astype(int), 1, 4000)
    for capacity in (1024, 2048, 4096):
        p = pack(lengths, capacity, truncation='truncate')
        assert len(p) <= 1.01 * p.lower_bound


# ---- packed == padded on the tiny model, rows planned by `pack` and collated by `collate_packed` ----

@pytest.fixture(scope='module')
def alpaca(shared, tiny_tok, tmp_path_factory):
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    ds, _ = tokenize_dataset(shared / 'datasets' / 'alpaca_en_demo.json', tiny_tok, TokenizeConfig(max_length=None),
                             cache_dir=tmp_path_factory.mktemp('tok'))
    return ds


def pick(ds, lo, hi, n):
    "Indices of the first n rows with lo < length <= hi."
    return [i for i, k in enumerate(ds['length']) if lo < k <= hi][:n]


CASES = {  # rows of a 512-token bin: over half a bin (one per bin), a third to a half (two), short (many)
    'one': (lambda ds: pick(ds, 256, 512, 3), lambda counts: counts == {1}),
    'two': (lambda ds: pick(ds, 171, 256, 4), lambda counts: counts == {2}),
    'many': (lambda ds: pick(ds, 0, 64, 16), lambda counts: max(counts) >= 5),
}


@pytest.mark.parametrize('impl,form', [('sdpa', 'bool'), ('eager', 'additive')])
@pytest.mark.parametrize('case', list(CASES))
def test_packed_equals_padded(alpaca, tiny_path, tiny_tok, case, impl, form):
    from transformers import AutoModelForCausalLM
    rows_of, check = CASES[case]
    capacity, sub = 512, alpaca.select(rows_of(alpaca))
    plan = pack(sub['length'], capacity, 'bfd', dp=1, seed=0)
    assert check({len(b) for b in plan.bins}), plan.bins
    model = AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation=impl, dtype=torch.float32).eval()
    [step] = plan.global_batches(len(plan))
    packed = collate_packed(bin_examples(step, sub, capacity), pad_id=tiny_tok.pad_token_id, capacity=capacity, mask_form=form)
    order = [i for b in step for i in b]
    padded = collate_padded([sub[i] for i in order], pad_id=tiny_tok.pad_token_id)
    with torch.no_grad():
        lk, lp = model(**model_inputs(packed)).logits, model(**model_inputs(padded)).logits
    j = 0
    for b, lens in enumerate(packed['seq_lens']):
        start = 0
        for n in lens:
            assert_rel_close(lk[b, start:start + n], lp[j, :n], 1e-5, f'logits of sequence {j}')
            start += n; j += 1
    (sk, nk), (sp, np_) = token_nll_sum(lk, packed['labels']), token_nll_sum(lp, padded['labels'])
    assert nk == np_ == packed['n_trained'] == padded['n_trained'] > 0
    assert_rel_close(sk.item() / nk, sp.item() / np_, 1e-5, 'mean NLL')


def test_fewer_rows_than_ranks(alpaca, tiny_path, tiny_tok):
    "A last global batch of 2 rows on 4 ranks: two ranks get an empty bin, a padding row with nothing trained."
    from transformers import AutoModelForCausalLM
    rows = pick(alpaca, 0, 100, 6)
    plan = pack([alpaca[i]['length'] for i in rows], 256, dp=4, rows_per_step=4)
    last = plan.global_batches()[-1]
    assert len(last) == 4 and sum(1 for b in last if not b) == 2
    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    sub = alpaca.select(rows)
    n_global, sums = 0, []
    for rank in range(4):
        batch = collate_packed(bin_examples(deal(last, 4)[rank], sub, 256), pad_id=tiny_tok.pad_token_id, capacity=256)
        with torch.no_grad(): logits = model(**model_inputs(batch)).logits
        assert torch.isfinite(logits).all()
        s, n = token_nll_sum(logits, batch['labels'])
        sums.append(s.item()); n_global += n
    assert n_global == sum(alpaca[rows[i]]['n_trained'] - alpaca[rows[i]]['loss_mask'][0] for i in (4, 5))
    assert sorted(sums)[:2] == [0.0, 0.0] and np.isfinite(sum(sums) / n_global)
