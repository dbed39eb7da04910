"""The trainer panel of `examples/interactive.ipynb` in a real JupyterLab + headless Chromium (tests/jupyter_lab.py),
one Run All shared by the tests of this module, in order. The notebook trains the tiny model on a tool-calling file
and a reasoning file (tests/fixtures) with a shipped template by name (`template = 'qwen3'`, which renders tool calls
and reasoning), max_length 440 with truncation 'keep_start' (the longer tool-call examples, 451-459 tokens, are cut),
3000 steps evaluated every 50, never stopping early, so the panel is used mid-run:

1. Step, Fit, Stop and Evaluate: the chart grows a point per step, the kernel answers a cell while the fit runs, a
   second `trainer.fit()` from a cell is refused (`TrainerBusy`) and the panel's fit goes on, Stop ends it within one
   step of the click;
2. eval samples: each Evaluate lists the model's answers under the chart, newest evaluation first, marked (inserted /
   removed words) against the one before, and the page shows what the kernel's `trainer.samples` holds; Evaluate again
   with no step in between re-reports and counts nothing (no eval line, no sample block);
3. chat: type, Send, the reply streams in (several partial texts seen on the page) and is what the kernel's chat box
   holds; no red stderr box from the workers' weight loading;
4. one truth: the notebook's own inspector, walked over every row of both files in the kernel, gives the ids and masks
   the trainer's data plan trains (cut rows included), and the page shows the cut row as truncated.

Screenshots: build/browser/panel_*.png, build/browser/inspector_truncated.png."""
from __future__ import annotations
import re, shutil
from types import SimpleNamespace
import pytest
from jupyter_lab import Notebook, LAB_DIR, ROOT, button, points, status, with_params
from sft_nb.inspect import COLORS

pytestmark = pytest.mark.timeout(900)
CHIPS = (COLORS['trained'], COLORS['masked'])  # trained and masked chips
CHART = ('#636efa', '#ef553b')  # the chart's train line and eval points (plotly's first two colours)
INS, DEL = '#c8f0c8', '#f7c6c6'  # the samples' inserted and removed words (sft_nb.live)
FIX = ROOT / 'tests' / 'fixtures'
PARAMS = {'train_data': "'tool_calls.jsonl,reasoning.jsonl'", 'template': "'qwen3'", 'max_length': '440', 'truncation': "'keep_start'",
          'num_steps': '3000', 'eval_every': '50', 'early_stopping': '0'}
SAMPLES = '.sft-nb-samples .sft-nb-sample'
N_POINTS = "() => (document.querySelector('.sft-nb-panel .js-plotly-plot .scatterlayer .trace')?.querySelectorAll('path.point').length ?? 0)"
# run in the notebook's kernel (%run -i): the displayed inspector against the trainer's data plan, row by row
ONE_TRUTH = """import json
from sft_nb.lens import train_source_names
bad, n, cut = [], 0, []
for name, ds in zip(train_source_names(trainer), trainer.data.train_sets):
    inspector.source.value, trained = name, {}
    for k in range(len(ds)): trained.setdefault(int(ds[k]['index']), []).append((list(ds[k]['input_ids']), list(ds[k]['loss_mask'])))
    for i, want in trained.items():
        inspector.row.value = i
        shown = [(list(e.input_ids), list(e.loss_mask)) for e in inspector.examples]
        n += len(want); bad += [[name, i]] * (shown != want)
        cut += [[name, i, len(e.input_ids)] for e in inspector.examples if e.truncated]
print('ONE-TRUTH', json.dumps({'n': n, 'bad': bad, 'cut': cut, 'max_length': trainer.cfg.tokenize.max_length}))
inspector.source.value, inspector.row.value = cut[0][0], cut[0][1]
"""


@pytest.fixture(scope='module')
def run(lab, browser):
    "interactive.ipynb with PARAMS, next to its data, after Run All; the tests below share it (and what each leaves)."
    for f in ('tool_calls.jsonl', 'reasoning.jsonl'): shutil.copy(FIX / f, LAB_DIR / f)
    (LAB_DIR / 'one_truth.py').write_text(ONE_TRUTH)
    nb = Notebook(browser, lab, with_params('interactive.ipynb', 'interactive_agent.ipynb', PARAMS))
    try:
        nb.run_all()
        yield SimpleNamespace(nb=nb, page=nb.page, panel=nb.page.locator('.sft-nb-panel'))
        nb.restart_clock()
        cell = nb.run_new_cell("trainer.shutdown(); print('workers stopped')")  # Ray goes with the trainer, not with the kernel
        nb.see(cell.locator('.jp-OutputArea-output', has_text='workers stopped'))
    finally: nb.close()


