#!/usr/bin/env bash
# The CUDA-build tier: build fastamp as a CUDA user would, on a machine without a GPU, and
# import it and test it against that build.
#
#   bash tests/tools/cuda_build_tier.sh        (make test runs it after the main suite)
#
# 1. A side virtualenv (.venv-cuda) with a CUDA build of torch whose CUDA major matches the
#    local nvcc (torch 2.11.0 is CUDA 13.0, as nvcc here and the GPU machine; it pairs with
#    triton 3.6, the oldest triton the GPU machine has).
# 2. `pip install --no-build-isolation .` with no CUDA variables set: setup.py must find the
#    toolkit behind the nvcc wrapper and pick the arch list itself (FASTAMP_REQUIRE_CUDA=1
#    turns "cannot build CUDA" into a failure here instead of a quiet CPU-only build).
# 3. `python -m fastamp.env` in a fresh process must report `loaded (cpu+cuda)`: a kernel
#    whose C++ signature differs between backends aborts the process right there.
# 4. The CPU tests that exercise the built library and the Triton interpreter run against
#    the installed package (not the source tree: python -P keeps the checkout off sys.path).
#
# Skips (exit 0, with the reason) only when there is no nvcc or the nvcc's CUDA major has no
# matching torch pin below. FASTAMP_SKIP_CUDA_TIER=1 skips it on purpose.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
VENV=${CUDA_TIER_VENV:-$ROOT/.venv-cuda}
say() { echo "[cuda-build tier] $*" >&2; }

if [ "${FASTAMP_SKIP_CUDA_TIER:-0}" = "1" ]; then
    say "skipped: FASTAMP_SKIP_CUDA_TIER=1"
    exit 0
fi
NVCC=$(command -v nvcc || true)
if [ -z "$NVCC" ]; then
    say "skipped: no nvcc on PATH (nothing to build the CUDA kernels with)"
    exit 0
fi
MAJOR=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
case "$MAJOR" in
    13) TORCH_PIN="torch==2.11.0" ;;
    *)
        say "skipped: nvcc is CUDA $MAJOR; this tier pins a CUDA 13 torch (add a pin for CUDA $MAJOR)"
        exit 0
        ;;
esac

t0=$(date +%s)
# torch's own dependencies (nvidia-* runtime wheels, triton) come with it; setuptools is left to
# torch's constraint (it caps the version).
# numpy 2.3: triton 3.6's interpreter converts 1-element arrays with int(), which numpy 2.4
# refuses ("only 0-dimensional arrays can be converted to Python scalars").
# pytest-xdist: the tests below run on every core, as the main suite does.
PACKAGES=("$TORCH_PIN" numpy==2.3.5 pytest==9.2.0 pytest-xdist==3.8.0 execnet==2.1.2 hypothesis==6.170.17
    expecttest==0.3.0 setuptools wheel ninja==1.13.2)
# the stamp names the whole list: a venv made from another list is made again
STAMP="$VENV/.tier-stamp-$TORCH_PIN-$(printf '%s\n' "${PACKAGES[@]}" | sha256sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "${PACKAGES[@]}"
    touch "$STAMP"
fi
say "environment ready after $(($(date +%s) - t0))s: $("$VENV/bin/python" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)')"

# Build from a clean copy of the tracked tree, so no in-place build of the main venv is picked up.
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
git ls-files -z --cached --others --exclude-standard | tar --null -cf - -T - | tar -xf - -C "$SRC"
t1=$(date +%s)
(cd "$SRC" && env -u CUDA_HOME -u CUDA_PATH -u TORCH_CUDA_ARCH_LIST FASTAMP_REQUIRE_CUDA=1 MAX_JOBS="${MAX_JOBS:-2}" \
    "$VENV/bin/python" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall .)
say "built and installed in $(($(date +%s) - t1))s"

# A fresh process, off the source tree: this is where a signature mismatch aborts.
ENV_OUT=$(cd "$SRC/.." && "$VENV/bin/python" -P -m fastamp.env)
echo "$ENV_OUT" >&2
if ! grep -q "fastamp._C: loaded (cpu+cuda)" <<<"$ENV_OUT"; then
    say "FAILED: the installed extension did not load with its CUDA kernels"
    exit 1
fi
(cd "$SRC/.." && "$VENV/bin/python" -P -c '
import fastamp, torch
from fastamp.ops import registry
assert "site-packages" in fastamp.__file__, fastamp.__file__
for op in ("unscale_check_", "unscale_check_stats_", "update_scale_", "optim_", "unscale_check_partials_",
           "sumsq_fold", *registry.PER_RULE_OPS):
    handle = torch._C._dispatch_find_schema_or_throw("fastamp::" + op, "")
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("fastamp::" + op, key), (op, key)
# on both devices optim_ is the C++ kernel and the per-rule optimizer ops run as optim_
for dev in ("cpu", "cuda"):
    assert {op for op, d in registry.AS_OPTIM if d == dev} == set(registry.PER_RULE_OPS), (dev, registry.AS_OPTIM)
print("[cuda-build tier] every op has a CPU and a CUDA kernel;", fastamp.__file__)
')

# The tests that run the built library on CPU and the Triton kernels under this triton's
# interpreter. CUDA-device tests skip with their reason. -P: import the installed fastamp (xdist
# gives its workers the sys.path of this process; FASTAMP_TEST_INSTALLED=1 makes tests/conftest.py
# check, in every worker, that fastamp comes from site-packages).
t2=$(date +%s)
FASTAMP_TEST_INSTALLED=1 "$VENV/bin/python" -P -m pytest -q -n "${CUDA_TIER_JOBS:-auto}" --dist load \
    -p no:cacheprovider -o addopts="" -rfE -W ignore::UserWarning -W ignore::DeprecationWarning \
    tests/backends/test_native_cpu.py tests/backends/test_optim_matrix.py tests/backends/test_triton.py tests/backends/test_triton_lowbit.py tests/api/test_adamw_amp.py \
    tests/backends/test_triton_q8.py tests/backends/test_cuda.py tests/backends/test_cuda_lowbit.py tests/backends/test_cuda_q8.py \
    tests/backends/test_cuda_optim.py tests/backends/test_cuda_release.py
say "tests ran in $(($(date +%s) - t2))s; tier total $(($(date +%s) - t0))s"
