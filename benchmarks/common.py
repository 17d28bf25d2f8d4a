"""Shared machinery of the fastamp microbenchmarks.

The bandwidth ceiling matched to each provider's traffic and measured in the same rounds,
the list of fastamp backends that can be timed on a device, correctness checks, and the
benchmark's Markdown / PNG output. The machine description, device resolution and
synchronisation, timing (interleaved rounds, median), progress bar, and CSV / Markdown
writers are shared with ``fastamp-compare`` and live in :mod:`fastamp._harness`; they are
imported here under their old names.

Every benchmark script builds *providers*: a name, the bytes it moves per element
(counted from what the implementation reads and writes, not from what an ideal kernel
would), the same count written stream by stream (its *traffic*, from which the ceiling
is built), a check against :mod:`fastamp.reference` on small data, and a callable that
runs one iteration. A provider that fails its check is reported and not timed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch

from fastamp._harness import (  # noqa: F401 (re-exported for the bench scripts)
    Progress,
    machine_info,
    markdown_table,
    resolve_device,
    time_interleaved,
    time_once,
    write_csv,
)

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

# The fewest timed runs of each CPU ceiling at a config. A round holds one call of every
# provider; where a provider takes seconds (bench_lowbit: torchao and bitsandbytes steps of 1.5
# to 5 s) a run has 3 rounds, and a median of 3 single ceiling calls, each after seconds of other
# work on a shared machine, was a disturbed one often enough to put compute-bound providers at 2x
# to 3x "of ceiling" (1-thread fused AdamW at 3.1x). At the adaptive rounds of fast providers (15
# to 30) each round runs a ceiling once, as before; at 3 rounds, 5 times back to back.
CEILING_MIN_SAMPLES = 15
# What the adaptive round count is made of (the defaults of fastamp._harness.time_interleaved).
_MIN_ROUNDS, _MAX_ROUNDS = 3, 30


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
    error (raising ``AssertionError`` when it is out of budget). ``traffic`` (see
    :func:`parse_traffic`) is ``bytes_per_elem`` stream by stream; the provider's ceiling
    is built from it, and the two counts must agree. Without it the row has no ceiling.
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
    traffic: str | None = None

    def __post_init__(self):
        if self.traffic is not None and traffic_bytes(self.traffic) != self.bytes_per_elem:
            raise ValueError(
                f"{self.name} ({self.scenario}, {self.dtype}): {self.bytes_per_elem} B/elem, but its traffic "
                f"{self.traffic!r} moves {traffic_bytes(self.traffic)}"
            )


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
# Traffic and the bandwidth ceiling matched to it

# How many bytes of a stream one element moves: a read-only or write-only stream once, an
# in-place read-modify-write twice (read + write).
ROLE_MULT = {"r": 1, "w": 1, "rw": 2}
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Every ceiling buffer holds fp32 normal numbers; XOR with this constant, on a 16, 32 or 64-bit
# integer view of them, flips mantissa bits only: the numbers stay finite and normal (no slow
# paths in the fp32 sum of a read stream), and two calls restore every value. (A stream XORed
# with another holds other bits between two calls; only read streams are summed.) On an 8-bit
# view every byte is XORed, the exponent's too: there the constant is 0x01, which moves an
# exponent by at most 2 (the buffers hold randn values, far from the subnormals and inf).
_XOR_K = 0x55
_XOR_K_BYTE = 0x01
# What a write-only stream with no read to copy is filled with: fp32 1.0 in every 4 bytes
# (0x3F3F3F3F, about 0.75, for a 1-byte stream).
_FILL = {1: 0x3F, 2: 0x3F80, 4: 0x3F800000, 8: 0x3F8000003F800000}


def _xor_k(x: torch.Tensor) -> int:
    return _XOR_K_BYTE if x.element_size() == 1 else _XOR_K


@dataclass(frozen=True)
class Stream:
    """One buffer an implementation streams over: name, bytes per element, role (r, w or rw)."""

    name: str
    size: int
    role: str


def parse_traffic(spec: str) -> tuple[tuple[Stream, ...], ...]:
    """Passes over memory, e.g. ``"g:r2 ; g:rw2"`` (a read pass, then an in-place pass).

    A pass is space-separated ``name:<role><bytes>`` items, role ``r`` (read only), ``w``
    (written, never read) or ``rw`` (read and written in place); passes are separated by
    ``;``. A name is one buffer across passes and, at one config, across providers.
    """
    passes = []
    for part in spec.split(";"):
        streams = []
        for item in part.split():
            name, _, rb = item.partition(":")
            role = rb.rstrip("0123456789")
            size = rb[len(role) :]
            if not name or role not in ROLE_MULT or not size or int(size) not in _INT_OF_SIZE:
                raise ValueError(f"traffic {spec!r}: bad item {item!r} (expected name:r2, name:w4, name:rw4 ...)")
            streams.append(Stream(name, int(size), role))
        if not streams:
            raise ValueError(f"traffic {spec!r}: an empty pass")
        if len({st.name for st in streams}) < len(streams):
            raise ValueError(f"traffic {spec!r}: a buffer twice in one pass (one stream per buffer and pass)")
        passes.append(tuple(streams))
    return tuple(passes)


def traffic_bytes(spec: str) -> int:
    """Bytes per element of a traffic spec: reads + writes of every stream of every pass."""
    return sum(s.size * ROLE_MULT[s.role] for p in parse_traffic(spec) for s in p)


def _cpu_ceiling(spec: str, numel: int, device: torch.device, pool: dict) -> tuple[Callable[[], None], str]:
    """torch in-place ops over one buffer per stream, moving exactly ``spec``'s bytes; and what they do."""

    def raw(key: tuple, nbytes: int) -> torch.Tensor:
        """``nbytes`` (or up to 3 more) as fp32 normal numbers; the ops below keep them finite and normal."""
        if key not in pool:
            pool[key] = torch.randn(-(-nbytes // 4), device=device)
        return pool[key]

    def buf(s: Stream) -> torch.Tensor:
        """``numel`` integers of the stream's element size over its bytes."""
        return raw((s.name, s.size), numel * s.size).view(torch.uint8)[: numel * s.size].view(_INT_OF_SIZE[s.size])

    passes = parse_traffic(spec)
    ops: list[Callable[[], object]] = []
    words: list[str] = []
    for i, streams in enumerate(passes):
        elsewhere = {s.name for j, p in enumerate(passes) if j != i for s in p}
        reads = [s for s in streams if s.role == "r"]
        partner: dict[Stream, Stream | None] = {}
        for s in streams:
            if s.role != "r":
                partner[s] = next((r for r in reads if r.size == s.size), None)
                if partner[s] is not None:
                    reads.remove(partner[s])
        # The read-modify-write streams with nothing to read beside them and in no other pass are
        # laid end to end in one allocation and XORed in one op: one parallel region, not one each.
        block = [s for s, r in partner.items() if s.role == "rw" and r is None and s.name not in elsewhere]
        if len(block) > 1:
            nbytes = numel * sum(s.size for s in block)
            width = next(w for w in (4, 2, 1) if all(s.size % w == 0 for s in block))
            x = raw(("block",) + tuple((s.name, s.size) for s in block), nbytes).view(torch.uint8)[:nbytes]
            x = x.view(_INT_OF_SIZE[width])
            ops.append(lambda x=x: x.bitwise_xor_(_xor_k(x)))
            words.append(f"[{' '.join(s.name for s in block)}] ^= k")
        for s, src in partner.items():
            if len(block) > 1 and s in block:
                continue
            dst = buf(s)
            x = buf(src) if src is not None else None
            if x is not None and s.role == "w":  # reads src, writes dst (never reads it)
                ops.append(lambda d=dst, x=x: d.copy_(x))
                words.append(f"{s.name}.copy_({src.name})")
            elif x is not None:  # reads dst and src, writes dst
                ops.append(lambda d=dst, x=x: d.bitwise_xor_(x))
                words.append(f"{s.name} ^= {src.name}")
            elif s.role == "w":
                ops.append(lambda d=dst: d.fill_(_FILL[d.element_size()]))
                words.append(f"{s.name}.fill_(k)")
            else:
                ops.append(lambda d=dst: d.bitwise_xor_(_xor_k(d)))
                words.append(f"{s.name} ^= k")
        # A read nothing else consumes: an fp32 sum over its bytes, whatever the stream's dtype (a bf16 sum
        # is bound by the conversion, not by memory).
        for r in reads:
            x = raw((r.name, r.size), numel * r.size)[: numel * r.size // 4]
            ops.append(lambda x=x: x.sum())
            words.append(f"{r.name}.sum()")

    def run() -> None:
        for op in ops:
            op()

    return run, "; ".join(words)


def _cuda_ceiling(spec: str, numel: int, device: torch.device, pool: dict) -> tuple[Callable[[], None], str]:
    """A device-to-device copy moving ``spec``'s bytes (half read, half written); and what it does."""
    half = (traffic_bytes(spec) * numel + 1) // 2
    key = ("copy", half)
    if key not in pool:
        pool[key] = (
            torch.empty(half, dtype=torch.uint8, device=device),
            torch.empty(half, dtype=torch.uint8, device=device),
        )
    dst, src = pool[key]
    return (lambda: dst.copy_(src)), f"device-to-device copy_ of {traffic_bytes(spec) / 2:g} B per element"


def ceiling(spec: str, numel: int, device: torch.device, pool: dict | None = None) -> tuple[Callable[[], None], str]:
    """A callable moving ``traffic_bytes(spec) * numel`` bytes the cheapest way torch can, and its description.

    CPU: for every pass of ``spec``, one flat buffer of ``numel`` elements per stream and
    one multithreaded torch in-place op per written stream, on integer views of the
    stream's element size (no arithmetic to speak of, no temporaries):
    a write-only stream is ``w.copy_(r)`` from a read stream of its size (else
    ``w.fill_(k)``); a read-modify-write stream is ``x ^= r`` with such a read stream
    (reads x and r, writes x), else ``x ^= k``; a read left over is an fp32 ``sum()``
    over its bytes (a scalar result, the only allocation). The ``x ^= k`` streams of a pass
    that no other pass touches are laid end to end in one allocation and XORed by one op,
    so that the ceiling pays as few parallel regions as torch allows. Each
    stream is read and written exactly as its role says, so the ops move the provider's
    bytes; write-allocate (a store to a line not read) costs the ceiling what it costs the
    provider, as both store to the same write-only streams. One flat buffer per stream
    takes no per-tensor overhead: the ratio to it is what the kernel's memory traffic, not
    its launch count, allows.

    CUDA: a device-to-device ``copy_`` of the same bytes (half read, half written).

    ``pool`` keeps buffers by (name, bytes), so providers of one config share them.
    """
    pool = {} if pool is None else pool
    build = _cuda_ceiling if device.type == "cuda" else _cpu_ceiling
    return build(spec, numel, device, pool)


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


def columns_of(rows: list[dict[str, object]]) -> list[tuple[str, str]]:
    """``markdown_table`` columns for rows whose keys differ (error rows): every key, in first-seen order."""
    return [(k, k) for k in dict.fromkeys(k for r in rows for k in r)]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------
# Output


def header_lines(info: dict[str, str], ceilings: dict[str, str] | None = None) -> list[str]:
    """The machine lines of a result file, and what each ceiling ran (``traffic -> description``)."""
    lines = [f"- {k}: {v}" for k, v in info.items()]
    if ceilings:
        lines.append(
            "- ceilings (measured in the same interleaved rounds as the providers, at each config; on CPU at least "
            f"{CEILING_MIN_SAMPLES} timed runs each, back to back within a round when the rounds are fewer):"
        )
        lines += [f"  - `{spec}` ({traffic_bytes(spec)} B/elem): {what}" for spec, what in ceilings.items()]
    return lines


def out_paths(args, name: str, device: torch.device) -> dict[str, str]:
    out_dir = args.out or DEFAULT_OUT
    os.makedirs(out_dir, exist_ok=True)
    tag = args.tag or (device.type + ("-quick" if args.quick else ""))
    stem = os.path.join(out_dir, f"{name}-{tag}")
    return {"csv": stem + ".csv", "md": stem + ".md", "png": stem + ".png"}


def plot_bench(rows: list[dict[str, object]], path: str, title: str) -> None:
    """One row of panels per scenario: GB/s against size (256 tensors), ms against tensor count.

    Each provider's ceiling is drawn with it: a dotted line of its colour, or a tick on its bar.
    """
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
            _bars(ax_bw, size_rows, "gbps", "GB/s", ticks="ceiling_gbps")
            r0 = size_rows[0]
            ax_bw.set_title(f"{sc}: bandwidth at {r0['n_tensors']} x {r0['elems_per_tensor']} (|: its ceiling)")
            ax_bw.set_xlabel("achieved GB/s (bytes counted per provider)")
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
                (line,) = ax_bw.plot([r["numel"] for r in by_size], [r["gbps"] for r in by_size], style, marker="o",
                                     label=lab)  # fmt: skip
                with_c = [r for r in by_size if r.get("ceiling_gbps")]
                if with_c:
                    ax_bw.plot([r["numel"] for r in with_c], [r["ceiling_gbps"] for r in with_c], ":",
                               color=line.get_color(), linewidth=1)  # fmt: skip
            by_count = sorted((r for r in lr if r["elems_per_tensor"] == 256), key=lambda r: r["n_tensors"])
            if by_count and not bar_t:
                ax_t.plot([r["n_tensors"] for r in by_count], [r["ms"] for r in by_count], style, marker="o", label=lab)
        if not bar_bw:
            _line_axes_bw(ax_bw, sc)
        if not bar_t:
            _line_axes_t(ax_t, sc)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (4.2 * len(scenarios))))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, rows: list[dict[str, object]], key: str, unit: str, ticks: str | None = None) -> None:
    labels = [f"{r['provider']} {r['dtype']}" for r in rows]
    vals = [float(r[key]) for r in rows]
    colors = ["tab:grey" if lab.startswith("torch") else "tab:blue" for lab in labels]
    bars = ax.barh(labels, vals, color=colors)
    for b, v in zip(bars, vals):
        ax.annotate(f" {v:.3g} {unit}", (b.get_width(), b.get_y() + b.get_height() / 2), va="center", fontsize=8)
    top = max(vals) if vals else 1.0
    if ticks:
        marks = [(float(r[ticks]), b.get_y() + b.get_height() / 2) for r, b in zip(rows, bars) if r.get(ticks)]
        if marks:
            ax.plot([m[0] for m in marks], [m[1] for m in marks], "k|", markersize=14)
            top = max([top] + [m[0] for m in marks])
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.25)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(True, axis="x", alpha=0.3)


