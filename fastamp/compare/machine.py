"""What the CPU offers low-precision training: its instruction-set flags, for the report header.

Read, not assumed: the flags come from ``/proc/cpuinfo`` (Linux), and torch's own choice of
kernels from ``torch.backends.cpu.get_cpu_capability()``. They are reported as facts only:
whether torch uses them for an op is another matter (on a Xeon with AVX512-FP16 torch's fp16
convolution weight gradient ran about 100x slower than fp32's), so the report explains the
speed column from the op profile it measures (:mod:`fastamp.compare.hotspots`), not from these."""

from __future__ import annotations

import torch

from fastamp.env import read_cpuinfo

# (label in the report, /proc/cpuinfo flags any of which means "yes")
CPU_FEATURES = (
    ("AMX", ("amx_tile",)),
    ("AMX-BF16", ("amx_bf16",)),
    ("AMX-FP16", ("amx_fp16",)),
    ("AVX512-BF16", ("avx512_bf16",)),
    ("AVX512-FP16", ("avx512_fp16",)),
    ("AVX-512", ("avx512f",)),
    ("AVX2", ("avx2",)),
)


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str] | None:
    """The CPU flags of the first processor listed in ``path``; None where there is no such file."""
    info = read_cpuinfo(path)
    if info is None:
        return None
    return info[1] if info[1] is not None else set()


def cpu_features(flags: set[str] | None = None) -> dict[str, bool] | None:
    """``{label: present}`` for :data:`CPU_FEATURES`; None when the flags cannot be read."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return None
    return {label: any(f in flags for f in names) for label, names in CPU_FEATURES}


def cpu_features_line(flags: set[str] | None = None) -> str:
    """One line for the report header: each feature yes/no, and the kernels torch picked."""
    feats = cpu_features(flags)
    have = "flags unknown (no /proc/cpuinfo)"
    if feats is not None:
        have = ", ".join(f"{label} {'yes' if ok else 'no'}" for label, ok in feats.items()) + " (/proc/cpuinfo flags)"
    return f"{have}; torch CPU kernels: {torch.backends.cpu.get_cpu_capability()}"
