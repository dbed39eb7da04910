"""What the driver feeds a step (`sft_nb.dataplan.DataPlan`), without workers: the items of step s depend on s alone (a
resumed run trains the rows an uninterrupted one would), and the step's loss divisor counts the trained targets of every
replica's micro-batches."""
import numpy as np
from sft_nb.config import load_config
from sft_nb.dataplan import DataPlan
from sft_nb.renderers import labels_for

ROWS = [{'messages': [{'role': 'user', 'content': f'question {k}' + ' more' * (k % 5)},
                      {'role': 'assistant', 'content': f'answer {k}' + ' longer' * (k % 3)}]} for k in range(12)]


def plan(tok, workers: int = 1):
    cfg = load_config({'model': {'path': 'tiny'}, 'train': {'global_batch_size': 4, 'micro_batch_size': 1, 'num_epochs': 3},
                       'placement': {'workers_per_node': workers}})
    return DataPlan(cfg, tok, train_data=ROWS).prepare().plan()


def test_global_batch_is_a_function_of_the_step(tiny_tok):
    """Over three epochs of a random sampler, step s's items are the same whether the plan walked steps 0 … s-1 first or
    was made fresh at s (what a resumed run does); each epoch trains every item once, in an order of its own."""
    walked = plan(tiny_tok)
    steps = range(walked.total_steps)
    assert walked.total_steps == 9 and walked.steps_per_epoch == 3
    order = [walked.global_batch(s) for s in steps]
    assert order == [plan(tiny_tok).global_batch(s) for s in steps]
    epochs = [sum(order[e * 3:(e + 1) * 3], []) for e in range(3)]
    assert all(sorted(e) == list(range(len(ROWS))) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3


def test_step_divisor_sums_every_replica(tiny_tok):
    """2 replicas, micro-batches of 1: the step's weight_sum (the divisor of every rank's loss) and n_trained are the
    trained targets of all 4 rows of the global batch, counted from the rows' own labels; n_real is their tokens."""
    dp = plan(tiny_tok, workers=2)
    items = dp.global_batch(0)
    sb = dp.rank_batches(items)
    assert [len(r) for r in sb.batches] == [2, 2]
    rows = [dp.example(k) for k in items]
    targets = sum(int(np.sum(np.asarray(labels_for(r['input_ids'], r['loss_mask'])) != -100)) for r in rows)
    assert sb.weight_sum == sb.n_trained == targets > 0
    assert sb.n_real == sum(len(r['input_ids']) for r in rows)
