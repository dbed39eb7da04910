"""The memory levers of issue 62 on SmolLM2-135M, CPU fp32, one rank, side by side in one run, each arm a fresh process:

- levers (2 rows of `--rows-length` tokens, full activation checkpointing): full fine-tuning, LoRA (r 16 on every
  linear of the blocks), LoRA on an nf4 base (QLoRA), DoRA;
- one long row (`--length` tokens, full activation checkpointing, full fine-tuning) with and without tiled MLP
  (`model.tiled_mlp` = `--tile` tokens a tile), and the longest row each way whose step peak stays under `--cap`.

For each: the rank's peak while setting up (VmHWM after `setup`, loading included) and its RSS after it, the peak of
one step as the dry run measures it (`sft_nb.memory.measure_step` on `estimate_batch`'s rows, as
`SFTTrainer.dry_run(full_length=True)` runs it: Adam's state held, its snapshot's bytes taken off), the seconds of
`--steps` further steps (median; the long rows: the measured step's own, its snapshot and restore included),
`sft_nb.memory.estimate(cfg, device='cpu', data=False)`'s peak (in its own process) and estimate / measured. The
arms that ask for a lever say how many layers it changed (0: the build does not apply it).

The longest row: the peak is about linear in the row's length (CPU attention is the flash kernel); the line through
the long row and a row of half its length predicts the longest row under the cap (on multiples of `--grid` tokens),
which is measured; then steps of `--grid` doubling away from it until the cap is bracketed, then halving the bracket,
at most `--probes` rows each way.

Beside each arm's longest row: its step time, the estimate's peak at that row, and the estimate's own longest row under
the same cap (`sft_nb.memory.fit_levers(device='cpu', gpu_memory=cap, others=False)`: its search, not another).

`--model llama-shaped`: Llama-3.1-8B's proportions with random weights (`llama_shaped`: 32 blocks, intermediate 3.5x
hidden, untied head) but 64 wide and the tiny model's 712-token vocabulary, so that a CPU step on rows of 4k-8k tokens
takes seconds to a minute and the blocks' activations, not the vocabulary, set the peak. Its attention is not grouped
(4 KV heads, not 1 a 4 query heads): torch's CPU sdpa backward with `enable_gqa`, which transformers takes for GQA
without a mask, ran 10-40x slower than on repeated KV heads here (16-dim heads, 4,096-8,192 tokens), a 8,192-token step
6 minutes; under full checkpointing K and V are held only inside the one block recomputed. At this width a tile's
tensors (1,024 tokens x 64 or 224 floats) are under the 1 MiB from which `compact_malloc` has glibc map each block on
its own, so they come from the heap, which keeps what they freed: `MALLOC_MMAP_THRESHOLD_=65536` maps them as an 8B
model's (megabytes each) are mapped, and measures the tensors, not the heap.

    HF_HUB_OFFLINE=1 python bench/memory_levers.py [--arms full,lora,qlora,dora,plain,tiled] [--length 6144] [--cap 3.5]
    MALLOC_MMAP_THRESHOLD_=65536 HF_HUB_OFFLINE=1 python bench/memory_levers.py --model llama-shaped --arms plain,tiled \
        --length 8192 --tile 1024 --cap 0.62 --probes 4 --max-length 16384    # RESULTS (4): 15 minutes here
    python bench/memory_levers.py --quick     # the tiny model, short rows, no search: a smoke run (minutes here)

Memory-heavy and slow (a SmolLM2 step on one 4,096-token row takes 2 minutes on 2 idle cores): run it alone.
"""
import sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
import argparse, json, os, statistics, subprocess, time

LINEARS = '[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]'
LORA = ['model.lora_r=16', 'model.lora_alpha=16', f'model.lora_target_modules={LINEARS}']
# name: (what, overrides); every arm: full activation checkpointing, one rank
LEVERS = {
    'full': ('full fine-tuning', []),
    'lora': ('LoRA r16', LORA),
    'qlora': ('LoRA r16 + nf4 base', LORA + ['model.quantize=nf4']),
    'dora': ('DoRA r16', LORA + ['model.lora_dora=true']),
}
LONG = {'plain': ('no tiled MLP', []), 'tiled': ('tiled MLP', None)}  # tiled: model.tiled_mlp=--tile
LEVER_OF = {'qlora': 'quantized', 'dora': 'dora', 'tiled': 'tiled'}  # the layers `worker` counts for the arm
BASE = ['data.train=[{path: "sft_nb:identity"}]', 'train.num_steps=1', 'checkpoint.export_hf=false',
        'logging.trackers=[jsonl]', 'placement.workers_per_node=1', 'model.activation_checkpointing=full']
