"""``python -m fastamp.env``: what decides how fast a run is here, and which code path runs.

Prints the CPU and its relevant instruction-set flags, thread settings and load, torch's build
(compiler, the ISA its CPU kernels use, CUDA), the versions of the frameworks fastamp
integrates with, what ``fastamp._C`` was built with, and, for every op on every device, which
backend runs it and why each other backend cannot. ``--json`` prints the same as one JSON
object, for bug reports. Nothing here imports Lightning, Accelerate or transformers (their
versions come from the installed package metadata).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from typing import Any

# flags that change which kernels torch and fastamp run on a CPU, and how fast fp16/bf16 go
_X86_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
)
_ARM_FLAGS = ("asimd", "fphp", "asimdhp", "bf16", "i8mm", "sve", "sve2", "sme")
# torch's own CPU probes (private, hence looked up defensively): the fallback without /proc/cpuinfo
_TORCH_PROBES = {
    "avx2": "_is_avx2_supported",
    "avx512f": "_is_avx512_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "avx512_vnni": "_is_vnni_supported",
    "amx_tile": "_is_amx_tile_supported",
    "amx_fp16": "_is_amx_fp16_supported",
}
_PACKAGES = ("triton", "lightning", "pytorch-lightning", "accelerate", "transformers", "numpy")
_ENV_VARS = (
    "FASTAMP_BACKEND",
    "FASTAMP_CPU_ISA",
    "FASTAMP_NO_EXT",
    "TRITON_INTERPRET",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "ATEN_CPU_CAPABILITY",
    "CUDA_VISIBLE_DEVICES",
)


def read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str | None, set[str] | None] | None:
    """``(model, flags)`` of the first processor listed in ``path`` (Linux; either None where its line is
    missing); None where the file cannot be read. Also what ``fastamp.compare`` reports the flags from."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    model, flags = None, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if model is None and key in ("model name", "hardware", "processor") and value and not value.isdigit():
            model = value
        if flags is None and key in ("flags", "features"):
            flags = set(value.split())
    return model, flags


def _cpu() -> dict[str, Any]:
    model, present = read_cpuinfo() or (None, None)
    flags, source = None, None
    if present is not None:
        flags = [f for f in _X86_FLAGS + _ARM_FLAGS if f in present]
        source = "/proc/cpuinfo"
    if flags is None:
        import torch

        probes = getattr(torch, "cpu", None)
        flags = [f for f, name in _TORCH_PROBES.items() if getattr(probes, name, lambda: False)()]
        source = "torch's CPU probes (no /proc/cpuinfo)"
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {
        "model": model or platform.processor() or platform.machine() or "unknown",
        "machine": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "flags": flags,
        "flags_from": source,
    }


def _threads() -> dict[str, Any]:
    import torch

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    parallel = next(
        (
            line.split(":", 1)[1].strip()
            for line in torch.__config__.parallel_info().splitlines()
            if line.startswith("ATen parallel backend")
        ),
        None,
    )
    return {
        "torch_intra_op": torch.get_num_threads(),
        "torch_inter_op": torch.get_num_interop_threads(),
        "parallel_backend": parallel,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
        "load_average": load,
    }


