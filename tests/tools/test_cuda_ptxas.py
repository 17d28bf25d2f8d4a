"""Register use and spills of every CUDA kernel, from ``ptxas -v``, for machines without a GPU.

Each ``csrc/cuda/*.cu`` is compiled once for sm_80 and sm_90 with setup.py's flags plus
``-Xptxas -v``, all files in parallel, by test_cuda_compile.py's session-wide compile (the
same objects its tests check). Every kernel
instantiation must report 0 spill bytes on both archs: a spill is a local-memory round trip
per thread in a memory-bound kernel. The figures (registers, stack, spills per kernel and
arch) are recorded in benchmarks/results/cuda_ptxas.md; regenerate it with
``python tests/tools/test_cuda_ptxas.py --write`` after changing a kernel.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a script: tests/ (pytest's pythonpath) holds cuda_optim_calls
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_cuda_compile import NVCC, ROOT, compile_cu_files, optim_instances, requires_nvcc, xdist_shared

pytestmark = pytest.mark.slow  # every test reads the session-wide nvcc compile (~45 s)
RESULTS = ROOT / "benchmarks" / "results" / "cuda_ptxas.md"
ARCHS = ("sm_80", "sm_90")


def _expected():
    """Kernels (by name) and instantiations per file: a kernel ptxas did not report is a kernel this test
    did not check. optim_'s come from the rules' kCudaStates (9 dtype pairs per (rule, format) pair, in its
    format's file; test_cuda_compile.py tells the rules and formats apart); optim.cu holds no kernel."""
    expected = {
        "amp.cu": {
            "unscale_check_kernel": 9,
            "sumsq_finalize_kernel": 1,
            "sumsq_fold_kernel": 1,
            "update_scale_kernel": 1,
            "table_fill_kernel": 1,
        },
        "optim.cu": {},
    }
    for name, instances in optim_instances().items():
        expected[name] = {"optim_kernel": sum(instances.values()), "table_fill_kernel": 1}
    return expected


EXPECTED = _expected()

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text):
    """{(mangled kernel, arch): {"registers", "stack", "spill_stores", "spill_loads"}} from ``ptxas -v`` output."""
    rows, cur = {}, None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            cur = (m.group(1), m.group(2))
            rows[cur] = {}
            continue
        if cur is None:
            continue
        m = _FRAME.search(line)
        if m:
            rows[cur].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _REGS.search(line)
        if m:
            rows[cur]["registers"] = int(m.group(1))
    return rows


def kernel_name(mangled):
    """The kernel's source name (``adamw_kernel``), read from its mangled name."""
    names = {name for per_file in EXPECTED.values() for name in per_file}
    found = [n for n in names if f"{len(n)}{n}" in mangled]
    return max(found, key=len) if found else mangled


def readable(mangled):
    """Demangled, without namespaces and parameter list (``adamw_kernel<F16, F32>``), or the mangled name."""
    filt = shutil.which("c++filt")
    if filt is None:
        return mangled
    out = subprocess.run([filt], input=mangled, capture_output=True, text=True).stdout.strip()
    out = re.sub(r"^void ", "", out)
    for prefix in ("fastamp::cuda::", "fastamp::math::", "fastamp::rules::", "(anonymous namespace)::", "detail::"):
        out = out.replace(prefix, "")
    depth, end = 0, len(out)
    for i, ch in enumerate(out):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            end = i
            break
    return out[:end].replace(" >", ">")


