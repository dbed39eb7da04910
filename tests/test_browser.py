"""The examples in a real JupyterLab driven by headless Chromium (Debian's `chromium`, through Playwright's own
driver; never `playwright install`). JupyterLab runs from this environment on 127.0.0.1 with a token, on copies of
`examples/` under `build/lab/` (so autosave never touches the repository). Each test opens one example, runs all
its cells, uses its widgets the way a person would, and checks what the page shows. Screenshots: `build/browser/`.
"""
from __future__ import annotations
import json, os, re, secrets, shutil, socket, subprocess, sys, time, urllib.request
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB_DIR, SHOTS = ROOT / 'build' / 'lab', ROOT / 'build' / 'browser'
pytestmark = pytest.mark.timeout(900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


@pytest.fixture(scope='module')
def lab():
    "A JupyterLab server from this environment on copies of the examples; yields (base url, token)."
    if shutil.which('chromium') is None: pytest.fail('chromium is not installed: apt-get install -y chromium (.ci/run does this)')
    shutil.rmtree(LAB_DIR, ignore_errors=True); LAB_DIR.mkdir(parents=True); SHOTS.mkdir(parents=True, exist_ok=True)
    for nb in (ROOT / 'examples').glob('*.ipynb'): shutil.copy(nb, LAB_DIR / nb.name)
    # the interactive example trains long enough for the test to use the panel mid-run, evaluating every 50 steps, never stopping early
    nb = json.loads((LAB_DIR / 'interactive.ipynb').read_text())
    params = next(c for c in nb['cells'] if 'parameters' in c['metadata'].get('tags', []))
    for k, v in {'num_steps': 3000, 'eval_every': 50, 'early_stopping': 0}.items():
        params['source'] = [re.sub(rf'^{k} = \d+', f'{k} = {v}', l) for l in params['source']]
    (LAB_DIR / 'interactive.ipynb').write_text(json.dumps(nb))
    port, token = _free_port(), secrets.token_hex(16)
    home = LAB_DIR / '.jupyter'
    env = {**os.environ, 'JUPYTERLAB_SETTINGS_DIR': str(home / 'settings'), 'JUPYTERLAB_WORKSPACES_DIR': str(home / 'workspaces')}
    notif = home / 'settings' / '@jupyterlab' / 'apputils-extension' / 'notification.jupyterlab-settings'
    notif.parent.mkdir(parents=True); notif.write_text('{"fetchNews": "false"}')  # no news toast over the widgets
    auto = home / 'settings' / '@jupyterlab' / 'docmanager-extension' / 'plugin.jupyterlab-settings'
    auto.parent.mkdir(parents=True); auto.write_text('{"autosave": false}')
    log = open(LAB_DIR / 'server.log', 'w')
    proc = subprocess.Popen([sys.executable, '-m', 'jupyter', 'lab', '--no-browser', '--ip=127.0.0.1', f'--port={port}',
                             f'--IdentityProvider.token={token}', f'--ServerApp.root_dir={LAB_DIR}', '--LabApp.news_url=None',
                             '--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate'] + (['--allow-root'] if os.geteuid() == 0 else []),
                            cwd=LAB_DIR, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f'http://127.0.0.1:{port}'
    try:
        for _ in range(240):
            try: urllib.request.urlopen(f'{base}/api/status?token={token}', timeout=2); break
            except OSError:
                if proc.poll() is not None: pytest.fail(f'jupyter lab exited: {(LAB_DIR / "server.log").read_text()[-2000:]}')
                time.sleep(0.5)
        else: pytest.fail('jupyter lab did not answer in 120 s')
        yield base, token
    finally:
        proc.terminate()
        try: proc.wait(30)
        except subprocess.TimeoutExpired: proc.kill()
        log.close()


@pytest.fixture(scope='module')
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=shutil.which('chromium'), args=['--no-sandbox', '--disable-dev-shm-usage'])
        yield b
        b.close()


class Notebook:
    "One example open in its own JupyterLab workspace, with the page's console errors collected."
    def __init__(self, browser, lab, name: str):
        base, token = self.base, self.token = lab
        self.name = name
        self.page = browser.new_page(viewport={'width': 1400, 'height': 1000})
        self.errors = []
        self.page.on('console', lambda m: m.type == 'error' and self.errors.append(m.text))
        self.page.on('pageerror', lambda e: self.errors.append(str(e)))
        self.page.goto(f'{base}/lab/workspaces/{Path(name).stem}/tree/{name}?reset&token={token}')
        self.page.wait_for_selector('.jp-NotebookPanel .jp-Cell', timeout=120_000)
        for _ in range(240):  # the page can show "idle" before its kernel is connected: ask the server
            if (k := self.session()) and k['kernel']['execution_state'] == 'idle': break
            time.sleep(0.5)
        else: pytest.fail(f'the kernel of {name} did not start in 120 s')

    def session(self) -> dict | None:
        "This notebook's session on the server (with its kernel), if it has one."
        with urllib.request.urlopen(f'{self.base}/api/sessions?token={self.token}', timeout=10) as r:
            return next((s for s in json.loads(r.read()) if s['path'] == self.name), None)

    def close(self):
        "Close the page and shut its kernel down (kernels outlive pages)."
        self.page.close()
        if s := self.session():
            req = urllib.request.Request(f'{self.base}/api/sessions/{s["id"]}?token={self.token}', method='DELETE')
            urllib.request.urlopen(req, timeout=60)

    def run_all(self, timeout: float = 600):
        self.page.locator('.lm-MenuBar-item', has_text=re.compile(r'^Run$')).click()
        self.page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
        self.page.wait_for_function('''() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')]
            .some(e => e.textContent.trim() !== '[ ]:')''', timeout=60_000)
        self.wait_executed(timeout)

    def wait_executed(self, timeout: float = 600):
        "Until every code cell shows an execution count, or a cell failed (Run All then stops): that fails the test."
        self.page.wait_for_function('''() => {
            const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
            const ps = [...nb.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim());
            // JupyterLab renders an error output as stderr text; IPython's traceback header tells it from a warning
            const failed = [...nb.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
                .some(e => e.textContent.includes('Traceback (most recent call last)'));
            return ps.length > 0 && (ps.every(t => /^\\[\\d+\\]:$/.test(t)) || (failed && !ps.some(t => t.includes('*')))); }''',
            timeout=timeout * 1000, polling=500)
        err = self.errors_shown()
        assert err.count() == 0, f'a cell failed: {err.first.inner_text()[-3000:]}'

    def run_new_cell(self, code: str):
        "Append a cell at the end, type `code` into it and run it (Shift+Enter); returns the cell."
        cells = self.page.locator('.jp-NotebookPanel .jp-Cell')
        cells.last.click()
        self.page.keyboard.press('Escape'); self.page.keyboard.press('b')
        self.page.wait_for_timeout(300)
        cells.last.locator('.cm-content').click()
        self.page.keyboard.type(code)
        self.page.keyboard.press('Shift+Enter')
        # found by its code: running the last cell appends another one, so "the last cell" moves
        return self.page.locator('.jp-NotebookPanel .jp-CodeCell', has=self.page.locator('.cm-content', has_text=code)).last

    def errors_shown(self, within=None):
        "Error outputs (tracebacks) on the page, or within one cell."
        return (within or self.page).locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]',
                                             has_text='Traceback (most recent call last)')

    def check_clean(self):
        "Widgets rendered as widgets (not as their text repr), no cell failed, no console error."
        outs = self.page.locator('.jp-OutputArea-output').all_inner_texts()
        assert not [o for o in outs if re.search(r'^(VBox|HBox|FigureWidget)\(', o.strip())], 'a widget rendered as plain text'
        assert self.errors_shown().count() == 0, \
            '\n'.join(o for o in outs if 'Error' in o)[:3000]
        assert not self.errors, self.errors

    def shot(self, name: str, locator=None):
        (locator or self.page).screenshot(path=str(SHOTS / f'{name}.png'))


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


