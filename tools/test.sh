#!/usr/bin/env bash
# The whole test suite: every notebook (nbdev_test) and then pytest. Fails loudly when either
# ran nothing, since both tools exit 0/5 in that case. Prints each notebook's time, the 30 slowest tests
# and the wall time of both parts (bench/RESULTS.md "Test suite time" keeps the ranking).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
# torch's inductor (FlexAttention) caches compiled kernels without keying on ATEN_CPU_CAPABILITY: a kernel another run
# built under another capability returns garbage or crashes here, so each checkout and capability compiles into its own cache
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/build/inductor-${ATEN_CPU_CAPABILITY:-native}}"
n_nbs=$(find nbs -name '[0-9a-z]*.ipynb' -not -path '*/.ipynb_checkpoints/*' | wc -l)
[ "$n_nbs" -ge 1 ] || { echo "FAIL: no notebooks under nbs/"; exit 1; }
log=$(mktemp)
t0=$SECONDS
# nbdev_test's runs, longest first (tools/test_notebooks.py)
python tools/test_notebooks.py --n_workers 2 --flags "${NBDEV_TEST_FLAGS-slow}" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "FAIL: nbdev_test exit $rc"; exit "$rc"; }
ran=$(grep -c '^Starting' "$log" || true)
[ "$ran" -ge 1 ] || { echo "FAIL: nbdev_test ran zero notebooks"; exit 1; }
echo "nbdev_test: $ran notebooks passed in $((SECONDS - t0)) s"
t1=$SECONDS
# two pytest workers, each with its own session Ray cluster (and JupyterLab/Chromium where it runs a browser test); a
# file's tests stay together (module fixtures, ordered browser steps): the Ray tests leave a third of the CPU idle alone.
# The longest files go first (tests/conftest.py, from tests/durations.json; `python tools/test_durations.py` refreshes it
# from this run's build/junit.xml)
python -m pytest tests -n 2 --dist loadfile --no-loadscope-reorder --junitxml=build/junit.xml --durations=30 ${PYTEST_ARGS:-} ; rc=$?
echo "pytest: exit $rc in $((SECONDS - t1)) s; notebooks + pytest $((SECONDS - t0)) s"
[ "$rc" -eq 5 ] && { echo "FAIL: pytest collected no tests"; exit 1; }
exit "$rc"
