"""The loss lens: per-token losses from the workers equal a plain Hugging Face forward of the same weights, padded ==
packed, on 1 and 2 FSDP ranks and on megatron's TP=2 and PP=2; rows ranked by loss; a run folder scores rows as its
workers did; bad input named."""
import numpy as np
import pytest
import torch
from sft_nb.numerics import rel_gap
from sft_nb.demo_data import identity_rows
from sft_nb.trainer import SFTTrainer
from helpers import run_cfg

ROWS = identity_rows()
TRAIN, EVAL = ROWS['train'], ROWS['eval']


def cfg(tiny_path, run_dir, **kw):
    return run_cfg(tiny_path, run_dir, **{'optim__lr': 1e-3, 'train__micro_batch_size': 2, 'train__num_steps': 2, **kw})


def hf_token_nll(model, ids: list[int], mask: list[int]) -> np.ndarray:
    "A plain HF forward of one row alone: the NLL of each trained token (NaN elsewhere)."
    with torch.no_grad(): lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return np.array([-float(lp[p - 1, ids[p]]) if p and mask[p] else np.nan for p in range(len(ids))])


def nll_gap(a: list[dict], b: list[dict]) -> float:
    "The worst row's max |Δ token NLL| as a fraction of that row's largest NLL (NaN at the same untrained positions)."
    assert len(a) == len(b) and all(x['input_ids'] == y['input_ids'] for x, y in zip(a, b))
    return rel_gap([y['nll'] for y in b], [x['nll'] for x in a])


