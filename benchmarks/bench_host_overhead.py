"""Host overhead of the optimizer path: many small tensors vs the same elements as one tensor.

Part 1, native CPU (issue 21's host-overhead rows). For 1 and 2 threads, each param layout
(``fp32`` params; ``bf16`` params + fp32 master; ``bf16rem`` bf16 params + int16 remainder,
with ``--layouts``), each shape (default 20,000 tensors x 256 and 1 x 5,120,000: the same
elements), two measurements:

``step``   ``opt.step()`` alone;
``whole``  the recommended loop past backward: ``scaler.scale(loss)``, ``scaler.clip_grad_norm_``
           (``unscale_`` + ``clip_grad_norm_(foreach=True)`` for torch), ``scaler.step(opt)``,
           ``scaler.update()``.

Providers: ``fastamp`` (``fastamp.Scaler`` + ``fastamp.optim.AdamW``, native backend) and
``torch``: its best path, ``GradScaler`` + ``AdamW(fused=True)`` (on the bf16 rows torch's
fused AdamW updates the bf16 params directly: torch has no master weights). Before every timed
call the grads are replaced by new tensors (clones, as a backward makes them); that, untimed,
is the only thing between two timed calls. The ratio many/one of each row is the figure the
issue's goal (<= 1.5x) is about. Repetitions are interleaved over every row (median, with the
spread: min and max over the repetitions).

Part 2, host-only launchers (``--no-launchers`` skips it): the host time per step at 20,000
tensors of the Triton ``optim_`` launcher (rule AdamW, fp32 moments; the one optimizer kernel of
kernels/optim.py) with its kernel launch recorded, not run (as
tests/tools/test_triton_aot.py does: the JIT function is replaced by a recorder and the CPU
device check is lifted, in a worker process), and of the CUDA launch plan's host side
(csrc/cuda/launch_plan.h: ``plan_optim`` + ``pack_table`` of AdamW's fp32 table, compiled here with the host
compiler, fake pointers, as tests/tools/test_cuda_launch_plan.py does; the binding's reading
of the tensors is not in it: it needs a CUDA torch). Reported per tensor, with the count of
Python function calls per step (``sys.setprofile``: Python-level calls and calls of C
functions) for the Triton launcher and for the eager native ``opt.step()``. The Triton rows
come in threes, interleaved round by round: the plan check's C passes (``fastamp._C.plan_grads``
for the persistent lists and ``fastamp._C.dense_ptrs`` for the grads, where the extension is
built for this torch), the same without ``dense_ptrs`` (torch's ``TensorGuards`` and Python
passes for the grads: what ran before it), and its Python passes alone (all forced off), each
with its own tensors and plan cache; besides the
wall time, the worker thread's CPU time (``time.thread_time``: on a shared machine the wall
time also counts the time other processes held the cores).

Writes ``results/bench_host_overhead-cpu.{csv,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from bench_step import make_check  # noqa: E402

import fastamp  # noqa: E402
from fastamp.optim import AdamW as FastAdamW  # noqa: E402

ROOT = common.ROOT
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
LAYOUTS = {
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, {}),
    "bf16rem": (torch.bfloat16, {"master_weights": "remainder"}),
}
SCALE = 1024.0
MAX_NORM = 1.0


class Row:
    """One provider x layout x shape: params, grads source, optimizer and scaler, kept across reps."""

    def __init__(self, provider: str, layout: str, n: int, m: int):
        self.provider, self.layout, self.n, self.m = provider, layout, n, m
        dtype, kw = LAYOUTS[layout]
        gen = torch.Generator().manual_seed(n)
        flat = torch.randn(n * m, generator=gen)
        self.params = [t.to(dtype) for t in flat.split(m)] if n > 1 else [flat.to(dtype)]
        gflat = (torch.randn(n * m, generator=gen) * SCALE * 1e-3).to(dtype)
        self.grad_src = list(gflat.split(m)) if n > 1 else [gflat]
        if provider == "torch":
            self.opt = torch.optim.AdamW(self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
            self.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=2**30)
        else:
            self.opt = FastAdamW(self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, backend="native", **kw)
            self.scaler = fastamp.Scaler("cpu", init_scale=SCALE, growth_interval=2**30, backend="native")
        self.loss = torch.ones(())

    def new_grads(self) -> None:
        for p, g in zip(self.params, self.grad_src):
            p.grad = g.clone()

    def step(self) -> None:
        self.opt.step()

    def whole(self) -> None:
        self.scaler.scale(self.loss)
        if self.provider == "torch":
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM, foreach=True)
        else:
            self.scaler.clip_grad_norm_(self.opt, MAX_NORM)
        self.scaler.step(self.opt)
        self.scaler.update()


def _checks(layouts) -> list[str]:
    """bench_step's 3-step check (clip that bites, an inf) of each provider against the reference."""
    out = []
    for layout in layouts:
        dtype = LAYOUTS[layout][0]
        if layout == "bf16rem":
            out.append("fastamp bf16rem: not checked here (tests/backends and tests/optim check remainders)")
            continue
        for kind in ("fastamp", "torch"):
            if kind == "torch" and dtype != torch.float32:
                continue
            ok, msg = common.run_check(
                common.Provider(
                    kind, "step", layout, 0, lambda: None, make_check(kind, dtype, torch.device("cpu"), "native")
                )
            )
            out.append(f"{kind} {layout}: {'ok' if ok else 'FAILED'}: {msg}")
            if not ok:
                raise SystemExit(f"bench_host_overhead: {kind} {layout} fails its check: {msg}")
    return out


