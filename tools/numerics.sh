#!/usr/bin/env bash
# The numerical tests under other CPU kernel choices, so a tolerance that only holds for one CPU's vector
# code is caught on any machine. torch picks its kernels by ATEN_CPU_CAPABILITY, MKL by MKL_ENABLE_INSTRUCTIONS,
# and the order of parallel reductions by OMP_NUM_THREADS; each combination runs the numerical notebooks and tests.
#
#   tools/numerics.sh                 every combination this CPU supports, notebooks and tests (~10 min each)
#   tools/numerics.sh --quick avx2    one combination, the notebooks and the tests that start no Ray cluster
#   tools/numerics.sh --mutation      the chunked-loss check must fail with an off-by-one chunk boundary
# A combination is `default`, `avx2`, `avx512`, `mkl-avx2`, `threads1` or `threads2`.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
NOTEBOOKS="00b_numerics 05_collate 06c_loss 07a_backends.fsdp 07b_backends.megatron 08c_lens"
QUICK_TESTS="tests/test_loss.py tests/test_loss_megatron.py tests/test_packing.py"
RAY_TESTS="tests/test_trainer.py::test_split_invariance tests/test_trainer.py::test_exact_resume_and_fewer_workers
           tests/test_megatron.py tests/test_lens.py tests/test_vlm.py::test_vlm_two_workers_match_one"

env_of() {  # the environment of one combination
    case "$1" in
        default|avx2|avx512) echo "ATEN_CPU_CAPABILITY=$1" ;;
        mkl-avx2) echo "MKL_ENABLE_INSTRUCTIONS=AVX2" ;;
        threads1) echo "OMP_NUM_THREADS=1" ;;
        threads2) echo "OMP_NUM_THREADS=2" ;;
        *) echo "unknown combination '$1' (default, avx2, avx512, mkl-avx2, threads1, threads2)" >&2; return 2 ;;
    esac
}

mutation() {  # an off-by-one at the chunk boundary of the backward pass (chunks overlap by one token) must fail
    # both the notebook's own check (nbdev_test runs the notebook's cells) and tests/test_loss.py (the package)
    local tmp rc=0 out; mkdir -p build; tmp=$(mktemp -d "$PWD/build/mutation.XXXX"); trap 'rm -rf "$tmp"' RETURN
    cp -r sft_nb nbs tests settings.ini "$tmp"/
    python - "$tmp/nbs/06c_loss.ipynb" "$tmp/sft_nb/loss.py" <<'PY'
import json, sys
def broken(s):  # chunks of the backward pass take one row more than the forward's: the boundary row counts twice
    head, back = s.split('    def backward(ctx, grad):', 1)
    assert back.count('s:s + ctx.chunk') >= 5, 'the backward pass no longer slices chunks as this mutation expects'
    return head + '    def backward(ctx, grad):' + back.replace('s:s + ctx.chunk', 's:s + ctx.chunk + 1')
nb_path, py_path = sys.argv[1:]
nb = json.load(open(nb_path))
[cell] = [c for c in nb['cells'] if 'def backward(ctx, grad):' in ''.join(c['source'])]
cell['source'] = broken(''.join(cell['source']))
json.dump(nb, open(nb_path, 'w'))
src = broken(open(py_path).read())
open(py_path, 'w').write(src)
PY
    [ $? -eq 0 ] || { echo 'FAIL: could not apply the mutation'; return 1; }
    out=$(cd "$tmp" && PYTHONPATH="$tmp" nbdev_test --path nbs/06c_loss.ipynb 2>&1) \
        && { echo "FAIL: nbs/06c_loss.ipynb passed with a broken chunk boundary"; rc=1; } \
        || echo "mutation: nbs/06c_loss.ipynb fails, as it must: $(echo "$out" | grep -m1 -o 'AssertionError: .*')"
    out=$(cd "$tmp" && PYTHONPATH="$tmp" python -m pytest -q -p no:cacheprovider tests/test_loss.py -k 'linear_nll_equals or worker_chunked' 2>&1) \
        && { echo "FAIL: tests/test_loss.py passed with a broken chunk boundary"; rc=1; } \
        || echo "mutation: tests/test_loss.py fails, as it must: $(echo "$out" | tail -1)"
    return $rc
}

run_one() {  # run_one COMBINATION [quick]
    local vars; vars=$(env_of "$1") || return 2
    # inductor's cache does not key on the ATen capability: a kernel built under another one crashes (SIGSEGV), so
    # each combination compiles into its own cache. Where the capability is DEFAULT torch runs no FlexAttention at
    # all; those checks say so (sft_nb.loss.flex_attention_runs_on) and the rest runs.
    vars="$vars TORCHINDUCTOR_CACHE_DIR=${TMPDIR:-/tmp}/sft_nb_inductor_$1"
    [ "$1" = avx512 ] && ! grep -q avx512f /proc/cpuinfo && { echo "== $1: this CPU has no AVX-512, skipped"; return 0; }
    echo "== $1 ($vars): $(env $vars python -c 'import torch; print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), "threads")')"
    local rc=0 nb log; log=$(mktemp)
    for nb in $NOTEBOOKS; do
        env $vars nbdev_test --path "nbs/$nb.ipynb" --flags "${NBDEV_TEST_FLAGS-slow}" >"$log" 2>&1 \
            || { echo "FAIL: $1: nbs/$nb.ipynb"; grep -v 'warning\|^ *[0-9]* |\|^ *|' "$log" | grep -v '^\s*$' | tail -15; rc=1; }
    done
    rm -f "$log"
    local tests="$QUICK_TESTS"; [ "${2:-}" = quick ] || tests="$tests $RAY_TESTS"
    env $vars python -m pytest -q -p no:cacheprovider $tests || rc=1
    return $rc
}

case "${1:-}" in
    --mutation) mutation ;;
    --quick) shift; rc=0; for c in "${@:-avx2}"; do run_one "$c" quick || rc=1; done; exit $rc ;;
    *) rc=0; for c in ${@:-default avx2 avx512 mkl-avx2 threads1 threads2}; do run_one "$c" || rc=1; done; exit $rc ;;
esac
