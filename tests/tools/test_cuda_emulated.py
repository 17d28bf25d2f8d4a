"""The CUDA kernel of ``optim_`` run on the host, against the reference, for machines without a GPU.

csrc/cuda/optim.cuh is compiled here by the host C++ compiler, unchanged but for its launch lines:
a shim ``cuda_runtime_api.h`` defines the CUDA keywords away, and each ``kernel<<<grid, block, 0,
stream>>>(args)`` line is rewritten to ``emu::launch(grid, block, [&] { kernel(args); })``, which runs
the kernel function on one host thread per CUDA thread of a block (``threadIdx``, ``blockIdx`` and
``gridDim`` are thread-locals), block after block, with ``__shfl_xor_sync`` exchanging values across
the 32 threads of a warp at a barrier (the q8 block maxima). The launcher around it is the real one
(optim.cu, optim_<format>.cu, launch_plan.h's plan and table, multi_tensor.cuh's walker, pack and
upload into host "device" memory), with 1 SM so that blocks walk several chunks. Host maths is
IEEE fp32 with ``-ffp-contract=off`` (SSE: no FMA, correctly rounded sqrt and division), what the
device code compiles to with ``--fmad=false``.

What this shows: the kernel's decoding, rule and encoding per master format, state format and flag,
its table rows, random streams, step-scalar rows, alignment paths, chunk walk and q8 block
exchange compute the reference's bits. What it cannot: the device compiler's code itself, warp
scheduling, memory ordering on the GPU, the binding (torch CUDA tensors): those are the GPU tests'
(tests/backends/test_cuda_optim.py, benchmarks/gpu_check.sh).
"""

import re
import shutil
import struct
import subprocess
from pathlib import Path

import cuda_optim_calls as calls
import pytest
import torch
from cuda_optim_calls import CHUNK, HYPER, RULE_FLAGS, compiled_combos, step_scalars
from helpers import assert_bits_equal

from fastamp import reference as R
from fastamp.reference.optim import AMSGRAD, MAXIMIZE, NESTEROV, SR_PARAM, SR_STATE

# compiles every instance of the kernel for the host (~2 min), once: make test's --dist loadfile keeps this
# file on one xdist worker
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
RULE_IDS = {name: i for i, (_, name) in enumerate(calls.rule_rows())}  # RuleId: csrc/optim_rules.h's order
FORMAT_IDS = {"fp32": 0, "bf16": 1, "q8": 2}
MASTER_IDS = {"none": 0, "fp32": 1, "remainder": 2, "ulp8": 3}
DTYPE_IDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

SHIM = r"""
// Host emulation of the CUDA runtime names the kernels use (tests/tools/test_cuda_emulated.py).
#pragma once
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__

using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
constexpr cudaError_t cudaErrorMemoryAllocation = 2;
using cudaStream_t = void*;
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0 };
inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* s) {
  *s = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) { *v = 1; return cudaSuccess; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "emulated"; }
struct uint4 { unsigned x, y, z, w; };

namespace emu {
struct Dim { unsigned x = 0, y = 0, z = 0; };
inline thread_local Dim thread_idx;
inline thread_local Dim block_idx;
inline Dim grid_dim;
struct Warp {
  std::barrier<> sync{32};
  uint64_t slot[32];
};
inline thread_local Warp* warp = nullptr;
inline thread_local std::barrier<>* block = nullptr;

template <class T>
T exchange(T x, int src_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of a wide type");
  const int lane = static_cast<int>(thread_idx.x & 31u);
  uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof(T));
  warp->slot[lane] = bits;
  warp->sync.arrive_and_wait();
  const uint64_t got = warp->slot[src_lane];
  warp->sync.arrive_and_wait();
  T y;
  std::memcpy(&y, &got, sizeof(T));
  return y;
}

// One host thread per CUDA thread of a block; the blocks one after another (a valid schedule: the
// kernel's blocks touch disjoint chunks).
template <class F>
void launch(int grid, int threads, F&& kernel) {
  grid_dim.x = static_cast<unsigned>(grid);
  std::barrier<> blk(threads);
  std::unique_ptr<Warp[]> warps(new Warp[threads / 32]);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      thread_idx.x = static_cast<unsigned>(t);
      warp = &warps[t / 32];
      block = &blk;
      for (int b = 0; b < grid; ++b) {
        block_idx.x = static_cast<unsigned>(b);
        kernel();
        blk.arrive_and_wait();
      }
    });
  }
  for (std::thread& th : pool) th.join();
}
}  // namespace emu

#define threadIdx ::emu::thread_idx
#define blockIdx ::emu::block_idx
#define gridDim ::emu::grid_dim

template <class T>
T __shfl_xor_sync(unsigned, T x, int off) {
  return emu::exchange(x, static_cast<int>(threadIdx.x & 31u) ^ off);
}
template <class T>
T __shfl_down_sync(unsigned, T x, int off) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  return emu::exchange(x, lane + off < 32 ? lane + off : lane);
}
inline void __syncthreads() { emu::block->arrive_and_wait(); }
"""

