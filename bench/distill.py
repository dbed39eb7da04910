"""Distillation against plain SFT of the same steps (issue 63): a small student with SmolLM2's tokenizer learns
alpaca_en_demo for N steps, once with `train.loss: nll` (the gold answers) and once with `train.loss: kd` from
SmolLM2-135M-Instruct (a fine-tuned SmolLM2, the teacher), side by side in one process.

    python bench/distill.py                       # 200 steps of 4 rows (at most 256 tokens), 24 held-out prompts
    python bench/distill.py --steps 20 --prompts 4   # a smoke run

The student is SmolLM2's architecture scaled down (hidden 192, 4 blocks, 3 heads, 1 KV head, tied embeddings; its
weights random, seeded) with the teacher's tokenizer saved beside it, so `check_same_tokenizer` accepts the pair. Both
arms: the same 900 training rows in the same order, the same seed, lr, schedule and batches; one in-process FSDP rank,
fp32, sdpa. Reported per arm:

- **held-out eval loss**: the NLL of the 99 held-out rows' gold answers (`evaluate`, token mean);
- **agreement with the teacher**: the teacher answers the first `--prompts` held-out prompts greedily (`--new-tokens`
  tokens at most); on each answer, teacher-forced, the share of its tokens that are the student's most likely next token
  (`token_losses`' top-1), over all the answers' tokens;
- seconds per step (the kd arm runs the teacher's forward too) and the final train loss (kd: the distillation loss).
"""
import os, sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
os.environ.setdefault('HF_HUB_OFFLINE', '1'); os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
os.environ.setdefault('TRANSFORMERS_VERBOSITY', 'error')
import argparse, json, time

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ALPACA = ROOT.parent / 'shared' / 'datasets' / 'alpaca_en_demo.json'
OUT = ROOT / 'build' / 'distill'


def conversations() -> tuple[list[dict], list[dict]]:
    "alpaca_en_demo as chat rows: (900 training rows, 99 held out)."
    rows = []
    for r in json.loads(ALPACA.read_text()):
        user = r['instruction'] + (f"\n\n{r['input']}" if r.get('input') else '')
        rows.append({'messages': [{'role': 'user', 'content': user}, {'role': 'assistant', 'content': r['output']}]})
    return rows[:900], rows[900:]


def student(teacher: Path, seed: int = 0) -> Path:
    "SmolLM2's architecture scaled down, random weights, the teacher's tokenizer (built once under build/distill/)."
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    d = OUT / f'student-s{seed}'
    if (d / 'config.json').exists(): return d
    cfg = AutoConfig.from_pretrained(teacher)
    cfg.update(dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=3,
                    num_key_value_heads=1, tie_word_embeddings=True))
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d)
    AutoTokenizer.from_pretrained(teacher).save_pretrained(d)
    return d


def teacher_answers(teacher: Path, prompts: list[dict], new_tokens: int) -> list[dict]:
    "The teacher's greedy answer to each prompt's user turn, as a chat row to score the student on."
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok, model = AutoTokenizer.from_pretrained(teacher), AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    out = []
    for r in prompts:
        ids = tok.apply_chat_template(r['messages'][:1], add_generation_prompt=True, return_tensors='pt', return_dict=True)
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        text = tok.decode(gen[0, ids['input_ids'].shape[1]:], skip_special_tokens=True).strip()
        out.append({'messages': [r['messages'][0], {'role': 'assistant', 'content': text}]})
    return out


def run_arm(loss: str, folder: Path, teacher: Path, train: list, heldout: list, scored: list, a) -> dict:
    from sft_nb.trainer import SFTTrainer
    cfg = {'model': {'path': str(folder), 'attn_implementation': 'sdpa'},
           'optim': {'lr': a.lr, 'schedule': 'cosine', 'warmup_steps': 10},
           'train': {'global_batch_size': a.batch, 'micro_batch_size': a.batch, 'num_steps': a.steps, 'loss': loss,
                     **({'teacher': str(teacher), 'kd_alpha': a.alpha, 'kd_temperature': a.temperature} if loss == 'kd' else {})},
           'tokenize': {'max_length': a.max_length, 'truncation': 'keep_start'}, 'eval': {'samples': 0},
           'placement': {'workers_per_node': 1, 'in_process': True},
           'checkpoint': {'run_dir': str(OUT / 'runs' / loss), 'export_hf': False, 'overwrite': True},
           'logging': {'trackers': ['jsonl']}}
    with SFTTrainer(cfg, train_data=train, eval_data={'heldout': heldout}) as t:
        t0 = time.perf_counter(); m = t.fit(); s = (time.perf_counter() - t0) / a.steps
        ev = t.evaluate()
        got = t.token_losses(scored)
    hit = n = 0
    for r in got:
        pos = [p for p in range(1, len(r['input_ids'])) if r['loss_mask'][p]]
        hit += sum(int(r['top_ids'][p][0] == r['input_ids'][p]) for p in pos); n += len(pos)
    return {'loss': loss, 'eval_loss': ev['eval_loss'], 'agreement': hit / n, 'scored_tokens': n, 's_per_step': s,
            'train_loss_last10': float(m['loss'].tail(10).mean())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--steps', type=int, default=200)
    ap.add_argument('--batch', type=int, default=4, help='rows a step')
    ap.add_argument('--max-length', type=int, default=256)
    ap.add_argument('--lr', type=float, default=3e-3)
    ap.add_argument('--alpha', type=float, default=0.0, help='train.kd_alpha: the share of NLL in the kd arm')
    ap.add_argument('--temperature', type=float, default=1.0)
    ap.add_argument('--prompts', type=int, default=24)
    ap.add_argument('--new-tokens', type=int, default=48)
    ap.add_argument('--json', default=None)
    a = ap.parse_args(argv)
    from sft_nb.models import smollm2_instruct
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    teacher = smollm2_instruct()
    folder, (train, heldout) = student(teacher), conversations()
    scored = teacher_answers(teacher, heldout[:a.prompts], a.new_tokens)
    arms = [run_arm(loss, folder, teacher, train, heldout, scored, a) for loss in ('nll', 'kd')]
    out = {'steps': a.steps, 'batch': a.batch, 'max_length': a.max_length, 'lr': a.lr, 'kd_alpha': a.alpha, 'kd_temperature': a.temperature, 'prompts': a.prompts,
           'arms': arms, 'load_avg_before': load0, 'load_avg_after': os.getloadavg()[0], 'wall_s': time.perf_counter() - t0}
    print(f"{'arm':<5}{'held-out eval loss':>20}{'agreement':>11}{'s/step':>8}{'train loss (last 10)':>22}")
    for r in arms:
        print(f"{r['loss']:<5}{r['eval_loss']:>20.4f}{r['agreement']:>10.1%}{r['s_per_step']:>8.2f}{r['train_loss_last10']:>22.4f}")
    print(f"agreement over {arms[0]['scored_tokens']} teacher tokens; load {load0:.1f} before, {out['load_avg_after']:.1f} after; "
          f"{out['wall_s']:.0f} s in all")
    if a.json: Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == '__main__':
    main()
