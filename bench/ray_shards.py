"""`tokenize_dataset(..., ray_shards=N)` on a real two-node Ray cluster on loopback, with a JSONL source larger than the
object store of either node (and of both together), against the serial `tokenize_dataset` in the same run (issue 16 item 4).

Each node is a `ray start --block` process with 1 CPU and a capped object store. A task is sent its shard as line
offsets (16 bytes a row) and reads its own lines from the file; its Arrow part goes straight into the cache folder
(every node here sees it). The driver only writes the index, the report and the manifest. Printed per method: wall
time, rows/s, the driver's peak RSS, and whether the datasets are equal.

    python bench/ray_shards.py --rows 200000 --shards 4 --object-store-mb 80
"""
import os, sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
os.environ.setdefault('HF_HUB_OFFLINE', '1'); os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
os.environ.setdefault('TRANSFORMERS_VERBOSITY', 'error')
import argparse, json, shutil, signal, socket, subprocess, tempfile, time

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / 'shared'  # the development data beside the checkout
ENV = {**os.environ, 'RAY_USAGE_STATS_ENABLED': '0', 'RAY_AUTH_MODE': 'disabled', 'PYTHONPATH': str(ROOT)}
RAY = str(Path(sys.executable).parent / 'ray')


def make_source(n: int, folder: Path) -> Path:
    "n alpaca-style rows as JSONL: the shared demo rows repeated, each instruction made unique."
    demo = json.loads((SHARED / 'datasets' / 'alpaca_en_demo.json').read_text())
    path = folder / f'alpaca_{n}.jsonl'
    with open(path, 'w') as f:
        for k in range(n):
            r = demo[k % len(demo)]
            f.write(json.dumps({**r, 'instruction': f"{r['instruction']} (#{k})"}, ensure_ascii=False) + '\n')
    return path


def start_node(args: list[str], log: Path) -> subprocess.Popen:
    "One Ray node in its own session: terminating that process group stops exactly this node."
    return subprocess.Popen([RAY, 'start', '--block', '--disable-usage-stats', *args], env=ENV, stdout=open(log, 'w'),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop_node(p: subprocess.Popen):
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try: p.wait(30)
        except subprocess.TimeoutExpired: os.killpg(p.pid, signal.SIGKILL)


def wait_nodes(address: str, n: int, timeout: float = 120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run([RAY, 'status', f'--address={address}'], env=ENV, capture_output=True, text=True).stdout
        if out.count('node_') >= n: return
        time.sleep(1)
    raise TimeoutError(f'{n} Ray nodes did not come up at {address}')


def child(a):
    "One measurement in a fresh process (its peak RSS is the driver's): prints one JSON line."
    import hashlib, resource
    from transformers import AutoTokenizer
    from sft_nb.models import smollm2_instruct
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    import datasets; datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(smollm2_instruct())
    if a.address:
        import ray
        ray.init(address=a.address, logging_level='ERROR', log_to_driver=False)
        nodes = [n['NodeID'] for n in ray.nodes() if n['Alive']]
    t0 = time.time()
    ds, rep = tokenize_dataset(a.source, tok, TokenizeConfig(max_length=4096), cache_dir=a.cache, batch_size=1024,
                               ray_shards=a.shards if a.address else 0)
    wall = time.time() - t0
    h = hashlib.sha256()
    for col in ('input_ids', 'loss_mask', 'index'):
        for chunk in ds.data.table.column(col).chunks: h.update(chunk.values.to_numpy().tobytes() if col != 'index' else chunk.to_numpy().tobytes())
    folder = next(p for p in Path(a.cache).iterdir() if p.is_dir() and not p.name.startswith('.'))
    print(json.dumps({'wall': wall, 'rows': rep.n_rows, 'kept': rep.n_kept, 'peak_rss_gib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                      'digest': h.hexdigest(), 'parts': len(list((folder / 'data').glob('data-*.arrow'))),
                      'nodes': len(nodes) if a.address else 1}))


def measure(src: Path, work: Path, name: str, address: str | None, shards: int) -> dict:
    cache = work / f'cache_{name}'
    cmd = [sys.executable, __file__, '--child', '--source', str(src), '--cache', str(cache), '--shards', str(shards)]
    r = subprocess.run(cmd + (['--address', address] if address else []), env=ENV, capture_output=True, text=True)
    if r.returncode: raise RuntimeError(f'{name} failed:\n{r.stderr[-3000:]}')
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rows', type=int, default=200_000)
    p.add_argument('--shards', type=int, default=4)
    p.add_argument('--object-store-mb', type=int, default=80, help='object store of each node (Ray needs at least ~75 MB)')
    p.add_argument('--child', action='store_true'); p.add_argument('--source'); p.add_argument('--cache'); p.add_argument('--address')
    a = p.parse_args()
    if a.child: return child(a)
    work = Path(tempfile.mkdtemp(prefix='sft_nb_ray_shards_'))
    src = make_source(a.rows, work)
    mb = src.stat().st_size / 2**20
    print(f'source: {a.rows:,} rows, {mb:.0f} MiB of JSONL; 2 nodes x 1 CPU, object store {a.object_store_mb} MB each '
          f'(source / one store = {mb / a.object_store_mb:.1f}x, / both = {mb / (2 * a.object_store_mb):.1f}x)', flush=True)
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    address, store = f'127.0.0.1:{port}', str(a.object_store_mb * 2**20)
    nodes = [start_node(['--head', f'--port={port}', '--node-ip-address=127.0.0.1', '--include-dashboard=false', '--num-cpus=1',
                         f'--object-store-memory={store}'], work / 'head.log')]
    try:
        wait_nodes(address, 1)
        nodes.append(start_node([f'--address={address}', '--node-ip-address=127.0.0.1', '--num-cpus=1', f'--object-store-memory={store}'],
                                work / 'worker.log'))
        wait_nodes(address, 2)
        ray_res = measure(src, work, 'ray', address, a.shards)
    finally:
        for n in reversed(nodes): stop_node(n)
    serial = measure(src, work, 'serial', None, 0)
    print('\n| method | nodes | wall s | rows/s | driver peak RSS GiB | parts | same dataset as serial |\n|---|---:|---:|---:|---:|---:|---|')
    for name, r in (('serial (one process)', serial), (f'ray_shards={a.shards}', ray_res)):
        print(f"| {name} | {r['nodes']} | {r['wall']:.1f} | {r['rows'] / r['wall']:,.0f} | {r['peak_rss_gib']:.2f} | {r['parts']} | "
              f"{'yes' if r['digest'] == serial['digest'] and r['kept'] == serial['kept'] else 'NO'} |")
    print(f"\nspeed-up {serial['wall'] / ray_res['wall']:.2f}x on {os.cpu_count()} cores")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
    main()
