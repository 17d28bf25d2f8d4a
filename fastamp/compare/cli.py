"""``fastamp-compare`` / ``python -m fastamp.compare``: arguments, the runs, the files written."""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fastamp._harness import machine_info, resolve_device, write_csv
from fastamp.compare import load
from fastamp.compare.data import ImageData, TextData
from fastamp.compare.machine import cpu_features_line
from fastamp.compare.memory import CpuPeakMeter, CudaPeakMeter
from fastamp.compare.models import SmallCNN, TinyGPT
from fastamp.compare.progress import JobProgress
from fastamp.compare.regimes import FULL_MODEL_REGIMES, MODEL_REGIMES, REGIMES, renamed
from fastamp.compare.report import report_lines, summarise
from fastamp.compare.train import MEMORY_STEP, MIN_STEPS, PROFILED_STEPS, RegimeResult, RegimeRun

MODELS = ("gpt", "cnn", "cnn-raw12")

# What a run costs on a 2-core CPU with one thread (the job's CPU time, measured on a 2-core
# Xeon: README "The two commands", benchmarks/results/compare-cpu*.md); printed by --help.
DEFAULT_DURATION = "about 2.5 minutes on a free 2-core Xeon"
FULL_SET_DURATION = "about 8.5 minutes on a free 2-core Xeon"

# Size presets: "small" is the CPU default (DEFAULT_DURATION with the default regime set,
# FULL_SET_DURATION with --full), "large" the CUDA default, "tiny" a smoke run of seconds.
SIZES = {
    "tiny": {
        "gpt": {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32, "batch": 8},
        "cnn": {"width": 8, "image": 12, "batch": 16},
        "steps": 12,
        "growth_interval": 2,
    },
    "small": {
        "gpt": {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 32, "batch": 16},
        "cnn": {"width": 16, "image": 16, "batch": 32},
        "steps": 150,
        # torch's default (2000) never grows in 150 steps; 10 shows the mechanism: the scale
        # grows x2 after 10 clean steps until the grads overflow fp16, then backs off x0.5
        # and the step is skipped (these models overflow near 2^17-2^19).
        "growth_interval": 10,
    },
    "large": {
        "gpt": {"n_layer": 6, "d_model": 384, "n_head": 6, "seq_len": 256, "batch": 64},
        "cnn": {"width": 64, "image": 32, "batch": 256},
        "steps": 600,
        "growth_interval": 50,
    },
}

