"""Training throughput benchmark: sft_nb's `SFTTrainer` (padded and packed) side by side in one run with TRL's
`SFTTrainer` (padded and packed) on the same model, rows, max_length, batch size, step count and optimizer settings.

    python bench/train.py                       # CPU: SmolLM2-135M-Instruct (6 steps) and the tiny model (30 steps × 3)
    python bench/train.py --models tiny --repeats-tiny 5 --json /tmp/train.json
    python bench/train.py --profile --models smollm2   # torch.profiler of one padded step: our worker code vs TRL
    python bench/train.py --gpu [--peak-tflops 989]    # CUDA: SmolLM2 bf16, ours vs TRL × packed/padded × mixed/uniform data
    python bench/train.py --gpu --dry-run              # the same code path on CPU with the tiny model (a smoke test)
    python bench/train.py --compile                    # also ours with model.compile (padded and packed) in the same run

What the figures depend on, printed beside each model's ratios ("conditions"): the load average before the run and
during it (sampled after every step; it counts this run's own threads too), torch's threads and OMP/MKL_NUM_THREADS in
this process (TRL) and in our Ray worker, each process's allocator (jemalloc/tcmalloc mapped in, LD_PRELOAD; our CPU
worker also fixes glibc's mmap threshold, `compact_malloc`), the CPUs Ray gives the worker (num_cpus, affinity), and
this machine's GEMM limit: fp32 matmuls of the model's block shapes on the same threads, timed in the same run, against
which each arm's model FLOP/s (6·N·tokens/s) is a utilization. A run refuses to start (exit 2) when the 1-minute load
before it is above --max-load (default 0.5 per CPU: 1.0 on 2 cores); --ignore-load runs anyway and the report says so.

What is compared (CPU):
- rows: `alpaca_en_demo.json` tokenized by sft_nb (all assistant turns trained, rows over max_length dropped); TRL
  gets exactly those rows as `messages` (`sft_nb.formats.normalize_row(row, 'alpaca')`), rendered by the model's own
  chat template with `{% generation %}` markers added around each assistant turn's content + `<|im_end|>` (the text
  is checked to equal the original template's render on every row, and TRL's ids/masks to equal ours), so
  `assistant_only_loss=True` trains exactly the tokens sft_nb trains.
- padded runs: ours shuffles rows; TRL padded gets the rows of our padded run's steps in the same order (sequential
  sampler), so both train on identical batches and their per-step losses must agree.
- packed runs: each trainer packs with its own best-fit-decreasing planner into rows of max_length tokens; the
  global batch is B packed rows (TRL flattens them padding-free into one sequence whose block-diagonal mask
  transformers derives from position_ids; sft_nb keeps B rows with a block-diagonal mask). Batches differ in
  content, not in size.
- same optimizer settings: AdamW lr 5e-5 constant, betas (0.9, 0.95), eps 1e-8, no weight decay, clip 1.0; fp32;
  no gradient checkpointing (TRL's default would be on). Each uses its own AdamW implementation (TRL: torch fused).
- the methods of a model are set up first, then run interleaved step by step (round-robin, the first method of each
  round rotating), one at a time, so a changing machine load hits them alike: all four together for the tiny model;
  for SmolLM2 (four fp32 copies with AdamW state and activations do not fit in 24 GB) ours/TRL padded together,
  then ours/TRL packed together (`--interleave`). TRL runs in this process with
  `torch.set_num_threads(threads)`; ours in a Ray worker with `cpus_per_worker=threads`, both at niceness 0
  (`--ray-niceness`; Ray's default would start our workers at 15).
- tokens/s = Σ real (non-padding) tokens / Σ step time over steps 2..N (step 1 is warm-up). Our step time is
  `SFTTrainer.step()`: collation on the driver (since 264d089 done in a thread during the previous step, except for
  step 1) + the Ray call to forward/backward + optimizer step. TRL's step time
  is on_step_begin → on_step_end (forward/backward/clip/optimizer step; its collation happens before on_step_begin,
  so it is excluded); "incl. TRL collation" adds TRL's time between steps (logging + next batch's collation).
  Also shown: the median of per-step tokens/s, the median of per-step ratios for each ours/TRL pair, and tokens per
  CPU-second (CPU time of our worker + driver process, or of TRL's process, during the step).
- loss@T: token-weighted mean training loss over each run's first steps up to T real tokens, T = the smallest
  token total of that model's runs (so every run is judged on the same amount of data).
"""
import os, sys
from pathlib import Path
# bench/ holds other benchmarks (bench/tokenize.py would shadow the stdlib module): keep it off the import path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]
os.environ.setdefault('HF_HUB_OFFLINE', '1'); os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
os.environ.setdefault('TRANSFORMERS_VERBOSITY', 'error')

import argparse, datetime, gc, json, platform, re, statistics, tempfile, time, warnings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / 'shared'  # the development data beside the checkout; the GPU machine has none: --data
DATA = str(SHARED / 'datasets' / 'alpaca_en_demo.json') if SHARED.exists() else None
METHODS = ('ours padded', 'ours packed', 'trl padded', 'trl packed')
COMPILED = ('ours padded compiled', 'ours packed compiled')  # --compile: model.compile beside eager
TARGETS = {'ours padded': 2.0, 'ours packed': 3.0}  # ours / TRL, eager, on this machine kind (issue 64)


def log(*a): print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# data: the rows sft_nb keeps, and the same rows as `messages` for TRL
def prepare(folder, max_length, path=DATA):
    from transformers import AutoTokenizer
    from sft_nb.config import TokenizeConfig
    from sft_nb.tokenize import tokenize_dataset
    from sft_nb.formats import normalize_row
    from sft_nb.data import load_source, row_dict
    import datasets; datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(folder)
    ds, rep = tokenize_dataset(path, tok, TokenizeConfig(mode='all_assistant', max_length=max_length, truncation='drop'))
    raw = load_source(path)
    keep = [int(i) for i in ds['index']]
    messages = {i: normalize_row(row_dict(raw[i]), 'alpaca')['messages'] for i in keep}
    ours = {i: (list(r['input_ids']), list(r['loss_mask'])) for i, r in zip(keep, ds.select_columns(['input_ids', 'loss_mask']))}
    train_tpl = training_template(tok.chat_template)
    bad = [i for i in keep if tok.apply_chat_template(messages[i], tokenize=False)
           != tok.apply_chat_template(messages[i], tokenize=False, chat_template=train_tpl)]
    if bad: raise SystemExit(f"training template renders {len(bad)} rows differently from the model's template, e.g. row {bad[0]}")
    return {'keep': keep, 'messages': messages, 'ours': ours, 'template': train_tpl, 'report': str(rep)}


