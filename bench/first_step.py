"""Time to the first training step in a fresh process: sft_nb's `SFTTrainer` (its worker under Ray, and in this process with
`placement.in_process`) vs TRL 1.16's `SFTTrainer`, side by side.

    .venv/bin/pip install --no-deps -r bench/requirements.txt   # TRL, for the peer only
    HF_HUB_OFFLINE=1 python bench/first_step.py [--models tiny smollm2] [--repeats 3]

Each run is a new Python process (`python bench/first_step.py --child METHOD MODEL`), so imports, Ray's start, the worker
processes and the model load all count, as they do for a user in a fresh kernel. The methods take turns (the order rotates
each repeat) so a changing machine load hits all alike; the best total of `--repeats` is kept. Methods: `ray` (ours, the
default placement: a local Ray node and one worker actor), `local` (ours, `placement.in_process`: the worker in the
driver's process, no Ray) and `trl`. Both train on the same 64
identity conversations (`sft_nb.demo_data.identity_rows`), global batch 8, one micro-batch, fp32, 2 threads (ours: one
worker with `cpus_per_worker=2`; TRL: `torch.set_num_threads(2)` in its process). TRL trains on every token of the
conversation (its default for `messages` rows), ours on the assistant's: the compute of a step is the same.

Phases: *import* (`import sft_nb.trainer` / `import trl` and the transformers classes it uses), *setup* (ours: tokenizer,
tokenization, Ray, worker, model, optimizer; TRL: tokenizer, model, `SFTTrainer(...)` with its dataset preparation),
*first step* (ours: `trainer.step()`; TRL: `train()` up to the end of step 1), and *total*: from the parent's `Popen` to the
end of step 1 (interpreter start included). Ours also builds a **second trainer in the same process** after `shutdown()`
(new run folder, same placement) and times it to its first step: the cost a notebook user pays when re-running a cell.
Peak RSS: the driver process (`ru_maxrss`); ours also lists its worker's (VmHWM) — TRL has one process.
"""
import sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
import argparse, json, os, subprocess, tempfile, time

ROOT = Path(__file__).resolve().parents[1]
ENV = {'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1', 'TOKENIZERS_PARALLELISM': 'false', 'RAY_USAGE_STATS_ENABLED': '0',
       'RAY_AUTH_MODE': 'disabled', 'TRANSFORMERS_VERBOSITY': 'error'}
ROWS, BATCH, THREADS = 64, 8, 2


def rows_file(folder: str) -> str:
    from sft_nb.demo_data import identity_rows
    p = os.path.join(folder, 'rows.jsonl')
    Path(p).write_text('\n'.join(json.dumps(r) for r in identity_rows()['train'][:ROWS]) + '\n')
    return p


def ours(model: str, folder: str, t0: float, in_process: bool) -> dict:
    from sft_nb.trainer import SFTTrainer
    t_import = time.perf_counter()
    data = rows_file(folder)
    def cfg(run): return {'model': {'path': model}, 'data': {'train': [{'path': data}]}, 'tokenize': {'max_length': 512},
                          'train': {'global_batch_size': BATCH, 'micro_batch_size': BATCH, 'num_steps': 2},
                          'placement': {'workers_per_node': 1, 'cpus_per_worker': THREADS, 'in_process': in_process},
                          'checkpoint': {'run_dir': os.path.join(folder, run), 'export_hf': False}, 'logging': {'trackers': []}}
    t = SFTTrainer(cfg('run1')).setup()
    t_setup = time.perf_counter()
    loss = t.step()['loss']
    out = {'import': t_import - t0, 'setup': t_setup - t_import, 'step': time.perf_counter() - t_setup, 'end': time.time(), 'loss': loss}
    vmhwm = lambda w: int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 2**20
    if not in_process: out['worker_peak_gb'] = t.backend.run(vmhwm)[0]  # the worker actor's process
    t.shutdown()
    s0 = time.perf_counter()
    t2 = SFTTrainer(cfg('run2')).setup()
    s1 = time.perf_counter()
    loss2 = t2.step()['loss']
    out.update(second_setup=s1 - s0, second_step=time.perf_counter() - s1, second_total=time.perf_counter() - s0, second_loss=loss2)
    t2.shutdown()
    return out


