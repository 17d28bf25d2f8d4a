"""``python -m fastamp.env``: versions, what was built, and which backend runs each op."""

from __future__ import annotations

import os
import platform
import sys


def report() -> str:
    import torch

    import fastamp
    from fastamp import _ops, backends, kernels

    lines = [
        f"fastamp {fastamp.__version__}",
        f"python {sys.version.split()[0]} on {platform.machine()} ({platform.platform()})",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}; cuda available: {torch.cuda.is_available()})",
    ]
    ok, why = kernels._triton_status()
    lines.append(f"triton: {why}" + (f"; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}" if ok else ""))
    if _ops.NATIVE_LOADED:
        isa = torch.ops.fastamp.cpu_isa() if hasattr(torch.ops.fastamp, "cpu_isa") else "unknown"
        lines.append(
            f"fastamp._C: loaded ({_ops.build_info()}); CPU kernels use {isa} "
            f"[FASTAMP_CPU_ISA={os.environ.get('FASTAMP_CPU_ISA', '')}]"
        )
    else:
        lines.append(f"fastamp._C: not loaded ({_ops.NATIVE_ERROR})")
    forced = backends.get_backend()
    lines.append(
        f"forced backend: {forced or 'none (AUTO)'}  [FASTAMP_BACKEND={os.environ.get('FASTAMP_BACKEND', '')}]"
    )
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        lines.append(f"device {dev}:")
        for op in _ops.NATIVE_OPS:
            avail = []
            for b in backends.BACKENDS:
                ok, why = backends.available(b, op, dev)
                avail.append(b if ok else f"-{b}")
            try:
                pick = backends.resolve(op, dev)
            except backends.BackendUnavailableError as e:
                pick = f"error: {e}"
            lines.append(f"  {op:<16} available: {' '.join(avail):<28} runs: {pick}")
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
