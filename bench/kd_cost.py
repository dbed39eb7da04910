"""The cost of a step of online distillation (`train.loss: kd`) against plain SFT (`train.loss: nll`) on the same worker
and batch: SmolLM2-135M-Instruct distilled from itself (a teacher of the student's size and tokenizer), side by side.

    python bench/kd_cost.py                         # 4 packed rows x 512 tokens of alpaca_en_demo, 5 timed steps each
    python bench/kd_cost.py --model tiny --teacher tiny --rows 8 --capacity 256

One in-process FSDP worker (1 rank, fp32, sdpa, the chunked head at the default `model.loss_chunk`) with the teacher
loaded; the two objectives alternate step by step on the same batch (`w.tcfg` switched between them), after one untimed
warm-up step of each, so a change of the machine's load hits both alike. Reported: the median seconds of
`forward_backward` for each and their ratio (the teacher's forward and the chunked divergence are the difference).
"""
import os, sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
os.environ.setdefault('HF_HUB_OFFLINE', '1'); os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
os.environ.setdefault('TRANSFORMERS_VERBOSITY', 'error')
import argparse, json, statistics, time

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def batch(*args):
    "bench/loss_memory.py's packed alpaca rows (loaded by path: bench/ on sys.path would shadow the stdlib's tokenize)."
    import importlib.util
    spec = importlib.util.spec_from_file_location('loss_memory', ROOT / 'bench' / 'loss_memory.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod.batch(*args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--model', default='smollm2', choices=['smollm2', 'tiny'])
    ap.add_argument('--teacher', default='smollm2', help="train.teacher ('smollm2', 'tiny' or a folder)")
    ap.add_argument('--rows', type=int, default=4)
    ap.add_argument('--capacity', type=int, default=512)
    ap.add_argument('--steps', type=int, default=5)
    ap.add_argument('--threads', type=int, default=2)
    ap.add_argument('--json', default=None)
    args = ap.parse_args(argv)
    import torch
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import ModelConfig, OptimConfig, TrainConfig
    from sft_nb.models import smollm2_instruct, tiny_chat_model
    from sft_nb.workers import free_port
    torch.set_num_threads(args.threads)
    folder = {'smollm2': smollm2_instruct, 'tiny': tiny_chat_model}[args.model]()
    mb, capacity = batch(folder, args.rows, args.capacity, args.model)
    kd = TrainConfig(loss='kd', teacher=args.teacher)
    w = FSDPWorker(0, 1, ModelConfig(path=str(folder), attn_implementation='sdpa'), OptimConfig(), total_steps=1, train=kd)
    w.init_dist('127.0.0.1', free_port())
    try:
        w.setup()
        n = int(mb['n_trained'])
        arms = {'nll': TrainConfig(), 'kd': kd}
        times, losses = {k: [] for k in arms}, {}
        for step in range(args.steps + 1):
            for name, cfg in arms.items():
                w.tcfg = cfg
                w.opt.zero_grad(set_to_none=True)
                t = time.perf_counter()
                r = w.forward_backward([mb], n)
                if step: times[name].append(time.perf_counter() - t)  # step 0: warm-up
                losses[name] = r['nll_sum'] / n
        w.opt.zero_grad(set_to_none=True)
    finally: w.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {'model': args.model, 'teacher': args.teacher, 'rows': args.rows, 'capacity': capacity, 'n_trained': n,
           'threads': args.threads, 'steps': args.steps, 'median_s': med, 'all_s': times, 'kd_over_nll': med['kd'] / med['nll'],
           'loss': losses, 'load_avg': os.getloadavg()}
    print(json.dumps(out, indent=1))
    if args.json: Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == '__main__':
    main()
