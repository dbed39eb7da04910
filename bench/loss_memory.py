"""Peak CPU memory of one forward + backward of SmolLM2-135M-Instruct on 8 packed rows of 1024 tokens, with the one-shot
LM head + cross-entropy (`model.loss_chunk: 0`) and the chunked one (`model.loss_chunk: 2048`, the default), side by side.

    python bench/loss_memory.py                                  # loss_chunk 0 vs 2048 vs 512, gradient checkpointing on
    python bench/loss_memory.py --chunks 0,2048 --no-gradient-checkpointing --threads 2

Each variant runs in its own subprocess (`--child`): it builds the FSDP worker in-process (1 rank, fp32, sdpa), collates
the batch, runs one untimed warm-up step on a small batch, then resets the kernel's peak-RSS counter
(`echo 5 > /proc/self/clear_refs`) and reads `VmHWM` from /proc/self/status after `forward_backward` on the full batch.
"step peak" is that high-water mark minus the resident memory just before the step (weights, gradients of the warm-up
step freed, Python). torch has no CPU allocator statistics (its CPU allocator does not cache), and tracemalloc does not
see tensor storage, so peak RSS of a fresh process per variant is the measure; glibc's `malloc_trim` runs before the reset.
Batch: alpaca_en_demo rows tokenized by sft_nb (all assistant turns, max_length 1024) packed best-fit-decreasing into rows of
1024, the 8 fullest rows. The trained tokens of those rows set the size of the one-shot logits: n_trained × 49,152 × 4 B.
"""
import os, sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
os.environ.setdefault('HF_HUB_OFFLINE', '1'); os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
os.environ.setdefault('TRANSFORMERS_VERBOSITY', 'error')
import argparse, json, subprocess, time

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / 'shared'  # the development data beside the checkout
DATA = str(SHARED / 'datasets' / 'alpaca_en_demo.json')


def status_kb(key):
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith(key + ':'): return int(line.split()[1])


def batch(folder, rows, capacity, model_name):
    from transformers import AutoTokenizer
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    from sft_nb.packing import plan_bins
    from sft_nb.collate import collate_packed
    import datasets; datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(folder)
    if model_name == 'tiny':  # tiny smoke run: short rows
        capacity = min(capacity, 256)
    ds, _ = tokenize_dataset(DATA, tok, TokenizeConfig(mode='all_assistant', max_length=capacity, truncation='drop'))
    exs = [{'input_ids': list(r['input_ids']), 'loss_mask': list(r['loss_mask'])} for r in ds.select_columns(['input_ids', 'loss_mask'])]
    bins = sorted(plan_bins([len(e['input_ids']) for e in exs], capacity), key=lambda b: -sum(len(exs[i]['input_ids']) for i in b))[:rows]
    return collate_packed([[exs[i] for i in b] for b in bins], tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                          capacity), capacity


def child(args):
    import ctypes, torch
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import ModelConfig, OptimConfig
    from sft_nb.models import smollm2_instruct, tiny_chat_model
    from sft_nb.workers import free_port
    torch.set_num_threads(args.threads)
    folder = {'smollm2': smollm2_instruct, 'tiny': tiny_chat_model}[args.model]()
    mb, capacity = batch(folder, args.rows, args.capacity, args.model)
    mcfg = ModelConfig(path=str(folder), loss_chunk=args.child_chunk, attn_implementation='sdpa',
                              activation_checkpointing='full' if args.gradient_checkpointing else 'none')
    w = FSDPWorker(0, 1, mcfg, OptimConfig(lr=1e-5), total_steps=10)
    w.init_dist('127.0.0.1', free_port(), threads=args.threads)
    w.setup()
    small = {k: (v[:1, :64] if isinstance(v, torch.Tensor) and v.dim() == 2 else v) for k, v in mb.items()}
    small['attention_mask'] = mb['attention_mask'][:1, :, :64, :64]
    w.forward_backward([small], 1)  # warm-up: lazy inits and the gradient buffers exist before the measured step
    w.opt.zero_grad(set_to_none=False)
    ctypes.CDLL('libc.so.6').malloc_trim(0)
    before = status_kb('VmRSS')
    Path('/proc/self/clear_refs').write_text('5')  # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    r = w.forward_backward([mb], mb['n_trained'])
    dt = time.perf_counter() - t0
    peak = status_kb('VmHWM')
    print(json.dumps({'loss_chunk': args.child_chunk, 'rows': int(mb['input_ids'].shape[0]), 'capacity': capacity,
                      'real_tokens': int(mb['attention_mask'].shape[0] and sum(map(sum, mb['seq_lens']))), 'n_trained': r['n_real'],
                      'loss': r['nll_sum'] / max(1, r['n_real']), 'rss_before_gb': before / 2**20, 'peak_gb': peak / 2**20,
                      'step_peak_gb': (peak - before) / 2**20, 'step_s': dt,
                      'vocab': int(w.model.get_output_embeddings().weight.shape[0])}))
    w.shutdown()


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default='smollm2', choices=('smollm2', 'tiny'))
    p.add_argument('--chunks', default='0,2048,512', help='comma list of model.loss_chunk values (0 = one-shot)')
    p.add_argument('--rows', type=int, default=8)
    p.add_argument('--capacity', type=int, default=1024)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--gradient-checkpointing', action=argparse.BooleanOptionalAction, default=True,
                   help='recompute layer activations (default on: the loss is then the largest part of the step)')
    p.add_argument('--json', default=None)
    p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--child-chunk', type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child: return child(args)
    res = []
    for c in [int(x) for x in args.chunks.split(',')]:
        cmd = [sys.executable, __file__, '--child', '--child-chunk', str(c), '--model', args.model, '--rows', str(args.rows),
               '--capacity', str(args.capacity), '--threads', str(args.threads),
               '--gradient-checkpointing' if args.gradient_checkpointing else '--no-gradient-checkpointing']
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode: raise SystemExit(f"loss_chunk={c} failed:\n{out.stderr[-3000:]}")
        res.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"loss_chunk={c}: done", file=sys.stderr, flush=True)
    r0 = res[0]
    print(f"{args.model}, {r0['rows']} packed rows × {r0['capacity']} tokens ({r0['real_tokens']:,} real, {r0['n_trained']:,} trained), "
          f"vocab {r0['vocab']:,}, fp32, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, {args.threads} threads; "
          f"one-shot logits would be {r0['n_trained'] * r0['vocab'] * 4 / 2**30:.2f} GiB\n")
    print("| loss_chunk | peak RSS (GiB) | RSS before step (GiB) | step peak − before (GiB) | vs loss_chunk 0 | loss | step (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in res:
        print(f"| {r['loss_chunk'] or '0 (one-shot)'} | {r['peak_gb']:.2f} | {r['rss_before_gb']:.2f} | {r['step_peak_gb']:.2f} | "
              f"{r['step_peak_gb'] / r0['step_peak_gb']:.2f}× | {r['loss']:.6f} | {r['step_s']:.1f} |")
    if args.json: Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == '__main__':
    main()
