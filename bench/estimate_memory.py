"""The estimate (`sft_nb.memory.estimate`, fake tensors + fake process group + FSDPMemTracker) against the real CPU dry run
(`sft_nb.memory.measure_step`, what `SFTTrainer.dry_run(full_length=True)` runs on each worker: one step on rows of
`tokenize.max_length` tokens, peak VmHWM less its snapshot), side by side for the configurations that run on this
machine; prints rank 0's peaks and estimate / dry run. Both step on the same rows (`estimate_batch` without data: the estimate is
given `data=False`, else it would step on the data's own longest rows), as a later step does (`warm_optimizer`).

    python bench/estimate_memory.py [--cases tiny-1,tiny-2-full,...]

Each estimate runs in its own process (a fake process group per process). The dry runs are N spawned gloo processes (no
Ray cluster: on a loaded 2-core machine Ray's start times out), each importing Ray first as a Ray actor has it.
"""
import sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
import argparse, json, os, subprocess

# name: (model, ranks, overrides)
CASES = {
    'tiny-1': ('tiny', 1, []), 'tiny-2': ('tiny', 2, []), 'tiny-3': ('tiny', 3, []),
    'tiny-2-full': ('tiny', 2, ['model.activation_checkpointing=full']),
    'tiny-2-packed': ('tiny', 2, ['packing.enabled=true']),
    'tiny-2-sp2': ('tiny', 2, ['placement.sequence_parallel=2']),
    'smollm2-1': ('smollm2', 1, []), 'smollm2-1-full': ('smollm2', 1, ['model.activation_checkpointing=full']),
    'smollm2-2-full': ('smollm2', 2, ['model.activation_checkpointing=full']),
    'smollm2-2-packed-full': ('smollm2', 2, ['model.activation_checkpointing=full', 'packing.enabled=true']),
    'smollm2-3-sp3-full': ('smollm2', 3, ['model.activation_checkpointing=full', 'placement.sequence_parallel=3']),
    '310m-2-full': ('310m', 2, ['model.activation_checkpointing=full']),
}
BASE = ['data.train=[{path: "sft_nb:identity"}]', 'tokenize.max_length=1024', 'train.micro_batch_size=2', 'train.num_steps=1', 'checkpoint.export_hf=false', 'logging.trackers=[jsonl]']


def args(model, ranks, over) -> list[str]:
    "The case's config overrides: one micro-batch of 2 rows on each of `ranks` workers."
    return BASE + [f'model.path={model}', f'placement.workers_per_node={ranks}', f'train.global_batch_size={2 * ranks}'] + over


def estimate_peak(model, ranks, over) -> int:
    code = ("import json,sys; from sft_nb.config import load_config; from sft_nb.memory import estimate; "
            f"p = estimate(load_config(None, {args(model, ranks, over)!r}), gpus={ranks}, device='cpu', data=False); "
            "print(json.dumps({'peak': p['ranks'][0]['peak'], 'parts': p['ranks'][0]['parts'], 's': p['estimate_s']}))")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    if out.returncode: raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _dry_rank(rank, world, port, args, q):
    import ray  # noqa: F401  (a worker is a Ray actor: its runtime has Ray loaded)
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import load_config
    from sft_nb.memory import measure_step, estimate_batch
    cfg = load_config(None, args)
    w = FSDPWorker(rank, world, cfg.model, cfg.optim, total_steps=1, placement=cfg.placement)
    w.init_dist('127.0.0.1', port); w.setup()
    mb = estimate_batch(cfg, w.model.config.get_text_config().vocab_size)
    q.put((rank, measure_step(w, mb)['peak'], tuple(mb['input_ids'].shape)))
    w.shutdown()


def dry_peak(model, ranks, over):
    import torch.multiprocessing as mp
    from sft_nb.workers import free_port
    ctx, port = mp.get_context('spawn'), free_port()
    q = ctx.Queue()
    procs = [ctx.Process(target=_dry_rank, args=(r, ranks, port, args(model, ranks, over), q)) for r in range(ranks)]
    for p in procs: p.start()
    got = sorted(q.get(timeout=900) for _ in procs)
    for p in procs: p.join(60)
    return got[0][1], got[0][2]


def model_310m() -> str:
    "bench/load_memory.py's random ~310M Qwen2 (1.13 GiB of fp32 weights, tied), saved once under build/."
    import importlib.util
    d = Path(__file__).resolve().parent.parent / 'build' / 'qwen2-310m'
    if not (d / 'config.json').exists():
        spec = importlib.util.spec_from_file_location('load_memory', Path(__file__).with_name('load_memory.py'))
        lm = importlib.util.module_from_spec(spec); spec.loader.exec_module(lm)
        d.mkdir(parents=True, exist_ok=True); lm.build_model(d, 24)
    return str(d)


def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--cases', default=','.join(CASES))
    a = ap.parse_args()
    paths = {'310m': model_310m()} if any(CASES[c][0] == '310m' for c in a.cases.split(',')) else {}
    print(f"load avg {os.getloadavg()[0]:.1f}; rank 0 peak in GiB; rows of 1024 tokens, micro-batch 2")
    print(f"{'case':<16}{'ranks':>6}{'dry run':>9}{'est.':>7}{'est/dry':>9}{'est. s':>8}  estimate parts (GiB)")
    for name in a.cases.split(','):
        model, ranks, over = CASES[name]
        model = paths.get(model, model)
        d, shape = dry_peak(model, ranks, over)
        p = estimate_peak(model, ranks, over)
        parts = ' '.join(f"{k} {v / 2**30:.2f}" for k, v in p['parts'].items())
        print(f"{name:<16}{ranks:>6}{d / 2**30:>9.2f}{p['peak'] / 2**30:>7.2f}{p['peak'] / d:>9.2f}{p['s']:>8.1f}  {parts}", flush=True)


if __name__ == '__main__': main()
