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


def test_mixed_sources_count_rows_apart_from_examples(tiny_tok, shared, tmp_path):
    """Two files mixed at weight 1: each source's report counts the rows its file has and keeps apart from the examples they
    give (Qwen3's template splits a conversation into one example per assistant turn), states its weight, its share of
    draws and how often an epoch repeats each example, and warns about the source that repeats; the panel says the same."""
    import json
    from sft_nb.mix import mix_line
    from sft_nb.live import data_html
    glaive = tmp_path / 'glaive.json'
    glaive.write_text(json.dumps(json.loads((shared / 'datasets' / 'glaive_toolcall_en_demo.json').read_text())[:50]))
    alpaca = shared / 'datasets' / 'alpaca_en_demo.json'
    cfg = load_config({'model': {'path': 'tiny'}, 'data': {'train': [{'path': str(glaive)}, {'path': str(alpaca)}]},
                       'tokenize': {'chat_template': 'tests/fixtures/templates/qwen3.jinja', 'max_length': 1024,
                                    'cache_dir': str(tmp_path / 'cache')}})
    dp = DataPlan(cfg, tiny_tok).prepare()
    g, a = dp.data_report.sources
    kept = len(set(dp.train_sets[0]['index']))  # distinct file rows behind the examples
    assert (g['n_rows'], g['n_kept'], g['n_examples']) == (50, kept, len(dp.train_sets[0]))
    assert 0 < kept < 50 < g['n_examples']  # long rows dropped; the kept ones give more examples than rows
    assert (a['n_rows'], a['n_kept'], a['n_examples']) == (999, len(set(dp.train_sets[1]['index'])), len(dp.train_sets[1]))
    assert g['n_drawn'] == sum(s == 0 for s, _ in dp.rows) and g['repeat'] == round(g['n_drawn'] / g['n_examples'], 2) > 2
    assert [(s['weight'], s['share']) for s in (g, a)] == [(1.0, 0.5), (1.0, 0.5)] and a['repeat'] == 1.0
    text = str(dp.data_report)
    assert f"{glaive}: weight 1 (50% of draws), 50 rows, {kept} kept, {g['n_examples']} examples, {g['n_drawn']} draws an epoch (×{g['repeat']:g})" in text
    assert f"WARNING: {glaive} repeats each example ×{g['repeat']:g} an epoch" in text and f"{alpaca} repeats" not in text
    assert data_html(dp.data_report).endswith(f" · {mix_line({**g, 'source': 'glaive.json'})} · {mix_line({**a, 'source': alpaca.name})}")


def test_fix_lines_name_the_notebook_parameter(tiny_tok):
    """Rows all longer than max_length: the refusal's fix names `tokenize.max_length` and `tokenize.truncation` where config
    keys are what the user edits (`sft-nb train`, a YAML config), and `max_length` and `truncation` in the kernel of
    interactive.ipynb, whose parameters cell sets them (its parameter check puts the words in place)."""
    import re
    import pytest
    from pathlib import Path
    from sft_nb import errors
    from sft_nb.cli import check_parameter_names
    from sft_nb.config import ConfigError
    cfg = load_config({'model': {'path': 'tiny'}, 'tokenize': {'max_length': 8}, 'train': {'global_batch_size': 4, 'micro_batch_size': 1}})
    with pytest.raises(ConfigError) as e:
        DataPlan(cfg, tiny_tok, train_data=ROWS).prepare()
    yaml_fix = errors.error_lines(e.value)[-1]
    assert re.match(r"fix: tokenize.max_length=\d+ keeps all 12, .*; tokenize.truncation='keep_start' keeps all 12", yaml_fix), yaml_fix
    notebook = Path(__file__).parents[1] / 'examples' / 'interactive.ipynb'
    try:
        check_parameter_names({'In': ['', "model = 'tiny'\nmax_length = 8", 'check(...)']}, notebook)
        assert errors.error_lines(e.value)[-1] == yaml_fix.replace('tokenize.max_length=', 'max_length=').replace('tokenize.truncation=', 'truncation=')
    finally:
        errors.reword = None
