"""Samples at every evaluation (`eval.samples` → run_dir/samples.jsonl, `trainer.samples`) and `sft_nb.runs.compare` on
run folders (`sft-nb train` and a papermill run compared: tests/test_cli.py::test_train_yaml_and_run_notebook)."""
import json
from pathlib import Path
import pytest
from sft_nb.demo_data import identity_rows
from sft_nb.trainer import SFTTrainer
from sft_nb.runs import compare
from helpers import run_cfg

ROWS = identity_rows()


def cfg(tiny_path, run_dir, **kw):
    "4 steps of 8 rows, constant LR 3e-3 (the tiny model's answers change within a few steps), greedy samples of 12 tokens."
    return run_cfg(tiny_path, run_dir, **{'optim__lr': 3e-3, 'train__micro_batch_size': 4, 'train__num_steps': 4,
                                          'eval__max_new_tokens': 12, **kw})


def read_samples(run_dir):
    return [json.loads(l) for l in (Path(run_dir) / 'samples.jsonl').read_text().splitlines()]


def test_samples_at_every_eval(tiny_path, tmp_path, ray_session):
    "Default eval.samples=4: the first 4 rows of the first eval set, answered at each eval (steps 2 and 4), each with the answer before."
    with SFTTrainer(cfg(tiny_path, tmp_path, train__eval_every=2), train_data=ROWS['train'], eval_data={'qa': ROWS['eval']}) as t:
        t.train()  # evaluates at steps 2 and 4 (eval_every), not again at the end
        recs = read_samples(tmp_path)
        assert [(r['step'], r['prompt_id']) for r in recs] == [(s, k) for s in (2, 4) for k in range(4)]
        assert recs == t.samples  # the file holds what memory holds
        assert {r['eval'] for r in recs} == {'qa'} and [r['row'] for r in recs[:4]] == [0, 1, 2, 3]
        for r, row in zip(recs, ROWS['eval'][:4] * 2):  # the prompt is the row without its answer; the answer is the reference
            assert r['messages'] == row['messages'][:2] and r['prompt'] == row['messages'][1]['content']
            assert r['reference'] == row['messages'][2]['content']
        assert [r['previous'] for r in recs] == [None] * 4 + [r['answer'] for r in recs[:4]]
        # greedy with the trainer's own generate: the same prompts now (no step since the last eval) give the same answers
        assert t.generate([r['messages'] for r in recs[4:]], 12) == [r['answer'] for r in recs[4:]]
        assert [e['step'] for e in t.eval_metrics] == [2, 4]


def test_samples_off(tiny_path, tmp_path, ray_session):
    "eval.samples=0: evaluations run, no samples are generated or written."
    with SFTTrainer(cfg(tiny_path, tmp_path, train__num_steps=2, train__eval_every=1, eval__samples=0, data__eval_fraction=0.2),
                    train_data=ROWS['train']) as t:
        t.train()
        assert [e['step'] for e in t.eval_metrics] == [1, 2] and not getattr(t, 'samples', [])
    assert not (tmp_path / 'samples.jsonl').exists()


def test_prompt_list_and_fallbacks(tiny_path, tmp_path, ray_session):
    "A list of prompts (a string, a message list) is used as given; without eval sets the prompts come from held-out, else train rows."
    prompts = ['Who are you?', [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Who made you?'}]]
    with SFTTrainer(cfg(tiny_path, tmp_path / 'list', train__num_steps=1, eval__samples=prompts), train_data=ROWS['train']) as t:
        t.fit(); t.evaluate()  # no eval set: train() would not evaluate; an explicit evaluate() has no loss but answers the samples
        recs = read_samples(tmp_path / 'list')
        assert [(r['step'], r['eval'], r['prompt'], r['row']) for r in recs] == [(1, 'prompts', 'Who are you?', None), (1, 'prompts', 'Who made you?', None)]
        assert recs[1]['messages'] == prompts[1] and 'messages' not in recs[0]
    with SFTTrainer(cfg(tiny_path, tmp_path / 'held', train__num_steps=1, eval__samples=2, data__eval_fraction=0.2), train_data=ROWS['train']) as t:
        t.train()
        held = {int(t.data.train_sets[0][int(i)]['index']) for _, i in t.data.heldout}
        recs = read_samples(tmp_path / 'held')
        assert [r['eval'] for r in recs] == ['heldout'] * 2 and {r['row'] for r in recs} <= held
    with SFTTrainer(cfg(tiny_path, tmp_path / 'train', train__num_steps=1, eval__samples=3), train_data=ROWS['train']) as t:
        t.fit(); t.evaluate()
        assert [r['eval'] for r in read_samples(tmp_path / 'train')] == ['train'] * 3


def test_compare_two_runs(tiny_path, tmp_path, ray_session):
    "Two tiny runs that differ in lr: compare() gives the lr row (and no other config row), the final metrics, and both runs' curves."
    for name, lr in (('fast', 3e-3), ('slow', 1e-4)):
        with SFTTrainer(cfg(tiny_path, tmp_path / name, optim__lr=lr, train__num_steps=3, train__eval_every=3, eval__samples=0,
                            data__eval_fraction=0.2), train_data=ROWS['train']) as t:
            t.fit()
    c = compare([tmp_path / 'fast', tmp_path / 'slow'])
    assert list(c.table.columns) == ['fast', 'slow']
    assert c.table.loc['optim.lr'].tolist() == [3e-3, 1e-4]
    config_rows = [k for k in c.table.index if '.' in k]
    assert config_rows == ['optim.lr'], config_rows
    assert c.table.loc['steps'].tolist() == [3, 3] and c.table.loc['final eval loss'].notna().all()
    names = [tr.name for tr in c.fig.data]
    assert names == ['fast train', 'fast eval', 'slow train', 'slow eval']
    assert [len(tr.y) for tr in c.fig.data] == [3, 1, 3, 1] and c.fig.data[0].y != c.fig.data[2].y
    (tmp_path / 'no_metrics').mkdir(); (tmp_path / 'no_metrics' / 'config.yaml').write_text('{}')
    with pytest.raises(FileNotFoundError, match='no_metrics: no metrics.jsonl'):
        compare([tmp_path / 'fast', tmp_path / 'no_metrics'])
