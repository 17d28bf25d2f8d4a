"""Time ``opt.step()`` of SGD (momentum) and Lion with q8 moments beside their dense step and torch's SGD.

SGD and Lion have no fused q8 kernel: under ``state_format="q8"`` their step decodes the moment
in slices, runs the dense kernel and encodes it again in torch ops
(``fastamp.optim.formats.moments.q8_composed_step``). This measures what that costs, in the
same interleaved rounds as the dense step of the same optimizer and ``torch.optim.SGD``
(foreach, fp32 params: torch's best CPU path for SGD; torch has no Lion). bf16 params with
remainder masters for fastamp. Reports the best of ``--repeats`` per row and the ratio to the
dense fastamp step.

    python benchmarks/bench_q8_rules.py [--numel 16777216] [--tensors 1] [--repeats 3]
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
            lambda: S(_params(n_tensors, numel, torch.bfloat16), **sgd, state_format="q8"),
        ),  # fmt: skip
        ("fastamp Lion dense", "", lambda: L(_params(n_tensors, numel, torch.bfloat16), **lion)),
        (
            "fastamp Lion q8",
            "fastamp Lion dense",
            lambda: L(_params(n_tensors, numel, torch.bfloat16), **lion, state_format="q8"),
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=16 * 2**20, help="elements per tensor (default 16M)")
    ap.add_argument("--tensors", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    print(f"# opt.step() of SGD / Lion with q8 moments ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"commit {commit or '?'}, torch {torch.__version__}, {torch.get_num_threads()} threads)")  # fmt: skip
    print(f"{args.tensors} x {args.numel} elements, best of {args.repeats} interleaved rounds\n")
    print("| optimizer | ms / step | ns / element | vs dense |\n|---|---|---|---|")
    for r in measure(args.tensors, args.numel, args.repeats):
        ratio = f"{r['ratio']:.0f}x" if r["ratio"] is not None else ""
        print(f"| {r['name']} | {r['ms']:.1f} | {r['ns_per_elem']:.2f} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