def training_template(tpl):
    "The ChatML-style template with `{% generation %}` around each assistant turn's content + <|im_end|> (what sft_nb trains)."
    pat = re.compile(r"\{\{-?\s*'<\|im_start\|>'\s*\+\s*message\['role'\]\s*\+\s*'(?:\n|\\n)'\s*\+\s*message\['content'\]"
                     r"\s*\+\s*'<\|im_end\|>'\s*\+\s*'(?:\n|\\n)'\s*-?\}\}")
    if len(pat.findall(tpl)) != 1: raise SystemExit("bench/train.py only knows how to mark ChatML templates for TRL's assistant_only_loss")
    block = ("{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
             "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
             "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endif %}")
    return pat.sub(lambda m: block, tpl)


# ---------------------------------------------------------------------------------------------------------------------
# runs
def summarize(name, losses, n_real, n_trained, positions, step_times, wall_times=None, cpu_times=None, extra=None):
    tt, st = sum(n_real[1:]), sum(step_times[1:])
    out = {'method': name, 'steps': len(losses), 'loss': losses, 'n_real': n_real, 'n_trained': n_trained,
           'positions': positions, 'step_time': step_times, 'tokens_per_s': tt / st if st else float('nan'),
           'median_step_tokens_per_s': statistics.median(a / b for a, b in zip(n_real[1:], step_times[1:])) if len(losses) > 1 else float('nan'),
           'final_loss': losses[-1], 'mean_loss': statistics.fmean(losses),
           'padding_efficiency': sum(n_real) / max(1, sum(positions))}
    if cpu_times: out['cpu_time'], out['tokens_per_cpu_s'] = cpu_times, tt / sum(cpu_times[1:])
    if wall_times:
        out['wall_time'] = wall_times
        out['wall_tokens_per_s'] = sum(n_real[1:]) / sum(wall_times[1:])
    out.update(extra or {})
    return out


def trim():
    "Give freed heap memory back to the OS (glibc keeps it otherwise), so the next group of runs has room."
    try:
        import ctypes; ctypes.CDLL('libc.so.6').malloc_trim(0)
    except Exception: pass


def peak_rss_gb(pid):
    "Peak resident memory of a process (VmHWM), GB."
    for line in Path(f'/proc/{pid}/status').read_text().splitlines():
        if line.startswith('VmHWM:'): return int(line.split()[1]) / 2**20


def proc_cpu(pid):
    "CPU seconds (user + system, all threads) a process has used so far."
    f = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf('SC_CLK_TCK')


# ---------------------------------------------------------------------------------------------------------------------
# what a figure depends on
def process_conditions():
    "This process's torch threads, thread variables, allocator and the CPUs it may run on (called here and in our Ray worker)."
    import torch
    maps = Path('/proc/self/maps').read_text()
    return {'torch_threads': torch.get_num_threads(), 'interop_threads': torch.get_num_interop_threads(),
            'allocator': next((a for a in ('jemalloc', 'tcmalloc', 'mimalloc') if a in maps), 'glibc'),
            'cpus': len(os.sched_getaffinity(0)), 'pid': os.getpid(),
            **{k: os.environ.get(k) for k in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'LD_PRELOAD', 'MALLOC_CONF')}}


def describe(c):
    "One process's conditions in a few words."
    env = ', '.join(f'{k}={c[k]}' for k in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'LD_PRELOAD', 'MALLOC_CONF') if c.get(k)) or 'no thread/allocator variables'
    return f"torch threads {c['torch_threads']} (interop {c['interop_threads']}), {env}, allocator {c['allocator']}, {c['cpus']} CPUs in its affinity"


def gemm_limit(cfg, tokens, threads, min_s=0.3):
    """FLOP/s of fp32 matmuls of the model's block shapes ([tokens, d]·[d, d], [tokens, d]·[d, ffn], [tokens, ffn]·[ffn, d])
    on `threads` torch threads in this process: this machine's limit for a step's dense work, measured now."""
    import torch
    torch.set_num_threads(threads)
    d, f = cfg.hidden_size, cfg.intermediate_size
    fl = tm = 0.0
    for k, n in ((d, d), (d, f), (f, d)):
        a, b = torch.randn(tokens, k), torch.randn(k, n)
        for _ in range(2): a @ b  # warm-up
        ts = []
        while sum(ts) < min_s or len(ts) < 3:
            t0 = time.perf_counter(); a @ b; ts.append(time.perf_counter() - t0)
        fl += 2 * tokens * k * n; tm += min(ts)  # the limit: the fastest of the repeats
    return {'flop_per_s': fl / tm, 'shapes': f"[{tokens}×{d}]·[{d}×{d}], [{tokens}×{d}]·[{d}×{f}], [{tokens}×{f}]·[{f}×{d}]",
            'threads': threads}


def check_load(args):
    "The load average now; exit 2 when its 1-minute figure is above the limit, unless --ignore-load."
    load, limit = os.getloadavg(), args.max_load if args.max_load is not None else 0.5 * os.cpu_count()
    args.load_limit = limit
    if load[0] > limit and not args.ignore_load:
        print(f"bench/train.py: the 1-minute load average is {load[0]:.2f} before the run, above {limit:.2f} "
              f"(--max-load; default 0.5 per CPU, {os.cpu_count()} here): other work would take CPU time from the arms "
              "unevenly and the ratios would not reproduce. Run it on a quiet machine, or pass --ignore-load (the report "
              "then says the machine was loaded).", file=sys.stderr)
        sys.exit(2)
    return load


def conditions_line(name, args, load0, runs, gemm0, gemm1, bench):
    "What this model's figures depend on, in one report line."
    during = [x for rs in runs.values() for r in rs for x in r.get('loadavg_during', [])]
    w = next((r for rs in runs.values() for r in rs if 'worker' in r), None)
    flag = f" (above the limit {args.load_limit:.2f}: run with --ignore-load, NOT a reproducible figure)" if load0[0] > args.load_limit else f" (limit {args.load_limit:.2f})"
    ours = (f"our Ray worker: {describe(w['worker'])}, Ray num_cpus {w['ray_num_cpus']} of the cluster's {w['ray_cluster_cpus']:g}"
            + (" (CPU workers also fix glibc's mmap threshold at 1 MiB: `compact_malloc`)" if w['worker']['allocator'] == 'glibc' else '')
            if w else 'no ours arm')
    return (f"{name} conditions: load before {load0[0]:.2f} / {load0[1]:.2f} / {load0[2]:.2f} (1 / 5 / 15 min){flag}; during "
            f"(1 min, after each step, this run's own threads included): median {statistics.median(during):.2f}, max {max(during):.2f}; "
            f"this process (TRL's): {describe(bench)}; {ours}; GEMM limit {gemm0['flop_per_s'] / 1e9:.1f} GFLOP/s before the runs, "
            f"{gemm1['flop_per_s'] / 1e9:.1f} after (fp32 {gemm0['shapes']}, {gemm0['threads']} threads)")