def _status(nb) -> str: return nb.page.locator('.sft-nb-status').text_content()  # off screen (a cell below ran), innerText is ''
def _points(nb) -> int: return nb.page.locator('.sft-nb-panel .js-plotly-plot .scatterlayer .trace').first.locator('path.point').count()
def _button(nb, name: str): return nb.page.locator('.sft-nb-panel button', has_text=re.compile(rf'^\s*{name}\s*$'))


def test_trainer_panel_in_browser(lab, browser):
    nb = Notebook(browser, lab, 'interactive.ipynb')
    nb.run_all()
    panel = nb.page.locator('.sft-nb-panel')
    panel.scroll_into_view_if_needed()
    assert _button(nb, 'Stop').is_disabled()  # idle: nothing to stop
    for k in (1, 2):
        _button(nb, 'Step').click()
        nb.page.wait_for_function(f"() => document.querySelector('.sft-nb-status').textContent.includes('step {k}/3000')", timeout=120_000)
        nb.page.wait_for_function('() => !document.querySelector(".sft-nb-panel button").disabled', timeout=60_000)
    nb.page.wait_for_function("() => (document.querySelector('.sft-nb-panel .js-plotly-plot .scatterlayer .trace')?.querySelectorAll('path.point').length ?? 0) === 2", timeout=30_000)
    assert _points(nb) == 2

    _button(nb, 'Fit').click()
    nb.page.wait_for_function("() => document.querySelector('.sft-nb-status').textContent.includes('fit running (from the panel)')", timeout=60_000)
    nb.page.wait_for_function("() => (document.querySelector('.sft-nb-panel .js-plotly-plot .scatterlayer .trace')?.querySelectorAll('path.point').length ?? 0) >= 12", timeout=120_000)
    assert _button(nb, 'Step').is_disabled() and _button(nb, 'Fit').is_disabled() and not _button(nb, 'Stop').is_disabled()
    nb.shot('panel_mid_fit', panel)

    # the kernel stays responsive: a cell runs while the fit goes on, and sees it running
    cell = nb.run_new_cell("print('alive', trainer.action, trainer.running, trainer.global_step)")
    cell.locator('.jp-OutputArea-output', has_text='alive').wait_for(timeout=60_000)
    assert 'alive fit True' in cell.locator('.jp-OutputArea-output').inner_text()  # action names it, running is a bool
    # a second run from a cell is refused with a clear error, and the panel's fit goes on
    cell = nb.run_new_cell('trainer.fit()')
    err = nb.errors_shown(cell)
    err.wait_for(timeout=60_000)
    assert 'TrainerBusy' in err.inner_text() and 'trainer.fit() is running in another thread' in err.inner_text()
    assert 'fit running (from the panel)' in _status(nb)
    n_before = _points(nb)
    nb.page.wait_for_function(f"() => (document.querySelector('.sft-nb-panel .js-plotly-plot .scatterlayer .trace')?.querySelectorAll('path.point').length ?? 0) > {n_before}", timeout=60_000)

    _button(nb, 'Stop').click()
    # the step in flight may be an eval_every evaluation with its samples (seconds, or a minute on a loaded 2-core machine)
    nb.page.wait_for_function("() => document.querySelector('.sft-nb-status').textContent.includes('stopped at step')", timeout=180_000)
    expected = int(re.search(r'stops after step (\d+)', nb.page.locator('.sft-nb-log').text_content()).group(1))
    stopped = int(re.search(r'stopped at step (\d+)', _status(nb)).group(1))
    assert stopped == expected, (stopped, expected)  # within one step of the click
    nb.page.wait_for_timeout(1000)
    assert _points(nb) == stopped and not _button(nb, 'Fit').is_disabled() and _button(nb, 'Stop').is_disabled()
    nb.shot('panel_stopped', panel)

    _button(nb, 'Evaluate').click()
    nb.page.locator('.sft-nb-log', has_text=f'eval at step {stopped}').wait_for(timeout=180_000)
    # the bad cell above is the only error output; take it out before the clean check
    outs = nb.errors_shown()
    assert outs.count() == 1
    cell.click(); nb.page.keyboard.press('Escape'); nb.page.keyboard.press('d'); nb.page.keyboard.press('d')
    nb.check_clean()
    cell = nb.run_new_cell("trainer.shutdown(); print('workers stopped')")  # Ray goes with the trainer, not with the kernel
    cell.locator('.jp-OutputArea-output', has_text='workers stopped').wait_for(timeout=120_000)
    nb.close()
