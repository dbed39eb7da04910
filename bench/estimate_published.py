"""`sft_nb.memory.estimate` beside published per-GPU memory figures of other tools, for the same model shapes and run settings.

    python bench/estimate_published.py [--cases titan-8b-fsdp8,...]

Each model is its `config.json` alone (the architecture the source names), written under build/published/; each estimate
runs in its own process (one fake process group per process). The published figures and their settings, as the
sources state them (read 2026-12-04):

- torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Table 1 and 3: Llama 3.1 8B, FSDP over 8 (128) H100s of
  96 GB, local batch 2 of 8,192 tokens, selective activation checkpointing, bf16 compute with fp32 master weights and
  fp32 gradient reduction, AdamW; "Memory(GiB)" 82.4 (8 GPUs) and 67.0 (128 GPUs), most likely peak reserved (the
  console's `memory:` line at that commit).
- DeepSpeed, docs/code-docs/source/memory.rst: ZeRO-3 model states per GPU = 4 x largest layer's params + 18 x params /
  GPUs bytes (fp32 weights, gradients and both Adam moments, plus fp16 weights); no activations.
- accelerate, `accelerate estimate-memory` (src/accelerate/commands/estimate.py): float32 training with Adam = 4 x the
  model's fp32 size (the largest of weights, gradients, Adam's two moments, "step"), one GPU, no activations.
- torchtune, README "optimization flags" table: Llama 3.2 3B on one A100, batch 2 packed to 4,096 tokens, bf16
  everything (no fp32 master weights: torchtune trains in pure bf16), compile, chunked cross-entropy, activation
  checkpointing: "Peak Memory Active" 24.9 GiB. The same table's LoRA and QLoRA rows (LoRA on q, v, output and the MLP,
  rank 64, alpha 128, per recipes/configs/llama3_2/3B_lora_single_device.yaml; "each technique is added on top of the
  previous one, except for LoRA and QLoRA, which do not use optimizer_in_bwd or AdamW8bit", so activation offloading on):
  8.5 and 4.6 GiB.
- torchtune, README "Memory and training speed" table (at bd2a0fc): Llama 3.1 8B on one RTX 4090 (24 GB), batch 2, a
  dataset packed to 2,048 tokens, compile on; recipes/configs/llama3_1/8B_lora_single_device.yaml and 8B_qlora_...:
  LoRA rank 8, alpha 16 on q, v, output and the MLP, bf16, activation checkpointing, chunked linear cross-entropy:
  "Peak Memory per GPU" LoRA 16.2 GiB, QLoRA 7.4 GiB.
- Unsloth, README "Context length benchmarks" (at 845e61d): Llama 3.1 8B Instruct, 4-bit QLoRA on q, k, v, o, gate, up
  and down, rank 32, batch 1, rows padded to the length: the longest row on a 24 GB / 80 GB GPU, Unsloth 78,475 /
  342,733 tokens (its gradient checkpointing offloads the kept activations to host memory, and its loss is chunked),
  Hugging Face + FA2 5,789 / 28,454 (checkpointing on the GPU, the whole logits at once). These are longest rows, not
  peaks: the plan's longest row with the same levers (`fit_levers`, the config's own combination) beside each.
"""
import sys
from pathlib import Path
sys.path = [p for p in sys.path if Path(p or '.').resolve() != Path(__file__).resolve().parent]  # bench/tokenize.py shadows the stdlib
import argparse, json, os, subprocess

ROOT = Path(__file__).resolve().parent.parent
LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False)
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, max_position_embeddings=4096, tie_word_embeddings=False)
LLAMA32_3B = dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                  num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True)
BF16 = ['model.dtype=bfloat16']
TUNE_LORA = ["model.lora_target_modules=['q_proj','v_proj','o_proj','gate_proj','up_proj','down_proj']", 'model.loss_chunk=512',
             'model.activation_checkpointing=full', 'train.micro_batch_size=2']
# name: (model, gpus, nodes, GiB a GPU, overrides, published GiB, what it counts)
CASES = {
    'titan-8b-fsdp8': (LLAMA31_8B, 8, 1, 96, BF16 + ['model.activation_checkpointing=selective', 'tokenize.max_length=8192',
                       'train.micro_batch_size=2'], 82.4, 'torchtitan peak (reserved)'),
    'titan-8b-fsdp128': (LLAMA31_8B, 8, 16, 96, BF16 + ['model.activation_checkpointing=selective', 'tokenize.max_length=8192',
                         'train.micro_batch_size=2'], 67.0, 'torchtitan peak (reserved)'),
    'accelerate-llama2-7b': (LLAMA2_7B, 1, 1, 141, ['model.dtype=float32', 'tokenize.max_length=512', 'train.micro_batch_size=1'],
                             4 * 6738415616 * 4 / 2**30, 'accelerate: 4 x fp32 size, no activations'),
    'torchtune-3b': (LLAMA32_3B, 1, 1, 80, BF16 + ['model.activation_checkpointing=full', 'tokenize.max_length=4096',
                     'train.micro_batch_size=2'], 24.9, 'torchtune peak active, pure bf16'),
    'torchtune-3b-lora': (LLAMA32_3B, 1, 1, 80, BF16 + TUNE_LORA + ['model.lora_r=64', 'model.lora_alpha=128', 'tokenize.max_length=4096',
                          'model.activation_offload=true'], 8.5, 'torchtune peak active, LoRA r64, offload'),
    'torchtune-3b-qlora': (LLAMA32_3B, 1, 1, 80, BF16 + TUNE_LORA + ['model.lora_r=64', 'model.lora_alpha=128', 'tokenize.max_length=4096',
                           'model.activation_offload=true', 'model.quantize=nf4'], 4.6, 'torchtune peak active, QLoRA r64, offload'),
    'torchtune-8b-lora': (LLAMA31_8B, 1, 1, 24, BF16 + TUNE_LORA + ['model.lora_r=8', 'tokenize.max_length=2048'], 16.2,
                          'torchtune peak per GPU, LoRA r8'),
    'torchtune-8b-qlora': (LLAMA31_8B, 1, 1, 24, BF16 + TUNE_LORA + ['model.lora_r=8', 'tokenize.max_length=2048', 'model.quantize=nf4'],
                           7.4, 'torchtune peak per GPU, QLoRA r8'),
}

