"""``python -m fastamp.env``: the machine, threads, builds and versions behind a run, and why each backend runs or not.

Each case runs the module in a fresh interpreter, as a user (or the Makefile, or the CUDA-build
tier's grep for ``fastamp._C: loaded (cpu+cuda)``) does.
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # conftest.py sets it for the suite; a user's shell has none
    env.pop("FASTAMP_BACKEND", None)
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _run(*args, before="", **extra):
    """``python -m fastamp.env ARGS``, after running ``before`` in the same interpreter."""
    code = f"import runpy, sys\n{before}\nsys.argv = ['fastamp.env', *{list(args)!r}]\n"
    code += "runpy.run_module('fastamp.env', run_name='__main__', alter_sys=True)\n"
    done = subprocess.run([sys.executable, "-c", code], env=_env(**extra), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_describes_the_command_and_does_not_print_the_report():
    done = subprocess.run(
        [sys.executable, "-m", "fastamp.env", "--help"], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m fastamp.env")
    assert "--json" in done.stdout and "bug report" in " ".join(done.stdout.split())
    assert "fastamp._C: " not in done.stdout  # the report's line ("fastamp._C: loaded (cpu)")
    assert "device cpu:" not in done.stdout


def test_json_holds_what_decides_speed_and_path():
    out = _run(
        "--json",
        before="import atexit\natexit.register(lambda: print([m for m in ('lightning', 'accelerate', "
        "'transformers') if m in sys.modules]))",
        OMP_NUM_THREADS="1",
    )
    report, _, imported = out.rstrip().rpartition("\n")
    assert imported == "[]"  # versions come from package metadata: no framework is imported
    info = json.loads(report)
    cpu, threads = info["cpu"], info["threads"]
    assert cpu["model"] and cpu["logical_cpus"] == os.cpu_count()
    if Path("/proc/cpuinfo").exists():
        assert cpu["flags_from"] == "/proc/cpuinfo"
        text = Path("/proc/cpuinfo").read_text()
        present = set(re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.M).group(1).split())
        for flag in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"):
            assert (flag in cpu["flags"]) == (flag in present), flag
    # OMP_NUM_THREADS reaches torch's intra-op pool, and both are reported
    assert threads["OMP_NUM_THREADS"] == "1" and threads["torch_intra_op"] == 1
    assert threads["parallel_backend"]
    assert info["torch"]["compiler"] and info["torch"]["cpu_capability"]
    assert info["os"]["system"]
    for name, version in info["packages"].items():
        try:
            want = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            want = None
        assert version == want, name
    ops = info["devices"]["cpu"]
    assert set(ops) >= {"adamw_", "unscale_check_", "update_scale_"}
    # every public op is listed with the backend that runs it (adamw_q8_ once was not: it is not in registry.OPS)
    from fastamp import functional

    assert set(functional.__all__) <= set(ops), set(functional.__all__) - set(ops)
    for op, entry in ops.items():
        assert entry["runs"] in ("native", "triton", "torch"), (op, entry)
        assert entry["backends"][entry["runs"]]["available"], (op, entry)
        for backend, state in entry["backends"].items():
            assert state["why"], (op, backend)
    # no TRITON_INTERPRET: Triton cannot run on the CPU, and the report says why
    if info["triton"]["importable"]:
        assert ops["adamw_"]["backends"]["triton"] == {
            "available": False,
            "why": "Triton runs on CPU only under TRITON_INTERPRET=1",
        }


def test_text_report_keeps_the_line_the_build_checks_rely_on_and_says_why_triton_is_off():
    out = _run()
    # tests/tools/cuda_build_tier.sh greps "fastamp._C: loaded (cpu+cuda)"; a CPU build says (cpu)
    from fastamp.ops import registry

    if registry.NATIVE_LOADED:
        assert re.search(r"^fastamp\._C: loaded \(cpu(\+cuda)?\); CPU kernels use \S+", out, re.M), out
    for heading in ("cpu: ", "  flags: ", "threads: torch intra-op ", "torch ", "packages: ", "device cpu:"):
        assert re.search("^" + re.escape(heading), out, re.M), (heading, out)
    if "triton: triton " in out:
        assert "  -triton (every op): Triton runs on CPU only under TRITON_INTERPRET=1" in out, out


def test_report_gives_the_reason_for_each_missing_backend_and_the_forced_one():
    no_triton = _run(before="sys.modules['triton'] = None", TRITON_INTERPRET="1", FASTAMP_BACKEND="torch")
    assert re.search(r"^  -triton \(every op\): triton is not importable", no_triton, re.M), no_triton
    assert "forced backend: torch  [FASTAMP_BACKEND=torch]" in no_triton
    assert re.search(r"^  adamw_ +available: .* runs: torch$", no_triton, re.M), no_triton
    no_ext = _run(before="sys.modules['fastamp._C'] = None")
    assert re.search(r"^fastamp\._C: not loaded \(", no_ext, re.M), no_ext
    assert re.search(r"^  -native \(every op\): fastamp\._C is not built or failed to load", no_ext, re.M), no_ext
    assert re.search(r"^  adamw_ +available: -native .* runs: torch$", no_ext, re.M), no_ext