def _line_axes_bw(ax_bw, sc: str) -> None:
    ax_bw.set_xscale("log", base=2)
    ax_bw.set_xlabel("elements in total (256 tensors or fewer)")
    ax_bw.set_ylabel("achieved GB/s (bytes counted per provider)")
    ax_bw.set_title(f"{sc}: bandwidth vs size (dotted: each provider's ceiling)")
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


class _CeilingSamples:
    """A CPU ceiling timed run by run: each call runs it ``repeats`` times back to back, timing each.

    The first ``skip`` calls (the estimate :func:`time_interleaved` makes before its rounds) are
    run and not kept; ``samples`` holds the seconds of every later run.
    """

    def __init__(self, run: Callable[[], None], device: torch.device, repeats: int, skip: int = 1):
        self.run, self.device, self.repeats, self.skip = run, device, repeats, skip
        self.samples: list[float] = []

    def __call__(self) -> None:
        if self.skip:
            self.skip -= 1
            self.run()
            return
        for _ in range(self.repeats):
            self.samples.append(time_once(self.run, self.device))

    def stats(self) -> dict[str, float]:
        s = sorted(self.samples)
        return {"median_s": s[len(s) // 2], "min_s": s[0], "rounds": len(s)}


def _rounds(args, est: dict[str, float], budget_s: float) -> int:
    """Timed rounds at a config: ``--rounds``, 3 for ``--quick``, else as many as ``budget_s`` allows the slowest."""
    if args.rounds:
        return args.rounds
    if args.quick:
        return 3
    slowest = max(est.values()) if est else 0.0
    return int(min(_MAX_ROUNDS, max(_MIN_ROUNDS, budget_s / max(slowest, 1e-6))))


def ceiling_repeats(rounds: int, device: torch.device) -> int:
    """Runs of a ceiling per round so that it gets :data:`CEILING_MIN_SAMPLES` (CPU; 1 on CUDA).

    On CUDA the ceiling is a device copy timed in batches by :func:`time_interleaved`, as the
    providers are; it is not the fragile one.
    """
    if device.type == "cuda":
        return 1
    return -(-CEILING_MIN_SAMPLES // max(rounds, 1))


def run_benchmark(
    args,
    name: str,
    op_for_backends: str,
    make_providers: Callable[[int, int, list[str]], list[Provider]],
    title: str,
    summarise: Callable[[list[dict[str, object]]], list[str]] | None = None,
    not_timed: list[str] | None = None,
) -> list[dict[str, object]]:
    """Check, time and report every provider at every config; write CSV, Markdown and PNG.

    ``not_timed``: lines the providers' builder appends to while it runs (a provider whose
    package is missing), listed with the backends that were not timed.

    At each config, every distinct provider traffic gets its :func:`ceiling` at that
    config's element count, timed in the same interleaved rounds as the providers (so the
    load of other processes and the cache residency of small sizes hit both alike);
    ``of ceiling`` is the provider's median GB/s over its ceiling's median GB/s. On CPU a
    ceiling gets at least :data:`CEILING_MIN_SAMPLES` timed runs: where the rounds are fewer
    it runs several times back to back in its slot of each round (:func:`ceiling_repeats`).
    Back-to-back runs find in the cache what the last one left there; only a traffic that
    fits in the last-level cache (the ``--quick`` sizes) gets a faster ceiling from that.
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

    rows: list[dict[str, object]] = []
    checked: dict[str, tuple[bool, str]] = {}
    ceilings: dict[str, str] = {}  # traffic -> what its ceiling runs
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
        pool: dict = {}
        for spec in dict.fromkeys(p.traffic for p in runnable if p.traffic):
            fns[f"ceiling/{spec}"], ceilings[spec] = ceiling(spec, numel, device, pool)
        budget = 0.3 if args.quick else 2.0
        # One warm-up call of everything and one timed (the round count is made from it); then
        # time_interleaved's own estimate call is the second warm-up: as many calls as before.
        for fn in fns.values():
            fn()
        rounds = _rounds(args, {k: time_once(fn, device) for k, fn in fns.items()}, budget)
        repeats = ceiling_repeats(rounds, device)
        sampled = {}
        if repeats > 1:
            for k in [k for k in fns if k.startswith("ceiling/")]:
                fns[k] = sampled[k] = _CeilingSamples(fns[k], device, repeats)
        times = time_interleaved(fns, device, rounds=rounds, budget_s=budget, warmup=0)
        times.update({k: c.stats() for k, c in sampled.items()})
        del fns, pool, sampled
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
                "traffic": p.traffic or "",
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
                if p.traffic:
                    c = times[f"ceiling/{p.traffic}"]
                    row["ceiling_ms"] = c["median_s"] * 1e3
                    row["ceiling_ms_min"] = c["min_s"] * 1e3
                    row["ceiling_samples"] = c["rounds"]
                    row["ceiling_gbps"] = p.bytes_per_elem * numel / c["median_s"] / 1e9
                    row["ceiling_gbps_best"] = p.bytes_per_elem * numel / c["min_s"] / 1e9
                    row["of_ceiling"] = row["gbps"] / row["ceiling_gbps"]
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

    if hasattr(os, "getloadavg"):
        info["load_avg_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    paths = out_paths(args, name, device)
    write_csv(paths["csv"], rows)
    cols = [
        ("scenario", "scenario"),
        ("provider", "provider"),
        ("dtype", "grad/param dtype"),
        ("n_tensors", "tensors"),
        ("elems_per_tensor", "elems/tensor"),
        ("ms", "ms (median)"),
        ("bytes_per_elem", "B/elem"),
        ("gbps", "GB/s"),
        ("ceiling_gbps", "ceiling GB/s"),
        ("of_ceiling", "of ceiling"),
        ("speedup_vs_torch", "speedup vs torch fp32"),
    ]
    table = markdown_table(rows, cols)
    notes = sorted({f"- {r['provider']} ({r['scenario']}): {r['notes']}" for r in rows if r["notes"]})
    failed = [f"- {r['scenario']}/{r['provider']}/{r['dtype']}: {r['check']}" for r in rows if r["check"] != "ok"]
    md = [f"# {title}", ""] + header_lines(info, ceilings) + [""]
    skipped = skipped + list(not_timed or ())
    if skipped:
        md += ["Not timed:", ""] + [f"- {s}" for s in skipped] + [""]
    if failed:
        md += ["Failed the check against the reference (not timed):", ""] + sorted(set(failed)) + [""]
    md += [table, ""]
    over = [r for r in rows if (r.get("of_ceiling") or 0) > 1.05]
    if over:
        md += [
            f"{len(over)} row(s) above 1.05 of their ceiling: the ceiling is wrong for them (or the run was "
            "disturbed: see the load average); investigate before quoting them.",
            "",
        ]
    if summarise is not None:
        md += summarise(rows) + [""]
    if notes:
        md += ["Providers:", ""] + notes + [""]
    md += [
        "B/elem counts the bytes each provider's implementation reads and writes per element, reads + writes "
        "(see the provider notes; benchmarks/README.md states the convention); GB/s = B/elem x elements / median "
        "time. 'ceiling GB/s' is the same bytes over the median time of the provider's ceiling (the torch in-place "
        "ops listed above on CPU, a device copy on CUDA, at the same element count, same rounds); 'of ceiling' = "
        "GB/s / ceiling GB/s. 'speedup vs torch fp32' = time of the named torch path on fp32 at the same size / "
        "this time.",
        "",
    ]
    with open(paths["md"], "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    if not args.no_plot:
        try:
            plot_bench(rows, paths["png"], f"{title} ({info['device']}, {info['git_commit']})")
        except Exception as e:  # a missing matplotlib must not lose the measured numbers
            log(f"[{name}] plot failed: {type(e).__name__}: {e}")
    log(f"[{name}] wrote {paths['csv']}, {paths['md']}" + ("" if args.no_plot else f", {paths['png']}"))
    return rows
