"""From the runs to the table: ratios to fp32, the convergence verdicts, Markdown."""

from __future__ import annotations

import math
from typing import Any

import torch

from fastamp._harness import markdown_table
from fastamp.compare.hotspots import dominant_ops, hotspot_table, slowdown_lines, top_ops_text
from fastamp.compare.regimes import REGIME_INFO
from fastamp.compare.train import BLOCK, RegimeResult

_BF16, _FP16 = torch.bfloat16, torch.float16


def _fmt_bytes(b: float) -> str:
    if not math.isfinite(b):
        return "-"
    return f"{b / 2**20:.2f} MiB"


def _fmt(v: Any, nd: int = 3) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.{nd}f}"
    return str(v)


# The parameter count of the training-state projection (a 7B model, as in the article that motivates fastamp).
PROJECTION_PARAMS = 7e9

TABLE_COLS = [
    ("regime", "regime"),
    ("peak_mem", "peak memory"),
    ("mem_vs_fp32", "memory vs fp32"),
    ("step_ms", "step (ms)"),
    ("speed_vs_fp32", "speed vs fp32"),
    ("final_loss", "final val loss"),
    ("convergence_pct", "convergence % of fp32"),
    ("skipped_steps", "skipped steps"),
    ("final_scale", "final scale"),
    ("nonfinite_losses", "non-finite losses"),
]


def summarise(results: list[RegimeResult]) -> list[dict[str, Any]]:
    """Fill the ratios to the fp32 row of the same model; return table rows."""
    rows = []
    by_model: dict[str, list[RegimeResult]] = {}
    for r in results:
        by_model.setdefault(r.model, []).append(r)
    for model, rs in by_model.items():
        base = next((r for r in rs if r.regime == "fp32" and not r.error), None)
        for r in rs:
            if base is not None:
                r.speed_vs_fp32 = base.step_ms / r.step_ms if r.step_ms > 0 else float("nan")
                drop_fp32 = base.initial_loss - base.final_loss
                drop = r.initial_loss - r.final_loss
                if math.isfinite(drop) and drop_fp32 > 0:
                    r.convergence_pct = 100.0 * drop / drop_fp32
            rows.append(
                {
                    "model": model,
                    "regime": r.regime,
                    "peak_mem": _fmt_bytes(r.peak_mem_bytes),
                    "peak_mem_bytes": r.peak_mem_bytes,
                    "state_bytes_per_param": _fmt(r.state_bytes / r.n_params, 3) if r.n_params else "-",
                    "large_state_bytes_per_param": (
                        _fmt(r.large_state_bytes / r.large_params, 3) if r.large_params else "-"
                    ),
                    "large_param_share": f"{100 * r.large_params / r.n_params:.1f}%" if r.n_params else "-",
                    "state_7b_gb": (
                        _fmt(r.large_state_bytes / r.large_params * PROJECTION_PARAMS / 1e9, 1)
                        if r.large_params
                        else "-"
                    ),
                    "mem_vs_fp32": (
                        f"{r.peak_mem_bytes / base.peak_mem_bytes:.2f}x"
                        if base is not None and math.isfinite(r.peak_mem_bytes) and base.peak_mem_bytes > 0
                        else "-"
                    ),
                    "step_ms": _fmt(r.step_ms, 2),
                    "step_clock": r.clock,
                    "step_wall_ms": _fmt(r.step_wall_ms, 2),
                    "step_cpu_ms": _fmt(r.step_cpu_ms, 2),
                    "timed_steps": r.timed_steps,
                    "speed_vs_fp32": (
                        "-"
                        if not math.isfinite(r.speed_vs_fp32)
                        else f"{r.speed_vs_fp32:.2f}x"
                        if r.speed_vs_fp32 >= 0.1
                        else f"{r.speed_vs_fp32:.3f}x"
                    ),
                    "initial_loss": _fmt(r.initial_loss),
                    "final_loss": _fmt(r.final_loss),
                    "convergence_pct": f"{r.convergence_pct:.1f}%"
                    if math.isfinite(r.convergence_pct)
                    else "diverged"
                    if not math.isfinite(r.final_loss)
                    else "-",
                    "skipped_steps": r.skipped_steps,
                    "final_scale": f"{r.final_scale:g}" if isinstance(r.final_scale, float) else r.final_scale,
                    "nonfinite_losses": r.nonfinite_losses,
                    "bn_running_var_max": "-" if r.bn_var_max is None else f"{r.bn_var_max:.4g}",
                    "skipped_at": "-" if r.skipped_at is None else " ".join(map(str, r.skipped_at)),
                    "guards": " ".join(r.guards),
                    "top_ops": top_ops_text(r.op_profile) if r.op_profile is not None and r.op_profile.ops else "",
                    "error": r.error,
                }
            )
    return rows


