"""Per-worker peak host memory (VmHWM, absolute) of FSDP2 worker setup from a random ~310M-parameter Qwen2 saved as
safetensors (fp32, ~1.2 GiB = W), 2 and 3 CPU (gloo) workers, side by side in one run:

- `every_rank` (this tree): each rank reads the whole checkpoint (`from_pretrained`), then shards;
- `scatter` (git `--main`, its `model.load: rank0`): rank 0 reads it, the others build on `meta`, rank 0 scatters each
  parameter's rows: measured from main's own code (a `git archive` of it), not a copy kept here;
- `slices` (this tree, the default): every rank builds on `meta` and reads only its own rows from the safetensors files.

Then Megatron-core, 2 TP ranks on the same checkpoint: `whole` (git `--megatron-ref`'s code: each rank reads the whole
state dict, then keeps its part) against `parts` (this tree: each rank reads only its rows and columns of each tensor).

Each rank reports its RSS after imports (before setup), its peak (VmHWM) after setup and the setup time; the node's
sum is the sum of its ranks' peaks. Then the issue's targets: 2 workers every rank <= 1.1 W and rank 0 <= 1.25x the
smallest rank; 3 workers the node's sum >= 40% below every_rank's; load time no slower than the scatter. Memory-heavy:
run it alone.

    python bench/load_memory.py [--main REF] [--megatron-ref REF] [--layers 24] [--only fsdp|megatron]
"""
import sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
import argparse, json, os, subprocess, tempfile, time

ROOT = Path(__file__).resolve().parents[1]


def status_gib(field: str) -> float:
    "VmRSS (now) or VmHWM (peak) of this process from /proc/self/status. Not ru_maxrss: Linux carries it across exec from the parent."
    line = next(l for l in open('/proc/self/status') if l.startswith(field + ':'))
    return int(line.split()[1]) / 2**20


def worker(a):
    "One rank: set up an FSDPWorker (or a MegatronWorker, TP over all ranks) on the model folder and print its RSS before and its peak after setup (JSON)."
    import torch
    from sft_nb.config import ModelConfig, OptimConfig
    if a.load == 'megatron':
        from sft_nb.backends.megatron import MegatronWorker
        w = MegatronWorker(a.rank, a.world, ModelConfig(path=a.model), OptimConfig(), total_steps=1,
                           placement={'tensor_parallel': a.world})
    else:
        from sft_nb.backends.fsdp import FSDPWorker
        w = FSDPWorker(a.rank, a.world, ModelConfig(path=a.model, load=a.load), OptimConfig(), total_steps=1)
    w.init_dist('127.0.0.1', a.port)
    import transformers.models.qwen2.modeling_qwen2, torch.distributed.fsdp, torch.distributed.checkpoint.state_dict  # noqa: F401
    if a.load == 'megatron': import megatron.core.models.gpt, safetensors.torch  # noqa: F401
    before = status_gib('VmRSS')  # after the imports setup would do: what follows is the loading's own memory
    t0 = time.perf_counter()
    info = w.setup()
    secs = time.perf_counter() - t0
    import gc; gc.collect()
    print(json.dumps({'rank': a.rank, 'before': before, 'peak': status_gib('VmHWM'), 'after': status_gib('VmRSS'), 'setup_s': secs,
                      'n_params': info['n_params']}))
    w.shutdown()


def build_model(d: Path, layers: int) -> int:
    "A random Qwen2 (hidden 1024, GQA 8/2 heads, MLP 2816, vocab 32000, tied) saved as safetensors; its weight bytes."
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config
    from sft_nb.models import tiny_chat_model
    cfg = Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    m.save_pretrained(d, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_chat_model()).save_pretrained(d)
    del m
    return sum(f.stat().st_size for f in d.glob('*.safetensors'))


def run(src: Path, model: Path, world: int, load: str) -> list[dict]:
    "Start `world` rank processes on the code at `src`; their reports, by rank."
    sys.path.insert(0, str(ROOT)); from sft_nb.workers import free_port
    port, env = free_port(), {**os.environ, 'PYTHONPATH': str(src), 'OMP_NUM_THREADS': '1'}
    cmd = [sys.executable, __file__, '--worker', '--world', str(world), '--port', str(port), '--model', str(model), '--load', load]
    procs = [subprocess.Popen(cmd + ['--rank', str(r)], env=env, stdout=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs): raise RuntimeError(f"{src} world={world} load={load}: exit codes {[p.returncode for p in procs]}")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--worker', action='store_true'); ap.add_argument('--rank', type=int, default=0)
    ap.add_argument('--world', type=int, default=1); ap.add_argument('--port', type=int, default=0)
    ap.add_argument('--model'); ap.add_argument('--load')
    ap.add_argument('--main', default='3fe3b79', help='git ref whose scatter loading (model.load: rank0) is measured (3fe3b79: the last main that had it)')
    ap.add_argument('--megatron-ref', default='fc28d16', help="git ref whose Megatron loading (each rank reads the whole checkpoint) is measured")
    ap.add_argument('--layers', type=int, default=24)
    ap.add_argument('--only', choices=('fsdp', 'megatron'))
    a = ap.parse_args()
    if a.worker: return worker(a)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp); model = tmp / 'model'
        wbytes = build_model(model, a.layers)
        W = wbytes / 2**30
        if a.only != 'megatron': fsdp(a, tmp, model, W)
        if a.only != 'fsdp': megatron(a, tmp, model, W)


