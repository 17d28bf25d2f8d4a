"""Shared machinery of the fastamp microbenchmarks.

Timing (interleaved rounds, median), a copy/triad bandwidth ceiling measured in the same
run, the list of fastamp backends that can be timed on a device, correctness checks, and
the benchmark's Markdown / PNG output. The machine description, device resolution and
synchronisation, progress bar, and CSV / Markdown writers are shared with
``fastamp-compare`` and live in :mod:`fastamp._harness`; they are imported here under
their old names.

Every benchmark script builds *providers*: a name, the bytes it moves per element
(counted from what the implementation reads and writes, not from what an ideal kernel
would), a check against :mod:`fastamp.reference` on small data, and a callable that runs
one iteration. A provider that fails its check is reported and not timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch

from fastamp._harness import Progress, machine_info, markdown_table, resolve_device, sync, write_csv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results")

# Sanity-check budget of a provider against the reference before timing. This is not the
# test suite (which compares bit for bit where the maths allows): it catches a provider
# that computes something else. 1e-5 relative matches tests/tolerances.py's
# ADAMW_VS_TORCH_RTOL / NORM_RTOL, the loosest budget of the ops benchmarked here.
CHECK_RTOL = 1e-5
CHECK_ATOL = 1e-6

# (n_tensors, elements per tensor). The size sweep keeps 256 tensors and grows them; the
# count sweep keeps 256-element tensors and adds more. The targets are 64M elements
# in 256 tensors and 20,000 tensors of 256 elements.
SIZE_SWEEP = [(256, 4096), (256, 16384), (256, 65536), (256, 262144)]
COUNT_SWEEP = [(256, 256), (2000, 256), (20000, 256)]
GPU_EXTRA = [(256, 1048576)]
QUICK_CONFIGS = [(8, 4099), (300, 256)]


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
    parser.add_argument(
        "--configs",
        default=None,
        help="comma-separated NxM list: N tensors of M elements (default: a size sweep at 256 tensors "
        "and a tensor-count sweep at 256 elements)",
    )
    parser.add_argument(
        "--backends", default=None, help="comma-separated fastamp backends to time (default: all available)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per provider (default: adaptive)")
    parser.add_argument("--out", default=None, help=f"output directory (default: {os.path.relpath(DEFAULT_OUT, ROOT)})")
    parser.add_argument("--tag", default=None, help="suffix of the output file names (default: the device type)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def parse_configs(args, device: torch.device) -> list[tuple[int, int]]:
    if args.configs:
        out = []
        for item in args.configs.split(","):
            try:
                n, m = item.lower().split("x")
                out.append((int(n), int(m)))
            except ValueError:
                raise SystemExit(f"--configs: expected NxM items like 256x262144, got {item!r}") from None
        return out
    if args.quick:
        return list(QUICK_CONFIGS)
    cfgs = SIZE_SWEEP + COUNT_SWEEP
    if device.type == "cuda":
        cfgs = cfgs + GPU_EXTRA
    return cfgs


# ----------------------------------------------------------------------------------------
# Providers


def timable_backends(op: str, device: torch.device, only: str | None = None) -> tuple[list[str], list[str]]:
    """fastamp backends that can be timed for ``op`` on ``device``, and a note for each one skipped.

    The Triton interpreter (TRITON_INTERPRET=1 on a CPU machine) runs Triton programs in
    Python, element block by element block: it is a correctness tool, not a backend, so it
    is never timed.
    """
    from fastamp import backends

    wanted = [b.strip() for b in only.split(",")] if only else list(backends.BACKENDS)
    for b in wanted:
        if b not in backends.BACKENDS:
            raise SystemExit(f"--backends: unknown backend {b!r}; expected some of {backends.BACKENDS}")
    ok, skipped = [], []
    for b in wanted:
        if b == "triton" and device.type == "cpu":
            skipped.append(
                "fastamp-triton: not timed on CPU (only the Triton interpreter runs there: a test tool, not a backend)"
            )
            continue
        avail, why = backends.available(b, op, device)
        if avail:
            ok.append(b)
        else:
            skipped.append(f"fastamp-{b}: unavailable for {op} on {device.type}: {why}")
    return ok, skipped


@dataclass
class Provider:
    """One implementation of the benchmarked work at one size.

    ``setup()`` allocates and returns ``run``, a zero-argument callable doing one
    iteration; ``check()`` runs on small data and returns a description of the largest
    error (raising ``AssertionError`` when it is out of budget).
    """

    name: str
    scenario: str
    dtype: str
    bytes_per_elem: float
    setup: Callable[[], Callable[[], object]]
    check: Callable[[], str] | None = None
    baseline: str | None = None  # name of the torch provider this one is compared with
    notes: str = ""
    extra: dict[str, object] = field(default_factory=dict)


def run_check(p: Provider) -> tuple[bool, str]:
    if p.check is None:
        return True, "no check"
    try:
        return True, p.check()
    except Exception as e:  # an assertion or a crash: either way, do not time it
        return False, f"{type(e).__name__}: {e}"


def assert_close(
    name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = CHECK_RTOL, atol: float = CHECK_ATOL
) -> float:
    """Raise AssertionError naming ``name`` when out of budget; return the max abs error."""
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    if g.shape != w.shape:
        raise AssertionError(f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}")
    same_nan = torch.equal(torch.isnan(g), torch.isnan(w))
    g0, w0 = torch.nan_to_num(g, nan=0.0), torch.nan_to_num(w, nan=0.0)
    err = (g0 - w0).abs()
    bad = err > atol + rtol * w0.abs()
    if not same_nan or bool(bad.any()):
        raise AssertionError(f"{name}: max abs error {err.max().item():.3g} exceeds atol {atol} + rtol {rtol}")
    return float(err.max().item()) if err.numel() else 0.0


# ----------------------------------------------------------------------------------------
# Timing


def _time_once(fn: Callable[[], object], device: torch.device, inner: int) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / inner


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    rounds: int | None = None,
    budget_s: float = 2.0,
    warmup: int = 2,
    min_rounds: int = 3,
    max_rounds: int = 30,
) -> dict[str, dict[str, float]]:
    """Median and min seconds per call of each function, timed in interleaved rounds.

    Rounds alternate between providers so that load from other processes on a shared
    machine hits all of them alike. The number of rounds adapts to ``budget_s`` per
    provider (at least ``min_rounds``); on CUDA each round times a batch of calls large
    enough to hide launch latency and the synchronize.
    """
    est: dict[str, float] = {}
    inner: dict[str, int] = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        t = _time_once(fn, device, 1)
        inner[name] = max(1, min(1000, int(0.02 / max(t, 1e-7)))) if device.type == "cuda" else 1
        est[name] = t
    if rounds is None:
        slowest = max(est.values()) if est else 0.0
        rounds = int(min(max_rounds, max(min_rounds, budget_s / max(slowest, 1e-6))))
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(_time_once(fn, device, inner[name]))
    out = {}
    for name, s in samples.items():
        s.sort()
        out[name] = {"median_s": s[len(s) // 2], "min_s": s[0], "rounds": len(s)}
    return out


def measure_ceiling(device: torch.device, numel: int | None = None, rounds: int = 7) -> dict[str, float]:
    """Copy and triad bandwidth (GB/s, 1e9 bytes) of this device, measured now.

    copy: ``b.copy_(a)`` moves 8 bytes per fp32 element (one read, one write).
    triad: ``torch.add(b, c, alpha=s, out=a)`` moves 12 (two reads, one write), the shape
    of a fused optimizer pass. The buffers (32M fp32 each on CPU, 256M on CUDA) are far
    larger than the last-level cache, so this is the DRAM ceiling; small benchmark sizes
    that fit in cache can exceed it.
    """
    if numel is None:
        numel = (256 if device.type == "cuda" else 32) * 1024 * 1024
    a, b, c = (torch.rand(numel, device=device) for _ in range(3))
    times = time_interleaved(
        {"copy": lambda: a.copy_(b), "triad": lambda: torch.add(b, c, alpha=0.5, out=a)},
        device,
        rounds=rounds,
    )
    # The ceiling is the best round (what the machine can do); benchmark rows use medians,
    # so their ratio to it is conservative.
    return {
        "copy_gbps": 8 * numel / times["copy"]["min_s"] / 1e9,
        "triad_gbps": 12 * numel / times["triad"]["min_s"] / 1e9,
        "copy_gbps_median": 8 * numel / times["copy"]["median_s"] / 1e9,
        "triad_gbps_median": 12 * numel / times["triad"]["median_s"] / 1e9,
        "ceiling_numel": numel,
    }


def ratio_lines(rows: list[dict[str, object]], pairs: Sequence[tuple[str, str, str, str]], what: str) -> list[str]:
    """Markdown lines comparing median times of pairs of rows of the same provider at each config.

    ``pairs``: (scenario, dtype of the row, scenario, dtype of the row it is compared with); the
    table gives both times and ``this / that`` (below 1: faster), for every fastamp provider.
    """
    out = []
    key = {(r["scenario"], r["provider"], r["dtype"], r["n_tensors"], r["elems_per_tensor"]): r for r in rows}
    for sc_a, dt_a, sc_b, dt_b in pairs:
        for r in rows:
            if (r["scenario"], r["dtype"]) != (sc_a, dt_a) or r.get("ms") is None:
                continue
            if not str(r["provider"]).startswith("fastamp"):
                continue
            o = key.get((sc_b, r["provider"], dt_b, r["n_tensors"], r["elems_per_tensor"]))
            if o is None or o.get("ms") is None:
                continue
            out.append(
                f"| {r['provider']} | {r['n_tensors']}x{r['elems_per_tensor']} | {sc_a} {dt_a}: {r['ms']:.3f} ms | "
                f"{sc_b} {dt_b}: {o['ms']:.3f} ms | {r['ms'] / o['ms']:.3f} |"
            )
    if not out:
        return []
    return [what, "", "| provider | config | this | compared with | time ratio |", "|---|---|---|---|---|"] + out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------
# Output


def header_lines(info: dict[str, str], ceiling: dict[str, float] | None = None) -> list[str]:
    lines = [f"- {k}: {v}" for k, v in info.items()]
    if ceiling:
        lines.append(
            f"- bandwidth ceiling (same run, {ceiling['ceiling_numel'] / 2**20:.0f}M fp32 per buffer): "
            f"copy {ceiling['copy_gbps']:.1f} GB/s, triad {ceiling['triad_gbps']:.1f} GB/s (best round; "
            f"medians {ceiling['copy_gbps_median']:.1f} / {ceiling['triad_gbps_median']:.1f})"
        )
    return lines


def out_paths(args, name: str, device: torch.device) -> dict[str, str]:
    out_dir = args.out or DEFAULT_OUT
    os.makedirs(out_dir, exist_ok=True)
    tag = args.tag or (device.type + ("-quick" if args.quick else ""))
    stem = os.path.join(out_dir, f"{name}-{tag}")
    return {"csv": stem + ".csv", "md": stem + ".md", "png": stem + ".png"}


def plot_bench(rows: list[dict[str, object]], ceiling: dict[str, float], path: str, title: str) -> None:
    """One row of panels per scenario: GB/s against size (256 tensors), ms against tensor count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("ms") not in (None, "")]
    scenarios = list(dict.fromkeys(r["scenario"] for r in timed))
    if not scenarios:
        return
    fig, axes = plt.subplots(len(scenarios), 2, figsize=(13, 4.2 * len(scenarios)), squeeze=False)
    for si, sc in enumerate(scenarios):
        srows = [r for r in timed if r["scenario"] == sc]
        labels = list(dict.fromkeys(f"{r['provider']} {r['dtype']}" for r in srows))
        ax_bw, ax_t = axes[si]
        size_rows = [r for r in srows if r["n_tensors"] <= 256]
        count_rows = [r for r in srows if r["elems_per_tensor"] == 256]
        # One size (or one count) only, as in a run at the target sizes: bars read better than lone points.
        bar_bw = len({r["numel"] for r in size_rows}) == 1
        bar_t = len({r["n_tensors"] for r in count_rows}) == 1
        if bar_bw:
            _bars(ax_bw, size_rows, "gbps", "GB/s")
            r0 = size_rows[0]
            ax_bw.set_title(f"{sc}: bandwidth at {r0['n_tensors']} x {r0['elems_per_tensor']}")
            ax_bw.set_xlabel("achieved GB/s (bytes counted per provider)")
            for key, ls, y in (("triad_gbps", ":", 0.96), ("copy_gbps", "-.", 0.02)):
                ax_bw.axvline(ceiling[key], color="grey", linestyle=ls, linewidth=1)
                ax_bw.annotate(f" {key.split('_')[0]} {ceiling[key]:.1f} GB/s", (ceiling[key], y),
                               xycoords=("data", "axes fraction"), fontsize=7, color="grey", va="bottom")  # fmt: skip
            top = max([float(r["gbps"]) for r in size_rows] + [ceiling["triad_gbps"], ceiling["copy_gbps"]])
            ax_bw.set_xlim(0, top * 1.3)
        if bar_t:
            _bars(ax_t, count_rows, "ms", "ms")
            r0 = count_rows[0]
            ax_t.set_title(f"{sc}: ms per call at {r0['n_tensors']} x {r0['elems_per_tensor']} (median)")
            ax_t.set_xlabel("ms per call (median), lower is better")
        for lab in labels:
            lr = [r for r in srows if f"{r['provider']} {r['dtype']}" == lab]
            style = "--" if lab.startswith("torch") else "-"
            by_size = sorted((r for r in lr if r["n_tensors"] <= 256), key=lambda r: r["numel"])
            if by_size and not bar_bw:
                ax_bw.plot([r["numel"] for r in by_size], [r["gbps"] for r in by_size], style, marker="o", label=lab)
            by_count = sorted((r for r in lr if r["elems_per_tensor"] == 256), key=lambda r: r["n_tensors"])
            if by_count and not bar_t:
                ax_t.plot([r["n_tensors"] for r in by_count], [r["ms"] for r in by_count], style, marker="o", label=lab)
        if not bar_bw:
            _line_axes_bw(ax_bw, sc, ceiling)
        if not bar_t:
            _line_axes_t(ax_t, sc)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (4.2 * len(scenarios))))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, rows: list[dict[str, object]], key: str, unit: str) -> None:
    labels = [f"{r['provider']} {r['dtype']}" for r in rows]
    vals = [float(r[key]) for r in rows]
    colors = ["tab:grey" if lab.startswith("torch") else "tab:blue" for lab in labels]
    bars = ax.barh(labels, vals, color=colors)
    for b, v in zip(bars, vals):
        ax.annotate(f" {v:.3g} {unit}", (b.get_width(), b.get_y() + b.get_height() / 2), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(vals) * 1.25 if vals else 1)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(True, axis="x", alpha=0.3)


