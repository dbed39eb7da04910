#!/usr/bin/env bash
# The GPU check: one command on the one GPU machine this project is lent (an H200 with Python 3.12, torch 2.11,
# transformers 5.17, a scientific stack, no internet; device/KINDS.md), with `.gpu_bundle/` (python tools/gpu_bundle.py)
# carried. It installs the bundle's wheels into a target folder (no network, no .venv), runs each part under its own time
# budget, prints one `VERDICT part: result` line per part (also in $OUT/verdicts.txt) and writes every log to $OUT (or
# ./gpu_check_out). Exit status 1 when a test failed or a part broke, else 0.
#
#   bash tools/gpu_check.sh                                    # on the GPU machine (device run: carry .gpu_bundle)
#   device tool: run(command="bash tools/gpu_check.sh", carry=[".gpu_bundle"], timeout_s=540)
#   PATH=/py3.12-venv/bin:$PATH SFT_NB_GPU_TESTS_ON_CPU=1 bash tools/gpu_check.sh   # the rehearsal here: CPU parts of tests/gpu, the bench's dry run
#
# Parts: env (nvidia-smi, versions); tests/gpu (bf16 FSDP2 with fp32 master weights vs fp32, packed = padded, FlexAttention
# document mask vs dense, chunked loss memory, exact resume, the Ray path on one GPU worker, the dry run vs `sft-nb estimate`,
# Megatron TP=1 vs FSDP); bench/train.py --gpu on random-weight models built from their configs (SmolLM2-135M's
# architecture and a ~1B Llama), ours vs TRL, packed and padded, MFU against the GPU's dense bf16 peak. What one GPU cannot
# run (2-GPU nccl, TransformerEngine's THD and context parallel) is named in its own line.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu_check_out}"; mkdir -p "$OUT_DIR"; : > "$OUT_DIR/verdicts.txt"
# every log in $W; $OUT gets at most 6 files (a device run brings 8 back): verdicts.txt, env.txt, tests_gpu.log, bench.md,
# estimate_vs_dry_run.json (the test writes it) and logs.tar.gz (all of $W)
W="${SFT_NB_CHECK_WORK:-/tmp/sft_nb-gpu-check}"; rm -rf "$W"; mkdir -p "$W"
pack() { cp "$W/env.txt" "$W/tests_gpu.log" "$OUT_DIR/" 2>/dev/null; cat "$W"/bench_*.md > "$OUT_DIR/bench.md" 2>/dev/null
         cp "$OUT_DIR/verdicts.txt" "$W/"; tar czf "$OUT_DIR/logs.tar.gz" -C "$W" . 2>/dev/null; }
trap pack EXIT
PY="${PYTHON:-python3}"
SITE="${SFT_NB_SITE:-/tmp/sft_nb-site}"
TOTAL="${TOTAL_BUDGET:-470}"; TEST_BUDGET="${TEST_BUDGET:-230}"; BENCH_BUDGET="${BENCH_BUDGET:-100}"; BENCH_STEPS="${BENCH_STEPS:-10}"
BUNDLE="$PWD/.gpu_bundle"
t0=$SECONDS; rc=0
say() { echo "VERDICT $1: $2" | tee -a "$OUT_DIR/verdicts.txt"; }
left() { local l=$((TOTAL - (SECONDS - t0) - ${2:-0})); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }  # a budget, cut to what TOTAL leaves

[ -d "$BUNDLE/wheels" ] || { say install "FAILED: no .gpu_bundle/ (python tools/gpu_bundle.py here, then carry .gpu_bundle)"; exit 1; }
if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$BUNDLE"/wheels/*.whl \
     > "$W/install.log" 2>&1; then say install "ok: $(ls "$BUNDLE"/wheels | wc -l) wheels into $SITE in $((SECONDS - t0)) s"
