"""``fastamp-compare`` / ``python -m fastamp.compare``: arguments, the runs, the files written."""

from __future__ import annotations

import argparse
import copy
import csv
import functools
import os
import sys
import time
from typing import Any

import torch

from fastamp._harness import Progress, machine_info, resolve_device, write_csv
from fastamp.compare.data import ImageData, TextData
from fastamp.compare.machine import cpu_features, cpu_features_line
from fastamp.compare.memory import CpuPeakMeter
from fastamp.compare.models import SmallCNN, TinyGPT
from fastamp.compare.plots import plot
from fastamp.compare.regimes import MODEL_REGIMES, REGIME_INFO, REGIMES
from fastamp.compare.report import cpu_speed_note, guard_lines, markdown, scale_lines, summarise, verdicts
from fastamp.compare.train import RegimeResult, train_regime

MODELS = ("gpt", "cnn", "cnn-raw12")

# Size presets: "small" is what the defaults run on a 2-core CPU in a few minutes.
SIZES = {
    "tiny": {
        "gpt": {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32, "batch": 8},
        "cnn": {"width": 8, "image": 12, "batch": 16},
        "steps": 12,
        "growth_interval": 2,
    },
    # fp16 matmuls on a CPU without AVX512-FP16/AMX run 10-50x slower than fp32 (measured on
    # the project's 2-core machine), so the CPU default keeps the transformer narrow.
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastamp-compare",
        description="Memory, speed and convergence of fp32, torch.amp, fastamp and pure low-precision training.",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--model", default="all", help=f"comma-separated subset of {','.join(MODELS)}, or all (default)")
    p.add_argument(
        "--regimes",
        default=None,
        help=f"comma-separated subset of {','.join(REGIMES)}, run on every model (default: per model, "
        + "; ".join(f"{m}: {','.join(rs)}" for m, rs in MODEL_REGIMES.items())
        + ")",
    )
    p.add_argument(
        "--size", default=None, choices=sorted(SIZES), help="size preset (default: small on CPU, large on CUDA)"
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per regime (default: from --size)")
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
    p.add_argument("--out", default="fastamp-compare-results", help="directory for the CSV and PNG files")
    p.add_argument("--tag", default=None, help="file name suffix (default: the device type)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    models = list(MODELS) if args.model == "all" else [m.strip() for m in args.model.split(",")]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"fastamp-compare: unknown --model {m!r}; expected some of {','.join(MODELS)}, or all")
    regimes = list(REGIMES) if args.regimes is None else [r.strip() for r in args.regimes.split(",")]
    for r in regimes:
        if r not in REGIMES:
            raise SystemExit(f"fastamp-compare: unknown regime {r!r}; expected some of {','.join(REGIMES)}")
    size = args.size or ("large" if device.type == "cuda" else "small")
    preset = copy.deepcopy(SIZES[size])
    steps = args.steps or preset["steps"]
    if steps < 4:
        raise SystemExit("fastamp-compare: --steps must be at least 4 (3 warm-up steps, then timed ones)")
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

    torch.manual_seed(args.seed)
    info = machine_info(device)
    info["size"] = f"{size}: gpt {g}, cnn {c}, steps {steps}, lr {args.lr}, clip {args.clip}"
    if device.type == "cpu":
        info["cpu_features"] = cpu_features_line()
    info["loss_scale"] = (
        f"every scaler (torch.amp.GradScaler and fastamp.Scaler alike) starts at 2^16, backs off x0.5 on an "
        f"overflow (the step is skipped) and grows x2 after {growth_interval} clean steps"
        + (" (never grows)" if growth_interval == 0 else "")
    )
    for i, note in enumerate(args.note):
        info["note" if len(args.note) == 1 else f"note_{i + 1}"] = note
    t_start = time.perf_counter()
    model_regimes = {m: list(MODEL_REGIMES[m]) if args.regimes is None else regimes for m in models}
    bar = Progress(
        sum(len(v) for v in model_regimes.values()) * steps, label="fastamp-compare", enabled=not args.no_progress
    )

    results: list[RegimeResult] = []
    for model_name in models:
        torch.manual_seed(args.seed)
        if model_name == "gpt":
            data = TextData(g["seq_len"], g["batch"], device, seed=args.seed)
            base = TinyGPT(len(data.vocab), g["seq_len"], g["n_layer"], g["d_model"], g["n_head"])
        else:
            bits = 12 if model_name == "cnn-raw12" else None
            data = ImageData(c["image"], c["batch"], device, seed=args.seed, bits=bits)
            base = SmallCNN(c["width"])
        n_params = sum(p.numel() for p in base.parameters())
        info[f"{model_name}_params"] = f"{n_params:,}"
        # Untimed warm-up so that one-time costs of the process (thread pools, allocator,
        # lazy imports) do not land on whichever regime runs first.
        train_regime(model_name, "fp32", base, data, device, 4, args.lr, args.clip, measure_memory=False)
        run = functools.partial(
            train_regime, base_model=base, data=data, device=device, steps=steps, lr=args.lr, clip=args.clip,
            growth_interval=growth_interval,
        )  # fmt: skip
        for regime in model_regimes[model_name]:
            tick = functools.partial(bar.update, 1, f"{model_name}/{regime}")
            try:
                r = run(model_name, regime, progress=tick)
            except Exception as e:  # one broken regime must not hide the others' numbers
                r = RegimeResult(model_name, regime, error=f"{type(e).__name__}: {e}")
                print(f"fastamp-compare: {model_name}/{regime} failed: {r.error}", file=sys.stderr)
                for _ in range(steps - (bar.n % steps if bar.n % steps else 0)):
                    tick()
            results.append(r)

    rows = summarise(results)
    info["wall_time"] = f"{time.perf_counter() - t_start:.0f} s for the whole run"
    if hasattr(os, "getloadavg"):
        info["load_avg_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    os.makedirs(args.out, exist_ok=True)
    tag = args.tag or device.type
    csv_path = os.path.join(args.out, f"compare-{tag}.csv")
    curves_path = os.path.join(args.out, f"compare-{tag}-curves.csv")
    png_path = os.path.join(args.out, f"compare-{tag}.png")
    md_path = os.path.join(args.out, f"compare-{tag}.md")
    write_csv(csv_path, rows)
    with open(curves_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "regime", "step", "loss", "scale", "skipped"])
        for r in results:
            skipped = set(r.skipped_at or ())
            for i, loss in enumerate(r.losses):
                scale = r.scales[i] if i < len(r.scales) else ""
                w.writerow([r.model, r.regime, i, loss, scale, "" if r.skipped_at is None else int(i in skipped)])

    mem_note = (
        "CUDA: torch.cuda.max_memory_allocated over the whole run minus what was allocated before the model "
        "was built (the dataset)"
        if device.type == "cuda"
        else CpuPeakMeter.method
    )
    lines = [f"# fastamp-compare ({device.type})", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [f"- peak memory: {mem_note}"]
    lines += [
        "- step time: wall-clock mean over the steps after 3 warm-up steps (the memory-profiled step excluded)",
        "- final val loss: mean cross-entropy on 8 held-out batches, evaluated in the regime's own precision",
        "- convergence % of fp32: (first-step loss - final val loss) / the same for fp32, x100",
        "- skipped steps: steps minus the optimizer's step counter (overflow steps skipped on device); "
        "'-' where no scaler is used",
    ]
    if device.type == "cpu":
        lines += ["- CPU note: " + cpu_speed_note(results, cpu_features())]
    lines += [
        "- data: gpt: text of a synthetic grammar; cnn: synthetic 10-class images, normalised; cnn-raw12: the same "
        "images as raw 12-bit sensor values (0..4095, not normalised)",
    ]
    ran = [r for r in REGIMES if any(r in v for v in model_regimes.values())]
    lines += ["", "## Regimes", ""] + [f"- `{r}`: {REGIME_INFO[r][1]}" for r in ran]
    lines.append("")
    for model_name in models:
        lines += [
            f"## {model_name} ({info.get(model_name + '_params', '?')} params)",
            "",
            markdown(rows, model_name),
            "",
        ]
        for r in rows:
            if r["model"] == model_name and r["error"]:
                lines.append(f"- {r['regime']} failed: {r['error']}")
        lines.append("")
    lines += ["## Loss scale", ""] + scale_lines(results, growth_interval) + [""]
    lines += ["## Pitfall guards", ""] + guard_lines(results) + [""]
    checks = verdicts(results)
    if checks:
        lines += ["## Convergence checks", ""] + [f"- {c}" for c in checks] + [""]
    text = "\n".join(lines)
    with open(md_path, "w") as f:
        f.write(text)
    print(text)
    if not args.no_plot:
        try:
            plot(
                results,
                rows,
                png_path,
                f"fastamp-compare on {device.type} ({info.get('git_commit', '')}, {info['date']})",
                growth_interval=growth_interval,
            )
        except Exception as e:
            print(f"fastamp-compare: plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"wrote {csv_path}, {curves_path}, {md_path}" + ("" if args.no_plot else f", {png_path}"), file=sys.stderr)
    return rows