def _line_axes_bw(ax_bw, sc: str, ceiling: dict[str, float]) -> None:
    for key, ls in (("triad_gbps", ":"), ("copy_gbps", "-.")):
        ax_bw.axhline(ceiling[key], color="grey", linestyle=ls, linewidth=1)
        ax_bw.annotate(
            f"{key.split('_')[0]} {ceiling[key]:.1f} GB/s",
            (0.01, ceiling[key]),
            xycoords=("axes fraction", "data"),
            fontsize=8,
            color="grey",
            va="bottom",
        )
    ax_bw.set_xscale("log", base=2)
    ax_bw.set_xlabel("elements in total (256 tensors or fewer)")
    ax_bw.set_ylabel("achieved GB/s (bytes counted per provider)")
    ax_bw.set_title(f"{sc}: bandwidth vs size")
    ax_bw.grid(True, alpha=0.3)
    if ax_bw.lines:
        ax_bw.legend(fontsize=7)


def _line_axes_t(ax_t, sc: str) -> None:
    ax_t.set_xscale("log")
    ax_t.set_yscale("log")
    ax_t.set_xlabel("number of 256-element tensors")
    ax_t.set_ylabel("ms per call (median)")
    ax_t.set_title(f"{sc}: many small tensors")
    ax_t.grid(True, alpha=0.3, which="both")
    if ax_t.lines:
        ax_t.legend(fontsize=7)


