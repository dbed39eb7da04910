#!/usr/bin/env bash
# The one script a GPU session runs: the GPU test suite, then the GPU bench under a time budget.
# Results go to $OUT (the device machine's return folder) or ./gpu_check_out: pytest log + junit xml, bench table + json,
# nvidia-smi, versions. Exit status: that of the tests (the bench is best effort within its budget).
#
#   bash tools/gpu_check.sh                       # tests (≤ 300 s) then bench (≤ 360 s)
#   TEST_BUDGET=200 BENCH_BUDGET=240 BENCH_STEPS=10 bash tools/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu_check_out}"; mkdir -p "$OUT_DIR"
TEST_BUDGET="${TEST_BUDGET:-300}"; BENCH_BUDGET="${BENCH_BUDGET:-360}"; BENCH_STEPS="${BENCH_STEPS:-15}"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 \
       RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
{ date -u; nvidia-smi || true; "$PY" -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available(), torch.cuda.device_count())"; } \
  > "$OUT_DIR/env.txt" 2>&1
echo "== tests/gpu (budget ${TEST_BUDGET}s)"
timeout -k 10 "$TEST_BUDGET" "$PY" -m pytest tests/gpu -q -rs -s --junitxml="$OUT_DIR/tests_gpu.xml" 2>&1 | tee "$OUT_DIR/tests_gpu.log"
rc=${PIPESTATUS[0]}
echo "tests/gpu exit status: $rc" | tee -a "$OUT_DIR/tests_gpu.log"
echo "== bench/train.py --gpu (budget ${BENCH_BUDGET}s, ${BENCH_STEPS} steps per method)"
timeout -k 10 "$BENCH_BUDGET" "$PY" bench/train.py --gpu --steps-gpu "$BENCH_STEPS" --json "$OUT_DIR/bench_gpu.json" \
  > "$OUT_DIR/bench_gpu.md" 2> "$OUT_DIR/bench_gpu.log"
echo "bench exit status: $?" | tee -a "$OUT_DIR/bench_gpu.log"
cat "$OUT_DIR/bench_gpu.md"
exit "$rc"
