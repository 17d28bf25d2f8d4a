"""What the memory layout of an optimizer's tensors costs the native optim_ table (issue 21).

The native CPU ``optim_`` runs a repeated step through a persistent table
(``fastamp._C.optim_table`` / ``optim_table_run``, csrc/cpu/optim.cpp): one pass of checks over
every tensor, then the kernel (here AdamW). At many small tensors both are bound by memory latency. This probe
times the table alone, fp32 params + m + v, in four layouts:

- ``separate``: every param, m, v and grad its own allocation (what an optimizer does today);
- ``flat-states``: params, m and v views of one buffer each, grads separate;
- ``flat-all``: the same, and the grads views of one buffer too;
- ``one``: one tensor of the same elements.

"checks" is the same call with found_inf = 1 (every check runs, the kernel does not). A write of
16 MB before each call pushes the tensors out of the caches, as a step a full forward/backward
later finds them. Before timing, every layout's params after one step are compared bit for bit
with the ``separate`` layout's (the same kernel on the same values must give the same bits).

    python benchmarks/probe_table_layout.py [--n 20000] [--m 256] [--reps 11]

Scratch timings for the notes (medians, one thread unless OMP_NUM_THREADS says otherwise), not a
side-by-side benchmark against torch: for that see bench_host_overhead.py.
"""

from __future__ import annotations

import argparse
import time

import torch

from fastamp import _C

LAYOUTS = ("separate", "flat-states", "flat-all", "one")


def _lists(layout: str, n: int, m: int):
    """(params, exp_avgs, exp_avg_sqs, a function making new grads) of one layout; the same values
    in every layout (drawn as [n, m], then split into rows, separate copies or views)."""
    gen = torch.Generator().manual_seed(0)
    drawn = [torch.randn((n, m), generator=gen) * s for s in (1.0, 0.1, 0.1)]
    drawn[2] = drawn[2].abs()

    def split(x, flat):
        if layout == "one":
            return [x.flatten()]
        return list(x.unbind(0)) if flat else [row.clone() for row in x]

    params, ms, vs = (split(x, layout != "separate") for x in drawn)
    grad_gen = torch.Generator().manual_seed(1)

    def grads():
        return split(torch.randn((n, m), generator=grad_gen), layout == "flat-all")

    return params, ms, vs, grads


def _run(table, grads, scalars, found_inf):
    got = _C.optim_table_run(table, grads, scalars, found_inf, None, 0, "adamw", [0.9, 0.999, 1e-8], 0)
    if got is not None:
        raise RuntimeError(f"optim_table_run declined ({got!r}): the probe's tensors do not fit the table")


def probe(n: int, m: int, reps: int) -> dict[str, dict[str, float]]:
    """Median ms of the checks and of the whole call per layout; raises if a layout's bits differ."""
    out, first = {}, None
    for layout in LAYOUTS:
        params, ms, vs, grads = _lists(layout, n, m)
        rows = len(params)
        table = _C.optim_table(params, [], [*ms, *vs], "adamw", 0)
        scalars = torch.tensor([[1e-3, 1.0, 0.99, 1.0]]).expand(rows, 4).contiguous()
        _run(table, grads(), scalars, torch.zeros(1))
        flat = torch.cat([p.flatten() for p in params])
        if first is None:
            first = flat
        elif not torch.equal(flat.view(torch.int32), first.view(torch.int32)):
            raise AssertionError(f"{layout}: params after one step differ from the separate layout's")
        times = {}
        for label, found_inf in (("checks", torch.ones(1)), ("checks+kernel", torch.zeros(1))):
            ts = []
            for _ in range(reps):
                g = grads()
                torch.ones(4_000_000).add_(1)  # 16 MB through the caches
                t0 = time.perf_counter()
                _run(table, g, scalars, found_inf)
                ts.append(time.perf_counter() - t0)
            times[label] = sorted(ts)[len(ts) // 2] * 1e3
        out[layout] = times
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=20000, help="tensors")
    parser.add_argument("--m", type=int, default=256, help="elements per tensor")
    parser.add_argument("--reps", type=int, default=11, help="timed calls per layout and measure (median)")
    args = parser.parse_args()
    res = probe(args.n, args.m, args.reps)
    print(
        f"# optim_ table (AdamW), fp32, {args.n} x {args.m}, torch threads {torch.get_num_threads()}, medians of {args.reps}"
    )
    print("| layout | checks ms | checks + kernel ms |")
    print("|---|---|---|")
    for layout, t in res.items():
        print(f"| {layout} | {t['checks']:.2f} | {t['checks+kernel']:.2f} |")


if __name__ == "__main__":
    main()