UNSLOTH = BF16 + ["model.lora_target_modules=['q_proj','k_proj','v_proj','o_proj','gate_proj','up_proj','down_proj']",
                  'model.lora_r=32', 'model.lora_alpha=32', 'model.quantize=nf4', 'model.activation_checkpointing=full',
                  'train.micro_batch_size=1', 'tokenize.max_length=4096', 'tokenize.extend_context=true']
# name: (model, GiB a GPU, overrides, published longest row, what it is); one GPU
LONGEST = {
    'unsloth-8b-24gb': (LLAMA31_8B, 24, UNSLOTH + ['model.activation_offload=true'], 78475, 'Unsloth: offloaded checkpointing, chunked loss'),
    'unsloth-8b-80gb': (LLAMA31_8B, 80, UNSLOTH + ['model.activation_offload=true'], 342733, 'Unsloth: offloaded checkpointing, chunked loss'),
    'hf-fa2-8b-24gb': (LLAMA31_8B, 24, UNSLOTH + ['model.loss_chunk=0'], 5789, 'HF + FA2: checkpointing, whole logits'),
    'hf-fa2-8b-80gb': (LLAMA31_8B, 80, UNSLOTH + ['model.loss_chunk=0'], 28454, 'HF + FA2: checkpointing, whole logits'),
}


def config_dir(arch: dict) -> Path:
    from transformers import LlamaConfig
    d = ROOT / 'build' / 'published' / f"llama-h{arch['hidden_size']}-l{arch['num_hidden_layers']}-v{arch['vocab_size']}"
    if not (d / 'config.json').exists(): LlamaConfig(**arch).save_pretrained(d)
    return d


def fresh_process(code: str) -> dict:
    "The JSON the last line of `code`'s output holds, `code` run in a fresh process (one fake process group each)."
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    if out.returncode: raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def estimate_case(name: str) -> dict:
    arch, gpus, nodes, mem, over, *_ = CASES[name]
    code = ("import json; from sft_nb.config import load_config; from sft_nb.memory import estimate; "
            f"p = estimate(load_config(None, {[f'model.path={config_dir(arch)}'] + over!r}), gpus={gpus}, nodes={nodes}, gpu_memory={mem}); "
            "r = p['ranks'][0]; print(json.dumps({'peak': r['peak'], 'parts': r['parts'], 'at_peak': r['at_peak'], 's': p['estimate_s'], 'fits': p['fits']}))")
    return fresh_process(code)


def longest_case(name: str) -> dict:
    arch, mem, over, *_ = LONGEST[name]
    code = ("import json; from sft_nb.config import load_config; from sft_nb.memory import fit_levers; "
            f"p = fit_levers(load_config(None, {[f'model.path={config_dir(arch)}'] + over!r}), gpu_memory={mem}, others=False); "
            "(r,) = p['rows']; print(json.dumps({'longest_row': r['longest_row'], 'peak': r['peak'], 's': p['fit_s']}))")
    return fresh_process(code)


def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--cases', default=','.join([*CASES, *LONGEST]))
    a = ap.parse_args()
    g = lambda b: f"{b / 2**30:.2f}"
    print(f"load avg {os.getloadavg()[0]:.1f}; rank 0, GiB")
    for name in a.cases.split(','):
        if name in LONGEST:
            arch, mem, over, pub, what = LONGEST[name]
            p = longest_case(name)
            print(f"{name}: 1 rank of {mem} GiB; the plan's longest row {p['longest_row']:,} tokens (its peak {g(p['peak'])} on "
                  f"rows of 4,096); published {pub:,} ({what}); plan / published {p['longest_row'] / pub:.2f}; fitted in {p['s']:.0f} s", flush=True)
            continue
        arch, gpus, nodes, mem, over, pub, what = CASES[name]
        p = estimate_case(name)
        states = sum(p['parts'][k] for k in ('weights', 'gradients', 'optimizer'))
        print(f"{name}: {gpus * nodes} ranks; estimate peak {g(p['peak'])} (states {g(states)}: " + ', '.join(f"{k} {g(v)}" for k, v in p['parts'].items())
              + f"; at the peak: " + ', '.join(f"{k} {g(v)}" for k, v in p['at_peak'].items()) + f"); published {pub:.2f} ({what}); "
              f"estimate / published {p['peak'] / 2**30 / pub:.2f}; estimated in {p['s']:.0f} s", flush=True)


if __name__ == '__main__': main()