def utilization_line(name, runs, n_params, gemm):
    "Each arm's model FLOP/s (6·N·tokens/s) and its fraction of the GEMM limit measured in the same run."
    parts = [f"{m} {6 * n_params * med(rs, 'tokens_per_s') / 1e9:.2f} GFLOP/s = {6 * n_params * med(rs, 'tokens_per_s') / gemm:.1%}"
             for m, rs in runs.items()]
    return f"{name} FLOP/s utilization (6·N·tokens/s, N = {n_params:,} parameters, against the GEMM limit {gemm / 1e9:.1f} GFLOP/s): " + '; '.join(parts)


class Ours:
    "sft_nb's SFTTrainer, driven one `step()` at a time (its Ray worker does the compute)."
    def __init__(self, folder, packed, args, use_gpu=False, data_path=DATA, compiled=False):
        import ray
        from sft_nb.trainer import SFTTrainer
        from sft_nb.callbacks import Callback
        self.name, self.args = ('ours packed' if packed else 'ours padded') + (' compiled' if compiled else ''), args
        self.tmp = tempfile.TemporaryDirectory(prefix='sftnb_bench_')
        cfg = {'model': {'path': str(folder), 'compile': compiled, **({'dtype': 'bfloat16'} if use_gpu else {})},
               'data': {'train': [{'path': data_path}]},
               'tokenize': {'max_length': args.max_length, 'mode': 'all_assistant'},
               'packing': {'enabled': packed, 'capacity': args.max_length},
               'optim': {'lr': args.lr, 'schedule': 'constant'},
               'train': {'global_batch_size': args.batch, 'micro_batch_size': args.micro_batch or args.batch, 'num_steps': args.n_steps},
               'placement': {'workers_per_node': 1, 'cpus_per_worker': 1 if use_gpu else args.threads, 'use_gpu': use_gpu},
               'checkpoint': {'run_dir': self.tmp.name, 'export_hf': False}, 'logging': {'trackers': []}}
        t = self.t = SFTTrainer(cfg).setup()
        order = [t.data.global_batch(s) for s in range(args.n_steps)]
        orig = [int(i) for i in t.data.train_sets[0]['index']]
        self.positions = []  # each step's positions as collated (padding included; padded rows go padding-free)
        self.rows = None if packed else [[orig[t.data.rows[k][1]] for k in b] for b in order]  # original row ids of each step
        flat = [[k for it in b for k in (it if isinstance(it, (list, tuple)) else [it])] for b in order]
        self.attn_pairs = [sum(int(t.data.lengths[k]) * (int(t.data.lengths[k]) + 1) // 2 for k in b) for b in flat]  # causal (query, key) pairs
        pid = ray.get(t.group.actors[0].__ray_call__.remote(lambda self: os.getpid()))
        self.niceness, self.pid = os.getpriority(os.PRIO_PROCESS, pid), pid
        self.cpu, self.collate_s = [], []

        class Meter(Callback):  # CPU seconds of the worker process + the driver, per step
            def on_step_start(s, trainer, step): s.c0 = (proc_cpu(pid), time.process_time())
            def on_step_end(s, trainer, m): self.cpu.append(proc_cpu(pid) - s.c0[0] + time.process_time() - s.c0[1])
        t.callbacks.append(Meter())
        rank_batches = t.data.rank_batches
        def timed(items):  # driver-side collation time of each step (inside step_time)
            c0 = time.perf_counter(); out = rank_batches(items); self.collate_s.append(time.perf_counter() - c0)
            self.positions.append(sum(b['input_ids'].numel() for mbs in out.batches for b in mbs))
            return out
        t.data.rank_batches = timed

    def step(self):
        import ray
        self.t.step()
        # outside the timed step: let the idle worker give freed activation memory back while the others run
        ray.get(self.t.group.actors[0].__ray_call__.remote(lambda self_: __import__('ctypes').CDLL('libc.so.6').malloc_trim(0)))

    def result(self):
        import ray
        h = self.t.metrics
        mem = ray.get(self.t.group.actors[0].__ray_call__.remote(
            lambda self_: __import__('torch').cuda.max_memory_allocated() / 2**30 if __import__('torch').cuda.is_available() else None))
        steps = h['step_time'].tolist()
        return summarize(self.name, h['loss'].tolist(), h['n_real'].astype(int).tolist(), h['n_trained'].astype(int).tolist(),
                         self.positions, steps, cpu_times=self.cpu,
                         extra={'n_params': self.t.model_info['n_params'], 'collate_time': self.collate_s, 'worker_niceness': self.niceness,
                                'worker_peak_rss_gb': peak_rss_gb(self.pid), 'attn_pairs': self.attn_pairs, 'gpu_peak_gb': mem,
                                # the first step's time above the median step: the compile (and the warm-up every arm has)
                                'first_step_excess_s': steps[0] - statistics.median(steps[1:]) if len(steps) > 1 else float('nan'),
                                'worker': ray.get(self.t.group.actors[0].__ray_call__.remote(lambda self_: process_conditions())),
                                'ray_num_cpus': self.t.cfg.placement.cpus_per_worker, 'ray_cluster_cpus': ray.cluster_resources().get('CPU')})

    def close(self):
        self.t.shutdown(); self.tmp.cleanup()


class TRL:
    "TRL's SFTTrainer.train() in a thread that runs one optimizer step each time `step()` hands it the turn."
    def __init__(self, folder, packed, args, data, rows=None, use_gpu=False):
        import threading, torch, trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from transformers.trainer_callback import PrinterCallback
        self.name, self.args = 'trl packed' if packed else 'trl padded', args
        tok = AutoTokenizer.from_pretrained(folder)
        if tok.pad_token is None: tok.pad_token = tok.eos_token  # as sft_nb does
        tok.chat_template = data['template']
        ids = data['keep'] if packed else [i for b in rows for i in b]  # packed: TRL packs and shuffles; padded: our batches, in order
        ds = Dataset.from_list([{'messages': data['messages'][i]} for i in ids])
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=trl_attn(use_gpu))
        if use_gpu: torch.cuda.reset_peak_memory_stats()
        self.use_gpu = use_gpu
        self.turn, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.step_s, self.wall_s, self.cpu, self.losses, self.stats, self.error, self.closing = [], [], [], [], [], None, False
        me = self

        class Timer(TrainerCallback):  # times on_step_begin → on_step_end; waits for its turn between steps
            def on_train_begin(s, args_, state, control, **k):
                me.turn.acquire(); s.last = time.perf_counter()
                if me.closing: control.should_training_stop = True
            def on_step_begin(s, *a, **k): s.begin = (time.perf_counter(), time.process_time())
            def on_step_end(s, args_, state, control, **k):
                now = time.perf_counter()
                me.step_s.append(now - s.begin[0]); me.wall_s.append(now - s.last); me.cpu.append(time.process_time() - s.begin[1])
                trim()  # outside the timed step, as for ours
                me.done.release(); me.turn.acquire(); s.last = time.perf_counter()
                if me.closing: control.should_training_stop = True  # closed early (an error elsewhere): stop after this step

        class Trainer(trl.SFTTrainer):
            def compute_loss(s, model, inputs, return_outputs=False, num_items_in_batch=None):
                out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
                if model.training: me.losses.append(float((out[0] if return_outputs else out).detach()))
                return out

        self.tmp = tempfile.TemporaryDirectory(prefix='trl_bench_')
        cfg = trl.SFTConfig(output_dir=self.tmp.name, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
                            max_steps=args.n_steps, learning_rate=args.lr, lr_scheduler_type='constant', warmup_steps=0,
                            weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,  # = sft_nb's optim defaults
                            max_length=args.max_length, packing=packed, assistant_only_loss=True,
                            gradient_checkpointing=False,  # TRL defaults to True; sft_nb does not checkpoint
                            report_to=[], use_cpu=not use_gpu, bf16=use_gpu, fp16=False, logging_steps=1, save_strategy='no',
                            eval_strategy='no', dataloader_num_workers=0, seed=0, disable_tqdm=True,
                            train_sampling_strategy='random' if packed else 'sequential')
        tr = self.tr = Trainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Timer()])
        tr.remove_callback(PrinterCallback)  # no per-step printing (sft_nb runs with no tracker either)
        self.check = None
        if not packed:  # TRL's tokenization of the same rows must equal ours
            mism = sum(1 for i, r in zip(ids, tr.train_dataset) if list(r['input_ids']) != data['ours'][i][0]
                       or [int(l != -100) for l in r['labels']][1:] != data['ours'][i][1][1:])
            self.check = f"{mism} of {len(ids)} rows differ from sft_nb's input_ids/trained-token mask"
        collate = tr.data_collator
        def counting(examples):  # real tokens (no padding), trained tokens, positions of each batch
            b = collate(examples)
            real = int(b['attention_mask'].sum()) if 'attention_mask' in b else int(b['input_ids'].numel())
            self.stats.append((real, int((b['labels'][:, 1:] != -100).sum()), int(b['input_ids'].numel()), attn_pairs_of(b)))
            return b
        tr.data_collator = counting
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try: self.tr.train()
        except BaseException as e: self.error = e
        finally: self.done.release()

    def step(self):
        self.turn.release(); self.done.acquire()
        if self.error is not None: raise RuntimeError(f"{self.name} failed") from self.error

    def result(self):
        n = self.args.n_steps
        import torch
        mem = torch.cuda.max_memory_allocated() / 2**30 if self.use_gpu else None
        return summarize(self.name, self.losses[:n], [s[0] for s in self.stats[:n]], [s[1] for s in self.stats[:n]],
                         [s[2] for s in self.stats[:n]], self.step_s[:n], self.wall_s[:n], self.cpu[:n],
                         extra={'token_check': self.check, 'attn_pairs': [s[3] for s in self.stats[:n]], 'gpu_peak_gb': mem})

    def close(self):
        self.closing = True; self.turn.release(); self.thread.join(timeout=900); self.tmp.cleanup()
        del self.tr; gc.collect()