# fastamp's rows are judged against torch.amp's with the same low-precision dtype: the final
# validation loss must be within this relative budget. Both runs start from the same weights
# and see the same batches; they differ only in rounding (fastamp stores the params and the
# embedding/LayerNorm inputs in low precision, autocast keeps them fp32), which moves a short
# training run's final loss by well under 1% in our runs; 3% leaves room for other seeds.
# The stochastic-rounding and bf16-moment rows are held to the same budget: they trade
# accuracy for memory, and the check says whether the trade cost more than that here.
CONVERGENCE_RTOL = 0.03
_PAIRS = (
    ("fastamp-fp16", "torch-amp-fp16"),
    ("fastamp-bf16", "torch-amp-bf16"),
    ("fastamp-bf16-remainder", "torch-amp-bf16"),
    ("fastamp-bf16-sr", "torch-amp-bf16"),
    ("fastamp-bf16-10B", "torch-amp-bf16"),
    ("fastamp-bf16-remainder-q8", "torch-amp-bf16"),
    ("fastamp-bf16-ulp8-q8", "torch-amp-bf16"),
    ("fastamp-bf16-sr-q8", "torch-amp-bf16"),
    ("fastamp-fp16-ulp8-q8", "torch-amp-fp16"),
    ("half-fp16-fastamp", "fastamp-fp16"),
)


def _first_nonfinite(losses: list[float]) -> int | None:
    return next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)


def _identical_steps(a: RegimeResult | None, b: RegimeResult | None) -> tuple[int, int]:
    """(the steps before ``a``'s and ``b``'s training losses first differ, the steps) when both ran alike; else (0, 0)."""
    if a is None or b is None or not a.losses or len(a.losses) != len(b.losses):
        return 0, 0
    n = len(a.losses)
    return next((i for i, (x, y) in enumerate(zip(a.losses, b.losses)) if x != y), n), n