DRIVER = r"""
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <vector>

#include "cuda/launchers.h"
#include "cuda/optim.cu"
#include "cuda/optim_bf16.cu"
#include "cuda/optim_fp32.cu"
#include "cuda/optim_q8.cu"

using namespace fastamp::cuda;

namespace {

class HostTables final : public TableMemory {
 public:
  void* device(size_t bytes) override { return grab(dev_, bytes); }
  void* staging(size_t bytes) override { bytes_ = bytes; return grab(stage_, bytes); }
  cudaError_t upload(cudaStream_t) override {
    std::memcpy(aligned(dev_), aligned(stage_), bytes_);
    return cudaSuccess;
  }

 private:
  static char* aligned(std::vector<char>& v) {
    return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(v.data()) + 15) / 16 * 16);
  }
  static void* grab(std::vector<char>& v, size_t bytes) {
    v.assign(bytes + 16, 0);
    return aligned(v);
  }
  std::vector<char> dev_, stage_;
  size_t bytes_ = 0;
};

struct Reader {
  std::vector<char> data;
  size_t at = 0;
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, data.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
};

// A tensor's bytes at a 64-byte boundary plus `offset` (a misaligned start when offset > 0).
struct Blob {
  std::vector<char> buf;
  char* ptr = nullptr;
  int64_t bytes = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::ifstream in(argv[1], std::ios::binary);
  Reader r{std::vector<char>(std::istreambuf_iterator<char>(in), {})};
  OptimCall call{};
  call.rule = static_cast<OptimRule>(r.get<int64_t>());
  call.format = static_cast<StateFormat>(r.get<int64_t>());
  call.master = static_cast<MasterKind>(r.get<int64_t>());
  call.num_states = static_cast<int>(r.get<int64_t>());
  call.flags = r.get<int64_t>();
  call.scalar_stride = r.get<int64_t>();
  call.rng_base = r.get<int64_t>();
  const int64_t has_found = r.get<int64_t>();
  const int64_t has_rng = r.get<int64_t>();
  const int64_t num_scalars = r.get<int64_t>();
  const int64_t n = r.get<int64_t>();
  const int64_t per_param = r.get<int64_t>();
  for (double& h : call.hyper) h = r.get<double>();
  float found = r.get<float>();
  int64_t rng[2];
  rng[0] = r.get<int64_t>();
  rng[1] = r.get<int64_t>();
  std::vector<float> scalars(static_cast<size_t>(num_scalars));
  for (float& s : scalars) s = r.get<float>();
  call.step_scalars = scalars.data();
  call.found_inf = has_found ? &found : nullptr;
  call.rng = has_rng ? rng : nullptr;

  std::vector<OptimTensorRef> refs(static_cast<size_t>(n));
  std::vector<std::vector<Blob>> blobs(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    OptimTensorRef& ref = refs[i];
    ref.param_dtype = static_cast<DType>(r.get<int64_t>());
    ref.grad_dtype = static_cast<DType>(r.get<int64_t>());
    ref.numel = r.get<int64_t>();
    const int64_t misalign = r.get<int64_t>();
    const int64_t count = 3 + per_param;  // param, grad, master, states
    std::vector<Blob>& bs = blobs[i];
    bs.resize(static_cast<size_t>(count));
    for (int64_t k = 0; k < count; ++k) bs[k].bytes = r.get<int64_t>();
    for (int64_t k = 0; k < count; ++k) {
      Blob& b = bs[k];
      b.buf.assign(static_cast<size_t>(b.bytes) + 128, 0);
      const int64_t offset = misalign && k < 2 ? (ref.numel > 0 ? b.bytes / ref.numel : 0) : 0;
      b.ptr = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(b.buf.data()) + 63) / 64 * 64) + offset;
      std::memcpy(b.ptr, r.data.data() + r.at, static_cast<size_t>(b.bytes));
      r.at += static_cast<size_t>(b.bytes);
    }
    auto ptr = [&](int64_t k) -> void* { return ref.numel > 0 && bs[k].bytes > 0 ? bs[k].ptr : nullptr; };
    ref.param = ptr(0);
    ref.grad = ptr(1);
    ref.master = ptr(2);
    for (int64_t k = 0; k < per_param; ++k) ref.states[k] = ptr(3 + k);
  }
  HostTables tables;
  const cudaError_t err = optim(refs.data(), n, call, tables, nullptr);
  std::ofstream out(argv[2], std::ios::binary);
  const int64_t code = err;
  out.write(reinterpret_cast<const char*>(&code), sizeof(code));
  for (int64_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < blobs[i].size(); ++k) {
      if (k == 1) continue;  // the grad: read only
      out.write(blobs[i][k].ptr, blobs[i][k].bytes);
    }
  }
  return 0;
}
"""