def run_interleaved(folder, methods, args, data):
    """Set up every method, then run their steps round-robin (step k of each method before step k+1 of any; the first
    method of each round rotates), so that a changing machine load hits all of them alike. Only one runs at a time."""
    import torch, ray
    from sft_nb.workers import init_ray
    torch.set_num_threads(args.threads)
    # one local Ray cluster for all of our trainers: a worker × `threads` logical CPUs each (only one computes at a time)
    started = init_ray(num_cpus=max(os.cpu_count(), sum(m.startswith('ours') for m in methods) * args.threads))
    steppers = {}
    try:
        for m in ('ours padded', 'ours packed') + COMPILED:
            if m in methods: steppers[m] = Ours(folder, m.startswith('ours packed'), args, compiled=m in COMPILED)
        if 'trl padded' in methods:
            if 'ours padded' not in steppers: raise SystemExit("trl padded needs ours padded (it replays its batches)")
            steppers['trl padded'] = TRL(folder, False, args, data, steppers['ours padded'].rows)
        if 'trl packed' in methods: steppers['trl packed'] = TRL(folder, True, args, data)
        names, load = list(steppers), []
        for k in range(args.n_steps):
            for j in range(len(names)):
                steppers[names[(k + j) % len(names)]].step()
            load.append(os.getloadavg()[0])
            log(f"    step {k + 1}/{args.n_steps} done (loadavg {load[-1]:.2f})")
        return {m: st.result() | {'loadavg_during': load} for m, st in steppers.items()}
    finally:
        for st in steppers.values():
            try: st.close()
            except Exception as e: log(f"close {st.name}: {e!r}")
        steppers.clear(); gc.collect(); trim()
        if started: ray.shutdown()


# ---------------------------------------------------------------------------------------------------------------------
def loss_at(r, T):
    "Token-weighted mean loss over the run's first steps until T real tokens are reached."
    tot = w = acc = 0
    for loss, n, k in zip(r['loss'], r['n_real'], r['n_trained']):
        acc += loss * k; w += k; tot += n
        if tot >= T: break
    return acc / w


def med(rs, key): return statistics.median(r[key] for r in rs)
def median_step(rs): return statistics.median(x for r in rs for x in r['step_time'][1:])  # step 1 is warm-up