def verdicts(results: list[RegimeResult]) -> list[str]:
    """One line per fastamp row vs its reference row, remainder vs fp32 master, and per pure low-precision row."""
    out = []
    by = {(r.model, r.regime): r for r in results if not r.error}
    for model in dict.fromkeys(r.model for r in results):
        for ours, theirs in _PAIRS:
            a, b = by.get((model, ours)), by.get((model, theirs))
            if a is None or b is None:
                continue
            rel = (a.final_loss - b.final_loss) / b.final_loss if b.final_loss else float("nan")
            ok = math.isfinite(rel) and abs(rel) <= CONVERGENCE_RTOL
            out.append(
                f"{model}: {ours} final val loss {a.final_loss:.4f} vs {theirs} {b.final_loss:.4f} "
                f"({100 * rel:+.2f}%): {'within' if ok else 'OUTSIDE'} the {100 * CONVERGENCE_RTOL:.0f}% tolerance"
            )
        same, n = _identical_steps(by.get((model, "fastamp-bf16-remainder")), by.get((model, "fastamp-bf16")))
        if n:
            out.append(
                f"{model}: fastamp-bf16-remainder vs fastamp-bf16 (fp32 masters): training losses bit-identical for "
                f"{same} of {n} steps (same master update; at an exact rounding tie, about 1 element in "
                f"65,536, the remainder's bf16 param is the neighbour away from zero, one ulp from the nearest-even "
                f"one, and from then on the two runs see slightly different forwards)"
            )
        same, n = _identical_steps(by.get((model, "fastamp-bf16-release")), by.get((model, "fastamp-bf16-remainder")))
        if n:
            out.append(
                f"{model}: fastamp-bf16-release vs fastamp-bf16-remainder (the same step inside backward): training "
                f"losses bit-identical for {same} of {n} steps"
                + ("" if same == n else " (MISMATCH: gradient release must reproduce the ordinary step)")
            )
        for pure in ("pure-fp16", "pure-bf16"):
            r, base = by.get((model, pure)), by.get((model, "fp32"))
            if r is None or base is None:
                continue
            if not math.isfinite(r.final_loss) or r.nonfinite_losses:
                what = (
                    f"diverged ({r.nonfinite_losses} non-finite training losses, the first at step "
                    f"{_first_nonfinite(r.losses)})"
                )
            elif r.convergence_pct < 90:
                what = f"stalls at {r.convergence_pct:.1f}% of fp32's loss reduction"
            else:
                what = f"reaches {r.convergence_pct:.1f}% of fp32's loss reduction"
            out.append(f"{model}: {pure} (plain .to({pure[5:]}), no master weights, no scaler) {what}")
        half, cast, pure = (by.get((model, k)) for k in ("half-fp16-fastamp", "fastamp-fp16", "pure-fp16"))
        if half is not None and cast is not None:
            rel = (half.final_loss - cast.final_loss) / cast.final_loss if cast.final_loss else float("nan")
            if math.isfinite(rel) and abs(rel) <= CONVERGENCE_RTOL and not half.nonfinite_losses:
                line = (
                    f"{model}: norm layers in fp16 (model.half()) trained as well as cast_model's fp32 norm layers "
                    f"here, with fp32 masters and a scaler (half-fp16-fastamp)"
                )
                if pure is not None and (pure.nonfinite_losses or not math.isfinite(pure.final_loss)):
                    line += (
                        "; so pure-fp16's failure comes with its optimizer (torch AdamW with fp16 state, no master, no "
                        "scaler), not from the fp16 norm layers alone"
                    )
            else:
                line = (
                    f"{model}: norm layers in fp16 (model.half(), half-fp16-fastamp) broke the model: final val loss "
                    f"{half.final_loss:.4f} vs {cast.final_loss:.4f} with cast_model's fp32 norm layers"
                )
                if half.bn_var_max is not None and not math.isfinite(half.bn_var_max) and not half.nonfinite_losses:
                    line += (
                        " (its training losses stayed finite: training normalises with each batch's own statistics; "
                        "the fp16 running statistics that evaluation uses overflowed)"
                    )
            out.append(line)
        bn = [r for r in results if r.model == model and not r.error and r.bn_var_max is not None]
        if bn:
            out.append(
                f"{model}: largest BatchNorm running_var after training: "
                + ", ".join(f"{r.regime} {r.bn_var_max:.4g}" for r in bn)
                + " (fp16 holds at most 65504; cast_model keeps these statistics fp32, .half() stores them in fp16)"
            )
    return out


def markdown(rows: list[dict[str, Any]], model: str) -> str:
    mr = [r for r in rows if r["model"] == model]
    cells = [
        {k: r[k] if not r["error"] or k == "regime" else ("FAILED" if k == "peak_mem" else "") for k, _ in TABLE_COLS}
        for r in mr
    ]
    return markdown_table(cells, TABLE_COLS, cell=str)


# Scaler pairs whose loss-scale trajectories are compared step by step: (fastamp row, torch row,
# whether they must be identical). fastamp-scaler-fp16 is torch-amp-fp16 with only the scaler
# swapped: same model, loop, settings and grads, so its scales, skipped steps and losses must
# equal torch's bit for bit. fastamp-fp16 does different arithmetic (fp16 params from cast_model,
# fastamp's AdamW on fp32 masters, the fused clip): its scales follow torch's only as long as the
# grads overflow at the same steps, which the report says rather than requires.
SCALE_PAIRS = (
    ("fastamp-scaler-fp16", "torch-amp-fp16", True),
    ("fastamp-fp16", "torch-amp-fp16", False),
)
_SCALE_COLS = [
    ("regime", "regime"),
    ("scaler", "scaler"),
    ("skipped", "skipped steps"),
    ("skipped_at", "skipped at step"),
    ("backoffs", "backoffs (x0.5)"),
    ("growths", "growths (x2)"),
    ("range", "scale range"),
    ("final", "final scale"),
]


def _log2(v: float) -> str:
    e = math.log2(v) if v > 0 and math.isfinite(v) else float("nan")
    return f"2^{e:.0f}" if math.isfinite(e) and e == round(e) else f"{v:g}"