# ----------------------------------------------------------------------------------------
# The driver shared by the op benchmarks


def run_benchmark(
    args,
    name: str,
    op_for_backends: str,
    make_providers: Callable[[int, int, list[str]], list[Provider]],
    title: str,
    summarise: Callable[[list[dict[str, object]]], list[str]] | None = None,
) -> list[dict[str, object]]:
    """Check, time and report every provider at every config; write CSV, Markdown and PNG.

    ``summarise(rows)`` may return Markdown lines (a comparison the benchmark exists for),
    printed after the table.
    """
    device = resolve_device(args.device)
    torch.manual_seed(0)
    configs = parse_configs(args, device)
    info = machine_info(device)
    fa_backends, skipped = timable_backends(op_for_backends, device, args.backends)
    for s in skipped:
        log(f"[{name}] {s}")
    log(f"[{name}] measuring the copy/triad ceiling on {device} ...")
    ceiling = measure_ceiling(device, numel=(1 << 22) if args.quick else None, rounds=3 if args.quick else 7)
    log(f"[{name}] copy {ceiling['copy_gbps']:.1f} GB/s, triad {ceiling['triad_gbps']:.1f} GB/s")

    rows: list[dict[str, object]] = []
    checked: dict[str, tuple[bool, str]] = {}
    bar = Progress(len(configs), label=name)
    for n_tensors, per in configs:
        numel = n_tensors * per
        provs = make_providers(n_tensors, per, fa_backends)
        for p in provs:
            key = f"{p.scenario}/{p.name}/{p.dtype}"
            if key not in checked:
                checked[key] = run_check(p)
                status = "ok" if checked[key][0] else "FAILED"
                log(f"[{name}] check {key}: {status} ({checked[key][1]})")
        runnable = [p for p in provs if checked[f"{p.scenario}/{p.name}/{p.dtype}"][0]]
        fns = {}
        for p in runnable:
            fns[f"{p.scenario}/{p.name}/{p.dtype}"] = p.setup()
        budget = 0.3 if args.quick else 2.0
        times = time_interleaved(fns, device, rounds=args.rounds or (3 if args.quick else None), budget_s=budget)
        del fns
        for p in provs:
            key = f"{p.scenario}/{p.name}/{p.dtype}"
            ok, msg = checked[key]
            row: dict[str, object] = {
                "scenario": p.scenario,
                "provider": p.name,
                "dtype": p.dtype,
                "n_tensors": n_tensors,
                "elems_per_tensor": per,
                "numel": numel,
                "bytes_per_elem": p.bytes_per_elem,
                "check": "ok" if ok else "FAILED: " + msg,
                "baseline": p.baseline or "",
                "notes": p.notes,
            }
            if ok:
                t = times[key]
                sec = t["median_s"]
                row["ms"] = sec * 1e3
                row["ms_min"] = t["min_s"] * 1e3
                row["rounds"] = t["rounds"]
                row["gbps"] = p.bytes_per_elem * numel / sec / 1e9
                row["of_triad"] = row["gbps"] / ceiling["triad_gbps"]
                row["of_copy"] = row["gbps"] / ceiling["copy_gbps"]
            rows.append(row)
        # speedups against the named torch provider at the same config
        for row in rows[-len(provs) :]:
            if row.get("ms") is None or not row["baseline"]:
                continue
            base = [
                r
                for r in rows[-len(provs) :]
                if r["provider"] == row["baseline"].split("@")[0]
                and r["scenario"] == (row["baseline"].split("@")[1] if "@" in row["baseline"] else row["scenario"])
                and r["dtype"] == "fp32"
                and r.get("ms") is not None
            ]
            if base:
                row["speedup_vs_torch"] = base[0]["ms"] / row["ms"]
        bar.update(1, f"{n_tensors}x{per}")
        if device.type == "cuda":
            torch.cuda.empty_cache()

    paths = out_paths(args, name, device)
    write_csv(paths["csv"], [{**r, **{f"ceiling_{k}": v for k, v in ceiling.items()}} for r in rows])
    cols = [
        ("scenario", "scenario"),
        ("provider", "provider"),
        ("dtype", "grad/param dtype"),
        ("n_tensors", "tensors"),
        ("elems_per_tensor", "elems/tensor"),
        ("ms", "ms (median)"),
        ("bytes_per_elem", "B/elem"),
        ("gbps", "GB/s"),
        ("of_copy", "of copy"),
        ("of_triad", "of triad"),
        ("speedup_vs_torch", "speedup vs torch fp32"),
    ]
    table = markdown_table(rows, cols)
    notes = sorted({f"- {r['provider']} ({r['scenario']}): {r['notes']}" for r in rows if r["notes"]})
    failed = [f"- {r['scenario']}/{r['provider']}/{r['dtype']}: {r['check']}" for r in rows if r["check"] != "ok"]
    md = [f"# {title}", ""] + header_lines(info, ceiling) + [""]
    if skipped:
        md += ["Not timed:", ""] + [f"- {s}" for s in skipped] + [""]
    if failed:
        md += ["Failed the check against the reference (not timed):", ""] + sorted(set(failed)) + [""]
    md += [table, ""]
    if summarise is not None:
        md += summarise(rows) + [""]
    if notes:
        md += ["Providers:", ""] + notes + [""]
    md += [
        "B/elem counts the bytes each provider's implementation reads and writes per element "
        "(see the provider notes); GB/s = B/elem x elements / median time; 'of copy' / 'of triad' are that over the "
        "copy / triad ceilings measured in this run (small sizes that fit in cache can exceed 1). "
        "'speedup vs torch fp32' = time of the named torch path on fp32 at the same size / this time.",
        "",
    ]
    with open(paths["md"], "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    if not args.no_plot:
        try:
            plot_bench(rows, ceiling, paths["png"], f"{title} ({info['device']}, {info['git_commit']})")
        except Exception as e:  # a missing matplotlib must not lose the measured numbers
            log(f"[{name}] plot failed: {type(e).__name__}: {e}")
    log(f"[{name}] wrote {paths['csv']}, {paths['md']}" + ("" if args.no_plot else f", {paths['png']}"))
    return rows
