#!/usr/bin/env bash
# The numerical tests under other CPU kernel choices, so a tolerance that only holds for one CPU's vector
# code is caught on any machine. torch picks its kernels by ATEN_CPU_CAPABILITY, MKL by MKL_ENABLE_INSTRUCTIONS,
# and the order of parallel reductions by OMP_NUM_THREADS; each combination runs the numerical notebooks and tests.
#
#   tools/numerics.sh                 every combination this CPU supports, notebooks and tests (~10 min each)
#   tools/numerics.sh --quick [COMBO] what CI runs: only the checks whose result depends on the kernel (the numerical
#                                     notebooks and in-process tests, no Ray) under COMBO; by default a capability other
#                                     than this CPU's own (AVX512 → avx2, AVX2 → default): the native one is `make test`'s
# A combination is `default`, `avx2`, `avx512`, `mkl-avx2`, `threads1` or `threads2`.
# A broken chunk boundary failing the chunked-loss checks is a planted bug of tools/mutants.py (--only loss_chunk_boundary).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
QUICK_NOTEBOOKS="00b_numerics 05_collate 06c_loss 07a_backends.fsdp 07b_backends.megatron"
RAY_NOTEBOOKS="08c_lens"
# the in-process float comparisons: chunked == one-shot loss, packed == padded, megatron's loss (its Ray cases: RAY_TESTS)
QUICK_TESTS="tests/test_loss.py tests/test_loss_megatron.py tests/test_packing.py"
QUICK_DESELECT="not trainer_step_chunked_equals_one_shot and not megatron_chunked_equals_fsdp"
RAY_TESTS="tests/test_loss.py::test_trainer_step_chunked_equals_one_shot tests/test_loss.py::test_megatron_chunked_equals_fsdp
           tests/test_trainer.py::test_micro_batch_split_invariance tests/test_trainer.py::test_two_ranks_equal_one
           tests/test_trainer.py::test_exact_resume_and_fewer_workers tests/test_megatron.py tests/test_lens.py
           tests/test_vlm.py::test_vlm_two_workers_match_one"

env_of() {  # the environment of one combination
    case "$1" in
        default|avx2|avx512) echo "ATEN_CPU_CAPABILITY=$1" ;;
        mkl-avx2) echo "MKL_ENABLE_INSTRUCTIONS=AVX2" ;;
        threads1) echo "OMP_NUM_THREADS=1" ;;
        threads2) echo "OMP_NUM_THREADS=2" ;;
        *) echo "unknown combination '$1' (default, avx2, avx512, mkl-avx2, threads1, threads2)" >&2; return 2 ;;
    esac
}

run_one() {  # run_one COMBINATION [quick]
    local vars; vars=$(env_of "$1") || return 2
    # inductor's cache does not key on the ATen capability: a kernel built under another one crashes (SIGSEGV), so
    # each combination compiles into its own cache. Where the capability is DEFAULT torch runs no FlexAttention at
    # all; those checks say so (sft_nb.loss.flex_attention_runs_on) and the rest runs.
    vars="$vars TORCHINDUCTOR_CACHE_DIR=${TMPDIR:-/tmp}/sft_nb_inductor_$1"
    [ "$1" = avx512 ] && ! grep -q avx512f /proc/cpuinfo && { echo "== $1: this CPU has no AVX-512, skipped"; return 0; }
    echo "== $1 ($vars): $(env $vars python -c 'import torch; print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), "threads")')"
    local rc=0 log nbs="$QUICK_NOTEBOOKS"; log=$(mktemp)
    [ "${2:-}" = quick ] || nbs="$nbs $RAY_NOTEBOOKS"
    # the notebooks two at a time (one nbdev_test: it names the notebook that fails)
    env $vars nbdev_test --path nbs --file_re "^($(echo $nbs | tr ' ' '|'))\.ipynb$" --n_workers 2 --flags "${NBDEV_TEST_FLAGS-slow}" >"$log" 2>&1 \
        || { echo "FAIL: $1: notebooks"; grep -v 'warning\|^ *[0-9]* |\|^ *|' "$log" | grep -v '^\s*$' | tail -25; rc=1; }
    rm -f "$log"
    if [ "${2:-}" = quick ]; then env $vars python -m pytest -q -p no:cacheprovider $QUICK_TESTS -k "$QUICK_DESELECT" || rc=1
    else env $vars python -m pytest -q -p no:cacheprovider $QUICK_TESTS $RAY_TESTS || rc=1; fi
    return $rc
}

case "${1:-}" in
    --quick) shift
        if [ $# -eq 0 ]; then  # a capability other than the native one
            case "$(python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" in
                AVX512) set -- avx2 ;; AVX2) set -- default ;;
                *) echo "numerics: this CPU's capability is torch's lowest; no other kernel to try"; exit 0 ;;
            esac
        fi
        rc=0; for c in "$@"; do run_one "$c" quick || rc=1; done; exit $rc ;;
    *) rc=0; for c in ${@:-default avx2 avx512 mkl-avx2 threads1 threads2}; do run_one "$c" || rc=1; done; exit $rc ;;
esac