def table(model, runs, steps, batch):
    "runs: method → list of repeats. Markdown rows + verdicts."
    T = min(sum(rs[0]['n_real']) for rs in runs.values())
    base = med(runs['trl padded'], 'tokens_per_s') if 'trl padded' in runs else None
    lines = []
    for m in METHODS + COMPILED:
        if m not in runs: continue
        rs = runs[m]; r = rs[0]
        tps = med(rs, 'tokens_per_s')
        spread = f"{min(x['tokens_per_s'] for x in rs):,.0f}–{max(x['tokens_per_s'] for x in rs):,.0f}" if len(rs) > 1 else ''
        wall = f"{med(rs, 'wall_tokens_per_s'):,.0f}" if 'wall_tokens_per_s' in r else f"{tps:,.0f}"
        ratio = f"{tps / base:.2f}×" if base else '–'
        step = median_step(rs)
        per_step = statistics.median(x['median_step_tokens_per_s'] for x in rs)
        cpu = f"{med(rs, 'tokens_per_cpu_s'):,.0f}" if all(x.get('tokens_per_cpu_s') for x in rs) else '–'
        lines.append(f"| {model} | {m} | {steps} | {batch} | {tps:,.0f} | {spread} | {per_step:,.0f} | {wall} | {ratio} | {cpu} | "
                     f"{r['final_loss']:.4f} | {r['mean_loss']:.4f} | {loss_at(r, T):.4f} | {sum(r['n_real']):,} | "
                     f"{r['padding_efficiency']:.0%} | {step:.3f} |")
    verdicts = []
    tp = lambda m: med(runs[m], 'tokens_per_s')
    if 'ours packed' in runs and 'ours padded' in runs:
        x = tp('ours packed') / tp('ours padded')
        verdicts.append(f"{model}: ours packed / ours padded = {x:.2f}× tokens/s (target ≥ 1.5×): {'MET' if x >= 1.5 else 'NOT MET'}")
    for a, b in (('ours padded', 'trl padded'), ('ours packed', 'trl packed')):
        if a in runs and b in runs:
            x = tp(a) / tp(b)
            la, lb = runs[a][0], runs[b][0]
            dl = max(abs(p - q) for p, q in zip(la['loss'], lb['loss']))
            same = a.endswith('padded')
            eq = (f"same batches, max per-step |Δloss| {dl:.4f}" if same else
                  f"loss@{T:,} tokens {loss_at(la, T):.4f} vs {loss_at(lb, T):.4f}, mean loss {la['mean_loss']:.4f} vs {lb['mean_loss']:.4f}")
            paired = statistics.median((na / ta) / (nb / tb) for ra, rb in zip(runs[a], runs[b]) for na, ta, nb, tb in
                                       zip(ra['n_real'][1:], ra['step_time'][1:], rb['n_real'][1:], rb['step_time'][1:]))
            tgt = TARGETS[a]
            verdicts.append(f"{model}: {a} / {b} = {x:.2f}× (median of per-step ratios {paired:.2f}×; target ≥ {tgt}× (issue 64); {eq}): "
                            f"{'MET' if x >= tgt else 'NOT MET'}")
    for c in COMPILED:
        e = c.removesuffix(' compiled')
        if c in runs and e in runs:
            rc, re_ = runs[c][0], runs[e][0]
            first_c, first_e = med(runs[c], 'first_step_excess_s'), med(runs[e], 'first_step_excess_s')
            extra, gain = first_c - first_e, median_step(runs[e]) - median_step(runs[c])  # the compile, net of the warm-up both pay
            pays = (f"it pays for itself after {max(extra, 0) / gain:.1f} steps: a run of fewer steps is faster eager" if gain > 0 else
                    "a compiled step is not faster here: compiling does not pay at any run length")
            verdicts.append(f"{model}: {c} / {e} = {tp(c) / tp(e):.2f}× tokens/s; compile ≈ {first_c:.1f} s "
                            f"(first step above the median step; eager's {first_e:.1f} s); {pays} "
                            f"({max(extra, 0):.1f} s of compile / {gain:.2f} s saved a step); loss@{T:,} "
                            f"{loss_at(rc, T):.4f} vs {loss_at(re_, T):.4f}; max per-step |Δloss| "
                            f"{max(abs(p - q) for p, q in zip(rc['loss'], re_['loss'])):.2e}")
    ours = [m for m in ('ours padded', 'ours packed') if m in runs]; trls = [m for m in ('trl padded', 'trl packed') if m in runs]
    if ours and trls:
        bo, bt = max(ours, key=tp), max(trls, key=tp)
        x = tp(bo) / tp(bt)
        verdicts.append(f"{model}: best ours ({bo}) / best TRL ({bt}) = {x:.2f}× (target ≥ 1.2×): {'MET' if x >= 1.2 else 'NOT MET'}")
    return lines, verdicts, T