else say install "FAILED (install.log)"; exit 1; fi
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 \
       RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# env
{ date -u; nvidia-smi || echo "nvidia-smi: not here"; } > "$W/env.txt" 2>&1
env_line=$("$PY" -c "
import sys, torch, transformers, ray, datasets
cuda = torch.cuda.is_available()
print(f\"Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}, datasets {datasets.__version__}; \"
      + (f'{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}' if cuda else 'no CUDA (rehearsal: CPU parts only)'))" 2>>"$W/env.txt") \
  && say env "$env_line" || { say env "FAILED: sft_nb's stack does not import (env.txt)"; exit 1; }
echo "$env_line" >> "$W/env.txt"
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")

# tests/gpu: one verdict line per test, the ones one GPU cannot run named by what they need
t=$SECONDS
# tests/conftest.py's fixtures (it loads without ../shared; its browser fixtures start only when a test asks)
TB=$(left "$TEST_BUDGET" 170)
timeout -k 10 "$TB" "$PY" -m pytest tests/gpu -q -rA -p no:cacheprovider --junitxml="$W/tests_gpu.xml" > "$W/tests_gpu.log" 2>&1
trc=$?
"$PY" - "$W/tests_gpu.xml" >> "$OUT_DIR/verdicts.txt" <<'EOF' || trc=1
import sys, xml.etree.ElementTree as ET
try: cases = ET.parse(sys.argv[1]).getroot().iter('testcase')
except (OSError, ET.ParseError): print('VERDICT tests/gpu: no results (timed out or did not start: tests_gpu.log)'); sys.exit(1)
n = {'passed': 0, 'failed': 0, 'skipped': 0}
PART = {'test_ray_worker_nccl_one_gpu': 'the Ray path (SFTTrainer, 1 worker, nccl world size 1)',
        'test_bf16_fsdp2_keeps_fp32_master_weights': 'bf16 FSDP2, fp32 master weights', 'test_bf16_packed_equals_padded': 'packed = padded, bf16',
        'test_bf16_split_invariance': '1x8 = 8x1 micro-batches, bf16', 'test_fp32_chunked_loss_equals_one_shot': 'chunked loss = one-shot, a whole step',
        'test_bf16_resume_exact': 'exact resume', 'test_nccl_two_workers_equal_one': '2 GPUs: nccl 2 workers = 1',
        'test_megatron_tp1_matches_fsdp': 'Megatron TP=1 = FSDP', 'test_dry_run_against_estimate': 'dry run vs sft-nb estimate',
        'test_chunked_ce_exact_fp32_cuda': 'chunked CE kernel, fp32', 'test_chunked_ce_bf16_cuda_and_memory': 'chunked loss peak memory vs one-shot, bf16',
        'test_document_block_mask_compiled_matches_dense': 'FlexAttention document mask = dense', 'test_flex_attention_backward_matches_sdpa': 'FlexAttention forward+backward = sdpa dense',
        'test_thd_packed_equals_padded_and_dense': 'TransformerEngine THD packed = padded = dense', 'test_context_parallel_two_equals_one': '2 GPUs + TE: context parallel 2 = 1'}
for c in cases:
    name = c.get('name'); bad = c.find('failure') if c.find('failure') is not None else c.find('error'); skip = c.find('skipped')
    if bad is not None: n['failed'] += 1; line = f"FAILED: {(bad.get('message') or '').splitlines()[0][:200]}"
    elif skip is not None:  # a module's own skip (needs CUDA, transformer_engine) says why in its text, not its message
        n['skipped'] += 1; why = skip.get('message') or ''
        if why == 'collection skipped': why = (skip.text or '').rstrip(")'").split("'Skipped: ")[-1].split("Skipped: ")[-1]
        line = f"not run: {why.replace('Skipped: ', '')[:200]}"
    else: n['passed'] += 1; line = f"passed ({float(c.get('time') or 0):.1f} s)"
    part = PART.get(name.split('[')[0]); print(f'VERDICT test {name}' + (f' ({part})' if part else '') + f': {line}')
print(f"VERDICT tests/gpu: {n['passed']} passed, {n['failed']} failed, {n['skipped']} not run")
sys.exit(1 if n['failed'] else 0)
EOF
grep -E '^VERDICT (test|tests/gpu)' "$OUT_DIR/verdicts.txt"
[ "$trc" -eq 0 ] || { rc=1; [ "$trc" -eq 124 ] && say tests/gpu "TIMED OUT after $TB s"; }
echo "tests/gpu: $((SECONDS - t)) s" >> "$W/env.txt"

# the bench: random-weight models from their configs (throughput and MFU need no trained weights), ours vs TRL
if [ "$CUDA" = 1 ]; then
  timeout -k 5 "$(left 60)" "$PY" - "$BUNDLE" /tmp/sft_nb-models > "$W/models.log" 2>&1 <<'EOF' || { say models "FAILED or timed out (models.log)"; rc=1; }
import shutil, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
bundle, out = Path(sys.argv[1]), Path(sys.argv[2])
small = AutoConfig.from_pretrained(bundle / 'smollm2')
big = LlamaConfig(**{**small.to_dict(), 'hidden_size': 2048, 'intermediate_size': 8192, 'num_hidden_layers': 16, 'num_attention_heads': 32,
                     'num_key_value_heads': 8, 'head_dim': 64, 'tie_word_embeddings': True})  # Llama-3.2-1B's shape, SmolLM2's vocabulary
for name, cfg in (('smollm2-arch', small), ('llama-1b', big)):
    d = out / name; shutil.rmtree(d, ignore_errors=True)
    torch.manual_seed(0)
    with torch.device('cuda'): m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    m.save_pretrained(d)
    for f in (bundle / 'smollm2').iterdir():
        if f.name.startswith(('tokenizer', 'chat_template', 'special_tokens')): shutil.copy(f, d)
    print(name, sum(p.numel() for p in m.parameters()) / 1e6, 'M parameters')
EOF
  n_left=2
  for name in smollm2-arch llama-1b; do
    t=$SECONDS; BB=$(( $(left 100000 10) / n_left )); [ "$BB" -gt "$BENCH_BUDGET" ] && BB=$BENCH_BUDGET; n_left=$((n_left - 1))
    timeout -k 10 "$BB" "$PY" bench/train.py --gpu --model-folder "/tmp/sft_nb-models/$name" --data "$BUNDLE/rows/alpaca_en_demo.json" \
      --datasets mixed --steps-gpu "$BENCH_STEPS" --json "$W/bench_$name.json" > "$W/bench_$name.md" 2> "$W/bench_$name.log"
    b=$?
    if [ "$b" -eq 0 ]; then say "bench $name" "$(grep -E '^\| mixed \| (ours|trl) (padded|packed)' "$W/bench_$name.md" | awk -F'|' '{gsub(/ /,"",$3); gsub(/ /,"",$6); gsub(/ /,"",$8); printf "%s %s tok/s MFU %s; ", $3, $6, $8}') ($((SECONDS - t)) s)"
    else say "bench $name" "FAILED or timed out after $((SECONDS - t)) s of its $BB s (exit $b, bench_$name.log)"; rc=1; fi
  done
else
  t=$SECONDS
  timeout -k 10 "$(left "$BENCH_BUDGET" 10)" "$PY" bench/train.py --gpu --dry-run --data "$BUNDLE/rows/alpaca_en_demo.json" --datasets mixed \
    --max-length 256 --batch 4 --json "$W/bench_dry_run.json" > "$W/bench_dry_run.md" 2> "$W/bench_dry_run.log"
  b=$?
  [ "$b" -eq 0 ] && say "bench" "dry run on CPU (tiny model, 3 steps: the code path, no GPU number): $(grep -cE '^\| mixed \| (ours|trl) (padded|packed) \|' "$W/bench_dry_run.md") of 4 methods ran ($((SECONDS - t)) s)" \
                 || { say "bench" "dry run FAILED (exit $b, bench_dry_run.log)"; rc=1; }
  # what the GPU bench does first with the bundle (SmolLM2's tokenizer and chat template on the bundle's rows), here too
  t=$SECONDS
  timeout -k 5 "$(left 120 5)" "$PY" - "$BUNDLE" > "$W/bench_data.log" 2>&1 <<'EOF'
import importlib.util, sys
b = sys.argv[1]; sys.argv = ['bench/train.py']
spec = importlib.util.spec_from_file_location('bench_train', 'bench/train.py'); bt = importlib.util.module_from_spec(spec); spec.loader.exec_module(bt)
print(bt.prepare(f'{b}/smollm2', 512, f'{b}/rows/alpaca_en_demo.json')['report'])
EOF
  [ $? -eq 0 ] && say "bench data" "SmolLM2's tokenizer and template on the bundle's rows, as the GPU bench prepares them: ok ($((SECONDS - t)) s; bench_data.log)" \
               || { say "bench data" "FAILED: the GPU bench could not prepare its rows ($(grep -E 'Error' "$W/bench_data.log" | tail -1 | cut -c1-200))"; rc=1; }
  say "bench smollm2-arch, llama-1b" "not run: no CUDA here (the rehearsal builds no 1B model)"
fi
say "2-GPU parts" "not run on one GPU: nccl with 2 workers (test_nccl_two_workers_equal_one), context parallel 2 (test_context_parallel_two_equals_one); kept in tests/gpu"
"$PY" -c "import transformer_engine" 2>/dev/null || say "TransformerEngine parts" "not run: transformer_engine is not installed (megatron THD packing, context parallel: tests/gpu/test_gpu_megatron_thd.py)"
say "all" "$([ "$rc" -eq 0 ] && echo ok || echo FAILED) in $((SECONDS - t0)) s"
exit "$rc"
