#!/usr/bin/env bash
# One command for a GPU machine without network, with its own torch/triton preinstalled:
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh
#
# Stages (each under `timeout`, failures do not stop the run, exit codes recorded):
#   env        nvidia-smi, python/torch/triton versions
#   build      pip install --no-build-isolation --no-deps -e . (CUDA extension, TORCH_CUDA_ARCH_LIST)
#              falling back to `setup.py build_ext --inplace`
#   fastamp_env  python -m fastamp.env (what was built, what AUTO picks)
#   cost_model benchmarks/gpu_cost_model.py --measure: device copy bandwidth and each path's floor
#   sync       benchmarks/sync_check.py: host syncs per fastamp step (set_sync_debug_mode)
#   pytest_optim  the native CUDA optimizer kernel first, on its own budget: optim_ (csrc/cuda/optim.cuh)
#              over every rule x master x state format x flag set (tests/backends/test_cuda_optim.py),
#              then the per-rule cases that now run on it (test_cuda_q8.py, test_cuda_lowbit.py,
#              test_cuda.py), bit for bit against the reference on the device
#   pytest_q8  the q8 moments' device tests, on their own budget: the native CUDA kernel
#              (tests/backends/test_cuda_q8.py) and the Triton one on the GPU (test_triton_q8.py),
#              byte for byte against the reference on the device; then the AOT tier's GPU tests
#   pytest     pytest -m gpu tests: every device test (CUDA kernels, Triton on the GPU, graph capture)
#   bench_step, bench_unscale, bench_adamw   microbenchmarks at GPU size (native + triton)
#   bench_adamw_q8   the q8 rows (bf16-q8, bf16-sr-q8, bf16-ulp8-q8) beside the 10-B config, native + triton
#   compare    python -m fastamp.compare --device cuda (large preset)
#   pytest_rest  pytest -m 'not gpu and not slow' tests, in the time left
# Everything is written under $OUT: logs/<stage>.log, results/, stages.tsv, summary.md.
# The whole script stays under GPU_CHECK_BUDGET_S seconds (default 465, i.e. < 8 minutes):
# each stage's timeout is cut to what is left.

set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT/logs" "$OUT/results"
BUDGET=${GPU_CHECK_BUDGET_S:-465}
START=$(date +%s)
PY=${PYTHON:-$(command -v python3 || command -v python)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
export PYTHONUNBUFFERED=1
# Triton must run on the GPU here, never in the interpreter.
unset TRITON_INTERPRET
STAGES="$OUT/stages.tsv"
printf "stage\texit_code\tseconds\ttimeout_s\n" > "$STAGES"

# run_stage NAME MAX_SECONDS COMMAND...
run_stage() {
    local name=$1 max=$2
    shift 2
    local now left limit t0 rc
    now=$(date +%s)
    left=$((BUDGET - (now - START) - 5))
    limit=$max
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -lt 10 ]; then
        printf "%s\tskipped(no time left)\t0\t0\n" "$name" >> "$STAGES"
        echo "[gpu_check] $name: skipped, no time left" >&2
        return 0
    fi
    echo "[gpu_check] $name (timeout ${limit}s): $*" >&2
    t0=$(date +%s)
    timeout --kill-after=5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
    rc=$?
    printf "%s\t%s\t%s\t%s\n" "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" >> "$STAGES"
    echo "[gpu_check] $name: exit $rc after $(( $(date +%s) - t0 ))s" >&2
    return $rc
}

run_stage env 30 bash -c "nvidia-smi; $PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name()); import triton; print(\"triton\", triton.__version__)'; $PY -m pip list 2>/dev/null | grep -i -E 'torch|triton|pytest|hypothesis|numpy|matplotlib|expecttest'; git -C $ROOT rev-parse HEAD; git -C $ROOT status --short | head -20"

if ! run_stage build 200 "$PY" -m pip install --no-build-isolation --no-deps -v -e .; then
    run_stage build_inplace 200 "$PY" setup.py build_ext --inplace
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

