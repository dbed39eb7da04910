"""Long rows with Ulysses sequence parallelism (issue 28): peak memory per worker of one training step on one packed
row of `--length` tokens with sp=1 and sp=SP, SmolLM2-135M, activation checkpointing on, CPU gloo (no Ray: spawned
processes, one per rank). Every run has `--world` ranks (default SP), so FSDP shards weights, gradients and optimizer
state the same way and only sp differs: sp=1 is dp=world (each rank a whole row), sp=SP is dp=world/SP (every replica's
rank 1/SP of the row). Also the loss of that step (sp=SP must equal sp=1 within fp32 rounding) and, with `--cap`, the
longest row of `--lengths` whose step peak (VmHWM of every rank) stays under a per-worker cap for each sp of `--sps`;
a ladder stops at its first length over the cap (longer ones need more).

SmolLM2-135M has 9 attention heads (3 KV heads): sp must divide 9, so the sequence-parallel run uses sp=3.

    HF_HUB_OFFLINE=1 python bench/long_rows.py --length 3072                                          # sp=1 vs sp=3 at one length
    HF_HUB_OFFLINE=1 python bench/long_rows.py --length 0 --sps 1 --lengths 2048,2560,3072 --cap 3.0e9   # the ladder, sp=1
    HF_HUB_OFFLINE=1 python bench/long_rows.py --length 0 --sps 3 --lengths 3072,4096,5120,6144 --cap 3.0e9   # and sp=3

The peak is the kernel's VmHWM of each rank's process over the step (reset just before it), so it includes the model,
gradients and allocator slack; "step adds" is that peak minus the RSS just before the step.
"""
import argparse, json, sys, time
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
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
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.memory import reset_peak_memory, rank_memory
    from sft_nb.config import ModelConfig, OptimConfig
    w = FSDPWorker(r, world, ModelConfig(path='smollm2', activation_checkpointing='full'), OptimConfig(),
                   total_steps=1, placement={'sequence_parallel': sp})
    w.init_dist('127.0.0.1', port)
    try:
        w.setup()
        mb, n = row(length, w.model.config.vocab_size)
        before = rank_memory()['rss']
        reset_peak_memory()
        t = time.perf_counter()
        res = w.forward_backward([mb], n * (world // sp))  # every replica trains the same row
        out.put({'rank': r, 'peak': rank_memory()['peak'], 'before': before, 'loss': res['nll_sum'] / res['weight_sum'],
                 'n_trained': res['weight_sum'], 'seconds': time.perf_counter() - t})
    finally: w.shutdown()


def measure(sp: int, length: int, world: int) -> list[dict]:
    from sft_nb.workers import free_port
    ctx, port = mp.get_context('spawn'), free_port()
    out = ctx.Queue()
    ps = [ctx.Process(target=rank, args=(r, world, sp, port, length, out)) for r in range(world)]
    for p in ps: p.start()
    got = sorted((out.get(timeout=900) for _ in ps), key=lambda d: d['rank'])
    for p in ps: p.join(timeout=60)
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--length', type=int, default=2048, help='tokens in the row for the fixed-length comparison')
    ap.add_argument('--sp', type=int, default=3, help='sequence-parallel size to compare with 1 (must divide 9 for SmolLM2)')
    ap.add_argument('--world', type=int, default=0, help='ranks of every run (default: --sp)')
    ap.add_argument('--sps', default='', help='comma-separated sp sizes for the --cap ladder (default: 1 and --sp)')
    ap.add_argument('--lengths', default='', help='comma-separated row lengths to search with --cap, shortest first')
    ap.add_argument('--cap', type=float, default=0, help='per-worker cap in bytes on the step peak (VmHWM)')
    a = ap.parse_args()
    torch.set_num_threads(1)
    world = a.world or a.sp
    if a.length: fixed(a, world)
    if a.cap and a.lengths:
        for sp in map(int, a.sps.split(',')) if a.sps else (1, a.sp):
            fits = []
            for L in map(int, a.lengths.split(',')):
                rs = measure(sp, L, world)
                peak = max(d['peak'] for d in rs)
                print(f"sp={sp} world={world} length {L}: max peak RSS per worker {peak / 1e9:.3f} GB (step adds up to "
                      f"{max(d['peak'] - d['before'] for d in rs) / 1e9:.3f} GB), loss {rs[0]['loss']:.8f}, {rs[0]['seconds']:.0f} s", flush=True)
                if peak > a.cap: break
                fits.append(L)
            print(f"sp={sp}: longest row under {a.cap / 1e9:.2f} GB per worker among {a.lengths}: {max(fits) if fits else 'none'}", flush=True)


def fixed(a, world: int):
    "sp=1 vs sp=SP on one row of `--length` tokens: peak RSS per worker, what the step adds, the loss."
    res = {sp: measure(sp, a.length, world) for sp in (1, a.sp)}
    print(f"SmolLM2-135M, activation checkpointing full, one packed row of {a.length} tokens (4 documents), CPU fp32, {world} ranks")
    print(f"{'sp':>3} {'rank':>4} {'peak RSS GB':>12} {'step peak - before GB':>22} {'loss':>12} {'n_trained':>9} {'s':>6}")
    for sp, rs in res.items():
        for d in rs: print(f"{sp:>3} {d['rank']:>4} {d['peak'] / 1e9:>12.3f} {(d['peak'] - d['before']) / 1e9:>22.3f} {d['loss']:>12.6f} {d['n_trained']:>9} {d['seconds']:>6.1f}")
    l1, l2 = res[1][0]['loss'], res[a.sp][0]['loss']
    print(f"loss sp={a.sp} vs sp=1: relative gap {abs(l2 - l1) / abs(l1):.1e}; max peak per worker sp=1 {max(d['peak'] for d in res[1]) / 1e9:.3f} GB, "
          f"sp={a.sp} {max(d['peak'] for d in res[a.sp]) / 1e9:.3f} GB", flush=True)


if __name__ == '__main__':
    main()
