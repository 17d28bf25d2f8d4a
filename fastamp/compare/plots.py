"""The PNG: loss curves, loss scale over steps, and memory / speed / convergence per regime."""

from __future__ import annotations

import math
from typing import Any

from fastamp.compare.train import RegimeResult


def _smooth(v: list[float], k: int) -> list[float]:
    out, acc, q = [], 0.0, []
    for x in v:
        if not math.isfinite(x):
            out.append(float("nan"))
            continue
        q.append(x)
        acc += x
        if len(q) > k:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


# Skipped-step markers, largest first so that identical trajectories stay visible on top of each other.
_SKIP_MARKERS = {"torch-amp-fp16": ("o", 9), "fastamp-scaler-fp16": ("x", 7), "fastamp-fp16": ("^", 6)}


def plot_title(device: str, commit: str, date: str, load=None) -> str:
    """The PNG's title; a run under load says so first (``load``: a :class:`~fastamp.compare.load.LoadVerdict`)."""
    title = f"fastamp-compare on {device} ({commit}, {date})"
    if load is not None and load.under_load:
        title = f"{load.banner()}: speed labels measured while other processes competed for the CPUs\n" + title
    return title


def plot(
    results: list[RegimeResult],
    rows: list[dict[str, Any]],
    path: str,
    title: str,
    growth_interval: int | None = None,
    note: str = "",
) -> None:
    """Write the PNG; ``title`` and ``note`` also go into its text metadata (Title, Description)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in results))
    colors = {
        "fp32": "black",
        "torch-amp-fp16": "tab:blue",
        "fastamp-scaler-fp16": "navy",
        "torch-amp-bf16": "tab:cyan",
        "fastamp-fp16": "tab:red",
        "fastamp-bf16": "tab:orange",
        "fastamp-bf16-remainder": "tab:brown",
        "fastamp-bf16-release": "tab:brown",
        "fastamp-bf16-sr": "tab:green",
        "fastamp-bf16-10B": "tab:pink",
        "fastamp-bf16-remainder-q8": "peru",
        "fastamp-bf16-ulp8-q8": "gold",
        "fastamp-bf16-sr-q8": "yellowgreen",
        "fastamp-fp16-ulp8-q8": "salmon",
        "half-fp16-fastamp": "tab:gray",
        "pure-fp16": "tab:purple",
        "pure-bf16": "tab:olive",
    }
    styles = {
        "fp32": "-",
        "torch-amp-fp16": "--",
        "fastamp-scaler-fp16": ":",
        "torch-amp-bf16": "--",
        "fastamp-bf16-remainder": (0, (5, 1)),
        "fastamp-bf16-release": ":",  # drawn over its twin: the two curves must coincide
        "half-fp16-fastamp": "-.",
        "pure-fp16": ":",
        "pure-bf16": ":",
    }
    fig, axes = plt.subplots(len(models), 3, figsize=(18, 5.2 * len(models)), squeeze=False)
    for mi, model in enumerate(models):
        ax_l, ax_s, ax_m = axes[mi]
        rs = [r for r in results if r.model == model and not r.error]
        finite_all = [x for r in rs for x in r.losses if math.isfinite(x)]
        for r in rs:
            if not r.losses:
                continue
            k = max(1, len(r.losses) // 25)
            ax_l.plot(
                range(len(r.losses)),
                _smooth(r.losses, k),
                linestyle=styles.get(r.regime, "-"),
                color=colors.get(r.regime),
                label=r.regime + (f" ({r.nonfinite_losses} non-finite)" if r.nonfinite_losses else ""),
                linewidth=1.4,
            )
            bad = next((i for i, v in enumerate(r.losses) if not math.isfinite(v)), None)
            if bad is not None:
                # mark where the loss first became inf/nan: the curve stops there
                last = next((v for v in reversed(r.losses[:bad]) if math.isfinite(v)), r.losses[0])
                ax_l.plot([bad], [last], "x", color=colors.get(r.regime), markersize=10, markeredgewidth=2)
                ax_l.annotate(f"{r.regime}: non-finite from step {bad}", (bad, last), fontsize=7,
                              xytext=(8, 4), textcoords="offset points", color=colors.get(r.regime))  # fmt: skip
        if finite_all:
            lo = min(finite_all)
            hi = max(r.losses[0] for r in rs if r.losses and math.isfinite(r.losses[0]))
            ax_l.set_ylim(lo * 0.9, hi * 1.15)
        ax_l.set_title(f"{model}: training loss (moving average)")
        ax_l.set_xlabel("step")
        ax_l.set_ylabel("loss")
        ax_l.grid(True, alpha=0.3)
        ax_l.legend(fontsize=8)
        any_scale = False
        scaled = [r for r in rs if r.scales]
        for k, r in enumerate(scaled):
            any_scale = True
            # the scale in effect at each step (before its update), drawn as steps; the first
            # regimes drawn widest so that a later identical trajectory shows on top of them
            effect = [r.init_scale if r.init_scale is not None else r.scales[0]] + r.scales
            ax_s.step(range(len(effect)), effect, where="post", linestyle=styles.get(r.regime, "-"),
                      color=colors.get(r.regime), linewidth=max(0.9, 3.2 - 1.1 * k), alpha=0.85,
                      label=f"{r.regime} (skipped {r.skipped_steps})")  # fmt: skip
            if r.skipped_at:
                marker, size = _SKIP_MARKERS.get(r.regime, ("s", 5))
                ax_s.plot(r.skipped_at, [effect[i] for i in r.skipped_at], marker, color=colors.get(r.regime),
                          markersize=size, markerfacecolor="none", markeredgewidth=1.3, linestyle="none")  # fmt: skip
        if any_scale and all(len(set(r.scales)) == 1 and not r.skipped_at for r in scaled):
            ax_s.annotate("no overflow: the scale never backed off", (0.02, 0.05), xycoords="axes fraction", fontsize=8)
        elif any_scale:
            ax_s.annotate("markers: skipped steps (overflow: scale x0.5, update skipped)", (0.02, 0.02),
                          xycoords="axes fraction", fontsize=8)  # fmt: skip
        else:
            ax_s.annotate("no fp16 regime with a loss scaler ran on this model\n(on CPU, --full runs them all)",
                          (0.5, 0.5), xycoords="axes fraction", ha="center", fontsize=9)  # fmt: skip
        ax_s.set_yscale("log", base=2)
        every = "" if growth_interval is None else f", x2 after {growth_interval} clean steps"
        ax_s.set_title(f"{model}: loss scale in effect at each step (fp16 regimes with a scaler{every})", fontsize=10)
        ax_s.set_xlabel("step")
        ax_s.set_ylabel("scale")
        ax_s.grid(True, alpha=0.3, which="both")
        if any_scale:
            ax_s.legend(fontsize=8)
        mrows = [r for r in rows if r["model"] == model and not r["error"] and math.isfinite(r["peak_mem_bytes"])]
        names = [r["regime"] for r in mrows]
        mem = [r["peak_mem_bytes"] / 2**20 for r in mrows]
        bars = ax_m.barh(names, mem, color=[colors.get(n, "grey") for n in names])
        for b, r in zip(bars, mrows):
            ax_m.annotate(
                f" {r['peak_mem']}, {r['speed_vs_fp32']} speed, conv {r['convergence_pct']}",
                (b.get_width(), b.get_y() + b.get_height() / 2),
                va="center",
                fontsize=8,
            )
        ax_m.invert_yaxis()
        ax_m.set_xlabel("peak memory (MiB)")
        ax_m.set_title(f"{model}: peak memory, speed vs fp32, convergence")
        if mem:
            ax_m.set_xlim(0, max(mem) * 1.9)
    loaded = title.startswith("UNDER LOAD")
    fig.suptitle(title, fontsize=11 if loaded else 10, color="firebrick" if loaded else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Title": title, "Description": note})
    plt.close(fig)
