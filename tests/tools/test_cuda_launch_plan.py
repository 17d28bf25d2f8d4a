"""Launch counts of the CUDA backend, counted without a GPU.

``csrc/cuda/launch_plan.h`` is the host-side, torch-free plan the CUDA launchers run: which
launches an op call makes, how its tensors are packed into the launch table, and how each
block finds its chunks (the same walker the kernels use). A small C++ driver compiled here
with the host compiler plans the configurations below, packs each table with fake pointers
that encode (list index, row), replays every block of every launch through the walker and
prints what it visited. The tests check the counts and that every element of every tensor
is covered exactly once, by the right launch, on 16-byte-aligned chunk boundaries.

Skipped only where no C++ compiler is found.
"""

import math
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
from cuda_optim_calls import rule_max_states, rule_rows
from test_cuda_compile import FORMAT_FILES, optim_combos

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "csrc" / "cuda"
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")

CHUNK = 65536
FILL_PAYLOAD = 32768 - 64  # kFillPayloadBytes with CUDA >= 12.1
MAX_LAUNCHES = 10
F32, F16, BF16 = 0, 1, 2
DTYPE_BYTES = {F32: 4, F16: 2, BF16: 2}
# Pointer rows per tensor in each op's table (launch_plan.h's k*Depth and optim_depth). optim_'s
# tables, one per (rule, state format) of the rules' kCudaStates (csrc/rules/<name>.h): param, grad,
# master, the rule's most states (x2 for q8: codes and scales), the tensor's list index.
_MAX_STATES = rule_max_states()
_RULE_IDS = {f"k{name}": i for i, (name, _) in enumerate(rule_rows())}  # RuleId: the list's order
_FORMAT_IDS = {"kFloat32": 0, "kBFloat16": 1, "kQ8": 2}
OPTIM = {
    f"optim_{rule[1:].lower()}_{fmt[1:].lower()}": (rule, fmt, 4 + _MAX_STATES[rule] * (2 if fmt == "kQ8" else 1))
    for rule, fmt in optim_combos()
}
OPS = {
    "unscale": {"depth": 1},
    "unscale_stats": {"depth": 3},
    **{name: {"depth": depth} for name, (_, _, depth) in OPTIM.items()},
}
SMS = 132

