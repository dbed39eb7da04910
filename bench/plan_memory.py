"""The plan (`sft_nb.plan.plan`, fake tensors + fake process group + FSDPMemTracker) against the real CPU dry run
(`SFTTrainer.dry_run(full_length=True)`: one step per Ray worker on rows of `tokenize.max_length` tokens, peak VmHWM),
side by side for the configurations that run on this machine; prints each rank-0 peak and plan / dry run.

    python bench/plan_memory.py [--cases tiny-1,tiny-2-full,...]

Each plan runs in its own process (a fake process group per process); the dry runs share one local Ray cluster.
"""
import sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
import argparse, json, os, subprocess, tempfile

# name: (model, ranks, overrides)
CASES = {
    'tiny-1': ('tiny', 1, []), 'tiny-2': ('tiny', 2, []), 'tiny-3': ('tiny', 3, []),
    'tiny-2-full': ('tiny', 2, ['model.activation_checkpointing=full']),
    'tiny-2-packed': ('tiny', 2, ['packing.enabled=true']),
    'smollm2-1': ('smollm2', 1, []), 'smollm2-2-full': ('smollm2', 2, ['model.activation_checkpointing=full']),
}
BASE = ['data.train=[{path: "sft_nb:identity"}]', 'tokenize.max_length=1024', 'train.micro_batch_size=2', 'train.global_batch_size=8',
        'train.num_steps=1', 'checkpoint.export_hf=false', 'logging.trackers=[jsonl]']


def plan_peak(model, ranks, over) -> int:
    code = ("import json,sys; from sft_nb.config import load_config; from sft_nb.plan import plan; "
            f"p = plan(load_config(None, {BASE + [f'model.path={model}'] + over!r}), gpus={ranks}, device='cpu'); "
            "print(json.dumps({'peak': p['ranks'][0]['peak'], 'parts': p['ranks'][0]['parts'], 's': p['plan_s']}))")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    if out.returncode: raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def dry_peak(model, ranks, over, run_dir) -> int:
    from sft_nb.config import load_config
    from sft_nb.trainer import SFTTrainer
    cfg = load_config(None, BASE + [f'model.path={model}', f'placement.workers_per_node={ranks}', f'checkpoint.run_dir={run_dir}',
                                    f'tokenize.cache_dir={run_dir}/cache'] + over)
    with SFTTrainer(cfg) as t: r = t.dry_run(full_length=True)
    return r['ranks'][0]['peak'], r['shape']


def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--cases', default=','.join(CASES))
    a = ap.parse_args()
    import ray
    from sft_nb.workers import init_ray
    init_ray(num_cpus=4, object_store_memory=256 * 1024**2)
    print(f"load avg {os.getloadavg()[0]:.1f}; rank 0 peak in GiB; rows of 1024 tokens, micro-batch 2")
    print(f"{'case':<16}{'ranks':>6}{'dry run':>9}{'plan':>7}{'plan/dry':>9}{'plan s':>8}  plan parts (GiB)")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in a.cases.split(','):
                model, ranks, over = CASES[name]
                d, shape = dry_peak(model, ranks, over, Path(tmp) / name)
                p = plan_peak(model, ranks, over)
                parts = ' '.join(f"{k} {v / 2**30:.2f}" for k, v in p['parts'].items())
                print(f"{name:<16}{ranks:>6}{d / 2**30:>9.2f}{p['peak'] / 2**30:>7.2f}{p['peak'] / d:>9.2f}{p['s']:>8.1f}  {parts}", flush=True)
    finally: ray.shutdown()


if __name__ == '__main__': main()
