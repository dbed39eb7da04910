"""`examples/interactive.ipynb` used as people use it, in a real JupyterLab + headless Chromium (the session's server and
browser, tests/jupyter_lab.py): one notebook, one kernel, one Run All, then in order

1. the Run All trains nothing, so its export cells write nothing: no `hf/`, no `gguf/` in the run folder; the empty
   chart says so (no axes from -1 to 6), and no label of the chat's settings is cut short;
2. a cell's `trainer.fit(3)` leaves the panel idle at step 3, Save, Evaluate, Step and Fit enabled;
3. the setup cell run again alone: the panel above drives the new trainer (its Step trains the new one, Send answers
   from it, no streaming cursor left), the old one stays where it was, retired;
4. two misspelled parameters: one box names both, each with its parameter (`learning_rate` → `lr`), and lists the
   notebook's parameters (not a name an `except ... as e` binds).

Each phase has its own short deadline, so a panel that never says what a phase waits for fails in minutes.
Screenshots: build/browser/second_run_*.png."""
from __future__ import annotations
import re
import pytest
from jupyter_lab import Notebook, button, code_cell, rerun, status, with_params
from test_browser_errors import BOX

pytestmark = pytest.mark.timeout(900)
PHASE_S = 240  # one phase's deadline (the first one's includes the kernel's start and the Run All)
CHART = '#636efa'  # the chart's train line (plotly's first colour)
IDLE_ENABLED = ('Save', 'Evaluate', 'Step', 'Fit')


def _idle_at(nb, step: int):
    "Wait until the panel says step `step` and nothing runs; Save, Evaluate, Step and Fit enabled, Stop not."
    nb.until(f"""() => {{ const s = document.querySelector('.sft-nb-status').textContent;
        return s.startsWith('step {step}/') && !s.includes('running'); }}""")
    nb.until('() => !document.querySelector(".sft-nb-panel button").disabled')
    assert [b for b in IDLE_ENABLED if button(nb, b).is_disabled()] == [] and button(nb, 'Stop').is_disabled(), status(nb)


def _run_again(nb, text: str):
    "Run the code cell whose source holds `text` again; wait until it has run (its prompt shows a new execution count)."
    cell = code_cell(nb, text)
    before = cell.locator('.jp-InputPrompt').text_content()
    rerun(nb, cell)
    nb.until(f"""() => {{ const t = [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell')]
        .find(c => c.querySelector('.cm-content')?.textContent.includes({text!r}))
        .querySelector('.jp-InputPrompt').textContent.trim();
        return /^\\[\\d+\\]:$/.test(t) && t !== {before.strip()!r}; }}""")


def test_second_run_of_interactive(lab, browser):
    nb = Notebook(browser, lab, with_params('interactive.ipynb', 'interactive_second.ipynb', {}))
    try:
        nb.restart_clock(PHASE_S)
        nb.run_all()
        gguf = code_cell(nb, "trainer.export(to='gguf')")
        assert 'train first' in gguf.locator('.jp-OutputArea').inner_text()
        wrote = nb.kernel_json("import json, pathlib; print('RUN-DIR', json.dumps(sorted(p.name for p in pathlib.Path(trainer.run_dir).iterdir())))", 'RUN-DIR')
        assert not {'hf', 'gguf'} & set(wrote), wrote  # no export of an untrained model
        gguf.scroll_into_view_if_needed(); nb.shot('second_run_no_export', gguf)
        panel = nb.page.locator('.sft-nb-panel')
        panel.scroll_into_view_if_needed()  # no step yet: the chart says so, with no axes from -1 to 6; no label cut short
        assert panel.locator('.js-plotly-plot .annotation-text', has_text='no step yet').count() == 1
        assert panel.locator('.js-plotly-plot .xtick').count() == 0
        assert nb.page.evaluate("() => [...document.querySelectorAll('.sft-nb-chat .widget-label')].filter(l => l.scrollWidth > l.clientWidth).map(l => l.textContent)") == []
        nb.shot('second_run_empty_panel', panel)

        nb.restart_clock(PHASE_S)
        nb.see(nb.run_new_cell('trainer.fit(3)').locator('.jp-InputPrompt', has_text=re.compile(r'\[\d+\]')))
        panel.scroll_into_view_if_needed()
        _idle_at(nb, 3)
        nb.shot('second_run_fit3_idle', panel, (CHART,))

        nb.restart_clock(PHASE_S)
        nb.run_new_cell('old = trainer')
        setup = code_cell(nb, 'trainer.setup()')
        _run_again(nb, 'trainer.setup()')
        nb.restart_clock(30)  # the cell has run: the panel says so now, or it still shows the retired trainer
        _idle_at(nb, 0)
        assert 'this panel now drives the new trainer' in nb.page.locator('.sft-nb-log').text_content()
        nb.restart_clock(PHASE_S)
        panel.scroll_into_view_if_needed()
        button(nb, 'Step').click()
        _idle_at(nb, 1)
        nb.page.locator('.sft-nb-chat-input textarea').fill('Who are you?')
        nb.page.locator('.sft-nb-chat-send').click()
        nb.until("""() => document.querySelector('.sft-nb-chat-assistant') && !document.querySelector('.sft-nb-chat-streaming')
            && !document.querySelector('.sft-nb-chat-send').disabled""")
        assert '▌' not in nb.page.locator('.sft-nb-chat-output').inner_text()
        assert nb.errors_shown(panel).count() == 0, panel.inner_text()[-2000:]
        nb.shot('second_run_panel_follows', panel)  # one step: a single point
        state = nb.kernel_json("print('FOLLOW', json.dumps({'old': old.global_step, 'new': trainer.global_step, 'rebound': panel.trainer is trainer, "
                               "'left_old': panel not in old.callbacks, 'reply': panel.chat.messages[-1]['role'], "
                               "'new_dir': trainer.run_dir != old.run_dir}))", 'FOLLOW')
        assert state == {'old': 3, 'new': 1, 'rebound': True, 'left_old': True, 'reply': 'assistant', 'new_dir': True}, state

        nb.restart_clock(PHASE_S)
        nb.run_new_cell('num_step = 20; lr = 3e-3; learning_rate = 1e-4')  # the parameters cell as a user mistypes it
        rerun(nb, setup)
        box = nb.see(nb.user_errors(setup).filter(has_text='ParameterError: '))
        text = box.inner_text()
        assert ('learning_rate: not a parameter of this notebook; did you mean lr?\n'
                'num_step: not a parameter of this notebook; did you mean num_steps?') in text, text
        params = re.search(r"this notebook's parameters: ([^)]*)\)", text).group(1).split(', ')
        assert {'lr', 'num_steps', 'model', 'in_process'} <= set(params) and 'e' not in params, params
        setup.scroll_into_view_if_needed(); nb.shot('second_run_typos', setup, (BOX,))

        nb.restart_clock(PHASE_S)
        cell = nb.run_new_cell("trainer.shutdown(); old.shutdown(); print('workers stopped')")
        nb.see(cell.locator('.jp-OutputArea-output', has_text='workers stopped'))
    except BaseException:
        nb.page.screenshot(path='build/browser/second_run_failed.png'); raise
    finally: nb.close()