HEADER = ("| model | method | steps | batch | tokens/s | range over repeats | median per-step tokens/s | tokens/s incl. TRL collation | "
          "vs TRL padded | tokens per CPU-s | final loss | mean loss | loss@T | real tokens | real/positions | median step (s) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def versions():
    import torch, transformers, datasets, ray
    v = {'python': platform.python_version(), 'torch': torch.__version__, 'transformers': transformers.__version__,
         'datasets': datasets.__version__, 'ray': ray.__version__}
    try:
        import trl; v['trl'] = trl.__version__
    except Exception: v['trl'] = 'not installed'
    return v


def cpu_main(args):
    from sft_nb.models import smollm2_instruct, tiny_chat_model
    models = {'smollm2': (smollm2_instruct, args.steps_smollm2, args.repeats_smollm2), 'tiny': (tiny_chat_model, args.steps_tiny, args.repeats_tiny)}
    load0 = check_load(args)
    log(f"loadavg before: {load0}")
    out = {'args': vars(args), 'versions': versions(), 'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
           'machine': f"{platform.machine()}, {os.cpu_count()} CPUs visible, {platform.platform()}", 'loadavg_before': load0, 'models': {}}
    all_lines, all_verdicts = [], []
    for name in args.models.split(','):
        build, steps, repeats = models[name]
        folder = build()
        args.n_steps = steps
        data = prepare(folder, args.max_length)
        log(f"[{name}] {data['report']}")
        methods = [m for m in METHODS if m in args.methods.split(',')]
        if args.compile: methods += [m + ' compiled' for m in ('ours padded', 'ours packed') if m in methods]
        from transformers import AutoConfig, AutoModelForCausalLM
        import torch
        mcfg = AutoConfig.from_pretrained(folder)
        with torch.device('meta'): n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(mcfg).parameters())
        gemm_tokens = min(args.batch * args.max_length, 4096)
        gemm0 = gemm_limit(mcfg, gemm_tokens, args.threads)
        log(f"[{name}] GEMM limit {gemm0['flop_per_s'] / 1e9:.1f} GFLOP/s ({gemm0['shapes']}, {args.threads} threads)")
        mode = args.interleave if args.interleave != 'auto' else ('pairs' if name == 'smollm2' else 'all')
        groups = ([methods] if mode == 'all' else
                  [g for g in ([m for m in methods if m.removesuffix(' compiled').endswith(k)] for k in ('padded', 'packed')) if g])
        runs, notes = {m: [] for m in methods}, []
        for rep in range(repeats):
            for g in (groups if rep % 2 == 0 else groups[::-1]):
                la = os.getloadavg()
                log(f"[{name}] repeat {rep + 1}/{repeats}: {', '.join(g)} interleaved, {steps} steps, batch {args.batch}, loadavg {la}")
                try: res = run_interleaved(folder, g, args, data)
                except Exception as e:
                    log(f"    FAILED: {e!r}"); notes.append(f"{name}: group {g} (repeat {rep + 1}) failed: {str(e)[:300]}"); continue
                finally: gc.collect(); trim()
                for m, r in res.items():
                    r['loadavg_start'], r['loadavg_end'] = la, os.getloadavg()
                    runs[m].append(r)
                    log(f"    {m}: {r['tokens_per_s']:,.0f} tokens/s, final loss {r['final_loss']:.4f}, mean loss {r['mean_loss']:.4f}"
                        + (f"; TRL tokenization check: {r['token_check']}" if r.get('token_check') else ''))
                if args.json: Path(args.json).with_suffix('.partial.json').write_text(json.dumps({'model': name, 'runs': runs}, default=str))
        notes.append(f"{name}: methods run interleaved step by step in groups {groups}")
        runs = {m: rs for m, rs in runs.items() if rs}
        if not runs:
            for v in notes: print('- ' + v, flush=True)
            continue
        for m, rs in runs.items():
            if len(rs) > 1 and any(abs(a - b) > 1e-3 for x in rs[1:] for a, b in zip(rs[0]['loss'], x['loss'])):
                notes.append(f"{name} {m}: losses differ between repeats")
            if rs[0].get('token_check'): notes.append(f"{name} {m}: TRL tokenization check: {rs[0]['token_check']}")
        lines, verdicts, T = table(name, runs, steps, args.batch)
        gemm1 = gemm_limit(mcfg, gemm_tokens, args.threads)
        verdicts.append(conditions_line(name, args, load0, runs, gemm0, gemm1, process_conditions()))
        verdicts.append(utilization_line(name, runs, n_params, gemm0['flop_per_s']))
        notes.append(f"{name}: loss@T uses T = {T:,} real tokens")
        if 'ours padded' in runs and 'trl padded' in runs:
            a, b = runs['ours padded'][0], runs['trl padded'][0]
            notes.append(f"{name}: ours padded vs TRL padded: real tokens {sum(a['n_real']):,} vs {sum(b['n_real']):,}, "
                         f"trained tokens {sum(a['n_trained']):,} vs {sum(b['n_trained']):,}; per-step losses ours "
                         f"{[round(x, 4) for x in a['loss']]} vs TRL {[round(x, 4) for x in b['loss']]}")
        all_lines += lines; all_verdicts += verdicts
        out['models'][name] = {'runs': runs, 'gemm_limit': [gemm0, gemm1], 'n_params': n_params,
                               'verdicts': verdicts, 'notes': notes, 'T': T, 'data': data['report']}
        print('\n'.join([HEADER] + lines), flush=True)
        for v in verdicts + notes: print('- ' + v, flush=True)
    out['loadavg_after'] = os.getloadavg()
    log(f"loadavg after: {out['loadavg_after']}")
    print('\n## All models\n\n' + '\n'.join([HEADER] + all_lines))
    print('\n' + '\n'.join('- ' + v for v in all_verdicts))
    if args.json: Path(args.json).write_text(json.dumps(out, indent=1, default=str))


# ---------------------------------------------------------------------------------------------------------------------
# GPU: tokens/s, MFU and memory, ours vs TRL, packed vs padded, mixed- and uniform-length data
PEAK_BF16_TFLOPS = [  # dense bf16 tensor-core peak (no sparsity), by a substring of torch.cuda.get_device_name(); first match wins
    ('H100 PCIe', 756.0), ('H100 NVL', 835.0), ('H200', 989.0), ('H100', 989.0), ('GH200', 989.0), ('B200', 2250.0),
    ('A100', 312.0), ('L40S', 362.0), ('A10G', 125.0), ('A10', 125.0), ('L4', 121.0), ('RTX 4090', 165.0), ('RTX 3090', 71.0)]


def peak_tflops(device_name, override=None):
    "The GPU's dense bf16 peak in TFLOP/s: `override`, else the table entry matching the device name (None if unknown)."
    if override: return override
    return next((v for k, v in PEAK_BF16_TFLOPS if k in device_name), None)


def trl_attn(use_gpu):
    "TRL's attention: flash_attention_2 on GPU when flash-attn is installed (what TRL recommends for packing), sdpa otherwise."
    if use_gpu:
        try:
            import flash_attn  # noqa: F401
            return 'flash_attention_2'
        except ImportError: pass
    return 'sdpa'