_LAUNCH = re.compile(r"^(\s*)(\S.*?)<<<(.+?)>>>\((.*)\);\s*$")


def _emulated_sources(out: Path) -> None:
    """csrc/*.h, csrc/rules/*.h and csrc/cuda/* copied under ``out``, each ``kernel<<<...>>>(args);`` line made an
    emu::launch."""
    (out / "cuda").mkdir(parents=True)
    (out / "rules").mkdir()
    for path in (ROOT / "csrc").glob("*.h"):
        shutil.copy(path, out / path.name)
    for path in (ROOT / "csrc" / "rules").glob("*.h"):
        shutil.copy(path, out / "rules" / path.name)
    for path in (ROOT / "csrc" / "cuda").iterdir():
        if path.suffix not in (".h", ".cuh", ".cu"):
            continue
        lines = []
        for line in path.read_text().splitlines():
            m = _LAUNCH.match(line)
            if m:
                indent, kernel, config, args = m.groups()
                grid, threads = [c.strip() for c in config.split(",")[:2]]
                line = f"{indent}::emu::launch({grid}, {threads}, [&] {{ {kernel}({args}); }});"
            lines.append(line)
        (out / "cuda" / path.name).write_text("\n".join(lines) + "\n")
    (out / "cuda_runtime_api.h").write_text(SHIM)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("cuda_emulated")
    _emulated_sources(out / "src")
    src = out / "driver.cpp"
    src.write_text(DRIVER)
    exe = out / "driver"
    cmd = [CXX, "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", "-w", "-I", str(out / "src"), str(src), "-o",
           str(exe)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, f"the emulated kernel does not compile:\n{res.stderr[-6000:]}"
    return exe


def _blob(t: torch.Tensor | None) -> bytes:
    return b"" if t is None else t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def run_emulated(driver, tmp_path, params, grads, masters, states, step_scalars, found_inf, rng, rng_base, rule,
                 hyper, flags, fmt, misalign=()):  # fmt: skip
    """optim_ on the emulated CUDA kernel, writing params, masters and states in place; its cudaError_t."""
    n = len(params)
    per_param = len(states) // n if n else 0
    master = "none" if not masters else {torch.int16: "remainder", torch.int8: "ulp8"}.get(masters[0].dtype, "fp32")
    rows = step_scalars.dim() == 2
    sc = step_scalars.to(torch.float32).contiguous()
    head = [RULE_IDS[rule], FORMAT_IDS[fmt], MASTER_IDS[master], per_param // (2 if fmt == "q8" else 1), flags,
            sc.shape[-1] if rows else 0, rng_base, found_inf is not None, rng is not None, sc.numel(), n, per_param]  # fmt: skip
    data = bytearray(struct.pack(f"<{len(head)}q", *head))
    data += struct.pack("<3d", *(list(hyper) + [0.0] * (3 - len(hyper))))
    data += struct.pack("<f", float(found_inf.reshape(-1)[0]) if found_inf is not None else 0.0)
    data += struct.pack("<2q", *(rng.reshape(-1).tolist() if rng is not None else [0, 0]))
    data += _blob(sc)
    for i, p in enumerate(params):
        mine = [p, grads[i], masters[i] if masters else None] + [states[k * n + i] for k in range(per_param)]
        data += struct.pack("<4q", DTYPE_IDS[p.dtype], DTYPE_IDS[grads[i].dtype], p.numel(), i in misalign)
        data += struct.pack(f"<{len(mine)}q", *(len(_blob(t)) for t in mine))
        for t in mine:
            data += _blob(t)
    spec, result = tmp_path / "call.bin", tmp_path / "out.bin"
    spec.write_bytes(bytes(data))
    res = subprocess.run([str(driver), str(spec), str(result)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = result.read_bytes()
    (code,) = struct.unpack_from("<q", out)
    at = 8
    for i, p in enumerate(params):
        for t in [p, masters[i] if masters else None] + [states[k * n + i] for k in range(per_param)]:
            if t is None:
                continue
            size = len(_blob(t))
            got = torch.frombuffer(bytearray(out[at : at + size]), dtype=torch.uint8) if size else None
            if got is not None:
                t.copy_(got.view(t.dtype).reshape(t.shape))
            at += size
    return code


# ---- the calls: every (param, grad) dtype pair a master format takes, edge values planted ----


def make_call(rule, fmt, master, flags, hyper, sizes, seed):
    """The GPU tests' call (tests/cuda_optim_calls.py) on the host, with a non-finite q8 block and an inf grad too."""
    return calls.make_call(rule, fmt, master, flags, hyper, sizes, seed, nonfinite=True)


SIZES = [1, 5, 33, 0, 1023, 4100, CHUNK + 37]
FLAG_SETS = [0, MAXIMIZE | SR_PARAM | SR_STATE, SR_PARAM, SR_STATE]


def check_steps(driver, tmp_path, rule, fmt, master, flags, hyper=None, steps=2, rows=False, found=None,
                sizes=SIZES, seed=0, misalign=(1, 4)):  # fmt: skip
    hyper = HYPER[rule] if hyper is None else hyper
    params, masters, states, grads = make_call(rule, fmt, master, flags, hyper, sizes, seed)
    ref = [[t.clone() for t in lst] for lst in (params, masters, states)]
    for step in range(1, steps + 1):
        sc = step_scalars(rule, step, len(params) if rows else None)
        rng = torch.tensor([-987654321012, 2**40 + step], dtype=torch.int64)
        fi = None if found is None else torch.full((1,), found)
        code = run_emulated(driver, tmp_path, params, grads, masters, states, sc, fi, rng, 3, rule, hyper, flags,
                            fmt, misalign)  # fmt: skip
        assert code == 0, f"the launcher refused the call: cudaError_t {code}"
        R.optim_(ref[0], grads, ref[1], ref[2], sc, fi, rng, 3, rule, list(hyper), flags)
        for name, a, b in zip(("params", "masters", "states"), (params, masters, states), ref):
            for i, (x, y) in enumerate(zip(a, b)):
                assert_bits_equal(x, y, f"{rule} {fmt} {master} flags {flags} step {step}: {name}[{i}] (n={x.numel()})")


COMBOS = compiled_combos()


@pytest.mark.parametrize("master", ["none", "fp32", "remainder", "ulp8"])
@pytest.mark.parametrize("rule, fmt", COMBOS)
def test_emulated_kernel_matches_reference(driver, tmp_path, rule, fmt, master):
    """Every (rule, state format) of the rules' kCudaStates with every master format: two steps, one flag set each in
    turn (the rule's own flag with the full set), shared or per-tensor step-scalar rows, misaligned tensors,
    a non-finite grad."""
    k = (RULE_IDS[rule] * 12 + FORMAT_IDS[fmt] * 4 + MASTER_IDS[master]) % len(FLAG_SETS)
    flags = FLAG_SETS[k] | (RULE_FLAGS[rule] if k == 1 else 0)
    check_steps(driver, tmp_path, rule, fmt, master, flags, rows=k % 2 == 1, seed=k)


@pytest.mark.parametrize("flags", [SR_PARAM, SR_STATE, SR_PARAM | SR_STATE | AMSGRAD | MAXIMIZE])
def test_emulated_adamw_q8_ulp8_flags(driver, tmp_path, flags):
    """AMSGRAD on q8, and SR_PARAM / SR_STATE each alone, on ulp8 masters."""
    check_steps(driver, tmp_path, "adamw", "q8", "ulp8", flags, steps=1, rows=True, seed=flags)


def test_emulated_sgd_without_momentum_and_nesterov(driver, tmp_path):
    check_steps(driver, tmp_path, "sgd", "fp32", "ulp8", SR_PARAM | MAXIMIZE, hyper=(0.0, 0.0, 0.3), steps=1)
    check_steps(driver, tmp_path, "sgd", "q8", "remainder", NESTEROV | SR_STATE, steps=2, seed=5)


@pytest.mark.parametrize("found", [1.0, float("nan")])
def test_emulated_found_inf_writes_nothing(driver, tmp_path, found):
    check_steps(driver, tmp_path, "lion", "q8", "ulp8", SR_PARAM | SR_STATE, steps=1, found=found, seed=6)


def test_emulated_many_tiny_tensors(driver, tmp_path):
    gen = torch.Generator().manual_seed(7)
    sizes = [int(n) for n in torch.randint(0, 70, (300,), generator=gen)]
    check_steps(driver, tmp_path, "adamw", "q8", "none", SR_STATE | AMSGRAD, steps=1, rows=True, sizes=sizes,
                misalign=range(0, 300, 7))  # fmt: skip


def test_emulated_launcher_refuses_what_the_kernels_cannot_take(driver, tmp_path):
    """SR flags without rng, a state count the rule does not keep, a (rule, format) not built:
    cudaErrorInvalidValue, nothing written."""
    cases = [("adamw", "bf16", SR_STATE), ("adamw", "bf16", AMSGRAD)]
    cases += [(r, f, 0) for r in ("adamw", "sgd", "lion") for f in ("fp32", "bf16", "q8") if (r, f) not in COMBOS]
    assert len(cases) > 2
    for rule, fmt, flags in cases:
        params, masters, states, grads = make_call(rule, fmt, "none", 0, HYPER[rule], [70], 8)
        before = [t.clone() for t in params + states]
        sc = step_scalars(rule, 1)
        code = run_emulated(driver, tmp_path, params, grads, masters, states, sc, None, None, 0, rule, HYPER[rule],
                            flags, fmt)  # fmt: skip
        assert code == 1, (rule, fmt, flags)
        for a, b in zip(params + states, before):
            assert_bits_equal(a, b, f"{rule} {fmt} flags {flags}: refused call")