@pytest.fixture(autouse=True)
def deadline(request):
    "Each test of this module gets its own deadline on the shared notebook (the first one's includes the Run All)."
    if 'run' in request.fixturenames: request.getfixturevalue('run').nb.restart_clock()


def _wait_idle(nb):
    nb.until('() => !document.querySelector(".sft-nb-panel button").disabled')


EVAL_LINES = "[...document.querySelectorAll('.sft-nb-log .sft-nb-log-text > div')].filter(d => d.textContent.startsWith('eval at step')).length"


def _evaluate(nb) -> int:
    "Click Evaluate; wait for its 'eval at step' log line and 4 sample rows per evaluation; returns the number of evaluations."
    n = nb.page.evaluate(f'() => {EVAL_LINES}') + 1
    button(nb, 'Evaluate').click()
    nb.until(f'() => {EVAL_LINES} === {n}')
    nb.until(f"() => document.querySelectorAll('{SAMPLES}').length === {4 * n}")
    _wait_idle(nb)
    return n


def _samples_shown(page) -> list[dict]:
    "Per sample row on the page, newest evaluation first: its prompt, the answer (removed words left out; '' where the page says '(empty answer)'), and its diff marks."
    return page.evaluate(f'''() => [...document.querySelectorAll('{SAMPLES}')].map(tr => {{
        const [p, a] = tr.querySelectorAll('td'); const c = a.cloneNode(true); c.querySelectorAll('del').forEach(d => d.remove());
        const empty = a.children.length === 1 && a.firstElementChild.tagName === 'I' && a.textContent === '(empty answer)';
        return {{prompt: p.textContent, answer: empty ? '' : c.textContent, ins: a.querySelectorAll('ins').length, del: a.querySelectorAll('del').length}}; }})''')


def test_step_fit_stop_evaluate(run):
    nb, page = run.nb, run.page
    data = page.locator('.sft-nb-data').text_content()  # Run All left the page at the last cell: off screen, innerText is ''
    assert re.match(r'data: [\d,]+ of [\d,]+ rows kept', data) and 'tool_calls.jsonl' in data and 'reasoning.jsonl' in data, data
    run.panel.scroll_into_view_if_needed()
    assert button(nb, 'Stop').is_disabled()  # idle: nothing to stop
    assert page.locator(SAMPLES).count() == 0  # nothing evaluated yet: no samples
    for k in (1, 2):
        button(nb, 'Step').click()
        nb.until(f"() => document.querySelector('.sft-nb-status').textContent.includes('step {k}/3000')")
        _wait_idle(nb)
    nb.until(f'{N_POINTS} === 2')
    assert points(nb) == 2

    assert _evaluate(nb) == 1
    run.first = _samples_shown(page)
    assert all(r['prompt'].strip() for r in run.first) and all(r['ins'] == r['del'] == 0 for r in run.first)  # nothing to compare with yet
    assert page.locator('.sft-nb-samples-eval b').all_inner_texts() == ['samples at step 2']
    nb.shot('panel_samples_first', run.panel, CHART)

    button(nb, 'Fit').click()
    nb.until("() => document.querySelector('.sft-nb-status').textContent.includes('fit running (from the panel)')")
    nb.until(f'{N_POINTS} >= 12')
    assert button(nb, 'Step').is_disabled() and button(nb, 'Fit').is_disabled() and not button(nb, 'Stop').is_disabled()
    nb.shot('panel_mid_fit', run.panel, CHART[:1])
    # the kernel stays responsive: a cell runs while the fit goes on, and sees it running
    cell = nb.run_new_cell("print('alive', trainer.action, trainer.running, trainer.global_step)")
    nb.see(cell.locator('.jp-OutputArea-output', has_text='alive'))
    assert 'alive fit True' in cell.locator('.jp-OutputArea-output').inner_text()  # action names it, running is a bool
    # a second run from a cell is refused with a clear error, and the panel's fit goes on
    run.busy_cell = nb.run_new_cell('trainer.fit()')
    err = nb.see(nb.errors_shown(run.busy_cell), within_s=120)  # the refusal is immediate: a miss costs 2 min, not the test's deadline
    assert 'TrainerBusy' in err.inner_text() and 'trainer.fit() is running in another thread' in err.inner_text()
    assert nb.user_errors(run.busy_cell).count() == 1  # the user's mistake: one short box, its traceback folded
    assert 'Traceback (most recent call last)' not in run.busy_cell.locator('.jp-OutputArea').inner_text()
    assert 'fit running (from the panel)' in status(nb)
    # train on until the answers have had time to change (an eval_every evaluation may come meanwhile), then stop
    nb.until("() => +(/step (\\d+)\\/3000/.exec(document.querySelector('.sft-nb-status').textContent) || [0, 0])[1] >= 40")
    button(nb, 'Stop').click()
    # the step in flight may be an eval_every evaluation with its samples (seconds, or a minute on a loaded 2-core machine)
    nb.until("() => document.querySelector('.sft-nb-status').textContent.includes('stopped at step')")
    expected = int(re.search(r'stops after step (\d+)', page.locator('.sft-nb-log').text_content()).group(1))
    run.stopped = int(re.search(r'stopped at step (\d+)', status(nb)).group(1))
    assert run.stopped == expected, (run.stopped, expected)  # within one step of the click
    _wait_idle(nb)
    nb.until(f'{N_POINTS} === {run.stopped}')
    assert points(nb) == run.stopped and not button(nb, 'Fit').is_disabled() and button(nb, 'Stop').is_disabled()
    nb.shot('panel_stopped', run.panel, CHART)