def _torch() -> dict[str, Any]:
    import torch

    shown = torch.__config__.show().splitlines()
    # the first "  - " line of torch's build summary names the compiler ("GCC 13.3", "clang 17")
    compiler = next((line.strip()[2:] for line in shown if line.strip().startswith("- ")), None)
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            gpus.append(f"{torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "compiler": compiler,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _packages() -> dict[str, str | None]:
    found = {}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _backends() -> dict[str, Any]:
    import torch

    from fastamp.ops import backends, registry

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    table = {}
    for dev in devices:
        ops = {}
        # every op fastamp.backends resolves: the ones every backend has, the per-rule q8 ops and the
        # generic optim_ (the release ops are native-only helpers)
        for op in (*registry.OPS, *registry.Q8_OPS, *registry.GENERIC_OPS):
            entry = {"backends": {}}
            for b in backends.BACKENDS:
                ok, why = backends.available(b, op, dev)
                entry["backends"][b] = {"available": ok, "why": why}
            try:
                entry["runs"] = backends.resolve(op, dev)
            except backends.BackendUnavailableError as e:
                entry["runs"] = None
                entry["error"] = str(e)
            ops[op] = entry
        table[dev] = ops
    return table


def collect() -> dict[str, Any]:
    """Everything the report shows, as plain data (what ``--json`` prints)."""
    import fastamp
    from fastamp import kernels
    from fastamp.ops import backends, registry

    triton_ok, triton_why = kernels._triton_status()
    native = {
        "loaded": registry.NATIVE_LOADED,
        "build": registry.build_info(),
        "error": registry.NATIVE_ERROR,
        "cpu_isa": registry.cpu_isa(),
    }
    return {
        "fastamp": {"version": fastamp.__version__, "path": os.path.dirname(fastamp.__file__)},
        "python": {"version": sys.version.split()[0], "implementation": platform.python_implementation()},
        "os": {"platform": platform.platform(), "system": platform.system(), "release": platform.release()},
        "cpu": _cpu(),
        "threads": _threads(),
        "torch": _torch(),
        "packages": _packages(),
        "triton": {"importable": triton_ok, "detail": triton_why},
        "native": native,
        "forced_backend": backends.get_backend(),
        "environment": {name: os.environ.get(name) for name in _ENV_VARS},
        "devices": _backends(),
    }


def _unset(value: Any) -> str:
    return "unset" if value is None else str(value)


def format_report(info: dict[str, Any]) -> str:
    cpu, threads, tv, env = info["cpu"], info["threads"], info["torch"], info["environment"]
    usable = "" if cpu["usable_cpus"] in (None, cpu["logical_cpus"]) else f", {cpu['usable_cpus']} usable"
    load = " ".join(str(x) for x in threads["load_average"]) if threads["load_average"] else "unknown"
    packages = ", ".join(f"{name} {version}" for name, version in info["packages"].items() if version)
    missing = ", ".join(name for name, version in info["packages"].items() if not version)
    native = info["native"]
    lines = [
        f"fastamp {info['fastamp']['version']} ({info['fastamp']['path']})",
        f"python {info['python']['version']} ({info['python']['implementation']}) on {info['os']['platform']}",
        f"cpu: {cpu['model']} ({cpu['machine']}), {cpu['logical_cpus']} logical CPUs{usable}",
        f"  flags: {' '.join(cpu['flags']) or 'none of the ones that matter here'} (from {cpu['flags_from']})",
        f"threads: torch intra-op {threads['torch_intra_op']}, inter-op {threads['torch_inter_op']} "
        f"({threads['parallel_backend']}); OMP_NUM_THREADS {_unset(threads['OMP_NUM_THREADS'])}, "
        f"MKL_NUM_THREADS {_unset(threads['MKL_NUM_THREADS'])}; load average {load}",
        f"torch {tv['version']}: built with {tv['compiler']}; its CPU kernels use {tv['cpu_capability']}; "
        f"CUDA {tv['cuda']} (cuda available: {tv['cuda_available']})",
    ]
    if tv["gpus"]:
        lines.append(f"gpus: {', '.join(tv['gpus'])}")
    lines.append(f"packages: {packages or 'none'}" + (f" (not installed: {missing})" if missing else ""))
    lines.append(f"triton: {info['triton']['detail']}; TRITON_INTERPRET {_unset(env['TRITON_INTERPRET'])}")
    if native["loaded"]:
        lines.append(
            f"fastamp._C: loaded ({native['build']}); CPU kernels use {native['cpu_isa'] or 'unknown'} "
            f"[FASTAMP_CPU_ISA={env['FASTAMP_CPU_ISA'] or ''}]"
        )
    else:
        lines.append(f"fastamp._C: not loaded ({native['error']})")
    lines.append(
        f"forced backend: {info['forced_backend'] or 'none (AUTO)'}  [FASTAMP_BACKEND={env['FASTAMP_BACKEND'] or ''}]"
    )
    for dev, ops in info["devices"].items():
        lines.append(f"device {dev}:")
        width = max(len(op) for op in ops)
        reasons: dict[tuple[str, str], list[str]] = {}
        for op, entry in ops.items():
            avail = " ".join(b if s["available"] else f"-{b}" for b, s in entry["backends"].items())
            runs = entry["runs"] or f"error: {entry['error']}"
            lines.append(f"  {op:<{width}}  available: {avail:<22} runs: {runs}")
            for b, s in entry["backends"].items():
                if not s["available"]:
                    reasons.setdefault((b, s["why"]), []).append(op)
        for (b, why), which in reasons.items():
            scope = "every op" if len(which) == len(ops) else ", ".join(which)
            lines.append(f"  -{b} ({scope}): {why}")
    return "\n".join(lines)


def report() -> str:
    """The text ``python -m fastamp.env`` prints."""
    return format_report(collect())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fastamp.env",
        description="What this machine and install give fastamp: CPU and its fp16/bf16/AMX/AVX flags, threads "
        "and load, torch's build, framework versions, what fastamp._C was built with, and which backend runs "
        "each op on each device (and why the others cannot). Paste its output into a bug report.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(collect(), indent=2))
    else:
        print(report())


if __name__ == "__main__":
    main()
