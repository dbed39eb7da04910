"""Eval samples in the trainer panel, in a real JupyterLab + headless Chromium (the harness of tests/test_browser.py):
after an Evaluate click the panel lists the model's answers under the chart; after more training and a second
Evaluate the newest evaluation comes first, its answers marked (inserted/removed words) against the first one, and
what the page shows is what the kernel's `trainer.samples` holds. Screenshots: build/browser/panel_samples_*.png.
"""
from __future__ import annotations
import json, re
import pytest
from test_browser import lab, browser, Notebook, _button, _status  # noqa: F401 (fixtures used by name)

pytestmark = pytest.mark.timeout(900)
ROWS = '.sft-nb-samples .sft-nb-sample'


def _wait_idle(nb):
    nb.page.wait_for_function('() => !document.querySelector(".sft-nb-panel button").disabled', timeout=120_000)


def _n_evals(nb) -> int:
    "Evaluations the panel's output area reported (every evaluation writes one 'eval at step' line there)."
    return nb.page.evaluate("() => [...document.querySelectorAll('.sft-nb-log .sft-nb-log-text > div')].filter(d => d.textContent.startsWith('eval at step')).length")


def _evaluate(nb) -> int:
    "Click Evaluate; wait for its eval line and for 4 sample rows per evaluation; returns the number of evaluations."
    n = _n_evals(nb) + 1
    _button(nb, 'Evaluate').click()
    nb.page.wait_for_function(f"() => [...document.querySelectorAll('.sft-nb-log .sft-nb-log-text > div')].filter(d => d.textContent.startsWith('eval at step')).length === {n}", timeout=180_000)
    nb.page.wait_for_function(f"() => document.querySelectorAll('{ROWS}').length === {4 * n}", timeout=60_000)
    _wait_idle(nb)
    return n


def _shown(nb) -> list[dict]:
    "Per sample row on the page, newest evaluation first: its prompt, the answer (removed words left out), and its diff marks."
    return nb.page.evaluate(f'''() => [...document.querySelectorAll('{ROWS}')].map(tr => {{
        const [p, a] = tr.querySelectorAll('td'); const c = a.cloneNode(true); c.querySelectorAll('del').forEach(d => d.remove());
        return {{prompt: p.textContent, answer: c.textContent, ins: a.querySelectorAll('ins').length, del: a.querySelectorAll('del').length}}; }})''')


def test_panel_shows_eval_samples(lab, browser):
    nb = Notebook(browser, lab, 'interactive.ipynb')
    nb.run_all()
    panel = nb.page.locator('.sft-nb-panel')
    panel.scroll_into_view_if_needed()
    assert nb.page.locator(ROWS).count() == 0  # nothing evaluated yet: no samples
    _button(nb, 'Step').click()
    nb.page.wait_for_function("() => document.querySelector('.sft-nb-status').textContent.includes('step 1/3000')", timeout=120_000)
    _wait_idle(nb)
    data_line = nb.page.locator('.sft-nb-data').text_content()  # what the run trains on, above the chart
    assert re.match(r'data: [\d,]+ of [\d,]+ rows kept', data_line), data_line
    assert _evaluate(nb) == 1
    first = _shown(nb)
    assert all(r['prompt'].strip() for r in first) and all(r['ins'] == r['del'] == 0 for r in first)  # nothing to compare with yet
    assert nb.page.locator('.sft-nb-samples-eval b').all_inner_texts() == ['samples at step 1']
    nb.shot('panel_samples_first', panel)

    _button(nb, 'Fit').click()  # train on until the answers have had time to change (eval_every=50 may evaluate meanwhile), then stop
    nb.page.wait_for_function("() => +(/step (\\d+)\\/3000/.exec(document.querySelector('.sft-nb-status').textContent) || [0, 0])[1] >= 30",
                              timeout=300_000, polling=500)
    _button(nb, 'Stop').click()
    nb.page.wait_for_function("() => document.querySelector('.sft-nb-status').textContent.includes('stopped at step')", timeout=60_000)
    stopped = int(re.search(r'stopped at step (\d+)', _status(nb)).group(1))
    _wait_idle(nb)
    n = _evaluate(nb)  # 2, or 3 when the fit passed step 50 (an eval_every evaluation)
    nb.page.locator('.sft-nb-log', has_text=f'eval at step {stopped}').wait_for(timeout=10_000)
    heads = nb.page.locator('.sft-nb-samples-eval b').all_inner_texts()
    assert heads[0] == f'samples at step {stopped}' and heads[-1] == 'samples at step 1' and len(heads) == n, heads  # newest first
    shown = _shown(nb)
    assert [r['prompt'] for r in shown[-4:]] == [r['prompt'] for r in first]  # the same prompts at every evaluation
    assert [r['prompt'] for r in shown[:4]] == [r['prompt'] for r in first]
    # answers after 30+ steps differ from those after one step: the evaluation that follows step 1 marks them
    assert sum(r['ins'] + r['del'] for r in shown[-8:-4]) > 0, shown
    nb.page.locator('.sft-nb-samples').scroll_into_view_if_needed()
    nb.shot('panel_samples_diff', panel)

    # the page shows what the kernel holds (trainer.samples, as in run_dir/samples.jsonl), newest evaluation first
    cell = nb.run_new_cell("import json; print('SAMPLES' + json.dumps([(s['step'], s['prompt'], s['answer']) for s in trainer.samples]))")
    out = cell.locator('.jp-OutputArea-output', has_text='SAMPLES')
    out.wait_for(timeout=60_000)
    kernel = json.loads(out.inner_text().strip().removeprefix('SAMPLES'))
    assert [k[0] for k in kernel[:4]] == [1] * 4 and [k[0] for k in kernel[-4:]] == [stopped] * 4 and len(kernel) == 4 * n
    groups = [kernel[i:i + 4] for i in range(0, len(kernel), 4)][::-1]
    assert [(r['prompt'], r['answer']) for r in shown] == [(p, a) for g in groups for _, p, a in g]
    nb.check_clean()
    cell = nb.run_new_cell("trainer.shutdown(); print('workers stopped')")
    cell.locator('.jp-OutputArea-output', has_text='workers stopped').wait_for(timeout=120_000)
    nb.close()