def scale_moves(r: RegimeResult) -> tuple[int, int]:
    """(backoffs, growths) of ``r``'s loss scale: steps after which it fell, rose (from its initial value)."""
    prev, down, up = r.init_scale, 0, 0
    for s in r.scales:
        if prev is not None:
            down += s < prev
            up += s > prev
        prev = s
    return down, up


def _first_difference(a: list[float], b: list[float]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def scale_lines(results: list[RegimeResult], growth_interval: int) -> list[str]:
    """The loss-scale section: per model a table of every scaler regime, then the torch/fastamp comparisons."""
    out = [
        f"Every scaler starts at 2^16, halves the scale on an overflow (that step's update is skipped) and "
        f"doubles it after {growth_interval} clean steps. Skipped steps are read from each optimizer's step "
        f"counter (steps are numbered from 0).",
    ]
    scaled = [r for r in results if not r.error and r.skipped_at is not None and r.scales]
    if scaled and growth_interval:
        skipped, total = sum(len(r.skipped_at) for r in scaled), sum(len(r.scales) for r in scaled)
        out[-1] += (
            f" With so short an interval the scale keeps probing the overflow threshold: {skipped} of {total} "
            f"fp16 steps ({100 * skipped / total:.1f}%) were skipped here, updates the fp16 rows did not get "
            f"(torch's default interval, 2000, probes 200x less often)."
        )
    out.append("")
    for model in dict.fromkeys(r.model for r in results):
        rs = [r for r in results if r.model == model and not r.error and r.skipped_at is not None]
        if not rs:
            continue
        cells = []
        for r in rs:
            down, up = scale_moves(r)
            scales = ([r.init_scale] if r.init_scale is not None else []) + r.scales
            cells.append(
                {
                    "regime": r.regime,
                    "scaler": "torch.amp.GradScaler" if r.regime.startswith("torch-amp") else "fastamp.Scaler",
                    "skipped": len(r.skipped_at),
                    "skipped_at": ", ".join(map(str, r.skipped_at)) or "none",
                    "backoffs": down,
                    "growths": up,
                    "range": f"{_log2(min(scales))} - {_log2(max(scales))}" if scales else "-",
                    "final": _log2(r.scales[-1]) if r.scales else "-",
                }
            )
        out += [f"### {model}", "", markdown_table(cells, _SCALE_COLS, cell=str), ""]
        by = {r.regime: r for r in rs}
        for ours, theirs, exact in SCALE_PAIRS:
            a, b = by.get(ours), by.get(theirs)
            if a is None or b is None:
                continue
            n = len(b.scales)
            d = _first_difference(a.scales, b.scales)
            same_skips = a.skipped_at == b.skipped_at
            if d is None and same_skips:
                what = f"loss scale identical at all {n} steps, the same {len(a.skipped_at)} skipped steps"
            else:
                what = (
                    f"loss scale identical for the first {n if d is None else d} of {n} steps"
                    + ("" if d is None else f" (step {d}: {a.scales[d]:g} vs {b.scales[d]:g})")
                    + f"; skipped steps {'the same' if same_skips else 'differ'}: "
                    f"{ours} {', '.join(map(str, a.skipped_at)) or 'none'}, "
                    f"{theirs} {', '.join(map(str, b.skipped_at)) or 'none'}"
                )
            if exact:
                same_loss = _first_difference(a.losses, b.losses)
                what += (
                    f", training losses bit-identical for {len(a.losses) if same_loss is None else same_loss} "
                    f"of {len(a.losses)} steps"
                )
                ok = d is None and same_skips and same_loss is None
                verdict = (
                    "as required: only the scaler differs" if ok else "EXPECTED IDENTICAL: only the scaler differs"
                )
            else:
                verdict = (
                    "not required: different arithmetic (fp16 params, fp32 masters, fused clip), so the grads "
                    "can overflow at different steps"
                )
            out.append(f"- {model}: {ours} vs {theirs}: {what} ({verdict})")
        out.append("")
    return out[:-1] if out and out[-1] == "" else out


def scale_trajectories_match(results: list[RegimeResult]) -> dict[tuple[str, str, str], bool]:
    """``{(model, fastamp row, torch row): identical}`` for the pairs of :data:`SCALE_PAIRS` that must match."""
    by = {(r.model, r.regime): r for r in results if not r.error}
    out = {}
    for model in dict.fromkeys(r.model for r in results):
        for ours, theirs, exact in SCALE_PAIRS:
            a, b = by.get((model, ours)), by.get((model, theirs))
            if exact and a is not None and b is not None:
                out[(model, ours, theirs)] = (
                    a.scales == b.scales and a.skipped_at == b.skipped_at and a.losses == b.losses
                )
    return out


def guard_lines(results: list[RegimeResult]) -> list[str]:
    """Which fastamp pitfall guards (AmpPitfallWarning) fired in which regime; recorded, not printed."""
    from fastamp.health import GUARDS

    fired = [r for r in results if r.guards]
    if not fired:
        return ["No fastamp pitfall guard (AmpPitfallWarning) fired in any regime."]
    out = [
        "fastamp's pitfall guards (AmpPitfallWarning) fired in these runs; the warnings were recorded per regime "
        "instead of printed (the bad regimes are bad on purpose). No guard fired in the other regimes.",
        "",
    ]
    out += [f"- {r.model}/{r.regime}: {', '.join(f'`{g}`' for g in r.guards)}" for r in fired]
    keys = list(dict.fromkeys(g for r in fired for g in r.guards))
    out += [""] + [f"- `{k}`: {GUARDS.get(k, 'not a listed guard')}" for k in keys]
    return out


def cpu_speed_note(results: list[RegimeResult], features: dict[str, bool] | None = None) -> str:
    """The CPU caveat, from what was measured: the speed ratios per dtype and model, and the op that dominates.

    ``features`` (the CPU's flags) is not used to explain anything: the flags are in the
    header, and which ops took the time is measured (:mod:`fastamp.compare.hotspots`).
    """
    parts = []
    for model in dict.fromkeys(r.model for r in results):
        per = []
        for dtype, name in ((_BF16, "bf16"), (_FP16, "fp16")):
            v = [
                r.speed_vs_fp32
                for r in results
                if r.model == model and not r.error and REGIME_INFO[r.regime][0] == dtype
                and math.isfinite(r.speed_vs_fp32)
            ]  # fmt: skip
            if v:
                per.append(f"{name} {_ratio(min(v))}-{_ratio(max(v))}" if len(v) > 1 else f"{name} {_ratio(v[0])}")
        if per:
            parts.append(f"{model}: " + ", ".join(per))
    speeds = "; ".join(parts) if parts else "no speed measured"
    dominant = dominant_ops(results)
    why = ""
    if dominant:
        why = (
            " Where the slower rows' extra time went (torch.profiler, three steps per regime): "
            + "; ".join(f"{op} in {', '.join(rows)}" for op, rows in dominant.items())
            + " (see 'Where the time goes')."
        )
    return (
        f"measured here, speed vs fp32 (lowest-highest over each dtype's regimes): {speeds}.{why} The speed column "
        f"is this machine's; a GPU's mixed-precision speed-up is not measured on a CPU. Memory and convergence "
        f"carry over."
    )


def _ratio(x: float) -> str:
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.3f}x"


