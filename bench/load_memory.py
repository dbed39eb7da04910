"""Per-worker peak host memory (RSS) of FSDP2 worker setup: a random ~300M-parameter Qwen2 saved as safetensors (fp32,
~1.2 GiB), 1 vs 2 CPU (gloo) workers, the loading of git `--main` (its default `model.load`) against this tree's
`model.load: rank0` (rank 0 reads it, the others build on `meta` and receive their shards), and this tree's
`load: every_rank`. Each rank reports its RSS after imports (before setup) and its peak RSS after setup; ratios are
against the checkpoint's weight bytes. `--phases`: also where this tree's `load: rank0` puts each rank's memory (RSS and
peak after each step of `FSDPWorker._load_sharded`, 2 workers). Memory-heavy: run it alone.

    python bench/load_memory.py [--main REF] [--layers 24] [--phases]
"""
import sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
import argparse, json, os, subprocess, tempfile, time

ROOT = Path(__file__).resolve().parents[1]


def status_gib(field: str) -> float:
    "VmRSS (now) or VmHWM (peak) of this process from /proc/self/status. Not ru_maxrss: Linux carries it across exec from the parent."
    line = next(l for l in open('/proc/self/status') if l.startswith(field + ':'))
    return int(line.split()[1]) / 2**20


def worker(a):
    "One rank: set up an FSDPWorker on the model folder and print its RSS before and its peak after setup (JSON)."
    from dataclasses import asdict, fields
    import torch
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import ModelConfig, OptimConfig
    kw = {'path': a.model}
    if a.load and 'load' in {f.name for f in fields(ModelConfig)}: kw['load'] = a.load
    w = FSDPWorker(a.rank, a.world, asdict(ModelConfig(**kw)), asdict(OptimConfig()), total_steps=1)
    w.init_dist('127.0.0.1', a.port)
    import transformers.models.qwen2.modeling_qwen2, torch.distributed.fsdp, torch.distributed.checkpoint.state_dict  # noqa: F401
    before = status_gib('VmRSS')  # after the imports setup would do: what follows is the loading's own memory
    marks = trace_phases(w) if a.phases else None
    t0 = time.perf_counter()
    info = w.setup()
    secs = time.perf_counter() - t0
    import gc; gc.collect()
    peak = status_gib('VmHWM')
    print(json.dumps({'rank': a.rank, 'before': before, 'peak': peak, 'after': status_gib('VmRSS'), 'setup_s': secs, 'n_params': info['n_params'],
                      'phases': marks}))


def trace_phases(w) -> list:
    "Record (phase, RSS, peak) after each step of the worker's sharded load, by wrapping the steps it calls (the list fills during setup)."
    import sft_nb.backends.fsdp as F
    marks = []
    def after(name, fn):
        def run(*args, **kw):
            out = fn(*args, **kw)
            marks.append((name(*args) if callable(name) else name, status_gib('VmRSS'), status_gib('VmHWM')))
            return out
        return run
    w._build_model = after(lambda device='cpu': 'read checkpoint (rank 0)' if device == 'cpu' else 'build on meta', w._build_model)
    w._shard = after('fully_shard', w._shard)
    rebuild = F.rebuild_buffers
    def mark_to_empty(*args):  # called right after model.to_empty: the rank's own shards are allocated
        marks.append(('to_empty (own shards)', status_gib('VmRSS'), status_gib('VmHWM')))
        return rebuild(*args)
    F.rebuild_buffers = mark_to_empty
    w._receive_shards = after('receive shards from rank 0', w._receive_shards)
    return marks
    w.shutdown()


def build_model(d: Path, layers: int) -> int:
    "A random Qwen2 (hidden 1024, GQA 8/2 heads, MLP 2816, vocab 32000, tied) saved as safetensors; its weight bytes."
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config
    from sft_nb.models import tiny_chat_model
    cfg = Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    m.save_pretrained(d, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_chat_model()).save_pretrained(d)
    del m
    return sum(f.stat().st_size for f in d.glob('*.safetensors'))


def run(src: Path, model: Path, world: int, load: str | None, phases: bool = False) -> list[dict]:
    "Start `world` rank processes on the code at `src`; their reports, by rank."
    sys.path.insert(0, str(ROOT)); from sft_nb.workers import free_port
    port, env = free_port(), {**os.environ, 'PYTHONPATH': str(src), 'OMP_NUM_THREADS': '1'}
    cmd = [sys.executable, __file__, '--worker', '--world', str(world), '--port', str(port), '--model', str(model)] + (['--load', load] if load else []) + (['--phases'] if phases else [])
    procs = [subprocess.Popen(cmd + ['--rank', str(r)], env=env, stdout=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs): raise RuntimeError(f"{src} world={world} load={load}: exit codes {[p.returncode for p in procs]}")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--worker', action='store_true'); ap.add_argument('--rank', type=int, default=0)
    ap.add_argument('--world', type=int, default=1); ap.add_argument('--port', type=int, default=0)
    ap.add_argument('--model'); ap.add_argument('--load')
    ap.add_argument('--main', default='main', help='git ref whose loading is the "before"')
    ap.add_argument('--layers', type=int, default=24)
    ap.add_argument('--phases', action='store_true', help="also trace this tree's rank0 load step by step (2 workers)")
    a = ap.parse_args()
    if a.worker: return worker(a)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp); model, old = tmp / 'model', tmp / 'main'
        old.mkdir()
        subprocess.run(f"git -C {ROOT} archive {a.main} sft_nb | tar -x -C {old}", shell=True, check=True)
        wbytes = build_model(model, a.layers)
        rev = subprocess.run(['git', '-C', str(ROOT), 'rev-parse', '--short', a.main], capture_output=True, text=True).stdout.strip()
        print(f"weights: {wbytes / 2**30:.2f} GiB safetensors; before = git {a.main} ({rev}); RSS in GiB, ratio = RSS / weight bytes")
        print(f"{'loading':<24}{'workers':>8}{'rank':>5}{'RSS before':>11}{'peak':>7}{'peak/W':>8}{'(peak-before)/W':>16}{'setup s':>8}")
        for name, src, load, worlds in ((f'{a.main} (its default)', old, None, (1, 2)), ('rank0 (this tree)', ROOT, 'rank0', (1, 2)),
                                         ('every_rank (this tree)', ROOT, 'every_rank', (2,))):
            for world in worlds:
                for r in run(src, model, world, load):
                    print(f"{name:<24}{world:>8}{r['rank']:>5}{r['before']:>11.2f}{r['peak']:>7.2f}{r['peak'] * 2**30 / wbytes:>8.2f}"
                          f"{(r['peak'] - r['before']) * 2**30 / wbytes:>16.2f}{r['setup_s']:>8.1f}", flush=True)
        if a.phases:
            print(f"\nload: rank0, 2 workers, step by step (GiB; ratio = (value - RSS before) / weight bytes)")
            for r in run(ROOT, model, 2, 'rank0', phases=True):
                for name, rss, peak in r['phases']:
                    print(f"rank {r['rank']}  {name:<28} RSS {rss:5.2f} ({(rss - r['before']) * 2**30 / wbytes:5.2f})  "
                          f"peak {peak:5.2f} ({(peak - r['before']) * 2**30 / wbytes:5.2f})", flush=True)


if __name__ == '__main__': main()
