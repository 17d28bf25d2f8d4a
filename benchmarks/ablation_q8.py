"""Ablation of the q8 moment format (issue 22): which 8-bit code keeps Adam's direction, and does it show in the loss?

Every variant trains the convergence study's model on its corpus (``benchmarks/convergence_q8.py``:
the same TinyGPT, batches, schedule, validation and seeds; its harness is imported, not copied)
with one optimizer, ``fastamp.optim.AdamW(master_weights="remainder")``: bf16 params with an exact
fp32 master and fp32 moments. After every step, on the tensors the q8 format covers (numel >=
:data:`LOWBIT_MIN_NUMEL`, as ``AdamW(state_format="q8")``; the others keep fp32 moments in every
variant), the variant replaces ``m`` and ``v`` by ``dequant(quant(.))``. Only the code differs
between variants; the update maths, the master and everything else are the same.

``fp32``        no requantisation: the reference
``default``     the q8 format as shipped (:mod:`fastamp.reference.q8`): blocks of 32, one E8M0 scale
                byte each, m as signed E3M4 and ``sqrt(v)`` as unsigned E3M5 float codes, stochastic
                rounding with the optimizer's random bits. Bit for bit
                ``AdamW(master_weights="remainder", state_format="q8")`` (the convergence study's
                ``remainder-q8``; tests/spec/test_adamw_q8.py and this script's smoke test check it)
``nearest``     the same codes rounded to nearest even (``state_rounding="nearest"``)
``block64``     the default over blocks of 64 (``block=64`` of the reference codec): 1.016 B per moment
                element instead of 1.031
``flashoptim``  FlashOptim's scheme (reference-only reimplementation, :func:`flash_quantise`), as its
                source describes it (databricks/flashoptim 8b2d966, ``flashoptim/optimizers.py``:
                ``quantize`` and the Adam kernel; read for the facts, no code taken): groups of 32,
                each normalised by its fp32 absmax (at least 1e-12), which is stored as fp16; m
                companded by softsign ``2x / (1 + |x|)`` into int8 ``floor(127 y + 0.5)``; v as
                ``sqrt(v)``, linear uint8 ``floor(255 y + 0.5)``; decode ``y / (2 - |y|)`` times
                the fp16 scale (m) and ``(q / 255 * scale)^2`` (v). 1.0625 B per moment element

Measured per variant:

- **Direction error**: at every step, on each covered tensor, ``sum |u - u*| / sum |u*|`` with
  ``u = m_hat / (sqrt(v_hat) + eps)`` from the moments the step used (the variant's: updated from
  the dequantised ones, before they are quantised again) and ``u*`` from an fp32-exact shadow
  (fp64 ``m*``, ``v*`` updated with the same grads, never quantised); both with the step's bias
  corrections. Reported: mean, median, p99 and max over (step, tensor) pairs of all seeds, and the
  mean over the last 10% of steps. ``fp32``'s is the floor of fp32 arithmetic.
- **v lost**: the fraction of (step, element) pairs whose dequantised v is 0 while the shadow's is
  not (the next step then divides m by eps alone); the q8 codes never do this by construction.
- **Final validation loss** per seed, and the mean over seeds relative to ``default`` and ``fp32``.

Decision rule (the design's, shared/design/memory-formats.md M4, made robust to one seed and
tied to what a format is for): the default stands unless a variant beats its mean final
validation loss by more than :data:`DECIDE_TOL` (0.2%), is better than it in every seed, follows
AdamW at least as closely (direction error mean), never decodes a nonzero v to 0, and is
portable (integer-only, power-of-two scales: bit-identical on every backend). A lower loss from
a format that moves Adam's direction away from the fp32 shadow's (a second moment biased low
acts as a larger step) measures another optimizer, not a better code for AdamW's moments.
``--report-from results/ablation_q8-cpu.json`` rewrites a finished run's report with the
current rule (the numbers and the run's meta are kept; the regeneration is recorded).

Threads: the matmuls' results depend on the thread count, so the cross-check against the study
is bit-exact only when both ran with the same number of threads.

Size: the study's own run, 1,000 steps and 3 seeds. 1,000 steps because shorter runs are still
in the warmup-dominated phase where the formats' errors have not separated (at 100 steps
round-to-nearest's direction error is still climbing) and because the default's row is then
the study's ``remainder-q8`` run bit for bit (checked in the report's cross-check); 3 seeds
because the rule's 0.2% margin is about the seed-to-seed spread of paired differences in the
study (remainder-q8 vs baseline: -0.13% to +0.06%). Cost per step on the 2-core CPU: the model
~30 ms; the reference codec (integer maths in torch) adds ~40-55 ms CPU for the SR and nearest q8
variants, ~10 ms for FlashOptim's: about 13-17 minutes for the five variants on a quiet machine.

Writes ``results/ablation_q8-<tag>.{md,json}`` (tag ``cpu``, ``cpu-quick`` with ``--quick``).
Run the full ablation niced, after the convergence study (the cross-check reads its JSON):
``nice -n 10 python benchmarks/ablation_q8.py``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import convergence_q8 as study  # noqa: E402

import fastamp  # noqa: E402
from fastamp.reference import q8, sr_random16  # noqa: E402

LOWBIT_MIN_NUMEL = 4096  # AdamW's lowbit_min_numel default: the tensors q8 covers
DECIDE_TOL = 0.002
LATE_FRACTION = 0.1  # "late" = the last 10% of the steps
CURVE_POINTS = 50  # the whole-model direction error is kept at this many steps per run

BASE = study.Config(
    "remainder", torch.bfloat16, {"master_weights": "remainder"}, None,
    "bf16 params, int16 remainder masters (exact fp32 master), fp32 moments",
)  # fmt: skip

# Codec: (m, v, rand_m, rand_v) -> (m', v'), both fp32 dequant(quant(.)); rand_* are 16 random bits
# per element (the optimizer's streams 4 * id + 1 and + 2), None for a variant that rounds to nearest.
Codec = Callable[[Tensor, Tensor, "Tensor | None", "Tensor | None"], tuple[Tensor, Tensor]]


def _q8_codec(block: int) -> Codec:
    def codec(m: Tensor, v: Tensor, rand_m: Tensor | None, rand_v: Tensor | None) -> tuple[Tensor, Tensor]:
        cm, sm = q8.q8_encode_m(m, rand_m, block=block)
        cv, sv = q8.q8_encode_v(v, rand_v, block=block)
        return q8.q8_decode_m(cm, sm, block=block), q8.q8_decode_v(cv, sv, block=block)

    return codec


def flash_quantise(x: Tensor, signed: bool, group: int = 32) -> tuple[Tensor, Tensor]:
    """FlashOptim's 8-bit group code of ``x`` (fp32; for v pass ``sqrt(v)`` with ``signed=False``).

    Returns int8 (signed, softsign-companded) or uint8 (linear) codes shaped like ``x`` and one fp16
    scale per ``group`` elements of the flattened tensor. A reimplementation from the scheme's
    description (module doc), for the ablation only.
    """
    flat = x.detach().float().reshape(-1)
    n = flat.numel()
    ng = -(-n // group)
    groups = torch.nn.functional.pad(flat, (0, ng * group - n)).view(ng, group)
    # normalised by the fp32 absmax; the stored (and decoding) scale is its fp16 rounding
    absmax = groups.abs().amax(dim=1).clamp_min(1e-12)
    y = groups / absmax[:, None]
    if signed:
        codes = torch.floor(2.0 * y / (1.0 + y.abs()) * 127.0 + 0.5).to(torch.int8)
    else:
        codes = torch.floor(y * 255.0 + 0.5).to(torch.uint8)
    return codes.reshape(-1)[:n].reshape(x.shape), absmax.to(torch.float16)


def flash_dequantise(codes: Tensor, scales: Tensor, signed: bool, group: int = 32) -> Tensor:
    """The inverse map of :func:`flash_quantise` (fp32): the signed codes un-companded, times the fp16 scale."""
    n = codes.numel()
    q = torch.nn.functional.pad(codes.reshape(-1).float(), (0, scales.numel() * group - n)).view(-1, group)
    if signed:
        y = q / 127.0
        y = y / (2.0 - y.abs())
    else:
        y = q / 255.0
    return (y * scales.float()[:, None]).reshape(-1)[:n].reshape(codes.shape)


def _flash_codec(m: Tensor, v: Tensor, rand_m: Tensor | None, rand_v: Tensor | None) -> tuple[Tensor, Tensor]:
    cm, sm = flash_quantise(m, signed=True)
    cw, sw = flash_quantise(torch.sqrt(v), signed=False)
    w = flash_dequantise(cw, sw, signed=False)
    return flash_dequantise(cm, sm, signed=True), w * w


@dataclass(frozen=True)
class Variant:
    name: str
    codec: Codec | None  # None: no requantisation
    stochastic: bool  # the codec takes random bits
    bytes_per_element: float  # of one moment, codes + scales
    description: str
    # integer-only quantisation with power-of-two scales: the same bits on every backend, the
    # project's exactness guarantee (a candidate default must keep it)
    portable: bool = True


VARIANTS = (
    Variant("fp32", None, False, 4.0, "fp32 moments, never quantised (the reference)"),
    Variant("default", _q8_codec(32), True, 1 + 1 / 32,
            "q8 as shipped: block 32, E8M0 scale byte, m E3M4 / sqrt(v) E3M5, stochastic rounding"),
    Variant("nearest", _q8_codec(32), False, 1 + 1 / 32, "q8, block 32, codes rounded to nearest even"),
    Variant("block64", _q8_codec(64), True, 1 + 1 / 64, "q8 over blocks of 64, stochastic rounding"),
    Variant("flashoptim", _flash_codec, False, 1 + 2 / 32,
            "FlashOptim: fp16 absmax scale per 32, m softsign int8, sqrt(v) linear uint8, round half up",
            portable=False),
)  # fmt: skip
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}


class Requantiser:
    """The ``after_step`` hook of one run: measures the direction error, then requantises m and v.

    Called after each optimizer step (the grads still in place). The random bits are the
    optimizer's own for ``state_format="q8"``: seed ``seed``, counter = the number of steps
    before this one (no step is skipped here), streams ``4 * id + 1`` (m) and ``+ 2`` (v) with
    ``id`` the param's index among the optimizer's bf16 params.
    """

    def __init__(self, variant: Variant, seed: int) -> None:
        self.variant, self.seed = variant, seed
        self.opt: fastamp.optim.AdamW | None = None
        self.covered: list[tuple[Tensor, int]] = []  # (param, rng id)
        self.shadow: dict[int, tuple[Tensor, Tensor]] = {}
        self.errors: list[list[float]] = []  # [step][covered tensor]
        self.whole: list[float] = []  # per step: one ratio over every covered element
        self.v_lost = 0
        self.v_count = 0

    def _start(self, opt: fastamp.optim.AdamW) -> None:
        self.opt = opt
        bf16 = 0
        for group in opt.param_groups:
            for p in group["params"]:
                if p.dtype == torch.bfloat16:
                    if p.numel() >= LOWBIT_MIN_NUMEL:
                        self.covered.append((p, bf16))
                    bf16 += 1
                elif p.numel() >= LOWBIT_MIN_NUMEL:
                    raise SystemExit(f"ablation_q8: a {p.dtype} param of {p.numel()} elements: the model is bf16 only")
        zeros = [torch.zeros(p.shape, dtype=torch.float64) for p, _ in self.covered]
        self.shadow = {id(p): (z, z.clone()) for (p, _), z in zip(self.covered, zeros)}

    @torch.no_grad()
    def __call__(self, step: int, opt: fastamp.optim.AdamW) -> None:
        if self.opt is None:
            self._start(opt)
        group = opt.param_groups[0]
        b1, b2 = group["betas"]
        eps = group["eps"]
        t = step + 1
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        errs: list[float] = []
        num = den = 0.0
        for p, rid in self.covered:
            st = opt.state[p]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            g = p.grad.double()
            ms, vs = self.shadow[id(p)]
            ms.mul_(b1).add_(g, alpha=1.0 - b1)
            vs.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            u = (m.double() / bc1) / ((v.double() / bc2).sqrt() + eps)
            us = (ms / bc1) / ((vs / bc2).sqrt() + eps)
            d, r = float((u - us).abs().sum()), float(us.abs().sum())
            errs.append(d / r if r > 0 else 0.0)
            num, den = num + d, den + r
            codec = self.variant.codec
            if codec is None:
                continue
            n = p.numel()
            rand_m = rand_v = None
            if self.variant.stochastic:
                counter = torch.tensor(step)
                rand_m = sr_random16(self.seed, counter, 4 * rid + 1, n, p.device)
                rand_v = sr_random16(self.seed, counter, 4 * rid + 2, n, p.device)
            m2, v2 = codec(m, v, rand_m, rand_v)
            self.v_lost += int(((v2 == 0) & (vs > 0)).sum())
            self.v_count += n
            m.copy_(m2)
            v.copy_(v2)
        self.errors.append(errs)
        self.whole.append(num / den if den > 0 else 0.0)


@dataclass
class VariantRun:
    variant: str
    seed: int
    result: study.RunResult
    errors: list[list[float]] = field(default_factory=list)
    whole: list[float] = field(default_factory=list)
    v_lost: int = 0
    v_count: int = 0
    covered: list[list[int]] = field(default_factory=list)  # shapes


def run_variant(
    variant: Variant, seed: int, data: study.Batches, steps: int, lr: float, weight_decay: float, n_evals: int
) -> tuple[VariantRun, Requantiser]:
    hook = Requantiser(variant, seed)
    res = study.train(BASE, seed, data, steps, lr, weight_decay, n_evals, after_step=hook)
    covered = [list(p.shape) for p, _ in hook.covered]
    run = VariantRun(variant.name, seed, res, hook.errors, hook.whole, hook.v_lost, hook.v_count, covered)
    return run, hook


# ---------------------------------------------------------------------------------------------
# Summaries, decision, report


def _quantile(xs: list[float], q: float) -> float:
    return float(torch.quantile(torch.tensor(xs, dtype=torch.float64), q))


def summarise(runs: dict[str, list[VariantRun]], steps: int) -> dict[str, dict[str, Any]]:
    late0 = steps - max(1, round(LATE_FRACTION * steps))
    ref = {r.seed: r.result.final_val for r in runs.get("fp32", [])}
    dflt = {r.seed: r.result.final_val for r in runs.get("default", [])}
    out: dict[str, dict[str, Any]] = {}
    for v in VARIANTS:
        rs = runs.get(v.name)
        if not rs:
            continue
        pairs = [e for r in rs for row in r.errors for e in row]
        late = [e for r in rs for row in r.errors[late0:] for e in row]
        finals = [r.result.final_val for r in rs]
        mean = study._mean(finals)
        every = max(1, steps // CURVE_POINTS)
        row: dict[str, Any] = {
            "description": v.description,
            "bytes_per_moment_element": v.bytes_per_element,
            "dir_err_mean": study._mean(pairs),
            "dir_err_p50": _quantile(pairs, 0.5),
            "dir_err_p99": _quantile(pairs, 0.99),
            "dir_err_max": max(pairs),
            "dir_err_late_mean": study._mean(late),
            "dir_err_per_tensor_mean": [
                study._mean([r.errors[s][i] for r in rs for s in range(len(r.errors))])
                for i in range(len(rs[0].covered))
            ],
            "dir_err_whole_curve": [
                (s + 1, study._mean([r.whole[s] for r in rs])) for s in range(0, len(rs[0].whole), every)
            ],
            "v_lost_fraction": sum(r.v_lost for r in rs) / max(1, sum(r.v_count for r in rs)),
            "seeds": [r.seed for r in rs],
            "final_val": finals,
            "mean": mean,
            "val_curves": [r.result.val_curve for r in rs],
            "train_loss_last10_mean": [study._mean(r.result.train_losses[-10:]) for r in rs],
            "nonfinite_train_losses": [sum(1 for x in r.result.train_losses if not math.isfinite(x)) for r in rs],
            "seconds": [round(r.result.seconds, 1) for r in rs],
            "covered_tensors": rs[0].covered,
            "covered_params": sum(math.prod(c) for c in rs[0].covered),
            "n_params": rs[0].result.n_params,
        }
        for name, by_seed in (("fp32", ref), ("default", dflt)):
            if by_seed and all(r.seed in by_seed for r in rs):
                row[f"vs_{name}"] = mean / study._mean([by_seed[r.seed] for r in rs]) - 1.0
                row[f"vs_{name}_per_seed"] = [r.result.final_val / by_seed[r.seed] - 1.0 for r in rs]
        out[v.name] = row
    return out


def decide(rows: dict[str, dict[str, Any]], steps: int, seeds: list[int], quick: bool) -> str:
    """The decision, in words, from the numbers.

    The default stands unless a variant (1) beats its mean final val loss by more than
    DECIDE_TOL and is better in every seed (so one seed's noise cannot change the default),
    (2) follows AdamW at least as closely (a direction error mean not above the default's: a
    format that trains to a lower loss by moving Adam's direction away from the fp32 shadow's,
    such as a second moment biased low that acts as a larger step, is another optimizer, not a
    better code for this one), (3) never decodes a nonzero v to 0 (the design's requirement:
    a zero v makes the next step m / eps), and (4) is portable (integer-only quantisation with
    power-of-two scales: the same bits on every backend).
    """

    def pct(x: float) -> str:
        return f"{x * 100:+.2f}%"

    d = rows.get("default")
    if d is None or "vs_default" not in d:
        return "Decision: none (the default did not run)."
    others = [n for n in rows if n not in ("fp32", "default") and "vs_default" in rows[n]]
    beats_mean = [n for n in others if rows[n]["vs_default"] < -DECIDE_TOL]
    better = [n for n in beats_mean if all(x < 0 for x in rows[n]["vs_default_per_seed"])]

    def failed(n: str) -> list[str]:
        r, why = rows[n], []
        if r["dir_err_mean"] > d["dir_err_mean"]:
            why.append(
                f"its direction error mean is {r['dir_err_mean'] / d['dir_err_mean']:.2f}x the default's "
                f"({r['dir_err_mean']:.4f} vs {d['dir_err_mean']:.4f}): it follows AdamW less closely, so its val "
                "loss measures another optimizer (e.g. a second moment biased low acts as a larger step), not a "
                "better code"
            )
        if r["v_lost_fraction"] > 0:
            why.append(f"it decodes a nonzero v to 0 ({r['v_lost_fraction'] * 100:.2g}% of (step, element) pairs)")
        portable = VARIANT_BY_NAME[n].portable if n in VARIANT_BY_NAME else True
        if not portable:
            why.append("it is not portable (float scales or float companding: no bit-exactness across backends)")
        return why

    eligible = [n for n in better if not failed(n)]
    parts = []
    if quick:
        parts.append("(--quick: a smoke run of the machinery; these numbers decide nothing.)")
    if eligible:
        best = min(eligible, key=lambda n: rows[n]["vs_default"])
        parts.append(
            f"Decision: change the default to {best}: its mean final val loss is {pct(rows[best]['vs_default'])} vs the "
            f"default's, it is better in every seed, follows AdamW at least as closely (direction error), loses no v "
            f"and is portable (rule: a variant that beats it by more than {DECIDE_TOL * 100:.1f}% in the mean and in "
            "no seed is worse, under those conditions, replaces it)."
        )
    else:
        parts.append(
            f"Decision: keep the default (q8, block 32, stochastic rounding): no variant beats its mean final val loss "
            f"by more than {DECIDE_TOL * 100:.1f}% in every seed while following AdamW at least as closely, losing no v "
            f"and staying portable ({steps} steps, {len(seeds)} seeds)."
        )
    for n in better:
        if n not in eligible:
            parts.append(
                f"{n} has a lower val loss ({pct(rows[n]['vs_default'])} vs the default, better in every seed) but is "
                f"not adopted: {'; '.join(failed(n))}."
            )
    for n in beats_mean:
        if n not in better:
            parts.append(
                f"{n} beats the default's mean by {pct(-rows[n]['vs_default'])[1:]} but not in every seed "
                f"({', '.join(pct(x) for x in rows[n]['vs_default_per_seed'])}): seed noise, not a reason to change."
            )
    if "vs_fp32" in d:
        parts.append(
            f"The default is {pct(d['vs_fp32'])} vs fp32 moments (per seed "
            f"{', '.join(pct(x) for x in d['vs_fp32_per_seed'])})."
        )
    for n in others:
        r = rows[n]
        ratio = r["dir_err_mean"] / d["dir_err_mean"] if d["dir_err_mean"] > 0 else float("inf")
        parts.append(
            f"{n}: val {pct(r['vs_default'])} vs the default (per seed {', '.join(pct(x) for x in r['vs_default_per_seed'])}), "
            f"direction error mean {r['dir_err_mean']:.4f} ({ratio:.2f}x the default's {d['dir_err_mean']:.4f}), "
            f"p99 {r['dir_err_p99']:.4f} (default {d['dir_err_p99']:.4f}), v lost {r['v_lost_fraction'] * 100:.3f}% of "
            f"elements, {r['bytes_per_moment_element']:.4f} B per moment element."
        )
    within = [n for n in others if abs(rows[n]["vs_default"]) <= DECIDE_TOL]
    worse = [n for n in others if rows[n]["vs_default"] > DECIDE_TOL]
    if within:
        parts.append(f"Within +-{DECIDE_TOL * 100:.1f}% of the default's val loss: {', '.join(within)}.")
    if worse:
        parts.append(f"Worse than the default by more than {DECIDE_TOL * 100:.1f}%: {', '.join(worse)}.")
    sharper = [n for n in others if n not in beats_mean and rows[n]["dir_err_mean"] < d["dir_err_mean"]]
    if sharper:
        parts.append(
            f"A lower direction error than the default's without a val loss better by more than "
            f"{DECIDE_TOL * 100:.1f}%: {', '.join(sharper)} (on this model the error it removes does not show in "
            "the loss beyond the rule's margin)."
        )
    return " ".join(parts)


def cross_check(rows: dict[str, dict[str, Any]], meta: dict[str, Any], path: str) -> str | None:
    """The default's final val losses against the convergence study's remainder-q8 (the same run, bit for bit)."""
    if "default" not in rows or not os.path.isfile(path):
        return None
    with open(path) as f:
        other = json.load(f)
    om = other.get("meta", {})
    same = om.get("bf16_model") == meta["model"] and all(
        om.get(k) == meta[k] for k in ("steps", "lr", "weight_decay", "corpus_sha256")
    )
    rq = other.get("configs", {}).get("remainder-q8")
    if not same or rq is None:
        return f"not comparable with {os.path.basename(path)} (another model, schedule or corpus)"
    theirs = dict(zip(rq["seeds"], rq["final_val"]))
    mine = dict(zip(rows["default"]["seeds"], rows["default"]["final_val"]))
    common_seeds = sorted(set(theirs) & set(mine))
    if not common_seeds:
        return f"no seed in common with {os.path.basename(path)}"
    equal = all(theirs[s] == mine[s] for s in common_seeds)
    text = (
        f"the default's final val loss per seed {[mine[s] for s in common_seeds]} vs remainder-q8 in "
        f"{os.path.basename(path)} (commit {om.get('git_commit')}): {'equal' if equal else 'DIFFERENT'} "
        f"for seeds {common_seeds}"
    )
    here, there = meta.get("machine", {}).get("cpu"), om.get("machine", {}).get("cpu")
    if here != there:
        text += (
            f"; the runs differ in machine or thread count ({here!r} vs {there!r}): the matmuls' bits depend on "
            "the thread count, so only equal settings are expected to agree bit for bit"
        )
    return text


def write_report(path_stem: str, payload: dict[str, Any]) -> None:
    """The Markdown report (``write_outputs`` writes the JSON)."""
    meta, rows = payload["meta"], payload["variants"]
    table = []
    for name, r in rows.items():
        row: dict[str, object] = {"variant": name, "B/moment elem": f"{r['bytes_per_moment_element']:.4f}"}
        row["dir. err mean"] = f"{r['dir_err_mean']:.4f}"
        row["p50"] = f"{r['dir_err_p50']:.4f}"
        row["p99"] = f"{r['dir_err_p99']:.4f}"
        row["max"] = f"{r['dir_err_max']:.4f}"
        row["late mean"] = f"{r['dir_err_late_mean']:.4f}"
        row["v lost"] = f"{r['v_lost_fraction'] * 100:.2g}%"
        for s, v in zip(r["seeds"], r["final_val"]):
            row[f"val seed {s}"] = f"{v:.4f}"
        row["val mean"] = f"{r['mean']:.4f}"
        row["vs default"] = f"{r['vs_default'] * 100:+.2f}%" if "vs_default" in r else "-"
        row["vs fp32"] = f"{r['vs_fp32'] * 100:+.2f}%" if "vs_fp32" in r else "-"
        row["s/run"] = f"{study._mean(r['seconds']):.0f}"
        table.append(row)
    cols = [(k, k) for k in table[0]] if table else []
    first = next(iter(rows.values()), None)
    lines = [
        "# ablation_q8: the q8 moment format vs round-to-nearest, block 64 and FlashOptim's scheme (issue 22)",
        "",
        *common.header_lines(meta["machine"]),
        "",
        *study.setup_lines(meta),
        f"- model: TinyGPT {meta['model']}, {meta['n_params']} params; optimizer fastamp.optim.AdamW("
        "master_weights='remainder') (exact fp32 master, fp32 moments); after every step each variant replaces m "
        "and v by dequant(quant(.)) on the tensors q8 covers (numel >= 4096)"
        + (
            f": {len(first['covered_tensors'])} tensors, {first['covered_params']} params "
            f"({first['covered_params'] / first['n_params'] * 100:.1f}%)"
            if first
            else ""
        ),
        "- direction error: per step and covered tensor, sum|u - u*| / sum|u*|, u = m_hat / (sqrt(v_hat) + eps) "
        "from the moments the step used, u* from an fp64 shadow fed the same grads; mean / p50 / p99 / max over "
        f"(step, tensor) pairs of all seeds; late mean: the last {LATE_FRACTION * 100:.0f}% of steps",
        "- v lost: share of (step, element) pairs whose dequantised v is 0 while the shadow's is not",
        f"- decision rule: the default stands unless a variant's mean final val loss beats it by more than "
        f"{DECIDE_TOL * 100:.1f}% and the variant is better in every seed (shared/design/memory-formats.md, M4), "
        "and it also follows AdamW at least as closely (direction error mean), never decodes a nonzero v to 0 and "
        "is portable (integer-only, power-of-two scales); the conditions after the design's are ours: one seed's "
        "noise must not change a default, and a format is a code for AdamW's moments, not a new optimizer",
        f"- wall time of the ablation: {meta['wall_s']:.0f} s",
        *(
            [f"- report text regenerated from the run's JSON (`--report-from`): {meta['report_regenerated']}"]
            if meta.get("report_regenerated")
            else []
        ),
        "",
        "## Variants",
        "",
        *[f"- {v.name}: {v.description}" for v in VARIANTS if v.name in rows],
        "",
        "## Results",
        "",
        common.markdown_table(table, cols, cell=str),
        "",
        "## Decision",
        "",
        payload["decision"],
        "",
    ]
    if payload.get("cross_check"):
        lines += ["## Cross-check", "", f"- {payload['cross_check']}", ""]
    curve_rows = []
    for name, r in rows.items():
        pts = r["dir_err_whole_curve"]
        pick = pts[:: max(1, len(pts) // 8)]
        curve_rows.append({"variant": name, **{f"step {s}": f"{e:.4f}" for s, e in pick}})
    if curve_rows:
        lines += [
            "## Direction error of the whole model during training (mean over seeds)",
            "",
            common.markdown_table(curve_rows, [(k, k) for k in curve_rows[0]], cell=str),
            "",
        ]
    with open(path_stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def report_from(path: str) -> dict[str, Any]:
    """Rewrite a finished run's report (``<stem>.json`` -> ``.md`` and ``.json``) with this code's decision
    rule and cross-check; the numbers and the run's meta (its commit, machine, date) are kept as measured,
    and ``meta["report_regenerated"]`` records when and at which commit the text was regenerated."""
    with open(path) as f:
        payload = json.load(f)
    meta, rows = payload["meta"], payload["variants"]
    seeds = next(iter(rows.values()))["seeds"] if rows else []
    payload["decision"] = decide(rows, meta["steps"], seeds, bool(meta.get("quick")))
    stem = path[: -len(".json")] if path.endswith(".json") else path
    payload["cross_check"] = cross_check(rows, meta, os.path.join(os.path.dirname(stem), "convergence_q8-cpu.json"))
    info = common.machine_info(torch.device("cpu"))
    meta["report_regenerated"] = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at commit {info.get('git_commit')}"
    )
    with open(stem + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    write_report(stem, payload)
    common.log(payload["decision"])
    return payload


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--report-from"]:
        if len(args) != 2:
            raise SystemExit("--report-from JSON: rewrite that run's report with this code's decision rule")
        return report_from(args[1])
    rs = study.parse_run_args(argv, __doc__, "variants", list(VARIANT_BY_NAME), 20, (4, 1))
    spec = study.QUICK_MODEL if rs.quick else study.BF16_MODEL
    n_val = study.QUICK_VAL_WINDOWS if rs.quick else study.VAL_WINDOWS

    info = common.machine_info(torch.device("cpu"))
    t_start = time.perf_counter()
    corpus = study.Corpus()
    data = study.Batches(corpus, spec, n_val)
    runs: dict[str, list[VariantRun]] = {}
    for seed in rs.seeds:
        for name in rs.names:
            run, _ = run_variant(VARIANT_BY_NAME[name], seed, data, rs.steps, rs.lr, rs.weight_decay, rs.n_evals)
            runs.setdefault(name, []).append(run)
            common.log(
                f"[ablation_q8] {name} seed {seed}: final val {run.result.final_val:.4f}, direction error mean "
                f"{study._mean([e for row in run.errors for e in row]):.4f} in {run.result.seconds:.0f} s"
            )
    wall = time.perf_counter() - t_start
    rows = summarise(runs, rs.steps)
    meta = study.run_meta(info, corpus, rs, n_val, wall)
    meta.update(
        model=spec.__dict__,
        n_params=next(iter(runs.values()))[0].result.n_params,
        lowbit_min_numel=LOWBIT_MIN_NUMEL,
        decide_tol=DECIDE_TOL,
    )
    payload = {
        "meta": meta,
        "variants": rows,
        "decision": decide(rows, rs.steps, rs.seeds, rs.quick),
        "cross_check": cross_check(rows, meta, os.path.join(rs.out_dir, "convergence_q8-cpu.json")),
    }
    study.write_outputs(rs, "ablation_q8", payload, write_report)
    common.log(payload["decision"])
    return payload


if __name__ == "__main__":
    main()