def test_samples_newest_first_marked_against_the_last(run):
    nb, page, stopped = run.nb, run.page, run.stopped
    # 2, or 3 when the fit passed step 50 (an eval_every evaluation); stopped right after that one, it is the newest
    n = _evaluate(nb) if stopped % 50 else page.evaluate(f'() => {EVAL_LINES}')
    nb.see(page.locator('.sft-nb-log', has_text=f'eval at step {stopped}'))
    heads = page.locator('.sft-nb-samples-eval b').all_inner_texts()
    assert heads[0] == f'samples at step {stopped}' and heads[-1] == 'samples at step 2' and len(heads) == n, heads  # newest first
    shown = _samples_shown(page)
    assert [r['prompt'] for r in shown[-4:]] == [r['prompt'] for r in run.first]  # the same prompts at every evaluation
    assert [r['prompt'] for r in shown[:4]] == [r['prompt'] for r in run.first]
    # answers after 40+ steps differ from those after two: the evaluation that follows step 2 marks them
    assert sum(r['ins'] + r['del'] for r in shown[-8:-4]) > 0, shown
    page.locator('.sft-nb-samples').scroll_into_view_if_needed()
    marks = (INS,) * any(r['ins'] for r in shown[-8:-4]) + (DEL,) * any(r['del'] for r in shown[-8:-4])
    nb.shot('panel_samples_diff', run.panel, (*CHART, *marks))  # and the words changed since the evaluation at step 2
    # the page shows what the kernel holds (trainer.samples, as in run_dir/samples.jsonl), newest evaluation first
    kernel = nb.kernel_json("import json; print('SAMPLES' + json.dumps([(s['step'], s['prompt'], s['answer']) for s in trainer.samples]))", 'SAMPLES')
    assert [k[0] for k in kernel[:4]] == [2] * 4 and [k[0] for k in kernel[-4:]] == [stopped] * 4 and len(kernel) == 4 * n
    groups = [kernel[i:i + 4] for i in range(0, len(kernel), 4)][::-1]
    assert [(r['prompt'], r['answer']) for r in shown] == [(p, a) for g in groups for _, p, a in g]


def test_evaluate_again_counts_nothing(run):
    "Evaluate with no step since the last evaluation re-reports it: no new eval line, no sample block (nor an early-stopping count)."
    nb, page = run.nb, run.page
    n, samples = page.evaluate(f'() => {EVAL_LINES}'), page.locator(SAMPLES).count()
    button(nb, 'Evaluate').click()
    nb.see(page.locator('.sft-nb-log', has_text=f'no step since the evaluation at step {run.stopped}: the same weights'))
    _wait_idle(nb)
    assert page.evaluate(f'() => {EVAL_LINES}') == n and page.locator(SAMPLES).count() == samples
    assert nb.kernel_json("print('EVALS', len(trainer.eval_metrics))", 'EVALS') == n