THREADS_WHY = (
    "one intra-op thread: on a CPU shared with other processes, torch's OpenMP threads wait for each other at every "
    "parallel region (on a loaded 2-core machine, 2 threads made steps 50-100x slower), while one thread's steps "
    "only wait for a CPU, which its CPU-time clock does not count; --threads N to change"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastamp-compare",
        description="Memory, speed and convergence of fp32, torch.amp, fastamp and pure low-precision training. "
        "Writes a Markdown report, two CSVs and a PNG to --out (default ./fastamp-compare-results/).",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--model", default="all", help=f"comma-separated subset of {','.join(MODELS)}, or all (default)")
    p.add_argument(
        "--regimes",
        default=None,
        help=f"comma-separated subset of {','.join(REGIMES)}, run on every model (default on CPU: per model, "
        + "; ".join(f"{m}: {','.join(rs)}" for m, rs in MODEL_REGIMES.items())
        + ")",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="run the full regime set on CPU too (every fp16 CNN row; the default on CUDA): "
        + "; ".join(f"{m}: {','.join(rs)}" for m, rs in FULL_MODEL_REGIMES.items())
        + f". {FULL_SET_DURATION} at --size small",
    )
    p.add_argument(
        "--size",
        default=None,
        choices=sorted(SIZES),
        help=f"size preset (default: small on CPU, {DEFAULT_DURATION}; large on CUDA; tiny: a smoke run of seconds)",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per regime (default: from --size)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default on CPU: 1, for steady timings on a shared machine; 0: torch's default)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="override the preset batch size (both models)")
    p.add_argument("--gpt-layers", type=int, default=None)
    p.add_argument("--gpt-dim", type=int, default=None)
    p.add_argument("--gpt-heads", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--cnn-width", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup + cosine to 10%%)")
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0 disables)")
    p.add_argument(
        "--growth-interval",
        type=int,
        default=None,
        help="clean steps before every scaler (torch's and fastamp's alike) doubles the loss scale "
        "(default: from --size; torch's own default is 2000)",
    )
    p.add_argument("--note", action="append", default=[], help="a line for the report header (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="fastamp-compare-results", help="directory for the report, CSV and PNG files")
    p.add_argument("--tag", default=None, help="file name suffix (default: the device type)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


@dataclass
class CompareRun:
    """What :func:`run` did: the table rows, the results, the files written and what went wrong."""

    rows: list[dict[str, Any]]
    results: list[RegimeResult]
    written: list[str] = field(default_factory=list)
    load: load.LoadVerdict | None = None
    threads: int = 0
    plot_missing: str = ""
    plot_error: str = ""

    @property
    def ok(self) -> bool:
        return not self.plot_error and not any(r.error for r in self.results)


def _choose_threads(device: torch.device, requested: int | None) -> tuple[int, str]:
    if requested is not None and requested < 0:
        raise SystemExit(f"fastamp-compare: --threads must be >= 0 (0: torch's default), got {requested}")
    if requested == 0:
        return torch.get_num_threads(), "torch's default (--threads 0)"
    if requested is not None:
        return requested, "--threads"
    if device.type == "cpu":
        return 1, THREADS_WHY
    return torch.get_num_threads(), "torch's default (CUDA run: the GPU does the work)"


def _parse(argv: list[str] | None):
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    models = list(MODELS) if args.model == "all" else [m.strip() for m in args.model.split(",")]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"fastamp-compare: unknown --model {m!r}; expected some of {','.join(MODELS)}, or all")
    regimes = None if args.regimes is None else [r.strip() for r in args.regimes.split(",")]
    for r in regimes or ():
        if r not in REGIMES:
            raise SystemExit(f"fastamp-compare: unknown regime {r!r}{renamed(r)}; expected some of {','.join(REGIMES)}")
    if regimes is not None and args.full:
        raise SystemExit("fastamp-compare: --full and --regimes choose the regimes both; give one of them")
    size = args.size or ("large" if device.type == "cuda" else "small")
    preset = copy.deepcopy(SIZES[size])
    steps = args.steps or preset["steps"]
    if steps < MIN_STEPS:
        raise SystemExit(
            f"fastamp-compare: --steps must be at least {MIN_STEPS} (7 set-up steps: warm-up, memory, "
            f"op profile; then a block of an untimed and a timed step), got {steps}"
        )
    growth_interval = preset["growth_interval"] if args.growth_interval is None else args.growth_interval
    if growth_interval < 0:
        raise SystemExit(f"fastamp-compare: --growth-interval must be >= 0 (0: never grow), got {growth_interval}")
    g, c = preset["gpt"], preset["cnn"]
    for key, val in (
        ("n_layer", args.gpt_layers),
        ("d_model", args.gpt_dim),
        ("n_head", args.gpt_heads),
        ("seq_len", args.seq_len),
    ):
        if val is not None:
            g[key] = val
    if args.cnn_width is not None:
        c["width"] = args.cnn_width
    if args.image_size is not None:
        c["image"] = args.image_size
    if args.batch_size is not None:
        g["batch"] = c["batch"] = args.batch_size
    if g["d_model"] % g["n_head"]:
        raise SystemExit(f"fastamp-compare: --gpt-dim {g['d_model']} must be divisible by --gpt-heads {g['n_head']}")
    if regimes is not None:
        model_regimes = {m: list(regimes) for m in models}
        which = "--regimes"
    elif args.full or device.type == "cuda":
        model_regimes = {m: list(FULL_MODEL_REGIMES[m]) for m in models}
        which = "the full set" + (" (--full)" if args.full else " (the CUDA default)")
    else:
        model_regimes = {m: list(MODEL_REGIMES[m]) for m in models}
        which = f"the CPU default set; --full adds the other fp16 CNN rows ({FULL_SET_DURATION})"
    return args, device, size, steps, growth_interval, g, c, model_regimes, which


def _build(model_name: str, g: dict, c: dict, device: torch.device, seed: int):
    torch.manual_seed(seed)
    if model_name == "gpt":
        data = TextData(g["seq_len"], g["batch"], device, seed=seed)
        return data, TinyGPT(len(data.vocab), g["seq_len"], g["n_layer"], g["d_model"], g["n_head"])
    bits = 12 if model_name == "cnn-raw12" else None
    return ImageData(c["image"], c["batch"], device, seed=seed, bits=bits), SmallCNN(c["width"])


def _train_interleaved(runs: dict, failed: dict, bar: JobProgress) -> None:
    """Advance every regime of every model in turn, a block of steps at a time.

    Interleaved, every regime meets the same load from other processes, and the slow
    regimes' costs are measured in the first round, which the ETA needs.
    """
    while True:
        active = [(k, r) for k, r in runs.items() if k not in failed and not r.done]
        if not active:
            return
        for key, run in active:
            first = run.next_step
            try:
                done = run.advance()
            except Exception as e:  # one broken regime must not hide the others' numbers
                failed[key] = f"{type(e).__name__}: {e}"
                print(f"fastamp-compare: {key[0]}/{key[1]} failed: {failed[key]}", file=sys.stderr)
                for step in range(first, run.steps):
                    bar.record(key, 0.0, step, estimate=False)
                continue
            for step, wall, _ in done:
                measured = step != MEMORY_STEP and step not in PROFILED_STEPS
                bar.record(key, wall, step, estimate=measured, label=f"{key[0]}/{key[1]}")


def run(argv: list[str] | None = None) -> CompareRun:
    """Run the job with command-line arguments ``argv``; bad arguments raise SystemExit with the reason.

    torch's thread count is set for the job and restored when it returns.
    """
    parsed = _parse(argv)
    threads, why = _choose_threads(parsed[1], parsed[0].threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(parsed, threads, why)
    finally:
        torch.set_num_threads(before)


def _run(parsed, threads: int, why: str) -> CompareRun:
    args, device, size, steps, growth_interval, g, c, model_regimes, which = parsed
    models = list(model_regimes)
    cpu_clock = device.type == "cpu" and threads == 1

    info = machine_info(device)
    info["torch_threads"] = f"{threads}: {why}"
    info["size"] = f"{size}: gpt {g}, cnn {c}, steps {steps}, lr {args.lr}, clip {args.clip}"
    info["regime_set"] = which
    if device.type == "cpu":
        info["cpu_features"] = cpu_features_line()
    info["loss_scale"] = (
        f"every scaler (torch.amp.GradScaler and fastamp.Scaler alike) starts at 2^16, backs off x0.5 on an "
        f"overflow (the step is skipped) and grows x2 after {growth_interval} clean steps"
        + (" (never grows)" if growth_interval == 0 else "")
    )
    for i, note in enumerate(args.note):
        info["note" if len(args.note) == 1 else f"note_{i + 1}"] = note
    n_regimes = sum(len(v) for v in model_regimes.values())
    print(
        f"fastamp-compare: {n_regimes} regimes on {len(models)} model{'s' if len(models) > 1 else ''}, {steps} steps "
        f"each, on {device.type}: {which}\nfastamp-compare: torch threads: {threads} ({why.split(';')[0]})",
        file=sys.stderr,
    )

    start, before = load.probe_before()
    t_start = time.perf_counter()
    runs: dict[tuple[str, str], RegimeRun] = {}
    failed: dict[tuple[str, str], str] = {}
    for model_name in models:
        data, base = _build(model_name, g, c, device, args.seed)
        info[f"{model_name}_params"] = f"{sum(p.numel() for p in base.parameters()):,}"
        for regime in model_regimes[model_name]:
            key = (model_name, regime)
            try:
                runs[key] = RegimeRun(
                    model_name, regime, base, data, device, steps, args.lr, args.clip,
                    growth_interval=growth_interval, cpu_clock=cpu_clock,
                )  # fmt: skip
            except Exception as e:
                failed[key] = f"{type(e).__name__}: {e}"
                print(f"fastamp-compare: {model_name}/{regime} failed: {failed[key]}", file=sys.stderr)
    bar = JobProgress({k: steps for k in runs}, enabled=not args.no_progress)
    if bar.tqdm_missing:
        print(
            "fastamp-compare: no progress line: tqdm is not installed (pip install 'fastamp[compare]')", file=sys.stderr
        )
    try:
        _train_interleaved(runs, failed, bar)
    finally:
        bar.close()
    end = load.snapshot()
    verdict = load.assess(before, start, end, os.cpu_count() or 1, threads)

    results: list[RegimeResult] = []
    for model_name in models:
        for regime in model_regimes[model_name]:
            key = (model_name, regime)
            if key not in failed:
                try:
                    results.append(runs[key].finish())
                    continue
                except Exception as e:
                    failed[key] = f"{type(e).__name__}: {e}"
            results.append(RegimeResult(model_name, regime, error=failed[key]))
    rows = summarise(results)
    info["wall_time"] = f"{time.perf_counter() - t_start:.0f} s for the job (set-up excluded)"
    if end.loadavg is not None:
        info["load_avg_at_end"] = " ".join(f"{x:.2f}" for x in end.loadavg)
    info["machine_load"] = verdict.summary

    os.makedirs(args.out, exist_ok=True)
    tag = args.tag or device.type
    csv_path, curves_path, png_path, md_path = (
        os.path.join(args.out, f"compare-{tag}{suffix}") for suffix in (".csv", "-curves.csv", ".png", ".md")
    )
    out = CompareRun(rows, results, load=verdict, threads=threads)
    write_csv(csv_path, rows)
    with open(curves_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "regime", "step", "loss", "scale", "skipped", "step_wall_ms", "step_cpu_ms"])
        for r in results:
            skipped = set(r.skipped_at or ())
            times = {step: (f"{1e3 * wall:.4f}", f"{1e3 * cpu:.4f}") for step, wall, cpu in r.step_times}
            for i, loss in enumerate(r.losses):
                scale = r.scales[i] if i < len(r.scales) else ""
                row = [r.model, r.regime, i, loss, scale, "" if r.skipped_at is None else int(i in skipped)]
                w.writerow(row + list(times.get(i, ("", ""))))
    mem_note = CudaPeakMeter.method if device.type == "cuda" else CpuPeakMeter.method
    text = "\n".join(
        report_lines(info, results, rows, models, model_regimes, device, verdict, mem_note, growth_interval)
    )
    with open(md_path, "w") as f:
        f.write(text)
    out.written += [md_path, csv_path, curves_path]
    print(text)
    if not args.no_plot:
        _plot(out, args, device, info, verdict, growth_interval, png_path)
    return out


def _plot(out: CompareRun, args, device, info, verdict, growth_interval: int, png_path: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        out.plot_missing = f"matplotlib is not installed ({e}); pip install 'fastamp[compare]' for the PNG"
        print(f"fastamp-compare: no plot: {out.plot_missing}", file=sys.stderr)
        return
    from fastamp.compare.plots import plot, plot_title

    title = plot_title(device.type, info.get("git_commit", ""), info["date"], verdict)
    try:
        plot(out.results, out.rows, png_path, title, growth_interval=growth_interval, note=verdict.summary)
    except Exception as e:
        out.plot_error = f"{type(e).__name__}: {e}"
        print(f"fastamp-compare: plot failed, {png_path} not written: {out.plot_error}", file=sys.stderr)
        return
    out.written.append(png_path)


def main(argv: list[str] | None = None) -> int:
    """The ``fastamp-compare`` console script: run the job; 0 when every regime ran and every file was written."""
    result = run(argv)
    print("fastamp-compare: wrote " + ", ".join(result.written), file=sys.stderr)
    if result.plot_missing:
        print("fastamp-compare: not written: the PNG (matplotlib is not installed)", file=sys.stderr)
    failed = [f"{r.model}/{r.regime}" for r in result.results if r.error]
    if failed:
        print(f"fastamp-compare: failed regimes: {', '.join(failed)}", file=sys.stderr)
    return 0 if result.ok else 1