def _count_calls(fn) -> tuple[int, int]:
    """(Python function calls, C function calls) during one ``fn()``."""
    counts = [0, 0]

    def prof(frame, event, arg):
        if event == "call":
            counts[0] += 1
        elif event == "c_call":
            counts[1] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts[0] - 1, counts[1]  # the first "call" is fn itself


def native_rows(args) -> tuple[list[dict], dict]:
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
    layouts = [s.strip() for s in args.layouts.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    rows = [Row(prov, lay, n, m) for lay in layouts for prov in ("fastamp", "torch") for n, m in shapes]
    samples: dict[tuple, list[float]] = {}
    keys = [(t, r, what) for t in threads for r in rows for what in ("step", "whole")]
    for _t, r, what in keys[: len(keys) // len(threads)]:  # warm up: first steps build plans and state
        for _ in range(2):
            r.new_grads()
            getattr(r, what)()
    bar = common.Progress(args.reps * len(keys), "host overhead")
    for _ in range(args.reps):
        for t, r, what in keys:
            torch.set_num_threads(t)
            r.new_grads()
            fn = getattr(r, what)
            t0 = time.perf_counter()
            fn()
            samples.setdefault((t, r.provider, r.layout, r.n, r.m, what), []).append(time.perf_counter() - t0)
            bar.update()
    calls = {}
    for r in rows:
        if r.provider == "fastamp" and r.n > 1:
            r.new_grads()
            calls[f"fastamp opt.step, {r.layout}, {r.n}x{r.m}"] = _count_calls(r.step)
    out = []
    many, one = shapes[0], shapes[-1]
    for t in threads:
        for lay in layouts:
            for what in ("step", "whole"):
                for prov in ("fastamp", "torch"):
                    s_many = samples[(t, prov, lay, *many, what)]
                    s_one = samples[(t, prov, lay, *one, what)]
                    med_many, med_one = statistics.median(s_many), statistics.median(s_one)
                    out.append(
                        {
                            "threads": t,
                            "layout": lay if prov == "fastamp" or lay == "fp32" else f"{lay} (no master)",
                            "measure": "opt.step()" if what == "step" else "whole path",
                            "provider": prov,
                            f"{many[0]}x{many[1]} ms": round(med_many * 1e3, 2),
                            "many spread ms": f"{min(s_many) * 1e3:.1f}-{max(s_many) * 1e3:.1f}",
                            f"{one[0]}x{one[1]} ms": round(med_one * 1e3, 2),
                            "one spread ms": f"{min(s_one) * 1e3:.1f}-{max(s_one) * 1e3:.1f}",
                            "ratio many/one": round(med_many / med_one, 2),
                            "us per extra tensor": round((med_many - med_one) / (many[0] - one[0]) * 1e6, 3),
                        }
                    )
    return out, calls


# ------------------------------------------------------------------------------------------
# Part 2: host-only launchers

_TRITON_WORKER = r"""
import json, sys, time
from collections import OrderedDict
sys.path.insert(0, {root!r})
sys.path.insert(0, {tools!r})
import torch
try:  # the C pass of the plan check (fastamp._C.plan_grads), where the extension is built for this torch
    import fastamp._C
except ImportError:
    pass
from test_triton_aot import _install_recorders, _load_kernels
from pathlib import Path
mods = _load_kernels(Path({root!r}))
launched = _install_recorders(mods)
optim = mods["optim"]
C = mods["_common"]
native_check, grad_guards, dense = C._plan_grads, C._TensorGuards, getattr(C, "_dense_ptrs", None)
CHECKS = {{"c": (native_check, grad_guards, dense), "c-guards": (native_check, grad_guards, None),
          "python": (None, None, None)}}
n, m = {n}, {m}


class Variant:
    # one layout x plan-check path, with its own tensors and its own plan cache
    def __init__(self, layout, check):
        self.key = layout + "/" + check
        self.check = CHECKS[check]
        self.plans = OrderedDict()
        self.dt = torch.float32 if layout == "fp32" else torch.bfloat16
        self.params = [torch.zeros(m, dtype=self.dt) for _ in range(n)]
        self.f32 = [[torch.zeros(m) for _ in range(n)] for _ in range(3 if layout == "bf16" else 2)]
        self.masters = self.f32[2] if layout == "bf16" else []
        self.states = self.f32[0] + self.f32[1]  # optim_'s states: exp_avgs, then exp_avg_sqs (kept, as a plan keeps them)
        self.scalars, self.found = torch.ones(4), torch.zeros(1)
        self.wall, self.cpu = [], []

    def new_grads(self):
        return [torch.zeros(m, dtype=self.dt) for _ in range(n)]

    def call(self, grads):
        C._PLANS, (C._plan_grads, C._TensorGuards, C._dense_ptrs) = self.plans, self.check
        optim.optim_(self.params, grads, self.masters, self.states, self.scalars, self.found, None, 0, "adamw",
                     [0.9, 0.999, 1e-8], 0)


variants = [Variant(layout, check) for check in ("c", "c-guards", "python") for layout in ("fp32", "bf16")
            if check == "python" or (native_check is not None and (check != "c" or dense is not None))]
for v in variants:
    for _ in range(2):
        v.call(v.new_grads())
for _ in range({reps}):  # interleaved: each variant once per round
    for v in variants:
        grads = v.new_grads()
        launched.clear()
        t0, c0 = time.perf_counter(), time.thread_time()
        v.call(grads)
        v.cpu.append(time.thread_time() - c0)
        v.wall.append(time.perf_counter() - t0)
        v.launches = len(launched)
out = {{}}
for v in variants:
    grads = v.new_grads()
    counts = [0, 0]
    def prof(frame, event, arg):
        if event == "call":
            counts[0] += 1
        elif event == "c_call":
            counts[1] += 1
    sys.setprofile(prof)
    v.call(grads)
    sys.setprofile(None)
    w, c = sorted(v.wall), sorted(v.cpu)
    out[v.key] = {{"median_s": w[len(w) // 2], "min_s": w[0], "max_s": w[-1], "cpu_median_s": c[len(c) // 2],
                  "cpu_min_s": c[0], "cpu_max_s": c[-1], "launches": v.launches, "py_calls": counts[0] - 1,
                  "c_calls": counts[1]}}
print(json.dumps(out))
"""

_PLAN_DRIVER = r"""
#include <chrono>
#include <cstdint>
#include <iostream>
#include <vector>

#include "launch_plan.h"

using namespace fastamp::cuda;

// optim_'s table of AdamW on fp32 states (csrc/cuda/optim.cuh): what an fp32 AdamW step packs
constexpr int kDepth = optim_depth(OptimRule::kAdamW, StateFormat::kFloat32);

int main(int argc, char** argv) {
  const int64_t n = std::atoll(argv[1]), m = std::atoll(argv[2]), reps = std::atoll(argv[3]);
  std::vector<int64_t> numel(n, m);
  std::vector<DType> param(n, DType::kFloat32), grad(n, DType::kFloat32);
  std::vector<double> ts;
  uintptr_t sink = 0;
  for (int64_t r = 0; r < reps + 2; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    LaunchPlan plan = plan_optim(OptimRule::kAdamW, StateFormat::kFloat32, param.data(), grad.data(), numel.data(), n,
                                 false, 132);
    std::vector<TableEntry<kDepth>> table(plan.entry_tensor.size());
    pack_table<kDepth>(plan, numel.data(), [](int64_t i, void** row) {
      for (int k = 0; k < kDepth; ++k) row[k] = reinterpret_cast<void*>(static_cast<uintptr_t>((i + 1) * 64 + k));
    }, table.data());
    const auto t1 = std::chrono::steady_clock::now();
    sink += reinterpret_cast<uintptr_t>(table.empty() ? nullptr : table.back().ptrs[0]);
    if (r >= 2) ts.push_back(std::chrono::duration<double>(t1 - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  std::cout << ts[ts.size() / 2] << ' ' << ts.front() << ' ' << ts.back() << ' ' << (sink & 1) << '\n';
  return 0;
}
"""


def triton_host(n: int, m: int, reps: int) -> dict:
    code = _TRITON_WORKER.format(root=ROOT, tools=os.path.join(ROOT, "tests", "tools"), n=n, m=m, reps=reps)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1200)
    if res.returncode != 0:
        return {"error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def cuda_plan_host(n: int, m: int, reps: int) -> dict:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return {"error": "no C++ compiler"}
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "plan.cpp"), os.path.join(d, "plan")
        with open(src, "w") as f:
            f.write(
                _PLAN_DRIVER.replace("#include <vector>", "#include <algorithm>\n#include <cstdlib>\n#include <vector>")
            )
        cmd = [cxx, "-std=c++17", "-O2", "-I", os.path.join(ROOT, "csrc", "cuda"), src, "-o", exe]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            return {"error": res.stderr[-2000:]}
        res = subprocess.run([exe, str(n), str(m), str(reps)], capture_output=True, text=True, timeout=300)
        med, lo, hi, _ = res.stdout.split()
        return {"median_s": float(med), "min_s": float(lo), "max_s": float(hi)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="20000x256,1x5120000", help="NxM,NxM: the many-tensor shape, then the one")
    parser.add_argument("--layouts", default="fp32,bf16", help="param layouts: fp32, bf16 (fp32 master), bf16rem")
    parser.add_argument("--threads", default="1,2", help="torch.set_num_threads values")
    parser.add_argument("--reps", type=int, default=9, help="interleaved repetitions (median)")
    parser.add_argument("--quick", action="store_true", help="smoke sizes: 2000x256 vs 1x512000, 3 reps")
    parser.add_argument("--no-launchers", action="store_true", help="skip part 2 (Triton / CUDA host time)")
    parser.add_argument("--no-native", action="store_true", help="skip part 1 (the native CPU rows)")
    parser.add_argument("--out", default=None, help="output directory (default: benchmarks/results)")
    parser.add_argument("--tag", default="cpu", help="suffix of the output file names")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.reps = "2000x256,1x512000", 3
    out_dir = args.out or common.DEFAULT_OUT
    os.makedirs(out_dir, exist_ok=True)
    info = common.machine_info(torch.device("cpu"))
    threads_before = torch.get_num_threads()
    checks, rows, calls = [], [], {}
    if not args.no_native:
        checks = _checks([s.strip() for s in args.layouts.split(",")])
        rows, calls = native_rows(args)
    torch.set_num_threads(threads_before)

    many_n, many_m = (int(x) for x in args.shapes.split(",")[0].split("x"))
    host_rows = []
    if not args.no_launchers:
        tri = triton_host(many_n, many_m, max(3, args.reps // 2))
        if "error" in tri:
            host_rows.append({"launcher": "triton optim_ adamw", "error": tri["error"].strip().splitlines()[-1]})
        for key, r in ({} if "error" in tri else tri).items():
            layout, check = key.split("/")
            check = {"c": "C passes", "c-guards": "C passes, grads by TensorGuards + Python passes"}.get(
                check, "Python passes"
            )
            host_rows.append(
                {
                    "launcher": f"triton optim_ adamw ({layout} params{', fp32 master' if layout == 'bf16' else ''}; "
                    f"{check})",
                    "tensors": many_n,
                    "host ms per step": round(r["median_s"] * 1e3, 2),
                    "spread ms": f"{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}",
                    "us per tensor": round(r["median_s"] / many_n * 1e6, 3),
                    "CPU ms per step": round(r["cpu_median_s"] * 1e3, 2),
                    "CPU spread ms": f"{r['cpu_min_s'] * 1e3:.1f}-{r['cpu_max_s'] * 1e3:.1f}",
                    "CPU us per tensor": round(r["cpu_median_s"] / many_n * 1e6, 3),
                    "launches": r["launches"],
                    "Python calls per step": r["py_calls"],
                    "C calls per step": r["c_calls"],
                }
            )
        plan = cuda_plan_host(many_n, many_m, 21)
        if "error" in plan:
            host_rows.append({"launcher": "cuda launch_plan.h optim_ (adamw)", "error": plan["error"].strip()[-300:]})
        else:
            host_rows.append(
                {
                    "launcher": "cuda launch_plan.h: plan_optim + pack_table (adamw, fp32)",
                    "tensors": many_n,
                    "host ms per step": round(plan["median_s"] * 1e3, 3),
                    "spread ms": f"{plan['min_s'] * 1e3:.2f}-{plan['max_s'] * 1e3:.2f}",
                    "us per tensor": round(plan["median_s"] / many_n * 1e6, 4),
                    "launches": "",
                    "Python calls per step": 0,
                    "C calls per step": "",
                }
            )
    for name, (py, c) in calls.items():
        host_rows.append(
            {
                "launcher": f"native {name} (eager)",
                "tensors": many_n,
                "host ms per step": "",
                "spread ms": "",
                "us per tensor": "",
                "launches": "",
                "Python calls per step": py,
                "C calls per step": c,
            }
        )

    info["load_avg_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    base = os.path.join(out_dir, f"bench_host_overhead-{args.tag}")
    if rows:
        common.write_csv(base + ".csv", rows)
    if host_rows:
        common.write_csv(base + "-host.csv", host_rows)
    lines = ["# Host overhead: many small tensors vs one tensor of the same elements", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [f"- {c}" for c in checks]
    lines += [
        "",
        "Medians of interleaved repetitions (spread: min-max over them). Grads are new tensors before every "
        "timed call (untimed). Goal (issue 21): ratio many/one <= 1.5 for fastamp.",
        "",
    ]
    lines += common.markdown_table(rows, common.columns_of(rows)).splitlines() if rows else ["(native rows not run)"]
    if host_rows:
        lines += ["", "## Host only: launches recorded, not run; Python calls per step", ""]
        lines += common.markdown_table(host_rows, common.columns_of(host_rows)).splitlines()
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {base}.csv and {base}.md")


if __name__ == "__main__":
    main()
