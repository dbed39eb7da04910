"""The examples in a real JupyterLab driven by headless Chromium (the session's server and browser, tests/jupyter_lab.py):
the inspector's row box changes the chips, the packing simulator's capacity changes the bin count. The trainer panel
is tests/test_browser_panel.py, the loss lens tests/test_browser_lens.py. Screenshots: `build/browser/`."""
from __future__ import annotations
import json, time
from pathlib import Path
import pytest
from jupyter_lab import LAB_DIR, Notebook
from sft_nb.inspect import COLORS
from sft_nb.packsim import PALETTE

pytestmark = pytest.mark.timeout(900)
CHIPS = (COLORS['trained'], COLORS['masked'])  # trained and masked chips, on every inspector screenshot
CHART = ('#636efa', '#ef553b')  # the panel chart's train line and eval points (plotly's first two colours)


def test_inspector_in_browser(lab, browser):
    nb = Notebook(browser, lab, 'inspect.ipynb')
    nb.run_all()
    widget = nb.page.locator('.jp-OutputArea-output .widget-vbox', has=nb.page.locator('.widget-dropdown', has_text='source')).first
    chips = widget.locator('.widget-html .sftnb > div:last-child span.k')
    n3 = chips.count()
    assert n3 > 20, n3
    widget.scroll_into_view_if_needed(); nb.shot('inspector', widget, CHIPS)
    row = widget.locator('input[type="number"]').first  # the row box linked to the slider
    row.fill('0'); row.press('Enter')
    nb.until(f'''() => [...document.querySelectorAll('.widget-html .sftnb > div:last-child')]
        .some(d => d.querySelectorAll('span.k').length > 0 && d.querySelectorAll('span.k').length !== {n3})''')
    assert chips.count() != n3 and chips.count() > 0
    assert widget.locator('.widget-slider .widget-readout').inner_text().strip() == '0'
    nb.shot('inspector_row0', widget, CHIPS)
    nb.check_clean()
    nb.close()


def _table(nb) -> str:
    "The text of the simulator's table (the last table on the page)."
    return nb.page.evaluate("() => [...document.querySelectorAll('.widget-html table')].pop().textContent")


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
    before, table = _bins(nb, 'bfd'), _table(nb)
    readout = sim.locator('.widget-readout').first
    cap = int(readout.inner_text())
    readout.click(); nb.page.keyboard.press('Control+A'); nb.page.keyboard.type(str(cap * 2)); nb.page.keyboard.press('Enter')
    # the table is drawn again for the new capacity (its text changes), with its bfd row
    nb.until(f'''() => {{ const t = [...document.querySelectorAll('.widget-html table')].pop();
        return t && t.textContent !== {json.dumps(table)} && [...t.querySelectorAll('tbody tr')].some(r => r.querySelector('td').textContent.trim() === 'bfd')
               && document.querySelector('.widget-slider .widget-readout').textContent.trim() === '{cap * 2}'; }}''')
    after = _bins(nb, 'bfd')
    assert after < before, (before, after)  # twice the capacity: fewer packed rows
    sim.scroll_into_view_if_needed(); nb.shot('packsim', sim, PALETTE[:2])  # the first two rows' bars
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


def _state(pid: int) -> str:
    try: return Path(f'/proc/{pid}/status').read_text().split('State:', 1)[1].split('\n', 1)[0]
    except (OSError, IndexError): return 'zombie'  # gone meanwhile


def _cmdline(pid: int) -> str:
    from pathlib import Path
    try: return Path(f'/proc/{pid}/cmdline').read_bytes().replace(b'\0', b' ').decode(errors='replace')
    except OSError: return ''