def test_chat_streams_what_the_kernel_holds(run):
    nb, page = run.nb, run.page
    # every text the streaming reply shows, as the page sees it
    page.evaluate('''() => { window.__stream = []; const out = document.querySelector('.sft-nb-chat-output');
        new MutationObserver(() => { const s = out.querySelector('.sft-nb-chat-streaming');
            if (s) window.__stream.push(s.textContent); }).observe(out, {subtree: true, childList: true, characterData: true}); }''')
    _wait_idle(nb)  # the chat answers between steps: nothing may run when Send is pressed
    box = page.locator('.sft-nb-chat-input textarea')
    box.scroll_into_view_if_needed(); box.click(); box.fill('What is the weather in Paris?')
    page.locator('.sft-nb-chat-send').click()
    # the kernel takes the click once it is idle; on a loaded 2-core machine that can take a while
    nb.see(page.locator('.sft-nb-chat-output .sft-nb-chat-user', has_text='What is the weather in Paris?'))
    nb.until("() => document.querySelector('.sft-nb-chat-output .sft-nb-chat-assistant:not(.sft-nb-chat-streaming)')")
    shown = page.locator('.sft-nb-chat-output .sft-nb-chat-assistant').inner_text()
    partial = page.evaluate('() => [...new Set(window.__stream)]')
    assert len(partial) >= 3, partial  # the reply grew on the page piece by piece
    final = shown.removeprefix('model:').strip()
    assert final, shown  # after 40 steps the model says something visible (not only blanks or special tokens)
    assert all(final.startswith(p.removeprefix('model:').strip().rstrip('▌').strip()) for p in partial), (partial, final)
    msgs = nb.kernel_json("import json; print('CHAT', json.dumps(panel.chat.messages))", 'CHAT')
    assert msgs[0] == {'role': 'user', 'content': 'What is the weather in Paris?'} and msgs[1]['role'] == 'assistant'
    assert msgs[1]['content'].strip() == final  # the page shows what the kernel's chat holds
    stderr = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').all_inner_texts()
    assert not [s for s in stderr if 'Loading weights' in s], stderr  # the workers' load progress is not a red box
    page.set_viewport_size({'width': 1400, 'height': 1900})  # the whole panel: buttons, chart, samples, chat, log
    run.panel.scroll_into_view_if_needed(); nb.shot('panel_chat', run.panel, CHART)


def test_inspector_shows_what_trains(run):
    nb, page = run.nb, run.page
    truth = nb.kernel_json('%run -i one_truth.py', 'ONE-TRUTH')
    assert truth['bad'] == [] and truth['n'] >= 48, truth  # every example of both files: the inspector's ids and mask are the trained ones
    assert truth['cut'] and all(n == 440 for *_, n in truth['cut']), truth  # cut rows among them, cut where training cuts them
    assert truth['max_length'] == 440
    ins = page.locator('.jp-OutputArea-output .sft-nb-inspector').first
    nb.see(ins.locator('.widget-html', has_text='truncated: yes'))  # the page shows the cut row as cut
    assert ins.locator('.widget-slider .widget-readout').inner_text().strip() == str(truth['cut'][0][1])
    ins.scroll_into_view_if_needed(); nb.shot('inspector_truncated', ins, CHIPS)
    # the refused `trainer.fit()` cell is the only error output: take it out before the clean check
    assert nb.errors_shown().count() == 1
    run.busy_cell.click(); page.keyboard.press('Escape'); page.keyboard.press('d'); page.keyboard.press('d')
    nb.check_clean()


def test_kernel_interrupt_stops_a_panel_fit(run):
    "The toolbar's interrupt (Kernel › Interrupt Kernel) while the panel fits: the fit stops after its step, the panel says so."
    nb, page = run.nb, run.page
    run.panel.scroll_into_view_if_needed()
    before = int(re.search(r'step (\d+)/3000', status(nb)).group(1))
    button(nb, 'Fit').click()
    nb.until("() => document.querySelector('.sft-nb-status').textContent.includes('fit running (from the panel)')")
    nb.until(f"() => +(/step (\\d+)\\/3000/.exec(document.querySelector('.sft-nb-status').textContent) || [0, 0])[1] >= {before + 2}")
    page.locator('.lm-MenuBar-item', has_text=re.compile(r'^Kernel$')).click()
    page.locator('.lm-Menu-item[data-command="kernelmenu:interrupt"]').click()
    nb.until("() => document.querySelector('.sft-nb-status').textContent.includes('stopped at step')")
    said = re.findall(r'interrupt: stop: the run stops after step (\d+)', page.locator('.sft-nb-log').text_content())
    stopped = int(re.search(r'stopped at step (\d+)', status(nb)).group(1))
    assert said and int(said[-1]) == stopped > before + 1, (said, stopped, before)
    _wait_idle(nb)
    nb.shot('panel_interrupted', run.panel, CHART[:1])