def test_exact_vs_hf_forward_padded_and_packed(tiny_path, tmp_path, ray_session):
    "After 2 steps: every trained token's NLL and the top-k equal a plain HF forward of the trained weights (≤1e-5 of the row's NLL); packed == padded."
    from transformers import AutoModelForCausalLM
    with SFTTrainer(cfg(tiny_path, tmp_path), train_data=TRAIN, eval_data={'q': EVAL}) as t:
        t.fit()
        padded = t.token_losses('q', k=4)
        packed = t.token_losses('q', k=4, packed=True, micro_batch_size=5)  # several rows per packed row
        trained = t.token_losses('train', indices=list(range(12)), packed=True)
        state = t.group.call('full_state')[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    hf.load_state_dict(state)
    refs = [hf_token_nll(hf, r['input_ids'], r['loss_mask']) for r in padded + trained]
    gap, n = rel_gap([r['nll'] for r in padded + trained], refs), sum(int((~np.isnan(ref)).sum()) for ref in refs)
    print(f'{n} trained tokens: token_losses vs HF forward {gap:.2e} of the NLL; packed vs padded {nll_gap(padded, packed):.2e}')
    assert gap <= 1e-5 and nll_gap(padded, packed) <= 1e-5
    r = padded[0]
    with torch.no_grad(): probs = torch.softmax(hf(torch.tensor([r['input_ids']])).logits[0].float(), -1)
    p = int(np.flatnonzero(~np.isnan(r['nll']))[0])
    top = probs[p - 1].topk(4)
    assert r['top_ids'][p].tolist() == top.indices.tolist() and rel_gap(r['top_p'][p], top.values.numpy()) <= 1e-5
    assert r['step'] == 2 and r['before_step'] == 2  # first scored now


def hf_gap(model, rows: list[dict]) -> float:
    "`nll_gap` of the rows' token losses against a plain HF forward of `model` on each row alone."
    return rel_gap([r['nll'] for r in rows], [hf_token_nll(model, r['input_ids'], r['loss_mask']) for r in rows])


def test_two_ranks_equal_one(tiny_path, tmp_path, ray_session):
    "FSDP over 2 ranks (an odd row count: one rank gets an empty micro-batch) gives the 1-rank losses: a plain HF forward of the same weights."
    from transformers import AutoModelForCausalLM
    with SFTTrainer(cfg(tiny_path, tmp_path, placement__workers_per_node=2), train_data=TRAIN) as t:
        two = t.token_losses('train', indices=list(range(11)), micro_batch_size=2)
    gap = hf_gap(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval(), two)
    print(f'2 ranks vs 1: relative gap {gap:.2e}')
    assert gap <= 1e-5


def test_rank_rows_order_and_first_scoring(tiny_path, tmp_path, ray_session):
    with SFTTrainer(cfg(tiny_path, tmp_path, **{'data__eval_fraction': 0.2}), train_data=TRAIN) as t:
        res = t.token_losses('heldout')
        for by in ('mean', 'sum', 'max'):
            df = t.rank_rows('heldout', by=by, k=None)
            assert df[f'{by}_loss'].is_monotonic_decreasing and len(df) == len(res), by
            top = res[int(df.position.iloc[0])]
            v = top['nll'][~np.isnan(top['nll'])]
            assert rel_gap(df[f'{by}_loss'].iloc[0], {'mean': v.mean(), 'sum': v.sum(), 'max': v.max()}[by]) <= 1e-6
            assert df.n_trained.iloc[0] == sum(top['loss_mask'][1:]) and df.length.iloc[0] == len(top['input_ids'])
        assert len(t.rank_rows('heldout', k=3)) == 3
        t.fit()
        after = t.token_losses('heldout')
        assert all(a['before_step'] == 0 and a['step'] == 2 and rel_gap(a['before_nll'], b['nll']) <= 1e-6
                   for a, b in zip(after, res))
        with pytest.raises(ValueError, match="by: 'median' is not allowed"): t.rank_rows(by='median')
        with pytest.raises(ValueError, match="'dev' is not a split of this trainer"): t.token_losses('dev')
        with pytest.raises(ValueError, match='row 1 would not be trained'):
            t.token_losses([EVAL[0], {'messages': [{'role': 'user', 'content': 'no answer'}]}])


@pytest.mark.parametrize('layout', ['tp2', 'pp2'])
def test_megatron_equals_hf_forward(tiny_path, tmp_path, ray_session, layout):
    """The megatron backend over 2 ranks (TP=2; PP=2: the last stage answers) gives the per-token losses and top-k of a plain
    HF forward of the same weights, padded and packed (1 rank: nbs/07b_backends.megatron.ipynb). TP=2 then trains, saves,
    and its checkpoint shards read back into the HF model score like its workers."""
    pytest.importorskip('megatron.core')
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    run = tmp_path / 'run'
    lay = {'tp2': dict(placement__tensor_parallel=2), 'pp2': dict(placement__pipeline_parallel=2)}[layout]
    with SFTTrainer(cfg(tiny_path, run, placement__backend='megatron', placement__workers_per_node=2, **lay), train_data=TRAIN, eval_data={'q': EVAL}) as t:
        padded, packed = t.token_losses('q', micro_batch_size=3), t.token_losses('q', packed=True, micro_batch_size=3)
        gaps = hf_gap(hf, padded), hf_gap(hf, packed)
        print(f'megatron {layout} vs HF forward: padded {gaps[0]:.2e} packed {gaps[1]:.2e}')
        assert max(gaps) <= 1e-5
        r = padded[0]
        with torch.no_grad(): probs = torch.softmax(hf(torch.tensor([r['input_ids']])).logits[0].float(), -1)
        p = int(np.flatnonzero(~np.isnan(r['nll']))[0])
        assert r['top_ids'][p].tolist() == probs[p - 1].topk(len(r['top_ids'][p])).indices.tolist()
        if layout == 'pp2': return
        t.fit(); t.save()
        ref = t.token_losses('train', indices=[0, 1, 2])
    got = _score_run(run, ref)
    print(f'megatron checkpoint vs workers: {nll_gap(ref, got):.2e}')
    assert nll_gap(ref, got) <= 1e-5


def _score_run(run_dir, exs):
    from sft_nb.lens import RunScorer
    return RunScorer(run_dir).token_losses(exs)


def test_inspect_run_cli(tiny_path, tmp_path, ray_session, capsys):
    "`sft-nb inspect DATA --run RUN_DIR --html`: the run's exported model, or its checkpoint, scores the row exactly as the workers did."
    import json, shutil, subprocess, sys
    data = tmp_path / 'rows.jsonl'
    data.write_text('\n'.join(json.dumps(r) for r in TRAIN))
    run = tmp_path / 'run'
    with SFTTrainer(cfg(tiny_path, run, checkpoint__export_hf=True), train_data=str(data)) as t:
        t.train()
        exs = [{'input_ids': e['input_ids'], 'loss_mask': e['loss_mask']} for e in t.token_losses('train', indices=[0, 1, 2])]
        ref = t.token_losses(exs)
    from_hf = _score_run(run, exs)
    shutil.rmtree(run / 'hf')
    from_ckpt = _score_run(run, exs)
    print(f'run scorer vs workers: hf export {nll_gap(ref, from_hf):.2e}, checkpoint {nll_gap(ref, from_ckpt):.2e}')
    assert nll_gap(ref, from_hf) <= 1e-5 and nll_gap(ref, from_ckpt) <= 1e-5
    assert all(r['step'] == 2 and r['before_step'] == 0 for r in from_ckpt)
    page = tmp_path / 'row.html'
    p = subprocess.run([sys.executable, '-m', 'sft_nb.cli', 'inspect', str(data), '--row', '0', '--run', str(run), '--html', str(page),
                        '--color', 'never'], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert 'loss mean' in p.stdout and '(step 2)' in p.stdout
    h = page.read_text()
    assert h.count(' loss" style=') == sum(exs[0]['loss_mask'][1:]) and 'class="loss-legend"' in h
    from sft_nb.cli import main
    capsys.readouterr()
    with pytest.raises(SystemExit) as bad: main(['inspect', str(data), '--run', str(tmp_path)])
    assert bad.value.code != 0 and 'has no config.yaml (not a run folder)' in capsys.readouterr().err