def attn_pairs_of(b):
    "Causal (query, key) pairs of a collated batch: per document from restarting position_ids (packed), else per row's real tokens."
    import torch
    if 'position_ids' in b and 'attention_mask' not in b:  # padding-free packing: documents restart at position 0
        pos = b['position_ids'].reshape(-1)
        starts = torch.nonzero(pos == 0).flatten().tolist() + [pos.numel()]
        return sum((e - s_) * (e - s_ + 1) // 2 for s_, e in zip(starts, starts[1:]))
    real = b['attention_mask'].sum(-1) if 'attention_mask' in b else torch.full((b['input_ids'].shape[0],), b['input_ids'].shape[1])
    return int(sum(int(n) * (int(n) + 1) // 2 for n in real))


def flops(cfg, n_params, tokens, pairs):
    """Model FLOPs of a training step (forward + backward = 3 × forward): 6·N per token (N = all parameters; tied embeddings
    counted once, as the LM head's matmul) + attention 12·L·d per causal (query, key) pair (QKᵀ and AV: 2·2·d per pair, × 3)."""
    d = cfg.num_attention_heads * (getattr(cfg, 'head_dim', None) or cfg.hidden_size // cfg.num_attention_heads)
    return 6 * n_params * tokens + 12 * cfg.num_hidden_layers * d * pairs


WORDS = ('time year people way day man thing woman life child world school state family student group country problem hand '
         'part place case week company system program question work government number night point home water room mother '
         'area money story fact month lot right study book eye job word business issue side kind head house service friend').split()


def uniform_rows(folder, max_length, n=256, seed=0):
    "Alpaca-format rows of (nearly) one length (≈ 75% of max_length): packing cannot gain anything on them. Returns a JSON path."
    import random
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(seed)
    def n_real(k):  # tokens of a row whose answer has k words (the chat template's system prompt included)
        r = random.Random(k)
        msgs = [{'role': 'user', 'content': 'List words 100.'}, {'role': 'assistant', 'content': ' '.join(r.choice(WORDS) for _ in range(k))}]
        return len(tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)['input_ids'])
    k = 8
    for _ in range(4): k = max(1, int(k * 0.75 * max_length / n_real(k)))  # aim at 75% of max_length (rows vary by a few %)
    rows = [{'instruction': f'List words {i}.', 'input': '', 'output': ' '.join(rng.choice(WORDS) for _ in range(k))} for i in range(n)]
    log(f"uniform rows: {k} words per answer, ≈ {n_real(k)} tokens per row (max_length {max_length})")
    path = Path(tempfile.gettempdir()) / f'sftnb_bench_uniform_{Path(folder).name}_{max_length}_{n}.json'
    path.write_text(json.dumps(rows))
    return str(path)


def gpu_main(args):
    """One GPU (or, with --dry-run, the CPU and the tiny model): for mixed-length (alpaca) and uniform-length data, ours padded /
    packed and TRL padded / packed (when trl is installed), one method at a time, same rows, batch, max_length and optimizer."""
    import torch
    from transformers import AutoConfig
    from sft_nb.models import smollm2_instruct, tiny_chat_model
    dry = args.dry_run
    if not dry and not torch.cuda.is_available(): raise SystemExit("--gpu needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run runs the code path on CPU")
    folder = tiny_chat_model() if dry else (args.model_folder or smollm2_instruct())
    use_gpu = not dry
    args.n_steps = args.steps_gpu if not dry else 3
    name = torch.cuda.get_device_name(0) if use_gpu else 'CPU (dry run)'
    peak = peak_tflops(name, args.peak_tflops) if use_gpu else None
    mcfg = AutoConfig.from_pretrained(folder)
    from transformers import AutoModelForCausalLM
    with torch.device('meta'): n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(mcfg).parameters())  # tied embeddings once
    v = versions()
    print(f"device: {name}; peak bf16 dense: {f'{peak} TFLOP/s' if peak else 'unknown (pass --peak-tflops)'}; versions {v}; "
          f"{'bf16 compute, fp32 master weights' if use_gpu else 'fp32'}; batch {args.batch}, max_length {args.max_length}, {args.n_steps} steps")
    methods = [m for m in METHODS if m in args.methods.split(',')]
    if args.compile: methods += [m + ' compiled' for m in ('ours padded', 'ours packed') if m in methods]
    if v['trl'] == 'not installed':
        skipped = [m for m in methods if m.startswith('trl')]
        methods = [m for m in methods if not m.startswith('trl')]
        if skipped: print(f"- trl is not installed here: {', '.join(skipped)} skipped (they run where `import trl` works)")
    header = ("| data | method | steps | batch | tokens/s | vs TRL same layout | MFU | model TFLOP/s | peak GPU mem (GiB) | real/positions | "
              "final loss | mean loss |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines, out = [], {'device': name, 'peak_tflops': peak, 'versions': v, 'args': vars(args), 'runs': {}}
    for data_name in args.datasets.split(','):
        path = (args.data or DATA) if data_name == 'mixed' else uniform_rows(folder, args.max_length)
        data = prepare(folder, args.max_length, path)
        log(f"[{data_name}] {data['report']}")
        res, ours_padded = {}, None
        for m in methods:
            if m == 'trl padded' and ours_padded is None: log("trl padded needs ours padded (it replays its batches): skipped"); continue
            log(f"[{data_name}] {m}: {args.n_steps} steps")
            if use_gpu: torch.cuda.empty_cache()
            st = (Ours(folder, m.removesuffix(' compiled').endswith('packed'), args, use_gpu=use_gpu, data_path=path,
                       compiled=m in COMPILED) if m.startswith('ours') else
                  TRL(folder, m.endswith('packed'), args, data, ours_padded, use_gpu=use_gpu))
            try:
                for _ in range(args.n_steps): st.step()
                r = res[m] = st.result()
                if m == 'ours padded': ours_padded = st.rows
            finally: st.close(); gc.collect(); trim()
            st_ = sum(r['step_time'][1:])
            r['model_tflops_per_s'] = flops(mcfg, n_params, sum(r['n_real'][1:]), sum(r['attn_pairs'][1:])) / st_ / 1e12 if st_ else float('nan')
            r['mfu'] = r['model_tflops_per_s'] / peak if peak else None
        for m, r in res.items():
            other = 'trl ' + m.split()[1] if m.startswith('ours') else None
            vs = f"{r['tokens_per_s'] / res[other]['tokens_per_s']:.2f}×" if other in res else '–'
            mem = f"{r['gpu_peak_gb']:.2f}" if r.get('gpu_peak_gb') is not None else '–'
            mfu = f"{r['mfu']:.1%}" if r.get('mfu') is not None else '–'
            lines.append(f"| {data_name} | {m} | {r['steps']} | {args.batch} | {r['tokens_per_s']:,.0f} | {vs} | {mfu} | "
                         f"{r['model_tflops_per_s']:.3g} | {mem} | {r['padding_efficiency']:.0%} | {r['final_loss']:.4f} | {r['mean_loss']:.4f} |")
        if 'ours packed' in res and 'ours padded' in res:
            lines.append(f"| {data_name} | ours packed / ours padded | | | {res['ours packed']['tokens_per_s'] / res['ours padded']['tokens_per_s']:.2f}× | | | | | | | |")
        out['runs'][data_name] = res
    print('\n'.join([header] + lines), flush=True)
    print("- tokens/s: real (non-padding) tokens over steps 2..N; MFU = model FLOPs/s ÷ peak, model FLOPs = 6·N·tokens + "
          "12·L·d·(causal query-key pairs within documents) (`flops`); memory: torch.cuda.max_memory_allocated of the process")
    if args.json: Path(args.json).write_text(json.dumps(out, indent=1, default=str))


def profile_main(args):
    """One padded step of the same 8 rows, in this process: sft_nb's worker code (`FSDPWorker.forward_backward` +
    `optim_step`, what the Ray actor runs) vs TRL (`training_step` + clip + optimizer step), timed and profiled."""
    import numpy as np, torch, trl
    from datasets import Dataset
    from transformers import AutoTokenizer
    from sft_nb.backends.fsdp import FSDPWorker
    from sft_nb.collate import collate_padded
    from sft_nb.config import ModelConfig, OptimConfig
    from sft_nb.models import smollm2_instruct, tiny_chat_model
    from torch.profiler import profile, ProfilerActivity
    torch.set_num_threads(args.threads)
    name = args.models.split(',')[0]
    folder = {'smollm2': smollm2_instruct, 'tiny': tiny_chat_model}[name]()
    data = prepare(folder, args.max_length)
    keep = data['keep']
    ids = [keep[k] for k in np.random.default_rng(0).permutation(len(keep))[:args.batch]]  # = our padded step 1
    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token is None: tok.pad_token = tok.eos_token
    batch = collate_padded([{'input_ids': data['ours'][i][0], 'loss_mask': data['ours'][i][1]} for i in ids], tok.pad_token_id)
    n_trained, n_real = batch.pop('n_trained'), batch.pop('n_real')
    print(f"profile: {name}, {args.batch} rows, {n_real} real tokens, batch shape {tuple(batch['input_ids'].shape)}, "
          f"{n_trained} trained, {args.threads} threads")
    w = FSDPWorker(0, 1, model=ModelConfig(path=str(folder)), optim=OptimConfig(lr=args.lr, schedule='constant'),
                   total_steps=100)
    w.setup()
    ours = lambda: (w.forward_backward([batch], n_trained), w.optim_step())

    tok.chat_template = data['template']
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation='sdpa')
    with tempfile.TemporaryDirectory() as tmp:
        cfg = trl.SFTConfig(output_dir=tmp, per_device_train_batch_size=args.batch, max_steps=100, learning_rate=args.lr,
                            lr_scheduler_type='constant', adam_beta2=0.95, max_length=args.max_length, assistant_only_loss=True,
                            gradient_checkpointing=False, report_to=[], use_cpu=True, bf16=False, save_strategy='no', disable_tqdm=True)
        tr = trl.SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_list([{'messages': data['messages'][i]} for i in ids]),
                            processing_class=tok)
        tr.create_optimizer_and_scheduler(num_training_steps=100)
        inputs = tr.data_collator([tr.train_dataset[i] for i in range(len(ids))])
        assert torch.equal(inputs['input_ids'], batch['input_ids'][:, :inputs['input_ids'].shape[1]]), 'different batches'
        def trl_step():
            model.train()
            tr.training_step(model, inputs, torch.tensor(n_trained))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            tr.optimizer.step(); tr.optimizer.zero_grad(set_to_none=True)
        res = {}
        for label, fn in (('sft_nb worker step', ours), ('TRL step', trl_step)):
            fn()  # warm-up
            ts = []
            for _ in range(args.profile_steps):
                t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            res[label] = ts
            print(f"\n### {label}: {args.profile_steps} timed steps {[round(x, 3) for x in ts]} s, median {statistics.median(ts):.3f} s "
                  f"({n_real / statistics.median(ts):,.0f} real tokens/s); torch.profiler, one more step, top ops by self CPU time:\n")
            print(prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=args.profile_rows, max_name_column_width=50))
    a, b = (statistics.median(res[k]) for k in ('sft_nb worker step', 'TRL step'))
    print(f"in-process step: sft_nb worker {a:.3f} s vs TRL {b:.3f} s (sft_nb / TRL time = {a / b:.2f})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--models', default='smollm2,tiny', help='comma list of smollm2, tiny')
    p.add_argument('--methods', default=','.join(m.replace(' ', '_') for m in METHODS), help='comma list of ' + ', '.join(m.replace(' ', '_') for m in METHODS))
    p.add_argument('--steps-smollm2', type=int, default=6)
    p.add_argument('--steps-tiny', type=int, default=30)
    p.add_argument('--steps-gpu', type=int, default=30)
    p.add_argument('--batch', type=int, default=8, help='global batch: rows (padded) or packed rows (packed)')
    p.add_argument('--micro-batch', type=int, default=None, help='ours: micro-batch size (default = batch)')
    p.add_argument('--max-length', type=int, default=512)
    p.add_argument('--lr', type=float, default=5e-5)
    p.add_argument('--threads', type=int, default=2, help='torch threads (TRL, in this process) = cpus_per_worker (ours)')
    p.add_argument('--repeats-smollm2', type=int, default=1, help='run every SmolLM2 method this many times (alternating order); medians are reported')
    p.add_argument('--repeats-tiny', type=int, default=3, help='the same for the tiny model')
    p.add_argument('--json', default=None, help='write every per-step number here')
    p.add_argument('--gpu', action='store_true', help='CUDA: SmolLM2 bf16, ours vs TRL, packed vs padded, mixed/uniform data: tokens/s, MFU, memory')
    p.add_argument('--dry-run', action='store_true', help='with --gpu: run the GPU code path on CPU with the tiny model (3 steps, fp32)')
    p.add_argument('--datasets', default='mixed,uniform', help='--gpu: comma list of mixed (alpaca lengths), uniform (one length)')
    p.add_argument('--model-folder', default=None, help='--gpu: the model folder (default: SmolLM2-135M-Instruct; tools/gpu_check.sh builds random-weight ones from configs)')
    p.add_argument('--data', default=None, help='--gpu: the mixed-length rows (default: ../shared/datasets/alpaca_en_demo.json)')
    p.add_argument('--peak-tflops', type=float, default=None, help='peak dense bf16 TFLOP/s of the GPU (default: looked up by device name)')
    p.add_argument('--interleave', choices=('auto', 'all', 'pairs'), default='auto',
                   help="all: the 4 methods step by step together; pairs: ours/TRL padded, then ours/TRL packed (less memory); "
                        "auto: pairs for smollm2 (4 fp32 copies with Adam and activations do not fit in 24 GB), all for tiny")
    p.add_argument('--ray-niceness', type=int, default=0, help="niceness of our Ray workers (Ray's own default is 15; -1 = leave Ray's default)")
    p.add_argument('--compile', action='store_true', help='also ours padded and packed with model.compile (compiled decoder blocks), in the same run')
    p.add_argument('--max-load', type=float, default=None, help='refuse to run (exit 2) above this 1-minute load average (default: 0.5 per CPU)')
    p.add_argument('--ignore-load', action='store_true', help='run on a loaded machine anyway (the report says so)')
    p.add_argument('--profile', action='store_true', help='profile one padded step of ours (worker code, in-process) and of TRL (first of --models)')
    p.add_argument('--profile-steps', type=int, default=3)
    p.add_argument('--profile-rows', type=int, default=25)
    args = p.parse_args()
    # Ray starts its worker processes at niceness 15 unless told otherwise; on a shared, busy machine that starves our
    # workers against TRL (which runs in this process, at niceness 0). Same priority for both by default.
    if args.ray_niceness >= 0: os.environ['RAY_worker_niceness'] = str(args.ray_niceness)
    args.methods = args.methods.replace('_', ' ')
    warnings.filterwarnings('ignore')
    profile_main(args) if args.profile else gpu_main(args) if args.gpu else cpu_main(args)


if __name__ == '__main__':
    main()