DRIVER = r"""
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "launch_plan.h"

using namespace fastamp::cuda;

// Fake device pointers: list index and row, recovered from the packed table.
static void* fake_ptr(int64_t i, int row) { return reinterpret_cast<void*>(static_cast<uintptr_t>((i + 1) * 16 + row)); }

template <int DEPTH>
static void replay(const LaunchPlan& plan, const std::vector<int64_t>& numel) {
  std::vector<TableEntry<DEPTH>> table(plan.entry_tensor.size());
  pack_table<DEPTH>(plan, numel.data(), [](int64_t i, void** row) {
    for (int r = 0; r < DEPTH; ++r) row[r] = fake_ptr(i, r);
  }, table.data());
  for (size_t k = 0; k < plan.launches.size(); ++k) {
    const PlannedLaunch& l = plan.launches[k];
    std::cout << "launch " << k << ' ' << l.group << ' ' << l.num_tensors << ' ' << l.num_chunks << ' '
              << l.first_chunk << ' ' << l.grid << '\n';
    const TableView<DEPTH> view{table.data() + l.first_entry, l.num_tensors, l.num_chunks};
    for (int64_t b = 0; b < l.grid; ++b) {
      int64_t first = 0, last = 0;
      block_chunk_range(view.num_chunks, l.grid, b, &first, &last);
      if (first >= last) continue;
      ChunkWalker<DEPTH> walk(view, first);
      for (int64_t c = first; c < last; ++c) {
        const ChunkLocation loc = walk.locate(c);
        const auto bits = reinterpret_cast<uintptr_t>(view.entries[loc.tensor].ptrs[0]);
        bool rows_ok = true;
        for (int r = 0; r < DEPTH; ++r) {
          rows_ok = rows_ok && view.entries[loc.tensor].ptrs[r] == fake_ptr(static_cast<int64_t>(bits / 16) - 1, r);
        }
        std::cout << "chunk " << k << ' ' << b << ' ' << c << ' ' << (static_cast<int64_t>(bits / 16) - 1) << ' '
                  << loc.offset << ' ' << loc.n << ' ' << (rows_ok ? 1 : 0) << '\n';
      }
    }
  }
}

template <int R, int F>
static void replay_optim_as(const LaunchPlan& plan, const std::vector<int64_t>& numel) {
  constexpr int kDepth = optim_depth(static_cast<OptimRule>(R), static_cast<StateFormat>(F));
  static_assert(sizeof(TableEntry<kDepth>) == optim_entry_bytes(static_cast<OptimRule>(R), static_cast<StateFormat>(F)));
  replay<kDepth>(plan, numel);
}

template <int R>
static void replay_rule(int format, const LaunchPlan& plan, const std::vector<int64_t>& numel) {
  switch (format) {
    case 0: replay_optim_as<R, 0>(plan, numel); break;
    case 1: replay_optim_as<R, 1>(plan, numel); break;
    case 2: replay_optim_as<R, 2>(plan, numel); break;
  }
}

// every rule of csrc/optim_rules.h's list
static void replay_optim(int rule, int format, const LaunchPlan& plan, const std::vector<int64_t>& numel) {
#define REPLAY_RULE_(Name, name) \
  if (rule == static_cast<int>(OptimRule::k##Name)) replay_rule<static_cast<int>(OptimRule::k##Name)>(format, plan, numel);
  FASTAMP_OPTIM_RULES(REPLAY_RULE_)
#undef REPLAY_RULE_
}

int main() {
  std::string word, op;
  int capturing = 0;
  int64_t sms = 0, n = 0;
  while (std::cin >> word >> op >> capturing >> sms >> n) {
    std::vector<int64_t> numel(n);
    std::vector<DType> param(n), grad(n);
    for (int64_t i = 0; i < n; ++i) {
      int p = 0, g = 0;
      std::cin >> numel[i] >> p >> g;
      param[i] = static_cast<DType>(p);
      grad[i] = static_cast<DType>(g);
    }
    LaunchPlan plan;
    int rule = -1, format = -1;
    if (op == "unscale" || op == "unscale_stats") {
      plan = plan_unscale_check(grad.data(), numel.data(), n, op == "unscale_stats", capturing != 0, sms);
    } else if (op.rfind("optim:", 0) == 0) {  // optim:<rule>:<format>
      rule = op[6] - '0';
      format = op[8] - '0';
      plan = plan_optim(static_cast<OptimRule>(rule), static_cast<StateFormat>(format), param.data(), grad.data(),
                        numel.data(), n, capturing != 0, sms);
    } else {
      std::cerr << "unknown op " << op << '\n';
      return 2;
    }
    std::cout << "plan " << word << ' ' << plan.launches.size() << ' ' << plan.table_copies << ' ' << plan.table_fills
              << ' ' << plan.other_launches << ' ' << plan.total_launches() << ' ' << plan.table_bytes << ' '
              << plan.entry_bytes << ' ' << plan.total_chunks << '\n';
    if (capturing != 0) {
      for (const FillSegment& seg : fill_segments(plan.table_bytes)) std::cout << "fill " << seg.offset << ' ' << seg.bytes << '\n';
    }
    if (op == "unscale") replay<kUnscaleDepth>(plan, numel);
    if (op == "unscale_stats") replay<kUnscaleStatsDepth>(plan, numel);
    if (rule >= 0) replay_optim(rule, format, plan, numel);
    std::cout << "end\n";
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    out = tmp_path_factory.mktemp("launch_plan")
    src = out / "driver.cpp"
    src.write_text(DRIVER)
    exe = out / "driver"
    cmd = [CXX, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(CUDA_DIR), str(src), "-o", str(exe)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"the launch-plan driver does not compile:\n{res.stderr[-4000:]}"
    return exe


def _driver_op(op):
    """The driver's name of an op: ``optim:<rule>:<format>`` (OptimRule, StateFormat values) for optim_'s tables."""
    if op in OPTIM:
        rule, fmt, _ = OPTIM[op]
        return f"optim:{_RULE_IDS[rule]}:{_FORMAT_IDS[fmt]}"
    return op


def _group(op, p, g):
    return g if op in ("unscale", "unscale_stats") else 3 * p + g


def _dtype_mix(op, i, mixed):
    """(param dtype, grad dtype) of tensor i: one combination, or all of the op's in turn."""
    if not mixed:
        return (F32, F32)
    if op in ("unscale", "unscale_stats"):
        return (BF16, i % 3)
    return ((i // 3) % 3, i % 3)


def run_plans(driver, configs):
    """configs: {name: (op, capturing, [(numel, param dtype, grad dtype), ...])} -> parsed plans."""
    lines = []
    for name, (op, capturing, tensors) in configs.items():
        lines.append(f"{name} {_driver_op(op)} {int(capturing)} {SMS} {len(tensors)}")
        lines.extend(f"{n} {p} {g}" for n, p, g in tensors)
    res = subprocess.run([str(driver)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    plans, cur = {}, None
    for line in res.stdout.splitlines():
        f = line.split()
        if f[0] == "plan":
            keys = ("launches", "copies", "fills", "other", "total", "table_bytes", "entry_bytes", "chunks")
            cur = {"counts": dict(zip(keys, map(int, f[2:]))), "launches": [], "chunks": [], "fills": []}
            plans[f[1]] = cur
        elif f[0] == "launch":
            cur["launches"].append(
                dict(zip(("k", "group", "tensors", "chunks", "first_chunk", "grid"), map(int, f[1:])))
            )
        elif f[0] == "fill":
            cur["fills"].append((int(f[1]), int(f[2])))
        elif f[0] == "chunk":
            cur["chunks"].append(tuple(map(int, f[1:])))
    return plans


def check_plan(name, op, capturing, tensors, plan):
    """Every element of every non-empty tensor exactly once, by the launch of its dtype group."""
    counts, launches = plan["counts"], plan["launches"]
    entry = 8 * OPS[op]["depth"] + 16
    live = [i for i, (n, _, _) in enumerate(tensors) if n > 0]
    assert counts["entry_bytes"] == entry
    assert counts["table_bytes"] == entry * len(live)
    assert counts["launches"] == len(launches) == len({_group(op, p, g) for n, p, g in tensors if n > 0})
    assert counts["chunks"] == sum(math.ceil(tensors[i][0] / CHUNK) for i in live)
    if capturing:
        assert counts["copies"] == 0 and counts["fills"] == len(plan["fills"])
        assert counts["fills"] == math.ceil(counts["table_bytes"] / FILL_PAYLOAD)
        pos = 0
        for offset, size in plan["fills"]:  # the fill kernels write the whole buffer once, in 16-byte words
            assert offset == pos and size % 16 == 0 and 0 < size <= FILL_PAYLOAD
            pos += size
        assert pos == -(-counts["table_bytes"] // 16) * 16
    else:
        assert counts["fills"] == 0 and counts["copies"] == (1 if live else 0)
    other = {"unscale": 1, "unscale_stats": 3 if tensors else 1}.get(op, 0)
    assert counts["other"] == other
    assert counts["total"] == counts["copies"] + counts["fills"] + counts["launches"] + other

    groups = [L["group"] for L in launches]
    assert groups == sorted(groups), "launches in dtype-group order"
    first = 0
    for L in launches:
        assert L["first_chunk"] == first, "chunk ordinals (sum-of-squares partials) follow launch order"
        first += L["chunks"]
        assert 1 <= L["grid"] <= min(L["chunks"], SMS * 2048 // 256)

    covered = defaultdict(list)
    per_launch_chunks = defaultdict(list)
    blocks_seen = defaultdict(set)
    for k, block, chunk, i, offset, n, rows_ok in plan["chunks"]:
        assert rows_ok == 1, f"{name}: table row pointers of tensor {i} came back wrong"
        numel, p, g = tensors[i]
        assert launches[k]["group"] == _group(op, p, g), f"{name}: tensor {i} in the wrong launch"
        assert 1 <= n <= CHUNK and offset % CHUNK == 0 and offset + n <= numel
        for size in {4, DTYPE_BYTES[p], DTYPE_BYTES[g]}:  # fp32 state rows and the 16-bit data
            assert (offset * size) % 16 == 0, f"{name}: chunk boundary not 16-byte aligned"
        covered[i].append((offset, n))
        per_launch_chunks[k].append(chunk)
        blocks_seen[k].add(block)
    assert sorted(covered) == live, f"{name}: tensors missing or extra"
    for i, spans in covered.items():
        spans.sort()
        pos = 0
        for offset, n in spans:
            assert offset == pos, f"{name}: tensor {i} has a gap or an overlap at {offset}"
            pos += n
        assert pos == tensors[i][0], f"{name}: tensor {i} covered up to {pos} of {tensors[i][0]}"
    for k, L in enumerate(launches):
        assert sorted(per_launch_chunks[k]) == list(range(L["chunks"])), f"{name}: launch {k} chunks not exactly once"
        assert blocks_seen[k] == set(range(L["grid"])), f"{name}: launch {k} has idle blocks"


def _configs():
    cfg = {}
    for op in OPS:
        for mixed in (False, True):
            for count, numel in ((20000, 256), (256, 262144)):
                tensors = [(numel, *_dtype_mix(op, i, mixed)) for i in range(count)]
                cfg[f"{op}-{count}x{numel}-{'mixed' if mixed else 'one'}"] = (op, False, tensors)
        # empty tensors, sizes around the chunk, a huge tensor, primes, under capture and not
        odd = [0, 1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 0, 3 * CHUNK + 5, 1000003, 0, 2**31 + 1029, 13]
        ragged = [(n, *_dtype_mix(op, i, True)) for i, n in enumerate(odd)]
        cfg[f"{op}-ragged"] = (op, False, ragged)
        cfg[f"{op}-ragged-capture"] = (op, True, ragged)
        cfg[f"{op}-20000x256-capture"] = (op, True, [(256, *_dtype_mix(op, i, False)) for i in range(20000)])
        cfg[f"{op}-empty"] = (op, False, [(0, *_dtype_mix(op, i, True)) for i in range(3)])
        cfg[f"{op}-none"] = (op, False, [])
    return cfg


CONFIGS = _configs()


@pytest.fixture(scope="module")
def plans(driver):
    return run_plans(driver, CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_covers_every_element_once(plans, name):
    op, capturing, tensors = CONFIGS[name]
    check_plan(name, op, capturing, tensors, plans[name])


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("shape", ["20000x256", "256x262144"])
@pytest.mark.parametrize("mix", ["one", "mixed"])
def test_at_most_ten_launches_per_op(plans, op, shape, mix):
    counts = plans[f"{op}-{shape}-{mix}"]["counts"]
    assert counts["total"] <= MAX_LAUNCHES, counts
    if mix == "one":
        # one dtype combination: the table copy, one kernel, and the op's own extras
        assert counts["launches"] == 1 and counts["copies"] == 1, counts


def test_launch_count_does_not_grow_with_the_tensor_count(driver):
    cfg = {f"n{n}": ("optim_adamw_float32", False, [(256, F32, F32)] * n) for n in (1, 61, 62, 1000, 20000, 100000)}
    got = run_plans(driver, cfg)
    assert {name: p["counts"]["total"] for name, p in got.items()} == {name: 2 for name in cfg}


def test_capture_fills_carry_the_whole_table(plans):
    # Under capture the table goes into the graph as kernel arguments, 32 KB per fill kernel.
    counts = plans["optim_adamw_float32-20000x256-capture"]["counts"]
    assert counts["table_bytes"] == 20000 * 72
    assert counts["fills"] == math.ceil(20000 * 72 / FILL_PAYLOAD) and counts["copies"] == 0


def test_every_launcher_runs_the_plan():
    """The launchers plan with launch_plan.h and run that plan; no other kernel launch loops."""
    for name, planners in {"amp.cu": ["plan_unscale_check"], "optim.cuh": ["plan_optim"]}.items():
        text = (CUDA_DIR / name).read_text()
        for planner in planners:
            assert f"{planner}(" in text, f"{name} does not call {planner}"
        assert text.count("detail::run_plan<" if name.endswith(".cu") else "run_plan<") == len(planners), name
    header = (CUDA_DIR / "launch_plan.h").read_text()
    assert "#include <cuda" not in header and "torch" not in header.split("#pragma once")[1]


def test_rules_and_formats_share_one_plan(plans):
    """optim_ plans every (rule, state format) alike, one launch per (param, grad) dtype pair: only the
    table entry (its rows) differs. Each state format's file only instantiates optim.cuh's launcher, which
    alone plans and launches."""
    names = sorted(OPTIM)
    for config in (c for c in CONFIGS if c.startswith(names[0] + "-")):
        suffix = config[len(names[0]) :]
        first = plans[config]
        for other in names[1:]:
            got = plans[other + suffix]
            assert got["launches"] == first["launches"] and got["chunks"] == first["chunks"], other + suffix
            assert got["counts"]["entry_bytes"] == 8 * OPS[other]["depth"] + 16
    for fmt in {fmt for _, fmt, _ in OPTIM.values()}:
        name = FORMAT_FILES[fmt]
        text = (CUDA_DIR / name).read_text()
        assert "run_optim<" in text, f"{name} does not run its format through optim.cuh"
        assert "run_plan<" not in text and "plan_" not in text and "<<<" not in text, f"{name} launches on its own"
    family = (CUDA_DIR / "optim.cuh").read_text()
    assert family.count("<<<") == 1 and "optim_kernel<Rule, PE, GE, SF>" in family