THREADS = 2  # one rank at a time on this 2-core machine


def overrides(model: str, rows: int, length: int, over: list[str]) -> list[str]:
    "A config of `rows` rows of `length` tokens a micro-batch on one rank; past the model's positions on purpose (memory, not quality)."
    return BASE + [f'model.path={model}', f'tokenize.max_length={length}', 'tokenize.extend_context=true',
                   f'train.micro_batch_size={rows}', f'train.global_batch_size={rows}'] + over


def llama_shaped(where: Path, hidden: int = 64, layers: int = 32, kv_heads: int = 4) -> str:
    """A model folder under `where` (made once, random weights, seed 0) shaped as Llama-3.1-8B (32 blocks of width 4,096:
    intermediate 14,336 = 3.5x, 131,072 positions, rope theta 500,000, untied head) but `hidden` wide with 4 query heads
    on `kv_heads` KV heads (Llama: 32 on 8), and the tiny model's tokenizer (712 tokens)."""
    import shutil, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from sft_nb.models import resolve_model_path
    out = Path(where) / f'llama-shaped-h{hidden}-l{layers}-kv{kv_heads}'
    if (out / 'model.safetensors').exists(): return str(out)
    tiny = Path(resolve_model_path('tiny'))
    torch.manual_seed(0)
    c = LlamaConfig(hidden_size=hidden, intermediate_size=int(3.5 * hidden), num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=712, max_position_embeddings=131072,
                    rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(c).save_pretrained(out)
    for f in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja'): shutil.copy(tiny / f, out / f)
    return str(out)


def worker(over: list[str], steps: int):
    "One rank: setup, the dry run's step, `steps` timed steps; prints a JSON line."
    import ray  # noqa: F401  (a CPU rank is a Ray actor: its runtime has Ray loaded, as the estimate counts)
    import torch
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.config import load_config
    from sft_nb.memory import estimate_batch, measure_step, rank_memory
    from sft_nb.workers import free_port
    cfg = load_config(None, over)
    w = FSDPWorker(0, 1, cfg.model, cfg.optim, total_steps=steps + 2, placement=cfg.placement)
    w.init_dist('127.0.0.1', free_port(), threads=THREADS)
    t0 = time.perf_counter(); info = w.setup(); setup_s = time.perf_counter() - t0
    after_setup = rank_memory()
    mb = estimate_batch(cfg, w.model.config.get_text_config().vocab_size)
    t = time.perf_counter(); m = measure_step(w, mb); dry_s = time.perf_counter() - t
    n = int((mb['labels'] != -100).sum())
    mods = dict(w.model.named_modules())
    # the layers each lever changed: a lever the build does not apply yet shows 0
    levers = {'quantized': sum(type(m).__module__.startswith('bitsandbytes') for m in mods.values()),
              'dora': sum(len(m) > 0 for k, m in mods.items() if k.endswith('lora_magnitude_vector')),  # PEFT makes an empty one per LoRA layer
              'tiled': sum(type(m.__dict__.get('forward')).__name__ == 'TiledForward' for m in mods.values())}
    times = []
    for _ in range(steps):
        t = time.perf_counter(); w.forward_backward([mb], n); w.optim_step(); times.append(time.perf_counter() - t)
    print(json.dumps({'setup_peak': after_setup['peak'], 'setup_rss': after_setup['rss'], 'setup_s': setup_s,
                      'before': m['before'], 'peak': m['peak'], 'step_s': statistics.median(times) if times else dry_s,
                      'n_trainable': info['n_trainable'], 'shape': list(mb['input_ids'].shape),
                      'threads': torch.get_num_threads(), 'levers': levers}))
    w.shutdown()


def estimator(over: list[str]):
    "The estimate of the same config on one CPU rank; prints a JSON line."
    from sft_nb.config import load_config
    from sft_nb.memory import estimate
    p = estimate(load_config(None, over), gpus=1, device='cpu', data=False)
    r = p['ranks'][0]
    print(json.dumps({'peak': r['peak'], 'parts': r['parts'], 's': p['estimate_s']}))


def fitter(over: list[str], cap: float):
    "The estimate's longest row of the same config under `cap` GiB on one CPU rank (`fit_levers`' search); prints a JSON line."
    from sft_nb.config import load_config
    from sft_nb.memory import fit_levers
    f = fit_levers(load_config(None, over), device='cpu', gpu_memory=cap, others=False)
    (r,) = f['rows']
    print(json.dumps({'longest': r['longest_row'], 's': f['fit_s']}))


def child(role: str, over: list[str], steps: int = 0, cap: float = 0) -> dict:
    "Run `role` (worker | estimator | fitter) in a fresh process: its JSON, or {'error': its last line}."
    env = {**os.environ, 'OMP_NUM_THREADS': str(THREADS)}
    out = subprocess.run([sys.executable, __file__, '--role', role, '--steps', str(steps), '--over', json.dumps(over),
                          '--cap', str(cap)], capture_output=True, text=True, env=env)
    if out.returncode:
        lines = [l for l in out.stderr.strip().splitlines() if l.strip()]
        return {'error': (lines or ['exit code %d' % out.returncode])[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


GiB = 2**30
g = lambda b: f"{b / GiB:.2f}" if b is not None else '-'


def row(name: str, what: str, m: dict, e: dict | None) -> str:
    "One line of the table: measured setup and step peaks, step time, the estimate and estimate / measured."
    if 'error' in m: return f"| {name} | {what} | failed: {m['error']} |"
    if (k := LEVER_OF.get(name)): what += f" ({m['levers'][k]} layers)" if m['levers'][k] else ' (**not in effect**: 0 layers)'
    est = '-' if e is None else (f"failed: {e['error']}" if 'error' in e else g(e['peak']))
    ratio = f"{e['peak'] / m['peak']:.2f}" if e and 'error' not in e else '-'
    step = f"{m['step_s']:.1f}" if m['step_s'] is not None else '-'
    return (f"| {name} | {what} | {m['shape'][0]} x {m['shape'][1]} | {m['n_trainable'] / 1e6:.2f} | {g(m['setup_peak'])} "
            f"| {g(m['setup_rss'])} | {g(m['peak'])} | {step} | {est} | {ratio} |")


HEAD = ("| arm | config | rows x tokens | trained M | setup peak | after setup | step peak (dry run) | step s | "
        "estimate peak | est / dry |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|")


def longest(measure, cap: int, pts: dict, grid: int, hi: int, probes: int = 6) -> tuple:
    """(longest measured length under `cap`, shortest measured over it, or None) on multiples of `grid` up to `hi`:
    the first probe where the line through the two longest points of `pts` ({length: peak} measured so far;
    `measure(L)` adds one) meets the cap, then steps of `grid` doubling away from it until the cap is bracketed,
    then halving the bracket, at most `probes` measurements."""
    fits = lambda L: pts[L] is not None and pts[L] <= cap
    (l0, p0), (l1, p1) = sorted((L, p) for L, p in pts.items() if p is not None)[-2:]
    slope = (p1 - p0) / (l1 - l0)
    L = max(grid, min(hi, int((l1 + (cap - p1) / slope) // grid * grid))) if slope > 0 else hi
    step = grid
    for _ in range(probes):
        if L not in pts: pts[L] = measure(L)
        ok = max([l for l in pts if fits(l)], default=0)
        over = min([l for l in pts if not fits(l) and l > ok], default=None)
        if over is not None and over - ok <= grid: break
        if over is None: L, step = ok + step, 2 * step  # still under: further up
        elif ok == 0 and over > grid: L, step = max(grid, over - step), 2 * step
        else: L = (ok + over) // 2 // grid * grid
        if L > hi: break
    return ok, over


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--role', choices=('worker', 'estimator', 'fitter')); ap.add_argument('--over', default='[]')
    ap.add_argument('--steps', type=int, default=2, help='timed steps after the measured one (median)')
    ap.add_argument('--arms', default=','.join([*LEVERS, *LONG]), help=f"of {', '.join([*LEVERS, *LONG])}")
    ap.add_argument('--rows-length', type=int, default=1024, help="tokens of each of the lever arms' 2 rows")
    ap.add_argument('--length', type=int, default=6144, help='tokens of the long row')
    ap.add_argument('--tile', type=int, default=1024, help='model.tiled_mlp of the tiled arm: tokens a tile')
    ap.add_argument('--cap', type=float, default=None, help='GiB the step peak of the longest row must stay under; 0: no search (default 3.5; --quick: 0)')
    ap.add_argument('--grid', type=int, default=512, help="the search's step in tokens")
    ap.add_argument('--max-length', type=int, default=32768, help='longest row the search tries')
    ap.add_argument('--probes', type=int, default=6, help='most rows the search measures past the two fixed ones, each way')
    ap.add_argument('--model', default='smollm2', help="'smollm2', 'tiny', 'llama-shaped' (`llama_shaped`, under build/) or a model folder")
    ap.add_argument('--quick', action='store_true', help='the tiny model, short rows: a smoke run')
    a = ap.parse_args()
    if a.role == 'worker': return worker(json.loads(a.over), a.steps)
    if a.role == 'estimator': return estimator(json.loads(a.over))
    if a.role == 'fitter': return fitter(json.loads(a.over), a.cap)
    model = 'tiny' if a.quick else a.model
    if model == 'llama-shaped': model = llama_shaped(Path(__file__).resolve().parents[1] / 'build')
    if a.quick: a.rows_length, a.length, a.tile, a.grid, a.steps = 128, 1024, 256, 256, 1
    if a.cap is None: a.cap = 0 if a.quick else 3.5
    arms = a.arms.split(',')
    print(f"{Path(model).name}, CPU fp32, 1 rank, {THREADS} threads, activation checkpointing full; load avg "
          f"{os.getloadavg()[0]:.1f} at the start; GiB\n\n{HEAD}", flush=True)
    for name in (n for n in arms if n in LEVERS):
        what, over = LEVERS[name]
        over = overrides(model, 2, a.rows_length, over)
        print(row(name, what, child('worker', over, a.steps), child('estimator', over)), flush=True)
    long = [n for n in arms if n in LONG]
    long_over = {n: overrides(model, 1, 0, LONG[n][1] if LONG[n][1] is not None else [f'model.tiled_mlp={a.tile}'])
                 for n in long}
    at = lambda n, L: [o if not o.startswith('tokenize.max_length=') else f'tokenize.max_length={L}' for o in long_over[n]]
    pts = {n: {} for n in long}
    for name in long:
        m = child('worker', at(name, a.length), 0)  # a step of a long row takes minutes here: the measured one is timed
        if 'error' not in m: pts[name][a.length] = m['peak']
        what = LONG[name][0] + (f" ({a.tile} tokens a tile)" if name == 'tiled' else '')
        print(row(name, what, m, child('estimator', at(name, a.length))), flush=True)
    if not (a.cap and long): return
    cap = int(a.cap * GiB)
    print(f"\nlongest row whose step peak stays under {a.cap:g} GiB (searched on multiples of {a.grid} tokens):", flush=True)
    found, fit, runs = {}, {}, {n: {} for n in long}  # runs: {length: the worker's JSON}
    for name in long:
        def measure(L, name=name):
            m = runs[name][L] = child('worker', at(name, L), 0)
            said = f"failed: {m['error']}" if 'error' in m else f"{g(m['peak'])} GiB, {m['step_s']:.1f} s"
            print(f"  {name} {L}: {said}", flush=True)
            return m.get('peak')
        if a.length // 2 not in pts[name]: pts[name][a.length // 2] = measure(a.length // 2)
        if sum(p is not None for p in pts[name].values()) < 2: print(f"  {name}: no line to search on"); continue
        found[name] = longest(measure, cap, pts[name], a.grid, a.max_length, a.probes)
        fit[name] = child('fitter', at(name, a.length), cap=a.cap)
    if not found: return
    print(f"\n| arm | longest row measured (over at) | its step peak | its step s | estimate's peak there | est / dry "
          f"| estimate's longest row | est / measured |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (ok, over) in found.items():
        m, f = runs[name].get(ok, {}), fit[name]
        e = child('estimator', at(name, ok)) if ok else {'error': 'none fits'}
        ep = g(e['peak']) if 'error' not in e else f"failed: {e['error']}"
        er = f"{e['peak'] / m['peak']:.2f}" if 'error' not in e and 'peak' in m else '-'
        fl = f"{f['longest']:,}" if 'error' not in f else f"failed: {f['error']}"
        fr = f"{f['longest'] / ok:.2f}" if 'error' not in f and ok else '-'
        step = f"{m['step_s']:.1f}" if 'step_s' in m else '-'
        print(f"| {name} | {ok:,} ({over if over is None else f'{over:,}'}) | {g(m.get('peak'))} | {step} | {ep} | {er} "
              f"| {fl} | {fr} |", flush=True)
    if {'plain', 'tiled'} <= set(found) and found['plain'][0]:
        ratio = lambda d: d['tiled'] / d['plain']
        est = (f"{ratio({n: fit[n]['longest'] for n in fit}):.2f}x" if all('error' not in f for f in fit.values())
               else '-')
        print(f"\ntiled / plain longest row: measured {ratio({n: found[n][0] for n in found}):.2f}x, "
              f"estimate {est} (goal >= 1.5x)")


if __name__ == '__main__': main()
