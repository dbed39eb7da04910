"""The cost of a step of distillation (`train.loss: kd`) against plain SFT (`train.loss: nll`) on the same worker and
batch, online (the teacher in memory) and offline (`train.teacher_cache`: the teacher's stored top-k), side by side:
SmolLM2-135M-Instruct distilled from itself (a teacher of the student's size and tokenizer); and the cache's cost:
seconds to write it and bytes per trained target.

    python bench/kd_cost.py                         # 4 packed rows x 512 tokens of alpaca_en_demo, 5 timed steps each
    python bench/kd_cost.py --model tiny --teacher tiny --rows 8 --capacity 256

First `sft_nb.loss.write_teacher_topk` (what `sft-nb teacher-topk` runs) writes the teacher's top `--k` over the first
`--cache-rows` rows of alpaca_en_demo (timed; its files' bytes on disk ÷ trained targets). Then one in-process FSDP
worker (1 rank, fp32, sdpa, the chunked head at the default `model.loss_chunk`) with the teacher loaded trains the
`--rows` fullest packed rows of those (each row's targets carrying its top-k from the cache, through `collate_packed`)
with three objectives that alternate step by step on the same batch (`w.tcfg` switched between them; the offline arm
with the worker's teacher set aside, as a `train.teacher_cache` run has none), after one untimed warm-up step of each,
so a change of the machine's load hits all alike. Reported: the median seconds of `forward_backward` of each and their
ratios.
"""
import os, sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
os.environ.setdefault('HF_HUB_OFFLINE', '1'); os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
os.environ.setdefault('TRANSFORMERS_VERBOSITY', 'error')
import argparse, json, statistics, tempfile, time

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = str(ROOT.parent / 'shared' / 'datasets' / 'alpaca_en_demo.json')


def write_cache(folder, teacher, args, capacity, out):
    "The teacher's top-k over the first `args.cache_rows` rows, as `sft-nb teacher-topk` writes it: (meta, seconds, bytes)."
    from sft_nb.config import load_config
    from sft_nb.loss import write_teacher_topk
    cfg = load_config({'model': {'path': str(folder)}, 'data': {'train': [{'path': DATA, 'max_rows': args.cache_rows}]},
                       'tokenize': {'mode': 'all_assistant', 'max_length': capacity, 'truncation': 'drop'},
                       'train': {'loss': 'kd', 'teacher': teacher}})
    t = time.perf_counter()
    meta = write_teacher_topk(cfg, out, k=args.k, batch_size=args.cache_batch)
    return cfg, meta, time.perf_counter() - t, sum(f.stat().st_size for f in Path(out).iterdir())


def batch_with_topk(cfg, folder, rows: int, capacity: int, cache):
    """The `rows` fullest packed rows of the cache's train set (bench/loss_memory.py's batch), each example with its
    targets' top-k (`TopKCache.row`)."""
    from transformers import AutoTokenizer
    from sft_nb.collate import collate_packed
    from sft_nb.packing import plan_bins
    from sft_nb.tokenize import tokenize_dataset
    import datasets; datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(folder)
    ds, _ = tokenize_dataset(cfg.data.train[0], tok, cfg.tokenize)  # the rows the cache was written for, in its order
    exs = [{'input_ids': list(r['input_ids']), 'loss_mask': list(r['loss_mask'])} | cache.row(0, i)
           for i, r in enumerate(ds.select_columns(['input_ids', 'loss_mask']))]
    bins = sorted(plan_bins([len(e['input_ids']) for e in exs], capacity),
                  key=lambda b: -sum(len(exs[i]['input_ids']) for i in b))[:rows]
    return collate_packed([[exs[i] for i in b] for b in bins], tok.pad_token_id, capacity)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--model', default='smollm2', choices=['smollm2', 'tiny'])
    ap.add_argument('--teacher', default='smollm2', help="train.teacher ('smollm2', 'tiny' or a folder)")
    ap.add_argument('--rows', type=int, default=4)
    ap.add_argument('--capacity', type=int, default=512)
    ap.add_argument('--steps', type=int, default=5)
    ap.add_argument('--threads', type=int, default=2)
    ap.add_argument('--k', type=int, default=64, help='tokens kept per trained target in the cache')
    ap.add_argument('--cache-rows', type=int, default=64, help='rows of alpaca_en_demo the cache is written for')
    ap.add_argument('--cache-batch', type=int, default=8, help='rows per teacher forward when writing the cache')
    ap.add_argument('--json', default=None)
    args = ap.parse_args(argv)
    import torch
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import ModelConfig, OptimConfig, TrainConfig
    from sft_nb.models import resolve_model_path
    from sft_nb.topk import TopKCache
    from sft_nb.workers import free_port
    torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.model)
    capacity = min(args.capacity, 256) if args.model == 'tiny' else args.capacity  # tiny smoke run: short rows
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / 'topk'
        cfg, meta, write_s, nbytes = write_cache(folder, args.teacher, args, capacity, out)
        n_cache = sum(s['targets'] for s in meta['sets'])
        mb = batch_with_topk(cfg, folder, args.rows, capacity, TopKCache(out, meta))
    kd = TrainConfig(loss='kd', teacher=args.teacher)
    arms = {'nll': TrainConfig(), 'kd_online': kd, 'kd_topk': TrainConfig(loss='kd', teacher=args.teacher, teacher_cache='bench')}
    w = FSDPWorker(0, 1, ModelConfig(path=str(folder), attn_implementation='sdpa'), OptimConfig(), total_steps=1, train=kd)
    w.init_dist('127.0.0.1', free_port())
    try:
        w.setup()
        teacher, n = w.teacher, int(mb['n_trained'])
        times, losses = {k: [] for k in arms}, {}
        for step in range(args.steps + 1):
            for name, c in arms.items():
                w.tcfg, w.teacher = c, (None if c.teacher_cache else teacher)
                w.opt.zero_grad(set_to_none=True)
                t = time.perf_counter()
                r = w.forward_backward([mb], n)
                if step: times[name].append(time.perf_counter() - t)  # step 0: warm-up
                losses[name] = r['nll_sum'] / n
        w.opt.zero_grad(set_to_none=True)
    finally: w.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {'model': args.model, 'teacher': args.teacher, 'rows': args.rows, 'capacity': capacity, 'n_trained': n,
           'threads': args.threads, 'steps': args.steps, 'k': meta['k'], 'median_s': med, 'all_s': times,
           'kd_online_over_nll': med['kd_online'] / med['nll'], 'kd_topk_over_nll': med['kd_topk'] / med['nll'],
           'kd_topk_over_kd_online': med['kd_topk'] / med['kd_online'], 'loss': losses,
           'cache': {'rows': args.cache_rows, 'targets': n_cache, 'write_s': write_s,
                     'write_ms_per_1k_targets': 1e3 * write_s / max(1, n_cache) * 1e3, 'bytes': nbytes,
                     'bytes_per_target': nbytes / max(1, n_cache)},
           'load_avg_before': load_before, 'load_avg_after': os.getloadavg()}
    print(json.dumps(res, indent=1))
    if args.json: Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == '__main__':
    main()
