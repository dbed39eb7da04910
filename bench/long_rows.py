"""Long rows with Ulysses sequence parallelism (issue 28): peak memory per worker of one training step on one packed
row of `--length` tokens with sp=1 and sp=SP, SmolLM2-135M, activation checkpointing on, CPU gloo (no Ray: spawned
processes, one per rank). Also the loss of that step (sp=SP must equal sp=1 within fp32 rounding) and, with `--cap`,
the longest row of `--lengths` whose step peak stays under a per-worker cap for each sp.

SmolLM2-135M has 9 attention heads (3 KV heads): sp must divide 9, so the sequence-parallel run uses sp=3.

    HF_HUB_OFFLINE=1 python bench/long_rows.py --length 2048
    HF_HUB_OFFLINE=1 python bench/long_rows.py --lengths 1024,2048,3072 --cap 3.0e9
"""
import argparse, json, sys, time
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
from dataclasses import asdict
import torch
import torch.multiprocessing as mp


def row(length: int, vocab: int, docs: int = 4, seed: int = 0) -> dict:
    "One packed row of `docs` random-id documents, every next token trained."
    from sft_nb.collate import collate_packed
    g = torch.Generator().manual_seed(seed)
    cuts = [length // docs] * (docs - 1) + [length - (length // docs) * (docs - 1)]
    exs = [{'input_ids': torch.randint(0, vocab, (n,), generator=g).tolist(), 'loss_mask': [0] + [1] * (n - 1)} for n in cuts]
    b = collate_packed([exs], pad_id=0)
    n = b['n_trained']
    for k in ('n_trained', 'n_real', 'seq_lens', 'cu_seqlens'): b.pop(k, None)
    return b, n


def rank(r, world, sp, port, length, out):
    from sft_nb.backends.fsdp import FSDPWorker, reset_peak_memory, rank_memory
    from sft_nb.config import ModelConfig, OptimConfig
    w = FSDPWorker(r, world, asdict(ModelConfig(path='smollm2', activation_checkpointing='full')), asdict(OptimConfig()),
                   total_steps=1, placement={'sequence_parallel': sp})
    w.init_dist('127.0.0.1', port)
    try:
        w.setup()
        mb, n = row(length, w.model.config.vocab_size)
        before = rank_memory()['rss']
        reset_peak_memory()
        t = time.perf_counter()
        res = w.forward_backward([mb], n)
        out.put({'rank': r, 'peak': rank_memory()['peak'], 'before': before, 'loss': res['nll_sum'] / res['weight_sum'],
                 'n_trained': res['weight_sum'], 'seconds': time.perf_counter() - t})
    finally: w.shutdown()


def measure(sp: int, length: int) -> list[dict]:
    from sft_nb.workers import free_port
    ctx, port = mp.get_context('spawn'), free_port()
    out = ctx.Queue()
    ps = [ctx.Process(target=rank, args=(r, sp, sp, port, length, out)) for r in range(sp)]
    for p in ps: p.start()
    got = sorted((out.get(timeout=900) for _ in ps), key=lambda d: d['rank'])
    for p in ps: p.join(timeout=60)
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--length', type=int, default=2048, help='tokens in the row for the fixed-length comparison')
    ap.add_argument('--sp', type=int, default=3, help='sequence-parallel size to compare with 1 (must divide 9 for SmolLM2)')
    ap.add_argument('--lengths', default='', help='comma-separated row lengths to search with --cap')
    ap.add_argument('--cap', type=float, default=0, help='per-worker cap in bytes on the step peak (VmHWM)')
    a = ap.parse_args()
    torch.set_num_threads(1)
    res = {sp: measure(sp, a.length) for sp in (1, a.sp)}
    print(f"SmolLM2-135M, activation checkpointing full, one packed row of {a.length} tokens (4 documents), CPU fp32")
    print(f"{'sp':>3} {'rank':>4} {'peak RSS GB':>12} {'step peak - before GB':>22} {'loss':>12} {'n_trained':>9} {'s':>6}")
    for sp, rs in res.items():
        for d in rs: print(f"{sp:>3} {d['rank']:>4} {d['peak'] / 1e9:>12.3f} {(d['peak'] - d['before']) / 1e9:>22.3f} {d['loss']:>12.6f} {d['n_trained']:>9} {d['seconds']:>6.1f}")
    l1, l2 = res[1][0]['loss'], res[a.sp][0]['loss']
    print(f"loss sp={a.sp} vs sp=1: relative gap {abs(l2 - l1) / abs(l1):.1e}; max peak per worker sp=1 {max(d['peak'] for d in res[1]) / 1e9:.3f} GB, "
          f"sp={a.sp} {max(d['peak'] for d in res[a.sp]) / 1e9:.3f} GB")
    if a.cap and a.lengths:
        for sp in (1, a.sp):
            fits = [L for L in map(int, a.lengths.split(',')) if max(d['peak'] for d in measure(sp, L)) <= a.cap]
            print(f"sp={sp}: longest row under {a.cap / 1e9:.2f} GB per worker among {a.lengths}: {max(fits) if fits else 'none'}")


if __name__ == '__main__':
    main()