def trl_run(model: str, folder: str, t0: float) -> dict:
    import torch, trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from sft_nb.models import resolve_model_path
    t_import = time.perf_counter()
    torch.set_num_threads(THREADS)
    path = resolve_model_path(model)
    from sft_nb.demo_data import identity_rows
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None: tok.pad_token = tok.eos_token
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ds = Dataset.from_list(identity_rows()['train'][:ROWS])
    marks = {}

    class First(TrainerCallback):
        def on_step_begin(s, *a, **k): marks.setdefault('begin', time.perf_counter())
        def on_step_end(s, args, state, control, **k):
            marks['end'], marks['wall'] = time.perf_counter(), time.time(); control.should_training_stop = True

    cfg = trl.SFTConfig(output_dir=os.path.join(folder, 'trl'), per_device_train_batch_size=BATCH, max_steps=2, max_length=512,
                        report_to=[], use_cpu=True, save_strategy='no', eval_strategy='no', logging_steps=1,
                        gradient_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True, seed=0)
    tr = trl.SFTTrainer(model=m, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[First()])
    t_setup = time.perf_counter()
    tr.train()
    return {'import': t_import - t0, 'setup': t_setup - t_import, 'step': marks['end'] - t_setup, 'end': marks['wall']}


def child(method: str, model: str):
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix='first_step_') as folder:
        out = trl_run(model, folder, t0) if method == 'trl' else ours(model, folder, t0, in_process=method == 'local')
    import resource
    out['peak_gb'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print('RESULT ' + json.dumps(out), flush=True)


def run(method: str, model: str) -> dict:
    start = time.time()
    p = subprocess.run([sys.executable, __file__, '--child', method, model], capture_output=True, text=True,
                       env={**os.environ, **ENV}, cwd=ROOT)
    line = next((l for l in p.stdout.splitlines() if l.startswith('RESULT ')), None)
    if line is None: raise RuntimeError(f"{method} {model} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    r = json.loads(line[7:])
    r['total'] = r['end'] - start
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--models', nargs='*', default=['tiny', 'smollm2'])
    ap.add_argument('--repeats', type=int, default=3)
    ap.add_argument('--child', nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child: return child(*a.child)
    print(f"load avg {os.getloadavg()[0]:.1f} at the start; {os.cpu_count()} CPUs; best total of {a.repeats}, alternating")
    for model in a.models:
        methods = ('ray', 'local', 'trl')
        runs = {m: [] for m in methods}
        for i in range(a.repeats):
            for method in methods[i % 3:] + methods[:i % 3]:  # each method goes first once in three
                r = run(method, model); runs[method].append(r)
                print(f"  {model} {method} #{i + 1}: total {r['total']:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
        best = {m: min(rs, key=lambda r: r['total']) for m, rs in runs.items()}
        print(f"\n{model}: {'method':<6}{'import':>8}{'setup':>8}{'step 1':>8}{'total':>8}{'peak GiB':>10}")
        for m, r in best.items():
            extra = f"  (worker {r['worker_peak_gb']:.2f})" if 'worker_peak_gb' in r else ''
            print(f"{'':<{len(model) + 2}}{m:<6}{r['import']:>8.1f}{r['setup']:>8.1f}{r['step']:>8.1f}{r['total']:>8.1f}"
                  f"{r['peak_gb']:>10.2f}{extra}")
        for m in ('ray', 'local'):
            sec = min(r['second_total'] for r in runs[m])
            print(f"{model}: ours ({m}) / TRL total {best[m]['total'] / best['trl']['total']:.2f}x; a second trainer in "
                  f"the same process: first step after {sec:.1f} s (setup {min(r['second_setup'] for r in runs[m]):.1f} s), "
                  f"loss equal to the first's: {all(r['loss'] == r['second_loss'] for r in runs[m])}", flush=True)
        print(f"{model}: first-step loss, ray vs local: {best['ray']['loss']!r} vs {best['local']['loss']!r}\n", flush=True)


if __name__ == '__main__': main()
