"""Time ``opt.step()`` of SGD (momentum) and Lion with q8 moments beside their dense step and torch's SGD.

Under ``state_format="q8"`` the step runs the rule's q8 op: on the CPU the generic native kernel of
``optim_`` (csrc/cpu/optim.cpp: decode, step and encode per block of 32 in one pass). Each row is
timed in the same interleaved rounds as the dense step of the same optimizer and
``torch.optim.SGD`` (foreach, fp32 params: torch's best CPU path for SGD; torch has no Lion). bf16 params with remainder masters for fastamp; ``lowbit_min_numel=0``, so the
small tensors of ``20000x256`` hold q8 moments too (the default 4096 would keep them fp32). Reports the best of
``--repeats`` per row and the ratio to the dense fastamp step, per shape and thread count.

    python benchmarks/bench_q8_rules.py [--shapes 1x67108864,20000x256] [--threads 1,2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import subprocess
import time
from datetime import datetime, timezone

import torch

import fastamp


def _params(n_tensors: int, numel: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n_tensors):
        p = torch.nn.Parameter((torch.randn(numel, generator=gen) * 0.02).to(dtype))
        p.grad = (torch.randn(numel, generator=gen) * 1e-3).to(dtype)
        out.append(p)
    return out


def rows_of(n_tensors: int, numel: int) -> list[tuple[str, str, object]]:
    """(name, the dense row it is compared with, factory) per timed row."""
    S, L = fastamp.optim.SGD, fastamp.optim.Lion
    sgd = dict(lr=1e-3, momentum=0.9, master_weights="remainder")
    lion = dict(lr=1e-4, weight_decay=0.1, master_weights="remainder")
    return [
        (
            "torch SGD foreach (fp32)",
            "",
            lambda: torch.optim.SGD(_params(n_tensors, numel, torch.float32), lr=1e-3, momentum=0.9, foreach=True),
        ),  # fmt: skip
        ("fastamp SGD dense", "", lambda: S(_params(n_tensors, numel, torch.bfloat16), **sgd)),
        (
            "fastamp SGD q8",
            "fastamp SGD dense",
            lambda: S(_params(n_tensors, numel, torch.bfloat16), **sgd, state_format="q8", lowbit_min_numel=0),
        ),  # fmt: skip
        ("fastamp Lion dense", "", lambda: L(_params(n_tensors, numel, torch.bfloat16), **lion)),
        (
            "fastamp Lion q8",
            "fastamp Lion dense",
            lambda: L(_params(n_tensors, numel, torch.bfloat16), **lion, state_format="q8", lowbit_min_numel=0),
        ),  # fmt: skip
    ]


def measure(n_tensors: int, numel: int, repeats: int) -> list[dict[str, object]]:
    rows = rows_of(n_tensors, numel)
    opts = {}
    for name, _, make in rows:
        opts[name] = make()
        opts[name].step()  # state created: not timed
    best = {name: float("inf") for name, _, _ in rows}
    for _ in range(repeats):  # interleaved rounds
        for name, _, _ in rows:
            t = time.perf_counter()
            opts[name].step()
            best[name] = min(best[name], time.perf_counter() - t)
    out = []
    for name, base, _ in rows:
        ratio = best[name] / best[base] if base else None
        out.append(dict(name=name, ms=best[name] * 1e3, ns_per_elem=best[name] * 1e9 / (n_tensors * numel),
                        ratio=ratio, base=base))  # fmt: skip
    return out


def _shape(text: str) -> tuple[int, int]:
    tensors, numel = text.lower().split("x")
    return int(tensors), int(numel)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x67108864,20000x256", help="TENSORSxNUMEL,... (default 1x64M,20000x256)")
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    print(f"# opt.step() of SGD / Lion with q8 moments ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"commit {commit or '?'}, torch {torch.__version__})")  # fmt: skip
    print(f"best of {args.repeats} interleaved rounds; bf16 params + remainder masters for fastamp")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for tensors, numel in map(_shape, args.shapes.split(",")):
            print(f"\n{tensors} x {numel} elements, {threads} thread{'s' if threads > 1 else ''}\n")
            print("| optimizer | ms / step | ns / element | vs dense |\n|---|---|---|---|")
            for r in measure(tensors, numel, args.repeats):
                ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else ""
                print(f"| {r['name']} | {r['ms']:.2f} | {r['ns_per_elem']:.3f} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