_STATE_COLS = [
    ("regime", "regime"),
    ("state_bytes_per_param", "B/param, whole model (measured)"),
    ("large_param_share", "params in tensors >= 4,096"),
    ("large_state_bytes_per_param", "B/param, tensors >= 4,096 (measured)"),
    ("state_7b_gb", "GB for 7B params (projection)"),
]


def state_lines(rows: list[dict[str, Any]], models: list[str]) -> list[str]:
    """Training state per param of each regime, measured here, and what it would be for a 7B-param model."""
    from fastamp.compare.train import LARGE_NUMEL

    out = [
        "## Training state per parameter, and a 7B-parameter projection",
        "",
        "Measured: the bytes of the distinct live storages of the params, their grads, the buffers, the optimizer "
        "state and the scaler right after the memory step, divided by the param count (no activations, no "
        "autocast copies: those are in the peak); then the same for the params of at least "
        f"{LARGE_NUMEL:,} elements alone (each param, its grad and its own optimizer state; the size from which "
        "fastamp's 8-bit formats apply). Projection: the second B/param x 7e9, in GB (1e9 bytes), i.e. the "
        "training state of a 7B model, whose tensors are that large, trained the same way. A projection, not a "
        "measurement: it leaves out a 7B model's small tensors (norms, biases) and everything but params, grads "
        "and optimizer state. The whole-model B/param is higher where the model's small tensors keep more state per "
        "param (fp32 moments below 4,096 elements, fp32 LayerNorms); `benchmarks/bench_memory.py` measures large "
        "tensors and the 8-bit optimizers of other libraries.",
        "",
    ]
    for model_name in models:
        cells = [{k: r[k] for k, _ in _STATE_COLS} for r in rows if r["model"] == model_name and not r["error"]]
        if cells:
            out += [f"### {model_name}", "", markdown_table(cells, _STATE_COLS, cell=str), ""]
    return out