@pytest.fixture(scope="module")
def ptxas(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found")
    compiled = compile_cu_files(lambda: tmp_path_factory.mktemp("cuda_objs"), xdist_shared(tmp_path_factory))
    return {name: (rc, out, parse_ptxas(out)) for name, (rc, out, _obj) in compiled.items()}


@requires_nvcc
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_kernel_is_reported_for_both_archs(ptxas, name):
    rc, out, rows = ptxas[name]
    assert rc == 0, f"nvcc failed on {name}:\n{out[-6000:]}"
    per_arch = {arch: sorted(k for k, a in rows if a == arch) for arch in ARCHS}
    assert per_arch["sm_80"] == per_arch["sm_90"], f"{name}: kernels differ between archs"
    counts = {}
    for mangled in per_arch["sm_80"]:
        counts[kernel_name(mangled)] = counts.get(kernel_name(mangled), 0) + 1
    assert counts == EXPECTED[name], f"{name}: kernels reported by ptxas {counts}"
    for key, row in rows.items():
        assert {"registers", "stack", "spill_stores", "spill_loads"} <= set(row), f"{name}: incomplete report {key}"


@requires_nvcc
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_no_kernel_spills(ptxas, name):
    rc, out, rows = ptxas[name]
    assert rc == 0, out[-6000:]
    spilling = {
        f"{readable(k)} [{arch}]": (row["registers"], row["spill_stores"], row["spill_loads"])
        for (k, arch), row in rows.items()
        if row["spill_stores"] or row["spill_loads"]
    }
    assert not spilling, f"{name}: kernels that spill (registers, spill store bytes, spill load bytes): {spilling}"


@requires_nvcc
def test_results_file_lists_every_kernel(ptxas):
    """benchmarks/results/cuda_ptxas.md names every kernel compiled today (regenerate it with --write)."""
    assert RESULTS.exists(), f"{RESULTS} missing: run python tests/tools/test_cuda_ptxas.py --write"
    text = RESULTS.read_text()
    missing = sorted({readable(k) for rc, out, rows in ptxas.values() for k, _ in rows} - set(_listed(text)))
    assert not missing, f"{RESULTS.name} lacks {missing}: run python tests/tools/test_cuda_ptxas.py --write"


def _listed(text):
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", text, flags=re.M)]


def render(results, nvcc_version):
    """The results file: one row per kernel, registers / stack / spills for each arch."""
    lines = [
        "# CUDA kernels: registers and spills (ptxas -v)",
        "",
        f"Generated by `python tests/tools/test_cuda_ptxas.py --write` with {nvcc_version}, setup.py's flags",
        "(`-O3 --fmad=false`), for sm_80 and sm_90. tests/tools/test_cuda_ptxas.py holds every kernel to",
        "0 spill bytes. Occupancy follows from the registers: 256-thread blocks, 64 K registers",
        "per SM, so <= 64 registers allow 4 blocks per SM, <= 80 allow 3, <= 128 allow 2.",
        "",
        "| kernel | file | sm_80 registers | sm_80 stack / spill st / spill ld (B) "
        "| sm_90 registers | sm_90 stack / spill st / spill ld (B) |",
        "|---|---|---|---|---|---|",
    ]
    for name in sorted(results):
        rows = results[name][2]
        for mangled in sorted({k for k, _ in rows}, key=readable):
            cells = []
            for arch in ARCHS:
                r = rows.get((mangled, arch), {})
                cells.append(str(r.get("registers", "?")))
                cells.append(f"{r.get('stack', '?')} / {r.get('spill_stores', '?')} / {r.get('spill_loads', '?')}")
            lines.append(f"| `{readable(mangled)}` | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv):
    if "--write" not in argv:
        print(__doc__)
        return 2
    if NVCC is None:
        print("nvcc not found", file=sys.stderr)
        return 1
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        compiled = compile_cu_files(lambda: Path(tmp))
    results = {name: (rc, out, parse_ptxas(out)) for name, (rc, out, _obj) in compiled.items()}
    for name, (rc, out, _) in results.items():
        if rc != 0:
            print(f"nvcc failed on {name}:\n{out[-6000:]}", file=sys.stderr)
            return 1
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+), (V[\d.]+)", version)
    RESULTS.write_text(render(results, f"nvcc {m.group(2)}" if m else "nvcc"))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
