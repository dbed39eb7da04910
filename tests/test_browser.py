"""The examples in a real JupyterLab driven by headless Chromium (the session's server and browser, tests/jupyter_lab.py):
the inspector's row box changes the chips, the packing simulator's capacity changes the bin count. The trainer panel
is tests/test_browser_panel.py, the loss lens tests/test_browser_lens.py. Screenshots: `build/browser/`."""
from __future__ import annotations
import pytest
from jupyter_lab import Notebook

pytestmark = pytest.mark.timeout(900)


def test_inspector_in_browser(lab, browser):
    nb = Notebook(browser, lab, 'inspect.ipynb')
    nb.run_all()
    widget = nb.page.locator('.jp-OutputArea-output .widget-vbox', has=nb.page.locator('.widget-dropdown', has_text='source')).first
    chips = widget.locator('.widget-html .sftnb > div:last-child span.k')
    n3 = chips.count()
    assert n3 > 20, n3
    widget.scroll_into_view_if_needed(); nb.shot('inspector', widget)
    row = widget.locator('input[type="number"]').first  # the row box linked to the slider
    row.fill('0'); row.press('Enter')
    nb.page.wait_for_function(f'''() => [...document.querySelectorAll('.widget-html .sftnb > div:last-child')]
        .some(d => d.querySelectorAll('span.k').length > 0 && d.querySelectorAll('span.k').length !== {n3})''', timeout=60_000)
    assert chips.count() != n3 and chips.count() > 0
    assert widget.locator('.widget-slider .widget-readout').inner_text().strip() == '0'
    nb.shot('inspector_row0', widget)
    nb.check_clean()
    nb.close()


def _bins(nb, strategy: str) -> int:
    "The bin count of `strategy` in the simulator's table."
    return int(nb.page.evaluate(f'''() => {{
        const t = [...document.querySelectorAll('.widget-html table')].pop();
        const head = [...t.querySelectorAll('thead th')].map(e => e.textContent.trim());
        const row = [...t.querySelectorAll('tbody tr')].find(r => r.querySelector('td').textContent.trim() === '{strategy}');
        return row.querySelectorAll('td')[head.indexOf('bins')].textContent; }}'''))


def test_packing_simulator_in_browser(lab, browser):
    nb = Notebook(browser, lab, 'packing.ipynb')
    nb.run_all()
    sim = nb.page.locator('.jp-OutputArea-output .widget-vbox', has=nb.page.locator('.widget-slider', has_text='capacity')).first
    before = _bins(nb, 'bfd')
    readout = sim.locator('.widget-readout').first
    cap = int(readout.inner_text())
    readout.click(); nb.page.keyboard.press('Control+A'); nb.page.keyboard.type(str(cap * 2)); nb.page.keyboard.press('Enter')
    nb.page.wait_for_function(f'''() => {{ const t = [...document.querySelectorAll('.widget-html table')].pop();
        return t && [...t.querySelectorAll('tbody tr')].some(r => r.querySelector('td').textContent.trim() === 'bfd'
               && r.textContent.includes('bfd')) && document.querySelector('.widget-slider .widget-readout').textContent.trim() === '{cap * 2}'; }}''', timeout=60_000)
    nb.page.wait_for_timeout(500)
    after = _bins(nb, 'bfd')
    assert after < before, (before, after)  # twice the capacity: fewer packed rows
    sim.scroll_into_view_if_needed(); nb.shot('packsim', sim)
    nb.check_clean()
    nb.close()


def _descendants(pid: int) -> list[int]:
    "PIDs below `pid` in the process tree (from /proc)."
    from pathlib import Path
    parent = {}
    for p in Path('/proc').glob('[0-9]*'):
        try: parent[int(p.name)] = int((p / 'stat').read_text().rsplit(')', 1)[1].split()[1])
        except (OSError, ValueError, IndexError): pass
    out, todo = [], [pid]
    while todo:
        top = todo.pop()
        kids = [c for c, par in parent.items() if par == top]
        out += kids; todo += kids
    return out


def _cmdline(pid: int) -> str:
    from pathlib import Path
    try: return Path(f'/proc/{pid}/cmdline').read_bytes().replace(b'\0', b' ').decode(errors='replace')
    except OSError: return ''


def test_run_all_three_times_leaves_one_trainer(lab, browser):
    """interactive.ipynb Run All three times in one kernel: each run retires the trainer before it, so one worker process
    remains. Then the 20-step run, done, continues to 30 from a cell: steps 1-20 and the chart's eval points stay."""
    from jupyter_lab import with_params
    nb = Notebook(browser, lab, with_params('interactive.ipynb', 'interactive_rerun.ipynb',
                                            {'num_steps': '20', 'eval_every': '10', 'early_stopping': '0', 'keep_best': 'False'}))
    try:
        for _ in range(3):
            nb.run_all()
            nb.page.locator('.sft-nb-panel').first.wait_for(timeout=120_000)
        kernel = nb.session()['kernel']['id']
        (kpid,) = [int(p.name) for p in __import__('pathlib').Path('/proc').glob('[0-9]*') if f'kernel-{kernel}' in _cmdline(int(p.name))]
        workers = [p for p in _descendants(kpid) if _cmdline(p).startswith('ray::FSDPWorker')]
        assert len(workers) == 1, [_cmdline(p) for p in workers]
        nb.shot('run_all_three_times', nb.page.locator('.sft-nb-panel').first)
        from jupyter_lab import button, status
        button(nb, 'Fit').click()
        nb.page.wait_for_function("() => document.querySelector('.sft-nb-status').textContent.includes('step 20/20')", timeout=300_000)
        losses = _kernel_json(nb, "import json; print('LOSSES', json.dumps(trainer.history.loss.tolist()))", 'LOSSES')
        nb.run_new_cell('trainer.fit(10)')
        nb.page.wait_for_function("() => document.querySelector('.sft-nb-status').textContent.includes('step 30/30')", timeout=300_000)
        after = _kernel_json(nb, "print('LOSSES', json.dumps(trainer.history.loss.tolist()))", 'LOSSES')
        assert len(after) == 30 and after[:20] == losses, (losses, after)
        traces = nb.page.locator('.sft-nb-panel .js-plotly-plot .scatterlayer .trace')
        nb.page.wait_for_function("() => document.querySelectorAll('.sft-nb-panel .js-plotly-plot .scatterlayer .trace')[1]?.querySelectorAll('path.point').length === 3",
                                  timeout=60_000)
        assert traces.nth(0).locator('path.point').count() == 30 and traces.nth(1).locator('path.point').count() == 3  # evals at 10, 20, 30
        nb.shot('panel_continued_to_30', nb.page.locator('.sft-nb-panel').first)
        cell = nb.run_new_cell("trainer.shutdown(); print('workers stopped')")
        cell.locator('.jp-OutputArea-output', has_text='workers stopped').wait_for(timeout=120_000)
    finally: nb.close()


def _kernel_json(nb, code: str, tag: str):
    "Run `code` in a new cell; the JSON it prints after `tag`."
    import json
    out = nb.run_new_cell(code).locator('.jp-OutputArea-output', has_text=tag)
    out.wait_for(timeout=60_000)
    return json.loads(out.inner_text().split(tag, 1)[1])