def test_run_all_twice_leaves_one_trainer(lab, browser):
    """interactive.ipynb Run All twice in one kernel, its worker under Ray (`in_process = False`): each run retires
    the trainer before it, so one worker process remains. Then the 20-step run, done, continues to 30 from a cell: steps
    1-20 and the chart's eval points stay. No Ray INFO line shows; the kernel, shut down with Ray up, leaves no Ray
    process and no stack dump."""
    from jupyter_lab import with_params
    log_at = len((LAB_DIR / 'server.log').read_text(errors='replace'))
    folders = lambda: set((LAB_DIR / 'runs').glob('interactive-*'))
    before = folders()
    nb = Notebook(browser, lab, with_params('interactive.ipynb', 'interactive_rerun.ipynb',
                                            {'num_steps': '20', 'eval_every': '10', 'early_stopping': '0', 'keep_best': 'False',
                                             'in_process': 'False'}))
    try:
        for k in range(2):
            nb.run_all()
            nb.see(nb.page.locator('.sft-nb-panel').first)
            if k: continue
            # Ray starts in the setup cell, and only its first start in a process logs INFO lines: none in any output,
            # as the notebook saves them (the page renders only the cells in view)
            saved = (LAB_DIR / nb.name).stat().st_mtime_ns
            nb.page.locator('.lm-MenuBar-item', has_text='File').click()
            nb.page.locator('.lm-Menu-item[data-command="docmanager:save"]').click()
            end = time.monotonic() + 30
            while (LAB_DIR / nb.name).stat().st_mtime_ns == saved and time.monotonic() < end: time.sleep(0.2)
            cells = json.loads((LAB_DIR / nb.name).read_text())['cells']
            shown = '\n'.join(''.join(o.get('text', '')) for c in cells for o in c.get('outputs', []))
            assert 'rows; run folder' in shown and 'INFO worker.py' not in shown and 'Started a local Ray instance' not in shown, shown
        assert len(folders() - before) == 1, folders() - before  # the retired trainers, never stepped, took their run folders
        kernel = nb.session()['kernel']['id']
        (kpid,) = [int(p.name) for p in __import__('pathlib').Path('/proc').glob('[0-9]*') if f'kernel-{kernel}' in _cmdline(int(p.name))]
        workers = [p for p in _descendants(kpid) if _cmdline(p).startswith('ray::FSDPWorker')]
        assert len(workers) == 1, [_cmdline(p) for p in workers]
        nb.shot('run_all_twice', nb.page.locator('.sft-nb-panel').first, ('#388e3c', '#e5ecf6'))  # Fit enabled, the empty chart
        from jupyter_lab import button, status
        button(nb, 'Fit').click()
        nb.until("() => document.querySelector('.sft-nb-status').textContent.includes('step 20/20')")
        losses = nb.kernel_json("import json; print('LOSSES', json.dumps(trainer.metrics.loss.tolist()))", 'LOSSES')
        nb.run_new_cell('trainer.fit(10)')
        nb.until("() => document.querySelector('.sft-nb-status').textContent.includes('step 30/30')")
        after = nb.kernel_json("print('LOSSES', json.dumps(trainer.metrics.loss.tolist()))", 'LOSSES')
        assert len(after) == 30 and after[:20] == losses, (losses, after)
        traces = nb.page.locator('.sft-nb-panel .js-plotly-plot .scatterlayer .trace')
        nb.until("() => document.querySelectorAll('.sft-nb-panel .js-plotly-plot .scatterlayer .trace')[1]?.querySelectorAll('path.point').length === 3")
        assert traces.nth(0).locator('path.point').count() == 30 and traces.nth(1).locator('path.point').count() == 3  # evals at 10, 20, 30
        nb.shot('panel_continued_to_30', nb.page.locator('.sft-nb-panel').first, CHART)
    finally: nb.close()  # the kernel shut down with its Ray up, as a user closes a notebook
    # no Ray stack dump on the kernel's stderr (the server's log): `*** SIGTERM received ... epoll_wait`
    log = (LAB_DIR / 'server.log').read_text(errors='replace')[log_at:]
    assert 'SIGTERM received' not in log, log[-3000:]
    end = time.monotonic() + 30  # and the kernel took its Ray node's processes and its worker with it
    while (left := [p for p in [kpid, *workers] if Path(f'/proc/{p}').exists() and 'zombie' not in _state(p)]) and time.monotonic() < end:
        time.sleep(0.5)
    assert not left, [_cmdline(p) for p in left]
