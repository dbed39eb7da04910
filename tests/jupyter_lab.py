"""The harness of the browser tests: one JupyterLab server from this environment (127.0.0.1, a token) on copies of
`examples/` under `build/lab/` (so autosave never touches the repository) and one headless Chromium (Debian's
`chromium` through Playwright's own driver; never `playwright install`), both started once per pytest session
(`tests/conftest.py` makes the fixtures visible to every test module). `Notebook` opens one notebook in its own
workspace, runs its cells and reads the page. A test waits for the states it needs by polling for them up to one
generous deadline of its own (`Notebook.until`, `Notebook.see`; `BUDGET_S`), not with a fixed time per wait: on a loaded
machine a slow step only uses time that a fast one left. Each screenshot (`build/browser/`) is a check: `Notebook.shot`
asserts that it is not blank and holds the colours the test names (and not others)."""
from __future__ import annotations
import json, os, re, secrets, shutil, socket, subprocess, sys, time, urllib.request
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
# one lab folder per pytest-xdist worker (each worker that runs a browser test starts its own server)
LAB_DIR, SHOTS = ROOT / 'build' / f"lab{os.environ.get('PYTEST_XDIST_WORKER', '')}", ROOT / 'build' / 'browser'
BUDGET_S = 780  # one browser test's deadline for all its waits (pytest-timeout, 900 s, stays the backstop)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


@pytest.fixture(scope='session')
def lab():
    "A JupyterLab server from this environment on copies of the examples; yields (base url, token)."
    if shutil.which('chromium') is None: pytest.fail('chromium is not installed: apt-get install -y chromium (.ci/run does this)')
    shutil.rmtree(LAB_DIR, ignore_errors=True); LAB_DIR.mkdir(parents=True); SHOTS.mkdir(parents=True, exist_ok=True)
    for nb in (ROOT / 'examples').glob('*.ipynb'): shutil.copy(nb, LAB_DIR / nb.name)
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


@pytest.fixture(scope='session')
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
        self.restart_clock()
        self.page = browser.new_page(viewport={'width': 1400, 'height': 1000})
        self.errors = []
        self.page.on('console', lambda m: m.type == 'error' and self.errors.append(m.text))
        self.page.on('pageerror', lambda e: self.errors.append(str(e)))
        self.page.goto(f'{base}/lab/workspaces/{Path(name).stem}/tree/{name}?reset&token={token}')
        self.see(self.page.locator('.jp-NotebookPanel .jp-Cell').first)
        # the page can show "idle" before its kernel is connected: ask the server
        while not ((k := self.session()) and k['kernel']['execution_state'] == 'idle'):
            if time.monotonic() > self.deadline: pytest.fail(f'the kernel of {name} did not start by the deadline')
            time.sleep(0.5)

    def restart_clock(self, budget_s: float = BUDGET_S):
        "Start this test's deadline (a module's tests that share one notebook each start their own)."
        self.deadline = time.monotonic() + budget_s

    def left_ms(self) -> float:
        "Milliseconds left to the deadline: the timeout of every wait (at least 1 ms, so a wait past it fails at once)."
        return max(1.0, (self.deadline - time.monotonic()) * 1000)

    def until(self, js: str, polling: float = 500):
        "Poll the page until the JavaScript predicate `js` holds, up to the deadline; a miss names the page's console errors."
        from playwright.sync_api import TimeoutError as PageTimeout
        try: self.page.wait_for_function(js, timeout=self.left_ms(), polling=polling)
        except PageTimeout as e: raise AssertionError(f'{js[:300]} did not hold by the deadline; console errors: {self.errors[-10:]}') from e

    def see(self, locator, within_s: float | None = None):
        "Wait, up to the deadline (or `within_s`, for what comes at once), until `locator` is on the page; returns it."
        locator.wait_for(timeout=self.left_ms() if within_s is None else min(self.left_ms(), within_s * 1000))
        return locator

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

    def run_all(self):
        self.page.locator('.lm-MenuBar-item', has_text=re.compile(r'^Run$')).click()
        self.page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
        self.until('''() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')]
            .some(e => e.textContent.trim() !== '[ ]:')''')
        self.wait_executed()

    def wait_executed(self):
        "Until every code cell shows an execution count, or a cell failed (Run All then stops): that fails the test."
        self.until('''() => {
            const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
            const ps = [...nb.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim());
            // JupyterLab renders an error output as stderr text; IPython's traceback header tells it from a warning, and
            // a user's mistake (sft_nb.errors) is a short box followed by its folded traceback
            const failed = nb.querySelector('.sft-nb-error-tb') || [...nb.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
                .some(e => e.textContent.includes('Traceback (most recent call last)'));
            return ps.length > 0 && (ps.every(t => /^\\[\\d+\\]:$/.test(t)) || (failed && !ps.some(t => t.includes('*')))); }''')
        err = self.errors_shown()
        assert err.count() == 0, f'a cell failed: {err.first.inner_text()[-3000:]}'

    def run_new_cell(self, code: str):
        """Append a cell at the end, type `code` into it and run it (Shift+Enter); returns the cell.
        Each step waits for the page to show it: on a loaded machine the new cell can appear after a fixed pause, and
        typing then went into the cell above (a SyntaxError, which has no traceback header a test could wait for)."""
        cells = self.page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')
        n = cells.count()
        cells.last.locator('.jp-InputPrompt').click()
        self.page.keyboard.press('Escape'); self.page.keyboard.press('b')
        self.until(f"() => document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell').length === {n + 1}", polling=100)
        new = cells.nth(n)
        new.locator('.cm-content').click()
        self.page.keyboard.type(code)
        typed = new.locator('.cm-content').inner_text().strip()
        assert typed == code, f'typed {code!r} into a new cell, it holds {typed!r}'
        self.page.keyboard.press('Shift+Enter')
        # found by its code: running the last cell appends another one, so "the last cell" moves
        return self.page.locator('.jp-NotebookPanel .jp-CodeCell', has=self.page.locator('.cm-content', has_text=code)).last

    def kernel_json(self, code: str, tag: str):
        "Run `code` in a new cell; the JSON it prints after `tag`."
        out = self.see(self.run_new_cell(code).locator('.jp-OutputArea-output', has_text=tag))
        return json.loads(out.inner_text().split(tag, 1)[1])

    def outputs_text(self) -> str:
        "The text of every cell output on the page (what a user reads below the cells)."
        return '\n'.join(self.page.locator('.jp-OutputArea-output').all_text_contents())  # innerText is '' off screen

    def errors_shown(self, within=None):
        "Error outputs on the page, or within one cell: tracebacks, and the short boxes of a user's mistake (`user_errors`)."
        return (within or self.page).locator(f'{STDERR}:has-text("Traceback (most recent call last)"), {USER_ERROR}')

    def user_errors(self, within=None):
        "The short boxes of a user's mistake (`sft_nb.errors`): the stderr output that the folded traceback follows."
        return (within or self.page).locator(USER_ERROR)

    def check_clean(self):
        "Widgets rendered as widgets (not as their text repr), no cell failed, no console error."
        outs = self.page.locator('.jp-OutputArea-output').all_inner_texts()
        assert not [o for o in outs if re.search(r'^(VBox|HBox|FigureWidget)\(', o.strip())], 'a widget rendered as plain text'
        assert self.errors_shown().count() == 0, \
            '\n'.join(o for o in outs if 'Error' in o)[:3000]
        assert not self.errors, self.errors

    def shot(self, name: str, locator=None, colours: tuple[str, ...] = (), at_most: dict[str, int] | None = None) -> Path:
        """Screenshot `locator` (or the page) to build/browser/`name`.png and check it (tools/screenshot.py's `check_png`),
        again for up to 10 s while the page is still drawing."""
        png, tool, deadline = SHOTS / f'{name}.png', screenshot_tool(), time.monotonic() + 10
        while True:
            (locator or self.page).screenshot(path=str(png))
            try: tool.check_png(png, colours, at_most); return png
            except AssertionError:  # still drawing (plotly draws the axes first, then its template's background)
                if time.monotonic() > deadline: raise
                self.page.wait_for_timeout(500)