def archive(ref: str, to: Path) -> Path:
    "The sft_nb package of git `ref`, unpacked under `to`."
    to.mkdir()
    subprocess.run(f"git -C {ROOT} archive {ref} sft_nb | tar -x -C {to}", shell=True, check=True)
    return to


def megatron(a, tmp: Path, model: Path, W: float):
    "2 TP ranks: git `--megatron-ref`'s whole-checkpoint read against this tree's own parts, VmHWM per rank and the node's sum."
    old = archive(a.megatron_ref, tmp / 'megatron_ref')
    print(f"\nMegatron-core, tensor_parallel 2, W = {W:.2f} GiB; whole = git {a.megatron_ref} (each rank reads the whole checkpoint); load avg {os.getloadavg()[0]:.1f}; GiB")
    print(f"{'loading':<12}{'rank':>5}{'RSS before':>11}{'VmHWM':>7}{'VmHWM/W':>9}{'setup s':>8}")
    sums = {}
    for name, src in (('whole', old), ('parts', ROOT)):
        rs = run(src, model, 2, 'megatron')
        for r in rs: print(f"{name:<12}{r['rank']:>5}{r['before']:>11.2f}{r['peak']:>7.2f}{r['peak'] / W:>9.2f}{r['setup_s']:>8.1f}", flush=True)
        sums[name] = sum(r['peak'] for r in rs)
    print(f"node sum: whole {sums['whole']:.2f}, parts {sums['parts']:.2f} GiB ({sums['parts'] / sums['whole']:.2f}x)")


def fsdp(a, tmp: Path, model: Path, W: float):
    "every_rank, git `--main`'s scatter and slices at 2 and 3 workers, and the issue's targets."
    old = archive(a.main, tmp / 'main')
    rev = subprocess.run(['git', '-C', str(ROOT), 'rev-parse', '--short', a.main], capture_output=True, text=True).stdout.strip()
    print(f"weights W = {W:.2f} GiB safetensors; scatter = git {a.main} ({rev}) model.load: rank0; load avg {os.getloadavg()[0]:.1f}; GiB")
    print(f"{'loading':<12}{'workers':>8}{'rank':>5}{'RSS before':>11}{'VmHWM':>7}{'VmHWM/W':>9}{'setup s':>8}")
    got = {}
    for world in (2, 3):
        for name, src, load in (('every_rank', ROOT, 'every_rank'), ('scatter', old, 'rank0'), ('slices', ROOT, 'slices')):
            got[name, world] = rs = run(src, model, world, load)
            for r in rs:
                print(f"{name:<12}{world:>8}{r['rank']:>5}{r['before']:>11.2f}{r['peak']:>7.2f}{r['peak'] / W:>9.2f}{r['setup_s']:>8.1f}", flush=True)
    print(f"\n{'loading':<12}{'workers':>8}{'node sum':>9}{'sum/every_rank':>15}{'max rank/W':>11}{'rank0/min':>10}{'max setup s':>12}")
    for (name, world), rs in got.items():
        peaks = [r['peak'] for r in rs]
        ref = sum(r['peak'] for r in got['every_rank', world])
        print(f"{name:<12}{world:>8}{sum(peaks):>9.2f}{sum(peaks) / ref:>15.2f}{max(peaks) / W:>11.2f}{peaks[0] / min(peaks):>10.2f}"
              f"{max(r['setup_s'] for r in rs):>12.1f}")
    s2, s3 = got['slices', 2], got['slices', 3]
    p2 = [r['peak'] for r in s2]
    t_new = max(r['setup_s'] for r in s2 + s3); t_old = max(r['setup_s'] for r in got['scatter', 2] + got['scatter', 3])
    checks = {'2 workers: every rank <= 1.1 W': max(p2) <= 1.1 * W,
              '2 workers: rank 0 <= 1.25 x smallest rank': p2[0] <= 1.25 * min(p2),
              '3 workers: node sum >= 40% below every_rank': sum(r['peak'] for r in s3) <= 0.6 * sum(r['peak'] for r in got['every_rank', 3]),
              f'load time no slower than scatter ({t_new:.1f} s vs {t_old:.1f} s, slowest rank)': t_new <= t_old}
    print()
    for k, ok in checks.items(): print(f"{'MET ' if ok else 'MISSED'}  {k}")


if __name__ == '__main__': main()