def report_lines(info, results, rows, models, model_regimes, device, verdict, mem_note, growth_interval) -> list[str]:
    """The Markdown report: header (machine, load, method), regimes, tables, where the time goes, checks."""
    lines = [f"# fastamp-compare ({device.type})", ""]
    if verdict is not None and verdict.under_load:
        lines += [
            f"**This run was under load**: {'; '.join(verdict.reasons)}. Other processes competed for the CPUs, "
            f"so the step times are not this machine's unloaded ones; the speed ratios are measured in the same "
            f"interleaved rounds and by CPU time with one thread, which keeps them comparable, but treat them with "
            f"care. Memory and convergence do not depend on the load.",
            "",
        ]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [f"- peak memory: {mem_note}"]
    timed = max((r.timed_steps for r in results if not r.error), default=0)
    clock = next((r.clock for r in results if not r.error), "wall")
    if clock == "cpu":
        how = (
            "the process's CPU time per step (one thread: the time the step computed, without the time it waited "
            "for a CPU while other processes ran; the wall clock's is in the CSV, step_wall_ms, and every step's "
            "times are in the curves CSV)"
        )
    elif device.type == "cuda":
        how = "wall clock over chunks of steps between two device synchronisations"
    else:
        how = "wall clock per step (more than one thread: CPU time would add the threads' waits)"
    lines += [
        f"- step time: the lower quartile of the {timed} timed steps of each regime (other processes only make a "
        f"step longer, and the quartile stays clear of the ~7% cheaper steps a scaler skips), by {how}. Steps 0-6 set up and measure "
        f"(warm-up; step 2 measured for memory; steps 4-6 profiled), then the regimes run interleaved, a block of "
        f"{BLOCK.get(device.type, BLOCK['cuda'])} steps each in turn, so that every regime meets the same load; the first "
        f"step of each block is not timed, as it finds the caches full of the previous regime's data",
        "- final val loss: mean cross-entropy on 8 held-out batches, evaluated in the regime's own precision",
        "- convergence % of fp32: (first-step loss - final val loss) / the same for fp32, x100",
        "- skipped steps: steps minus the optimizer's step counter (overflow steps skipped on device); "
        "'-' where no scaler is used",
    ]
    if device.type == "cpu":
        lines += ["- CPU note: " + cpu_speed_note(results)]
    lines += [
        "- data: gpt: text of a synthetic grammar; cnn: synthetic 10-class images, normalised; cnn-raw12: the same "
        "images as raw 12-bit sensor values (0..4095, not normalised)",
    ]
    ran = [r for r in REGIME_INFO if any(r in v for v in model_regimes.values())]
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
    lines += state_lines(rows, models)
    lines += ["## Where the time goes", ""]
    lines += [
        "torch.profiler over three training steps per regime (steps 4-6), each profiled on its own: each op's "
        "self time, summed by op name within a step, then the least over the three steps (the profiler times ops "
        "by the wall clock, so an op during which another process held the CPU only looks longer); the shares are "
        "of the time spent in ops. Under load the small ops' shares stay noisy; a dominant op shows in every step.",
        "",
    ]
    for model_name in models:
        table = hotspot_table(results, model_name)
        if table:
            lines += [f"### {model_name}", "", table, ""]
    slow = slowdown_lines(results)
    if slow:
        lines += ["Rows slower than fp32 by more than 1.5x, and the op that grew the most:", ""]
        lines += [f"- {v}" for v in slow] + [""]
    lines += ["## Loss scale", ""] + scale_lines(results, growth_interval) + [""]
    lines += ["## Pitfall guards", ""] + guard_lines(results) + [""]
    checks = verdicts(results)
    if checks:
        lines += ["## Convergence checks", ""] + [f"- {c}" for c in checks] + [""]
    return lines