def screenshot_tool():
    "tools/screenshot.py as a module: its PNG reader, colour counts and `check_png`."
    import importlib.util
    spec = importlib.util.spec_from_file_location('sft_nb_screenshot', ROOT / 'tools' / 'screenshot.py')
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


STDERR = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
USER_ERROR = f'.jp-OutputArea-child:has(+ .jp-OutputArea-child .sft-nb-error-tb) {STDERR}'


def code_cell(nb, text: str):
    "The notebook's code cell whose source contains `text`."
    return nb.page.locator('.jp-NotebookPanel .jp-CodeCell', has=nb.page.locator('.cm-content', has_text=text)).first


def rerun(nb, cell):
    "Run `cell` again (Shift+Enter in its editor)."
    cell.locator('.cm-content').click()
    nb.page.keyboard.press('Shift+Enter')


def status(nb) -> str: return nb.page.locator('.sft-nb-status').text_content()  # off screen (a cell below ran), innerText is ''
def points(nb) -> int: return nb.page.locator('.sft-nb-panel .js-plotly-plot .scatterlayer .trace').first.locator('path.point').count()
def button(nb, name: str): return nb.page.locator('.sft-nb-panel button', has_text=re.compile(rf'^\s*{name}\s*$'))


def with_params(src: str, name: str, params: dict) -> str:
    "Copy examples/`src` into the lab folder as `name` with `params` set in its parameters cell (what papermill -p does)."
    nb = json.loads((ROOT / 'examples' / src).read_text())
    cell = next(c for c in nb['cells'] if 'parameters' in c['metadata'].get('tags', []))
    code = ''.join(cell['source'])
    for k, v in params.items():
        code, n = re.subn(rf'^{k} = [^#\n]*', f'{k} = {v}  ', code, flags=re.M)
        assert n == 1, f'{src} has no parameter {k}'
    cell['source'] = code.splitlines(keepends=True)
    (LAB_DIR / name).write_text(json.dumps(nb))
    return name
