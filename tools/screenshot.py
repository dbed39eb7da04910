"""The inspector in a real browser: run examples/inspect.ipynb headless (papermill), turn it into a
page (nbconvert --to html), screenshot the page with headless Chromium (Debian's `chromium`), and
check the PNG shows the trained and masked chip colours.

    python tools/screenshot.py [--out build/screenshot] [--install]     # exit 0 = chips found

Used by `make screenshot` and tests/test_inspect.py.
"""
from __future__ import annotations
import argparse, os, shutil, struct, subprocess, sys, zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / 'examples' / 'inspect.ipynb'
APT_INSTALL = ['apt-get', 'install', '-y', '--no-install-recommends', 'chromium', 'fonts-dejavu-core']
CHROMIUM_FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
                  '--disable-sync', '--hide-scrollbars', '--no-first-run', '--disable-dev-shm-usage']


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, ('chromium', 'chromium-browser')) if p), None)


def ensure_chromium(install: bool = True) -> tuple[str | None, str]:
    "(path to chromium, '') or (None, why it is missing and could not be installed)."
    if path := find_chromium(): return path, ''
    if not install: return None, 'chromium is not installed (run: apt-get install -y chromium)'
    if not shutil.which('apt-get'): return None, 'chromium is not installed and this system has no apt-get to install it'
    if os.geteuid() != 0: return None, 'chromium is not installed and apt-get needs root to install it'
    env = {**os.environ, 'DEBIAN_FRONTEND': 'noninteractive'}
    log = ''
    for cmd in (['apt-get', 'update'], APT_INSTALL):
        try: r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        except subprocess.TimeoutExpired: return None, f'{" ".join(cmd)} timed out'
        log = (r.stdout + r.stderr)[-600:]
    if path := find_chromium(): return path, ''
    return None, f'apt-get install chromium failed: {log.strip()}'


def execute_example(out_ipynb: Path, **parameters) -> Path:
    "Run examples/inspect.ipynb with papermill (defaults: glaive tool-calling data, tiny model, Qwen2.5 template)."
    import papermill
    sys.path.insert(0, str(ROOT))
    shared = ROOT.parent / 'shared'  # the development data beside the checkout
    params = dict(data=str(shared / 'datasets' / 'glaive_toolcall_en_demo.json'), model='tiny', mode='all_assistant',
                  template=str(shared / 'templates' / 'qwen2.5-instruct.jinja'), row=3, renderer='plotly_mimetype+notebook')
    params.update(parameters)
    out_ipynb.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(str(EXAMPLE), str(out_ipynb), parameters=params, kernel_name='python3',
                               progress_bar=False, cwd=str(EXAMPLE.parent))
    return out_ipynb


def to_html(ipynb: Path, html: Path | None = None) -> Path:
    "`jupyter nbconvert --to html`, in process."
    from nbconvert import HTMLExporter
    html = html or ipynb.with_suffix('.html')
    body, _ = HTMLExporter().from_filename(str(ipynb))
    html.write_text(body, encoding='utf-8')
    return html


def screenshot(chromium: str, page: Path, png: Path, size: tuple[int, int] = (1280, 2400)) -> Path:
    "Headless Chromium screenshot of the top `size` pixels of `page`."
    png.unlink(missing_ok=True)
    cmd = [chromium, *CHROMIUM_FLAGS, f'--screenshot={png}', f'--window-size={size[0]},{size[1]}', page.resolve().as_uri()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if not png.exists(): raise RuntimeError(f'chromium wrote no screenshot (exit {r.returncode}): {r.stderr[-800:]}')
    return png


def _png_pixels(png: Path):
    "(width, height, channels, bytes) of an 8-bit RGB/RGBA PNG, with PIL if present, else zlib."
    try:
        from PIL import Image
        im = Image.open(png).convert('RGB')
        return im.width, im.height, 3, im.tobytes()
    except ImportError: pass
    data = png.read_bytes()
    assert data[:8] == b'\x89PNG\r\n\x1a\n', f'{png} is not a PNG'
    pos, idat = 8, b''
    while pos < len(data):
        n, kind = struct.unpack('>I4s', data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + n]
        if kind == b'IHDR':
            w, h, depth, color, _, _, interlace = struct.unpack('>IIBBBBB', chunk)
            assert depth == 8 and color in (2, 6) and not interlace, 'only 8-bit, non-interlaced RGB/RGBA PNGs'
        elif kind == b'IDAT': idat += chunk
        pos += 12 + n
    ch = 3 if color == 2 else 4
    raw, stride, out, prev = zlib.decompress(idat), w * ch, bytearray(), bytearray(w * ch)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - ch] if i >= ch else 0
            b, c = prev[i], prev[i - ch] if i >= ch else 0
            if f == 1: line[i] = (line[i] + a) & 255
            elif f == 2: line[i] = (line[i] + b) & 255
            elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out += line; prev = line
    return w, h, ch, bytes(out)


