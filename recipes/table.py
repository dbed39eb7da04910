"""The README's table of the recipes' estimates: each recipe as configured, on the GPUs its name says.

    python recipes/table.py > build/recipes_table.md

`sft_nb.memory.fit_levers` on each recipe (config.json alone, nothing downloaded): the per-rank peak on rows of its
`tokenize.max_length`, the longest row the same settings hold, and whether it fits.
"""
import sys, time
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]
from sft_nb.config import load_config
from sft_nb.memory import fit_levers

ROOT = Path(__file__).resolve().parent
GPU = {'qlora-24gb': 24, 'lora-80gb': 80, 'full-8x80gb': 80}


def main():
    t0 = time.perf_counter()
    print('| recipe | ranks x GiB | rows of | per-rank peak (GiB) | longest row (tokens) | fits |\n|---|---|---:|---:|---:|---|')
    for f in sorted(ROOT.glob('*/*.yaml')):
        cfg = load_config(str(f.relative_to(ROOT.parent)))
        gpus, mem = cfg.placement.workers_per_node, GPU[f.stem]
        (r,) = fit_levers(cfg, gpus=gpus, gpu_memory=mem, others=False)['rows']
        t = r['longest_row']
        row = 'any' if t == float('inf') else f"{t:,}" + (' (the model\'s limit)' if r['at_limit'] else '')
        print(f"| `{f.relative_to(ROOT.parent)}` | {gpus} x {mem} | {cfg.tokenize.max_length:,} | {r['peak'] / 2**30:.1f} "
              f"| {row} | {'yes' if r['fits'] else '**no**'} |", flush=True)
    print(f"\n<!-- {time.perf_counter() - t0:.0f} s -->")


if __name__ == '__main__': main()
