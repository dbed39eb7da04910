"""A CPU rank's host memory with glibc's malloc as it is, with `sft_nb.workers.compact_malloc` (what CPU workers
run in `init_dist`: mmap threshold fixed at 1 MiB) and with jemalloc (the `libjemalloc.so` Ray's wheel ships, preloaded
with `LD_PRELOAD`, `MALLOC_CONF` as given by --jemalloc-conf), side by side in one run: each arm is N spawned gloo ranks that
take 2 training steps, then one more whose peak (VmHWM, reset before it) is read; also the RSS held between steps, the
live tensors of that step by torch's `FSDPMemTracker`, and the seconds a step takes.

    python bench/cpu_malloc.py [--model smollm2] [--ranks 2] [--ac full] [--length 1024]
"""
import sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
import argparse, json, os, time


def _rank(rank, world, port, args, compact, q):
    import ray  # noqa: F401  (a worker is a Ray actor: its runtime has Ray loaded)
    import sft_nb.workers
    if not compact: sft_nb.workers.compact_malloc = lambda: False  # glibc's own behaviour: the arm compared against
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.memory import rank_memory, reset_peak_memory
    from sft_nb.config import load_config
    from sft_nb.memory import estimate_batch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    cfg = load_config(None, args)
    w = FSDPWorker(rank, world, cfg.model, cfg.optim, total_steps=4, placement={})
    w.init_dist('127.0.0.1', port); w.setup()
    mb = estimate_batch(cfg, w.model.config.get_text_config().vocab_size)
    t0 = time.perf_counter()
    for _ in range(2): w.forward_backward([mb], 1); w.optim_step()
    step_s = (time.perf_counter() - t0) / 2
    held = rank_memory()['rss']; reset_peak_memory(False)
    tracker = FSDPMemTracker(w.model, w.opt)
    with tracker:
        w.forward_backward([mb], 1); w.optim_step()
    (live,) = tracker.get_tracker_snapshot('peak').values()
    q.put((rank, {'held': held, 'peak': rank_memory()['peak'], 'live': live['Total'], 'step_s': step_s}))
    w.shutdown()


def jemalloc() -> str:
    "The jemalloc shared library in Ray's wheel."
    import ray
    return str(Path(ray.__file__).parent / 'core' / 'libjemalloc.so')


def run(args, world, compact, env=None):
    import torch.multiprocessing as mp
    from sft_nb.workers import free_port
    ctx, port = mp.get_context('spawn'), free_port()
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, compact, q)) for r in range(world)]
    before = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # a spawned rank starts with this environment (LD_PRELOAD must be there at exec)
    try:
        for p in procs: p.start()
    finally:
        for k, v in before.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v
    got = dict(q.get(timeout=1800) for _ in procs)
    for p in procs: p.join(60)
    return [got[r] for r in range(world)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--model', default='smollm2'); ap.add_argument('--ranks', type=int, default=2)
    ap.add_argument('--ac', default='full'); ap.add_argument('--length', type=int, default=1024)
    ap.add_argument('--jemalloc-conf', default='background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0',
                    help="jemalloc's MALLOC_CONF for the jemalloc arm ('' to skip that arm)")
    a = ap.parse_args()
    os.environ['OMP_NUM_THREADS'] = '1'
    args = ['data.train=[{path: "sft_nb:identity"}]', f'model.path={a.model}', f'model.activation_checkpointing={a.ac}',
            f'tokenize.max_length={a.length}', 'train.micro_batch_size=2', f'placement.workers_per_node={a.ranks}',
            f'train.global_batch_size={2 * a.ranks}', 'checkpoint.export_hf=false', 'logging.trackers=[jsonl]']
    print(f"load avg {os.getloadavg()[0]:.1f}; {a.model}, {a.ranks} gloo ranks, AC {a.ac}, 2 rows of {a.length} tokens; GiB")
    print(f"{'malloc':<22}{'rank':>5}{'held':>8}{'peak':>8}{'live':>8}{'step s':>8}")
    res = {}
    arms = [('glibc default', False, None), ('compact_malloc 1 MiB', True, None)]
    if a.jemalloc_conf: arms.append(('jemalloc', False, {'LD_PRELOAD': jemalloc(), 'MALLOC_CONF': a.jemalloc_conf}))
    for name, compact, env in arms:
        res[name] = run(args, a.ranks, compact, env)
        for r, x in enumerate(res[name]):
            print(f"{name:<22}{r:>5}{x['held'] / 2**30:>8.2f}{x['peak'] / 2**30:>8.2f}{x['live'] / 2**30:>8.2f}{x['step_s']:>8.1f}", flush=True)
    g = res['glibc default']
    mx = lambda xs, k: max(x[k] for x in xs)
    for name in list(res)[1:]:
        c = res[name]
        print(f"{name} / default: peak {mx(c, 'peak') / mx(g, 'peak'):.2f}, held {mx(c, 'held') / mx(g, 'held'):.2f}, "
              f"step time {mx(c, 'step_s') / mx(g, 'step_s'):.2f}")


if __name__ == '__main__': main()
