"""How long a new user waits: `make lab` (environment already built or not) until JupyterLab answers, then, in headless
Chromium, Run All on examples/interactive.ipynb until the panel shows, and one Step click until its point is drawn.

    python tools/lab_time.py            # from the repository root; prints the three times

The numbers in the README's "Work in a notebook" come from this script on a fresh clone.
"""
from __future__ import annotations
import os, re, secrets, shutil, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tests'))


def main():
    from jupyter_lab import Notebook, _free_port
    port, token = _free_port(), secrets.token_hex(16)
    settings = Path(tempfile.mkdtemp()) / 'settings'  # no autosave: the examples stay as they are in git
    (settings / '@jupyterlab' / 'docmanager-extension').mkdir(parents=True)
    (settings / '@jupyterlab' / 'docmanager-extension' / 'plugin.jupyterlab-settings').write_text('{"autosave": false}')
    (settings / '@jupyterlab' / 'apputils-extension').mkdir(parents=True)
    (settings / '@jupyterlab' / 'apputils-extension' / 'notification.jupyterlab-settings').write_text('{"fetchNews": "false"}')
    env = {**os.environ, 'JUPYTERLAB_SETTINGS_DIR': str(settings), 'JUPYTERLAB_WORKSPACES_DIR': str(settings.parent / 'ws')}
    t0 = time.perf_counter()
    proc = subprocess.Popen(['make', 'lab', f'LAB_ARGS=--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token}'],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try: urllib.request.urlopen(f'http://127.0.0.1:{port}/api/status?token={token}', timeout=2); break
            except OSError:
                if proc.poll() is not None: sys.exit('make lab exited')
                time.sleep(0.5)
        t_lab = time.perf_counter() - t0
        from playwright.sync_api import sync_playwright
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=shutil.which('chromium'), args=['--no-sandbox', '--disable-dev-shm-usage'])
            t1 = time.perf_counter()
            nb = Notebook(b, (f'http://127.0.0.1:{port}', token), 'interactive.ipynb')
            nb.run_all()
            nb.page.locator('.sft-nb-panel').wait_for()
            t_run = time.perf_counter() - t1
            t2 = time.perf_counter()
            nb.page.locator('.sft-nb-panel button', has_text=re.compile(r'^\s*Step\s*$')).click()
            nb.page.wait_for_function("() => (document.querySelector('.sft-nb-panel .js-plotly-plot .scatterlayer .trace')?.querySelectorAll('path.point').length ?? 0) === 1", timeout=120_000)
            t_step = time.perf_counter() - t2
            nb.run_new_cell('trainer.shutdown()')
            nb.page.wait_for_timeout(3000)
            nb.close(); b.close()
        print(f'make lab → JupyterLab answers: {t_lab:.1f} s\nRun All on interactive.ipynb → panel shown: {t_run:.1f} s\n'
              f'first Step → its point on the chart: {t_step:.1f} s')
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


if __name__ == '__main__':
    main()