run_stage fastamp_env 30 "$PY" -m fastamp.env
run_stage cost_model 30 "$PY" benchmarks/gpu_cost_model.py --measure --out "$OUT/results/gpu_cost_model.md"
run_stage sync 45 "$PY" benchmarks/sync_check.py --out "$OUT/results"
# The device tests first and whole (no -x: every CUDA/Triton-on-GPU/capture test reports), the
# rest of the suite last, in what time is left. The q8 ones run again in the second stage (cheap).
run_stage pytest_optim 90 "$PY" -m pytest -q tests/backends/test_cuda_optim.py tests/backends/test_cuda_q8.py \
    tests/backends/test_cuda_lowbit.py tests/backends/test_cuda.py -p no:cacheprovider -rfE --durations=10 \
    --junitxml="$OUT/results/pytest_optim.xml"
run_stage pytest_q8 60 "$PY" -m pytest -q tests/backends/test_cuda_q8.py tests/backends/test_triton_q8.py \
    -p no:cacheprovider -rfE --durations=10 --junitxml="$OUT/results/pytest_q8.xml"
run_stage pytest 150 "$PY" -m pytest -q -m gpu tests -p no:cacheprovider -rfE --durations=15 \
    --junitxml="$OUT/results/pytest.xml"
GPU_CONFIGS=256x4096,256x262144,256x1048576,20000x256
run_stage bench_step 45 "$PY" benchmarks/bench_step.py --device cuda --backends native,triton --dtypes bf16,fp32 \
    --configs "$GPU_CONFIGS" --out "$OUT/results" --tag cuda
run_stage compare 110 "$PY" -m fastamp.compare --device cuda --size large --steps 150 --no-progress \
    --out "$OUT/results" --tag cuda
run_stage bench_unscale 40 "$PY" benchmarks/bench_unscale.py --device cuda --backends native,triton \
    --configs "$GPU_CONFIGS" --out "$OUT/results" --tag cuda
run_stage bench_adamw 40 "$PY" benchmarks/bench_adamw.py --device cuda --backends native,triton \
    --configs "$GPU_CONFIGS" --out "$OUT/results" --tag cuda
run_stage bench_adamw_q8 40 "$PY" benchmarks/bench_adamw.py --device cuda --backends native,triton \
    --dtypes bf16-10B,bf16-q8,bf16-sr-q8,bf16-ulp8-q8 --configs "$GPU_CONFIGS" --out "$OUT/results" --tag cuda-q8
run_stage pytest_rest 120 "$PY" -m pytest -q -m "not gpu and not slow" tests -p no:cacheprovider -rfE \
    --junitxml="$OUT/results/pytest_rest.xml"

{
    echo "# gpu_check summary"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- commit: $(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null)"
    echo "- gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
    echo "- total: $(( $(date +%s) - START ))s of a ${BUDGET}s budget"
    echo
    echo '```'
    column -t -s $'\t' "$STAGES" 2>/dev/null || cat "$STAGES"
    echo '```'
    echo
    echo "## pytest_optim (tail)"
    echo '```'
    tail -n 15 "$OUT/logs/pytest_optim.log" 2>/dev/null
    echo '```'
    echo "## pytest_q8 (tail)"
    echo '```'
    tail -n 15 "$OUT/logs/pytest_q8.log" 2>/dev/null
    echo '```'
    echo "## pytest (tail)"
    echo '```'
    tail -n 25 "$OUT/logs/pytest.log" 2>/dev/null
    echo '```'
    echo "## pytest_rest (tail)"
    echo '```'
    tail -n 15 "$OUT/logs/pytest_rest.log" 2>/dev/null
    echo '```'
    echo "## sync check"
    echo '```'
    cat "$OUT/logs/sync.log" 2>/dev/null | tail -n 20
    echo '```'
} > "$OUT/summary.md"
cat "$OUT/summary.md"
# Non-zero when any stage failed, so a caller sees it; every stage still ran.
if awk -F'\t' 'NR > 1 && $2 != "0" && $2 !~ /^skipped/ {bad=1} END {exit !bad}' "$STAGES"; then exit 1; fi
exit 0
