"""What the optimizer path should cost on a GPU: bytes per param per configuration and the
time each takes at a device bandwidth, so a GPU run can be judged against the limit.

The byte counts are the benchmarks' own (reads + writes per element, as the providers of
``bench_adamw.py`` / ``bench_step.py`` / ``bench_unscale.py`` count them); every pass is a
stream over memory, so on a GPU its floor is ``bytes / bandwidth``. The bandwidth is a
device-to-device copy measured on the GPU when one is present (``--measure``, what
``gpu_check.sh`` does), else the number given with ``--bandwidth-gbs`` (default: the
H200's nominal 4,800 GB/s; a copy typically reaches ~90% of nominal).

    python benchmarks/gpu_cost_model.py                       # table at 4.8 TB/s, markdown to stdout
    python benchmarks/gpu_cost_model.py --measure --out benchmarks/results/gpu_cost_model.md

Judge a measured GPU time ``t`` for ``n`` elements of a row as ``(n * bytes_per_param / t)``
against the measured copy bandwidth: ≥ ~0.8 of it is at the limit for a streaming kernel.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_adamw import DTYPES, KINDS, NOTES  # noqa: E402

# The whole step of bench_step.py: check+norm pass (reads the grad once) + AdamW + update.
TORCH_STEP_BYTES = 48  # GradScaler.unscale_ 8 + clip_grad_norm_(foreach) 12 + AdamW(fused) 28, fp32
# The grad is the param's dtype in every bench_adamw kind: made from its table, so that a new kind
# there cannot miss here (a hand-kept table once lacked one: a KeyError in CI).
GRAD_BYTES = {kind: DTYPES[kind].itemsize for kind in KINDS}


def rows() -> list[tuple[str, int, str]]:
    """``(configuration, bytes per param, what is read and written)`` of every path we ship."""
    out = [("torch fp32 step (GradScaler + clip_grad_norm_ + AdamW(fused))", TORCH_STEP_BYTES, "fp32, 3 passes")]
    for kind, (_master, _moments, _sr, adam_bytes) in KINDS.items():
        grad = GRAD_BYTES[kind]
        out.append((f"fastamp step, {kind}", grad + adam_bytes, f"check+norm read {grad} B + {NOTES[kind]}"))
    for kind, (_master, _moments, _sr, adam_bytes) in KINDS.items():
        out.append((f"fastamp AdamW alone, {kind}", adam_bytes, NOTES[kind]))
    for name, grad in (("fp32", 4), ("bf16/fp16", 2)):
        out.append((f"unscale check + norm, {name} grads (read only)", grad, "the scaler's fused check pass"))
        out.append((f"unscale check + norm + write-back, {name} grads", 2 * grad, "unscale_ on an ordinary optimizer"))
    return out


def measure_copy_gbs() -> float:
    """Device-to-device copy bandwidth (GB/s, reads + writes counted), best of 10, 1 GiB buffers."""
    import torch

    n = 1 << 28
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / best / 1e9


def table(gbs: float, sizes: list[int]) -> str:
    head = "| configuration | B/param | " + " | ".join(f"floor at {n / 1e6:g}M params (ms)" for n in sizes)
    lines = [head + " | traffic |", "|---|---|" + "---|" * len(sizes) + "---|"]
    for name, nbytes, note in rows():
        times = " | ".join(f"{n * nbytes / (gbs * 1e9) * 1e3:.3f}" for n in sizes)
        lines.append(f"| {name} | {nbytes} | {times} | {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="device bandwidth, GB/s")
    parser.add_argument("--measure", action="store_true", help="measure a device copy on the GPU instead")
    parser.add_argument("--sizes", default="64e6,1e9", help="comma-separated param counts")
    parser.add_argument("--out", default=None, help="write the markdown here too")
    args = parser.parse_args(argv)
    gbs, source = args.bandwidth_gbs, f"given: {args.bandwidth_gbs:g} GB/s"
    if args.measure:
        import torch

        if not torch.cuda.is_available():
            parser.error("--measure needs a CUDA device")
        gbs = measure_copy_gbs()
        source = f"measured device copy on {torch.cuda.get_device_name()}: {gbs:.0f} GB/s"
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    text = (
        "# GPU cost model: the memory-bandwidth floor of each optimizer path\n\n"
        f"Bandwidth ({source}). Floor = params x bytes/param / bandwidth; "
        "bytes are reads + writes per element.\n\n" + table(gbs, sizes) + "\n"
    )
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