def count_color(png: Path, hex_color: str, tol: int = 4) -> int:
    "Pixels within `tol` of `hex_color` on every channel."
    w, h, ch, px = _png_pixels(png)
    target = [int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]
    try:
        import numpy as np
        a = np.frombuffer(px, dtype=np.uint8).reshape(h, w, ch)[..., :3].astype(int)
        return int((np.abs(a - target) <= tol).all(-1).sum())
    except ImportError:
        return sum(all(abs(px[i + k] - target[k]) <= tol for k in range(3)) for i in range(0, len(px), ch))


def check_png(png: Path, colours: tuple[str, ...] = (), at_most: dict[str, int] | None = None, min_pixels: int = 30) -> dict[str, int]:
    """A screenshot as a check: not blank (no colour covers more than 97% of it, and it has more than 16 colours: text,
    widgets), each of `colours` (#rrggbb: chip fills, a chart's line, an error box) covers at least `min_pixels` pixels
    and each colour of `at_most` at most that many. Returns the pixels of each named colour; an AssertionError names
    what is wrong and the image's most common colours."""
    from collections import Counter
    w, h, ch, px = _png_pixels(png)
    try:
        import numpy as np
        a = np.frombuffer(px, np.uint8).reshape(-1, ch)[:, :3].astype(np.int32)
        vals, counts = np.unique(a[:, 0] << 16 | a[:, 1] << 8 | a[:, 2], return_counts=True)
        seen = Counter({int(v).to_bytes(3, 'big'): int(k) for v, k in zip(vals, counts)})
    except ImportError: seen = Counter(px[i:i + 3] for i in range(0, len(px), ch))
    top = ', '.join(f'#{c.hex()} {k / (w * h):.1%}' for c, k in seen.most_common(8))
    assert seen.most_common(1)[0][1] <= 0.97 * w * h and len(seen) > 16, f'{png.name} looks blank: {len(seen)} colours; most common: {top}'
    at_most = at_most or {}
    near = lambda c: sum(k for rgb, k in seen.items() if all(abs(x - int(c[i:i + 2], 16)) <= 3 for x, i in zip(rgb, (1, 3, 5))))
    n = {c: near(c) for c in (*colours, *at_most)}  # pixels within 3 of the colour on every channel, as `count_color`
    assert all(n[c] >= min_pixels for c in colours) and all(n[c] <= k for c, k in at_most.items()), f'{png.name}: {n}; most common: {top}'
    return n


def chip_pixels(png: Path) -> dict[str, int]:
    "Pixels of the trained and masked chip fills (the inspector's colour map)."
    from sft_nb.inspect import COLORS
    return {k: count_color(png, COLORS[k]) for k in ('trained', 'masked')}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--out', default=str(ROOT / 'build' / 'screenshot'), help='folder for inspect.ipynb, inspect.html, inspector.png')
    p.add_argument('--install', action='store_true', help='apt-get install chromium when it is missing')
    p.add_argument('--min-pixels', type=int, default=2000, help='pixels of each chip colour the screenshot must hold')
    a = p.parse_args(argv)
    chromium, why = ensure_chromium(a.install)
    if chromium is None: print(f'screenshot: {why}', file=sys.stderr); return 2
    out = Path(a.out).resolve()  # the notebook runs in examples/
    page = to_html(execute_example(out / 'inspect.ipynb', cache_dir=str(out / 'cache')))
    png = screenshot(chromium, page, out / 'inspector.png')
    counts = chip_pixels(png)
    ok = all(n >= a.min_pixels for n in counts.values())
    print(f'{png}: trained-chip pixels {counts["trained"]}, masked-chip pixels {counts["masked"]} -> {"ok" if ok else "FAIL"}')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
