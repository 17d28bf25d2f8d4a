"""Convergence of AdamW's 8-bit formats on real text (issue 22): do q8 moments and ulp8 masters train as fp32 masters?

A character-level GPT (:class:`fastamp.compare.models.TinyGPT`) learns the docstrings of the
installed torch wheel (a fixed list of its Python sources, read with ``ast``; the corpus string is
checked by sha256, so every run trains on the same text), under bf16 autocast with
``fastamp.cast_model(model, torch.bfloat16)``, in these configurations:

``baseline``        fp32-master AdamW (``master_weights=True``, fp32 moments): the reference
``remainder-q8``    ``master_weights="remainder", state_format="q8"`` (exact master, 8-bit moments)
``sr-q8``           ``master_weights=False, stochastic_rounding=True, state_format="q8"`` (no master)
``ulp8-q8``         ``master_weights="ulp8", state_format="q8"`` (int8 master correction, 8-bit moments)
``pure-bf16``       ``master_weights=False``, round to nearest, fp32 moments: the negative control;
                    small updates are lost, and it must fail the criterion, else the study cannot
                    tell a loss of precision from none

and, on a smaller GPT (fp16 matmuls are slow on CPUs without AVX512-FP16), in fp16
(``cast_model(model, torch.float16)``, ``fastamp.Scaler``) with overflows injected
at fixed steps (the loss times 1e30: inf grads, a skipped step, a backoff):

``fastamp-fp16``    fp32 masters, fp32 moments: the fp16 twin
``fp16-q8``         fp32 masters, ``state_format="q8"``
``fp16-ulp8-q8``    ``master_weights="ulp8", state_format="q8"`` (fp16 param + int8 correction, no fp32 master)

Every configuration of a seed starts from the same init (``torch.manual_seed(seed)`` before the
model is built) and sees the same batches in the same order (a generator seeded by seed and
step); the q8, ulp8 and stochastic-rounding bits come from ``AdamW(seed=seed)``. Validation: fixed
windows of a fixed document-level split (every 10th docstring), the same for every seed and
configuration, evaluated in the model's own precision under autocast with the loss in fp32.

Criterion: a configuration passes when the mean over seeds of its final validation loss is
within +0.5% of its reference's (``baseline`` for the bf16 rows, ``fastamp-fp16`` for the fp16
ones) and every seed's within +1.0% of the same seed's reference. ``pure-bf16`` must fail it.

A run is judged on its own: ``--configs`` names the configurations to run, and the script adds
what their verdict needs, each one's reference and, whenever a configuration is judged, the
pure-bf16 negative control (and its reference), saying so in the log and the report. (The
committed ``convergence_q8-cpu-ulp8`` results predate this: their control ran in
``convergence_q8-cpu``, so their verdict reads "inconclusive".)

The ulp8 rows of those results ran ``adamw_q8_`` on the torch reference backend, before the
native CPU kernel had ulp8 masters: the same bits by the backend contract, but their wall time
per run says nothing about the kernels' speed.

``--optimizer lion`` runs the same study with ``fastamp.optim.Lion`` (betas (0.9, 0.99); Lion
wants a 3-10x smaller lr and a larger weight decay than AdamW: pass ``--lr`` / ``--weight-decay``)
on the rows Lion takes (no ulp8: that master is AdamW's), tag ``cpu-lion``.

Writes ``results/convergence_q8-<tag>.{md,json}`` (tag ``cpu``, ``cpu-quick`` with ``--quick``).
Run the full study niced: ``nice -n 10 python benchmarks/convergence_q8.py``.
"""

from __future__ import annotations

import argparse
import ast
import collections
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import fastamp  # noqa: E402
from fastamp.compare.models import TinyGPT  # noqa: E402

# The corpus: the docstrings (module, class, function; ``ast.get_docstring(clean=True)``) of these
# files of the torch package, in this order, joined by blank lines.
CORPUS_TORCH_VERSION = "2.13.0"
CORPUS_FILES = (
    *(
        f"nn/modules/{m}.py"
        for m in (
            "__init__", "_functions", "activation", "adaptive", "batchnorm", "channelshuffle", "container",
            "conv", "distance", "dropout", "flatten", "fold", "instancenorm", "lazy", "linear",
            "linear_cross_entropy", "linear_cross_entropy_options", "loss", "module", "normalization",
            "padding", "pixelshuffle", "pooling", "rnn", "sparse", "transformer", "upsampling", "utils",
        )
    ),
    "nn/functional.py",
    *(
        f"optim/{m}.py"
        for m in (
            "__init__", "_adafactor", "_functional", "_muon", "_stateless", "adadelta", "adagrad", "adam",
            "adamax", "adamw", "asgd", "lbfgs", "lr_scheduler", "nadam", "optimizer", "radam", "rmsprop",
            "rprop", "sgd", "sparse_adam", "swa_utils",
        )
    ),
)  # fmt: skip
CORPUS_SHA256 = "cbe9fa71f08d5c986ab6ac2bd8b7c6b3f6b9a86bf4dad7047edcb19d4e5b52be"
# characters seen fewer times than this in the corpus share one token
RARE_CHAR_COUNT = 20
# every VAL_EVERY-th docstring (in corpus order) is validation text
VAL_EVERY = 10
RARE = "\x00"

INJECT_FACTOR = 1e30
INJECT_AT = (0.1, 0.3, 0.5, 0.7, 0.9)  # fractions of the run: the steps whose loss is multiplied
MEAN_TOL = 0.005
SEED_TOL = 0.010


@dataclass(frozen=True)
class ModelSpec:
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    batch: int


# bf16 rows: 365k params, every weight matrix >= 4096 elements (so q8 covers ~99% of the params).
BF16_MODEL = ModelSpec(n_layer=3, d_model=96, n_head=4, seq_len=128, batch=16)
# fp16 rows: fp16 matmuls run ~25x slower than bf16 ones on this CPU (no AVX512-FP16; measured:
# 1.1 s vs 40 ms per step of a 2x128 model), so a smaller GPT; its weights are still >= 4096 elements.
FP16_MODEL = ModelSpec(n_layer=2, d_model=64, n_head=4, seq_len=32, batch=16)
QUICK_MODEL = ModelSpec(n_layer=1, d_model=64, n_head=4, seq_len=32, batch=8)
VAL_WINDOWS = 256
QUICK_VAL_WINDOWS = 32


@dataclass(frozen=True)
class Config:
    name: str
    dtype: torch.dtype
    kwargs: dict[str, Any]
    reference: str | None  # the config it is judged against; None for a reference itself
    description: str
    control: bool = False  # must FAIL the criterion


CONFIGS = (
    Config("baseline", torch.bfloat16, {"master_weights": True}, None,
           "bf16 params, fp32 masters, fp32 moments (fastamp.optim.AdamW default)"),
    Config("remainder-q8", torch.bfloat16, {"master_weights": "remainder", "state_format": "q8"}, "baseline",
           "bf16 params, int16 remainder masters (exact), q8 moments"),
    Config("sr-q8", torch.bfloat16,
           {"master_weights": False, "stochastic_rounding": True, "state_format": "q8"}, "baseline",
           "bf16 params, no master, stochastic rounding, q8 moments"),
    Config("ulp8-q8", torch.bfloat16, {"master_weights": "ulp8", "state_format": "q8"}, "baseline",
           "bf16 params, int8 ulp8 master corrections (stochastic), q8 moments"),
    Config("pure-bf16", torch.bfloat16, {"master_weights": False}, "baseline",
           "bf16 params, no master, round to nearest, fp32 moments (negative control: must fail)", control=True),
    Config("fastamp-fp16", torch.float16, {"master_weights": True}, None,
           "fp16 params, fp32 masters, fp32 moments, fastamp.Scaler, injected overflows (the fp16 twin)"),
    Config("fp16-q8", torch.float16, {"master_weights": True, "state_format": "q8"}, "fastamp-fp16",
           "fp16 params, fp32 masters, q8 moments, fastamp.Scaler, injected overflows"),
    Config("fp16-ulp8-q8", torch.float16, {"master_weights": "ulp8", "state_format": "q8"}, "fastamp-fp16",
           "fp16 params, int8 ulp8 master corrections (stochastic), q8 moments, fastamp.Scaler, injected overflows"),
)  # fmt: skip
CONFIG_BY_NAME = {c.name: c for c in CONFIGS}
CONTROL = next(c.name for c in CONFIGS if c.control)


def with_verdict_configs(names: list[str], unsupported: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """``names`` and what their verdict needs, in :data:`CONFIGS` order; and the added ones.

    Each config's reference, and the negative control (with its reference) whenever a config is
    judged: without the control the verdict cannot say whether the study could see a loss of
    precision at all. Configs in ``unsupported`` (the optimizer's) are neither kept nor added.
    """
    names = [n for n in names if n not in unsupported]
    need = set(names)
    if any(CONFIG_BY_NAME[n].reference is not None for n in names):
        need.add(CONTROL)
    need |= {CONFIG_BY_NAME[n].reference for n in need if CONFIG_BY_NAME[n].reference is not None}
    ordered = [c.name for c in CONFIGS if c.name in need and c.name not in unsupported]
    return ordered, [n for n in ordered if n not in names]


# --optimizer: the class, its name in the report, its fixed hyperparameters (report text), and
# the configs it cannot run
OPTIMIZERS = {
    "adamw": ("AdamW", "betas (0.9, 0.999), eps 1e-8", ()),
    "lion": ("Lion", "betas (0.9, 0.99)", ("ulp8-q8", "fp16-ulp8-q8")),
}


# ---------------------------------------------------------------------------------------------
# Corpus and data


def corpus_docs() -> list[str]:
    """The docstrings of :data:`CORPUS_FILES` of the installed torch, in order."""
    root = os.path.dirname(torch.__file__)
    docs: list[str] = []
    for rel in CORPUS_FILES:
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            raise SystemExit(
                f"convergence_q8: corpus file torch/{rel} is missing; the corpus is defined on torch=="
                f"{CORPUS_TORCH_VERSION} (installed: {torch.__version__} at {root})"
            )
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    docs.append(doc)
    return docs


def check_corpus(text: str, expected: str = CORPUS_SHA256) -> str:
    """The corpus's sha256; SystemExit naming the torch version it expects when it differs."""
    got = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if got != expected:
        raise SystemExit(
            f"convergence_q8: the corpus (docstrings of {len(CORPUS_FILES)} torch source files, {len(text)} chars) "
            f"has sha256 {got}, expected {expected}: it is defined on torch=={CORPUS_TORCH_VERSION} "
            f"(installed: torch {torch.__version__}, Python {sys.version.split()[0]}). Install torch=="
            f"{CORPUS_TORCH_VERSION} to reproduce the study; results on another corpus are not comparable."
        )
    return got


class Corpus:
    """The checked corpus, its character vocabulary and its fixed train / validation split."""

    def __init__(self) -> None:
        docs = corpus_docs()
        self.text = "\n\n".join(docs)
        self.sha256 = check_corpus(self.text)
        counts = collections.Counter(self.text)
        kept = sorted(c for c, n in counts.items() if n >= RARE_CHAR_COUNT)
        self.rare_chars = sorted(c for c, n in counts.items() if n < RARE_CHAR_COUNT)
        self.vocab = [RARE] + kept
        stoi = {c: i for i, c in enumerate(self.vocab)}

        def encode(parts: list[str]) -> torch.Tensor:
            s = "\n\n".join(parts)
            return torch.tensor([stoi.get(c, 0) for c in s], dtype=torch.long)

        self.train = encode([d for i, d in enumerate(docs) if i % VAL_EVERY != VAL_EVERY - 1])
        self.val = encode([d for i, d in enumerate(docs) if i % VAL_EVERY == VAL_EVERY - 1])
        self.n_docs = len(docs)


class Batches:
    """Train batches drawn by (seed, step), and fixed validation windows, for one model size."""

    def __init__(self, corpus: Corpus, spec: ModelSpec, n_val_windows: int) -> None:
        self.corpus, self.spec = corpus, spec
        t = spec.seq_len + 1
        n_windows = len(corpus.val) // t
        if n_windows < n_val_windows:
            raise SystemExit(
                f"convergence_q8: the validation text holds {n_windows} windows of {t}, need {n_val_windows}"
            )
        stride = n_windows // n_val_windows
        starts = torch.arange(n_val_windows) * stride * t
        self.val_rows = corpus.val[starts[:, None] + torch.arange(t)[None, :]]

    def train_batch(self, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        t = self.spec.seq_len + 1
        idx = torch.randint(0, len(self.corpus.train) - t, (self.spec.batch,), generator=gen)
        rows = self.corpus.train[idx[:, None] + torch.arange(t)[None, :]]
        return rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------------------------------------
# Training


def lr_at(step: int, steps: int, base_lr: float) -> float:
    """Linear warmup over 5% of the steps, then cosine decay to 10% of ``base_lr`` (as fastamp.compare)."""
    warm = max(1, steps // 20)
    if step < warm:
        return base_lr * (step + 1) / warm
    prog = (step - warm) / max(1, steps - warm)
    return base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


def inject_steps(steps: int) -> list[int]:
    return sorted({min(steps - 1, max(1, round(f * steps))) for f in INJECT_AT})


def eval_points(steps: int, n: int) -> list[int]:
    """Steps after which validation runs (0 = before the first step); always includes ``steps``."""
    return sorted({round(i * steps / n) for i in range(n + 1)})


@torch.no_grad()
def val_loss(model: torch.nn.Module, rows: torch.Tensor, dtype: torch.dtype, chunk: int = 64) -> float:
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(rows), chunk):
        r = rows[i : i + chunk]
        with torch.autocast("cpu", dtype=dtype):
            logits = model(r[:, :-1])
        loss = TinyGPT.loss(logits, r[:, 1:])  # fp32 cross entropy on the fp32-cast logits
        total += float(loss) * len(r)
        n += len(r)
    model.train()
    return total / n


@dataclass
class RunResult:
    config: str
    seed: int
    final_val: float = float("nan")
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    seconds: float = float("nan")
    n_params: int = 0
    q8_params: int = 0
    q8_tensors: int = 0
    ulp8_params: int = 0
    n_tensors: int = 0
    injected: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    final_scale: float | None = None


def train(
    cfg: Config,
    seed: int,
    data: Batches,
    steps: int,
    lr: float,
    weight_decay: float,
    n_evals: int,
    after_step: Callable[[int, fastamp.optim.AdamW], None] | None = None,
    optimizer: str = "adamw",
) -> RunResult:
    """One run of ``cfg`` with ``seed``; ``after_step(step, opt)`` runs after every optimizer step
    (the grads still in place), before the validation that follows it (the ablation's hook)."""
    spec = data.spec
    torch.manual_seed(seed)
    model = TinyGPT(len(data.corpus.vocab), spec.seq_len, spec.n_layer, spec.d_model, spec.n_head)
    fastamp.cast_model(model, cfg.dtype)
    opt_cls = getattr(fastamp.optim, OPTIMIZERS[optimizer][0])
    opt = opt_cls(model.parameters(), lr=lr, weight_decay=weight_decay, seed=seed, **cfg.kwargs)
    fp16 = cfg.dtype == torch.float16
    scaler = fastamp.Scaler("cpu", growth_interval=100) if fp16 else None
    res = RunResult(cfg.name, seed)
    res.injected = inject_steps(steps) if fp16 else []
    inject = set(res.injected)
    evals = set(eval_points(steps, n_evals))
    losses: list[torch.Tensor] = []
    counts: list[float] = []
    t0 = time.perf_counter()
    if 0 in evals:
        res.val_curve.append((0, val_loss(model, data.val_rows, cfg.dtype)))
    for step in range(steps):
        x, y = data.train_batch(seed, step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=cfg.dtype):
            loss = TinyGPT.loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss * INJECT_FACTOR if step in inject else loss).backward()
            before = scaler.get_scale() if optimizer != "adamw" else None
            scaler.step(opt)
            scaler.update()
            if before is None:
                counts.append(float(next(iter(opt.state.values()))["step"]))
            elif scaler.get_scale() < before:  # no step count (Lion): a skipped step backs the scale off
                res.skipped.append(step)
        else:
            loss.backward()
            opt.step()
        if after_step is not None:
            after_step(step, opt)
        losses.append(loss.detach().float())
        if step + 1 in evals:
            res.val_curve.append((step + 1, val_loss(model, data.val_rows, cfg.dtype)))
    res.seconds = time.perf_counter() - t0
    res.final_val = res.val_curve[-1][1]
    res.train_losses = torch.stack(losses).tolist()
    params = list(model.parameters())
    res.n_params = sum(p.numel() for p in params)
    res.n_tensors = len(params)
    q8 = [p for p in params if "exp_avg_q" in opt.state[p]]
    res.q8_params, res.q8_tensors = sum(p.numel() for p in q8), len(q8)
    res.ulp8_params = sum(p.numel() for p in params if "master_ulp8" in opt.state[p])
    if scaler is not None:
        if optimizer == "adamw":
            res.skipped = [i for i, c in enumerate(counts) if c == (counts[i - 1] if i else 0.0)]
        res.final_scale = float(scaler.get_scale())
    return res


# ---------------------------------------------------------------------------------------------
# Judging and reporting


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def judge(runs: dict[str, list[RunResult]]) -> dict[str, dict[str, Any]]:
    """Per config: losses per seed, mean, ratio to its reference, and the two tests of the criterion."""
    out: dict[str, dict[str, Any]] = {}
    for cfg in CONFIGS:
        if cfg.name not in runs:
            continue
        rs = runs[cfg.name]
        row: dict[str, Any] = {
            "description": cfg.description,
            "dtype": str(cfg.dtype).replace("torch.", ""),
            "optimizer_kwargs": {k: v for k, v in cfg.kwargs.items()},
            "reference": cfg.reference,
            "control": cfg.control,
            "seeds": [r.seed for r in rs],
            "final_val": [r.final_val for r in rs],
            "mean": _mean([r.final_val for r in rs]),
            "seconds": [round(r.seconds, 1) for r in rs],
            "n_params": rs[0].n_params,
            "q8_fraction": rs[0].q8_params / rs[0].n_params,
            "q8_tensors": f"{rs[0].q8_tensors}/{rs[0].n_tensors}",
            "ulp8_fraction": rs[0].ulp8_params / rs[0].n_params,
            "val_curves": [r.val_curve for r in rs],
            "train_loss_first": [r.train_losses[0] for r in rs],
            "train_loss_last10_mean": [_mean(r.train_losses[-10:]) for r in rs],
            "nonfinite_train_losses": [sum(1 for v in r.train_losses if not math.isfinite(v)) for r in rs],
        }
        if cfg.dtype == torch.float16:
            row["injected_overflow_steps"] = rs[0].injected
            row["skipped_steps"] = [r.skipped for r in rs]
            row["all_injected_skipped"] = all(set(r.injected) <= set(r.skipped) for r in rs)
            row["final_scale"] = [r.final_scale for r in rs]
        ref = runs.get(cfg.reference) if cfg.reference else None
        if ref is not None:
            by_seed = {r.seed: r.final_val for r in ref}
            seed_ratios = [r.final_val / by_seed[r.seed] for r in rs]
            ratio = row["mean"] / _mean([r.final_val for r in ref])
            row["ratio"] = ratio
            row["seed_ratios"] = seed_ratios
            row["pass_mean"] = ratio <= 1 + MEAN_TOL
            row["pass_seeds"] = all(x <= 1 + SEED_TOL for x in seed_ratios)
            row["pass"] = row["pass_mean"] and row["pass_seeds"]
            row["as_expected"] = row["pass"] != cfg.control
        out[cfg.name] = row
    return out


def verdict(
    rows: dict[str, dict[str, Any]], steps: int, seeds: list[int], quick: bool = False, name: str = "AdamW"
) -> str:
    def pct(r):
        return f"{(r['ratio'] - 1) * 100:+.2f}%"

    # the configurations on trial: every judged row but the control, in CONFIGS order
    q8 = [c.name for c in CONFIGS if not c.control and c.name in rows and "pass" in rows[c.name]]
    ctl = rows.get("pure-bf16")
    parts = []
    if ctl is None or "pass" not in ctl:
        parts.append("The negative control (pure-bf16) did not run, so the study's power is unknown.")
        valid = False
    elif ctl["pass"]:
        parts.append(
            f"The study is too weak: the negative control pure-bf16 passes the criterion ({pct(ctl)} vs baseline), "
            "so it cannot tell a loss of precision from none; lengthen the run or lower the lr."
        )
        valid = False
    else:
        worst = max(ctl["seed_ratios"])
        parts.append(
            f"The study can see a loss of precision: the negative control pure-bf16 fails the criterion "
            f"({pct(ctl)} mean vs baseline, worst seed {(worst - 1) * 100:+.2f}%)."
        )
        valid = True
    passed = [n for n in q8 if rows[n]["pass"]]
    failed = [n for n in q8 if not rows[n]["pass"]]
    if passed:
        parts.append(
            "Within the criterion (mean <= +0.5%, each seed <= +1.0% of its reference): "
            + ", ".join(
                f"{n} ({pct(rows[n])}, worst seed {(max(rows[n]['seed_ratios']) - 1) * 100:+.2f}%)" for n in passed
            )
            + "."
        )
    if failed:
        parts.append(
            "Outside the criterion: "
            + ", ".join(
                f"{n} ({pct(rows[n])} mean, worst seed {(max(rows[n]['seed_ratios']) - 1) * 100:+.2f}%; "
                f"mean {'pass' if rows[n]['pass_mean'] else 'FAIL'}, seeds {'pass' if rows[n]['pass_seeds'] else 'FAIL'})"
                for n in failed
            )
            + "."
        )
    fp16 = [n for n, r in rows.items() if "all_injected_skipped" in r]
    if fp16:
        missed = [n for n in fp16 if not rows[n]["all_injected_skipped"]]
        parts.append(
            f"fp16: every injected overflow was skipped by the scaler in every fp16 row ({', '.join(fp16)}): "
            + ("yes." if not missed else f"NO (not in {', '.join(missed)}).")
        )
    frac = next((rows[n]["q8_fraction"] for n in ("remainder-q8", "sr-q8", "ulp8-q8") if n in rows), None)
    if frac is not None:
        parts.append(f"q8 covered {frac * 100:.1f}% of the bf16 model's params.")
    ulp8 = [n for n in rows if rows[n]["ulp8_fraction"] > 0]
    if ulp8:
        parts.append(
            "ulp8 (int8) masters covered "
            + ", ".join(f"{rows[n]['ulp8_fraction'] * 100:.1f}% of {n}'s params" for n in ulp8)
            + "."
        )
    if valid and q8 and not failed:
        parts.insert(
            0,
            f"Verdict: on this study ({steps} steps, {len(seeds)} seeds), {name} with q8 moments (and with ulp8 "
            f"masters, where they ran) trains as well as fp32-master {name}.",
        )
    elif valid and failed:
        parts.insert(0, f"Verdict: on this study ({steps} steps, {len(seeds)} seeds), the 8-bit formats do NOT match "
                     f"fp32-master {name} in every configuration.")  # fmt: skip
    else:
        parts.insert(0, "Verdict: inconclusive.")
    if quick:
        parts.insert(0, "(--quick: a smoke run of the machinery, far too short for the criterion to mean anything.)")
    return " ".join(parts)


def _pf(v: Any) -> str:
    if v is None or v == "":
        return "-"
    return "PASS" if v else "FAIL"


def corpus_meta(corpus: Corpus) -> dict[str, Any]:
    """What a report says about the corpus (also the ablation's)."""
    return {
        "corpus_sha256": corpus.sha256,
        "corpus_torch_version": CORPUS_TORCH_VERSION,
        "corpus_files": len(CORPUS_FILES),
        "corpus_docs": corpus.n_docs,
        "corpus_chars": len(corpus.text),
        "train_chars": len(corpus.train),
        "val_chars": len(corpus.val),
        "vocab": len(corpus.vocab),
        "rare_chars": "".join(corpus.rare_chars),
    }


def setup_lines(meta: dict[str, Any]) -> list[str]:
    """The report lines on corpus, split, schedule and validation, from :func:`corpus_meta` plus
    ``steps``, ``seeds``, ``lr``, ``weight_decay`` and ``val_windows`` (also the ablation's)."""
    return [
        f"- corpus: docstrings of {meta['corpus_files']} files of torch=={CORPUS_TORCH_VERSION} "
        f"(torch/nn/modules/*, torch/nn/functional.py, torch/optim/*; list in benchmarks/convergence_q8.py), "
        f"{meta['corpus_chars']} chars, {meta['corpus_docs']} docstrings, sha256 `{meta['corpus_sha256']}` (checked)",
        f"- vocabulary {meta['vocab']} tokens (chars seen < {RARE_CHAR_COUNT} times share one: "
        f"{meta['rare_chars']!r}); split: every {VAL_EVERY}th docstring is validation: train {meta['train_chars']} "
        f"chars, val {meta['val_chars']} chars",
        f"- steps {meta['steps']}, seeds {meta['seeds']}, lr {meta['lr']:g} (warmup 5%, cosine to 10%), weight decay "
        f"{meta['weight_decay']:g}, {meta.get('optimizer_hyper', 'betas (0.9, 0.999), eps 1e-8')}, no clipping; "
        "bf16/fp16 autocast, "
        "fastamp.cast_model (LayerNorm fp32)",
        f"- validation: {meta['val_windows']} fixed windows of the val text (evenly spaced, the same for every run), "
        "model in its own precision under autocast, fp32 cross entropy",
    ]


def write_report(path_stem: str, payload: dict[str, Any]) -> None:
    """The Markdown report (``write_outputs`` writes the JSON)."""
    meta, rows = payload["meta"], payload["configs"]
    added = meta.get("added_for_verdict") or []
    added_lines = (
        [
            "- added to the configurations asked for, so that the verdict stands on this run alone: "
            f"{', '.join(added)} (each judged row's reference; the negative control)"
        ]
        if added
        else []
    )
    table = []
    for name, r in rows.items():
        row: dict[str, object] = {"config": name, "dtype": r["dtype"]}
        for s, v in zip(r["seeds"], r["final_val"]):
            row[f"seed {s}"] = f"{v:.4f}"
        row["mean"] = f"{r['mean']:.4f}"
        row["reference"] = r["reference"] or "-"
        row["ratio"] = f"{r['ratio']:.4f}" if "ratio" in r else "-"
        row["worst seed ratio"] = f"{max(r['seed_ratios']):.4f}" if "seed_ratios" in r else "-"
        row["mean <= +0.5%"] = _pf(r.get("pass_mean"))
        row["seeds <= +1.0%"] = _pf(r.get("pass_seeds"))
        row["criterion"] = _pf(r.get("pass")) + (" (control: must FAIL)" if r["control"] else "")
        row["q8 params"] = f"{r['q8_fraction'] * 100:.1f}%"
        row["ulp8 params"] = f"{r['ulp8_fraction'] * 100:.1f}%"
        row["s/run"] = f"{_mean(r['seconds']):.0f}"
        table.append(row)
    cols = [(k, k) for k in table[0]] if table else []
    lines = [
        f"# convergence_q8: {meta.get('optimizer', 'AdamW')}'s 8-bit formats (q8 moments, ulp8 masters) vs "
        f"fp32-master {meta.get('optimizer', 'AdamW')} on real text (issue 22)",
        "",
        *common.header_lines(meta["machine"]),
        "",
        *setup_lines(meta),
        f"- bf16 model: TinyGPT {meta['bf16_model']}, {meta['bf16_params']} params; fp16 model: TinyGPT "
        f"{meta['fp16_model']}, {meta['fp16_params']} params",
        f"- fp16 rows: fastamp.Scaler(growth_interval=100), loss x {INJECT_FACTOR:g} at steps "
        f"{meta['inject_steps']} (inf grads: the step is skipped)",
        f"- criterion: mean final val loss <= reference x {1 + MEAN_TOL:g} and each seed <= same-seed reference x "
        f"{1 + SEED_TOL:g}; the pure-bf16 control must fail it",
        f"- q8 threshold lowbit_min_numel = 4096: {meta['q8_coverage']}",
        *added_lines,
        f"- wall time of the study: {meta['wall_s']:.0f} s",
        "",
        "## Final validation loss",
        "",
        common.markdown_table(table, cols, cell=str),
        "",
        "## Verdict",
        "",
        payload["verdict"],
        "",
        "## Validation loss during training (mean over seeds)",
        "",
    ]
    curve_rows = []
    for name, r in rows.items():
        steps_at = [s for s, _ in r["val_curves"][0]]
        row = {"config": name}
        for j, s in enumerate(steps_at):
            row[f"step {s}"] = f"{_mean([c[j][1] for c in r['val_curves']]):.4f}"
        curve_rows.append(row)
    by_len: dict[tuple, list[dict]] = collections.defaultdict(list)
    for row in curve_rows:
        by_len[tuple(row)].append(row)
    for keys, group in by_len.items():
        lines += [common.markdown_table(group, [(k, k) for k in keys], cell=str), ""]
    fp16_rows = [(n, r) for n, r in rows.items() if "skipped_steps" in r]
    if fp16_rows:
        lines += ["## fp16 rows: skipped steps", ""]
        for n, r in fp16_rows:
            lines.append(
                f"- {n}: injected {r['injected_overflow_steps']}; skipped per seed {r['skipped_steps']}; "
                f"final scale {r['final_scale']}; all injected skipped: {r['all_injected_skipped']}"
            )
        lines.append("")
    with open(path_stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


@dataclass(frozen=True)
class RunSettings:
    """What the command line of the study (and of the ablation) decided."""

    steps: int
    seeds: list[int]
    lr: float
    weight_decay: float
    n_evals: int
    names: list[str]  # the chosen configs / variants, in their table's order
    quick: bool
    out_dir: str
    tag: str
    optimizer: str = "adamw"


def parse_run_args(
    argv: list[str] | None,
    doc: str,
    subset: str,
    choices: list[str],
    quick_steps: int,
    evals: tuple[int, int],
    with_optimizer: bool = False,
) -> RunSettings:
    """The shared command line: ``--{subset}`` picks among ``choices``; ``evals`` = (full, quick) validation points."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help=f"steps per run (default 1000; --quick {quick_steps})")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 3; --quick 1)")
    parser.add_argument("--lr", type=float, default=None, help="peak lr (default 1e-3; --quick 3e-3)")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument(f"--{subset}", default=None, help=f"comma-separated subset of {choices}")
    parser.add_argument("--evals", type=int, default=None, help=f"validation points after step 0 (default {evals[0]})")
    parser.add_argument("--quick", action="store_true", help=f"CI smoke: a tiny model, {quick_steps} steps, 1 seed")
    parser.add_argument("--out", default=None, help="output directory (default benchmarks/results)")
    parser.add_argument("--tag", default=None, help="suffix of the output names (default cpu, cpu-quick)")
    if with_optimizer:
        parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw", help="the rule (default adamw)")
    args = parser.parse_args(argv)
    optimizer = getattr(args, "optimizer", "adamw")
    picked = getattr(args, subset)
    names = picked.split(",") if picked else list(choices)
    for n in names:
        if n not in choices:
            raise SystemExit(f"--{subset}: unknown {subset[:-1]} {n!r}; expected some of {choices}")
    return RunSettings(
        steps=args.steps or (quick_steps if args.quick else 1000),
        seeds=list(range(args.seeds or (1 if args.quick else 3))),
        lr=args.lr or (3e-3 if args.quick else 1e-3),
        weight_decay=args.weight_decay,
        n_evals=args.evals or evals[1 if args.quick else 0],
        names=[c for c in choices if c in names],
        quick=args.quick,
        out_dir=args.out or common.DEFAULT_OUT,
        tag=args.tag or ("cpu-quick" if args.quick else "cpu") + ("" if optimizer == "adamw" else f"-{optimizer}"),
        optimizer=optimizer,
    )


def run_meta(info: dict[str, Any], corpus: Corpus, rs: RunSettings, n_val: int, wall: float) -> dict[str, Any]:
    """The meta fields every report of the study and the ablation has (the load average at the end added to ``info``)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    if load is not None:
        info["load_avg_at_end"] = " ".join(f"{x:.2f}" for x in load)
    return {
        "machine": info,
        "git_commit": info.get("git_commit"),
        "date": info.get("date"),
        "torch": torch.__version__,
        **corpus_meta(corpus),
        "steps": rs.steps,
        "seeds": rs.seeds,
        "lr": rs.lr,
        "weight_decay": rs.weight_decay,
        "quick": rs.quick,
        "val_windows": n_val,
        "wall_s": wall,
    }


def write_outputs(rs: RunSettings, name: str, payload: dict[str, Any], writer: Callable[[str, dict], None]) -> str:
    """``payload`` as ``<out>/<name>-<tag>.json``, and ``writer(stem, payload)`` (the Markdown); returns the stem."""
    os.makedirs(rs.out_dir, exist_ok=True)
    stem = os.path.join(rs.out_dir, f"{name}-{rs.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    writer(stem, payload)
    common.log(f"[{name}] wrote {stem}.md and .json in {payload['meta']['wall_s']:.0f} s")
    return stem


def main(argv: list[str] | None = None) -> dict[str, Any]:
    rs = parse_run_args(argv, __doc__, "configs", list(CONFIG_BY_NAME), 40, (8, 2), with_optimizer=True)
    steps, seeds, lr, n_evals = rs.steps, rs.seeds, rs.lr, rs.n_evals
    opt_name, opt_hyper, unsupported = OPTIMIZERS[rs.optimizer]
    names, added = with_verdict_configs(rs.names, unsupported)
    cfgs = [CONFIG_BY_NAME[n] for n in names]
    if added:
        common.log(f"[convergence_q8] added for a self-contained verdict: {', '.join(added)}")
    bf16_spec, fp16_spec = (QUICK_MODEL, QUICK_MODEL) if rs.quick else (BF16_MODEL, FP16_MODEL)
    n_val = QUICK_VAL_WINDOWS if rs.quick else VAL_WINDOWS

    info = common.machine_info(torch.device("cpu"))
    t_start = time.perf_counter()
    corpus = Corpus()
    data = {torch.bfloat16: Batches(corpus, bf16_spec, n_val), torch.float16: Batches(corpus, fp16_spec, n_val)}
    runs: dict[str, list[RunResult]] = {}
    for seed in seeds:
        for cfg in cfgs:
            r = train(cfg, seed, data[cfg.dtype], steps, lr, rs.weight_decay, n_evals, optimizer=rs.optimizer)
            runs.setdefault(cfg.name, []).append(r)
            common.log(
                f"[convergence_q8] {cfg.name} seed {seed}: final val {r.final_val:.4f} "
                f"(train {r.train_losses[0]:.3f} -> {_mean(r.train_losses[-10:]):.3f}) in {r.seconds:.0f} s"
            )
    wall = time.perf_counter() - t_start
    rows = judge(runs)

    def n_params(spec: ModelSpec) -> int:
        m = TinyGPT(len(corpus.vocab), spec.seq_len, spec.n_layer, spec.d_model, spec.n_head)
        return sum(p.numel() for p in m.parameters())

    coverage = "; ".join(
        f"{n}: {r['q8_fraction'] * 100:.1f}% of {r['n_params']} params ({r['q8_tensors']} tensors) under q8"
        for n, r in rows.items()
        if r["q8_fraction"] > 0
    )
    meta = run_meta(info, corpus, rs, n_val, wall)
    meta.update(
        bf16_model=bf16_spec.__dict__,
        fp16_model=fp16_spec.__dict__,
        bf16_params=n_params(bf16_spec),
        fp16_params=n_params(fp16_spec),
        inject_steps=inject_steps(steps),
        q8_coverage=coverage,
        criterion={"mean_tol": MEAN_TOL, "seed_tol": SEED_TOL},
    )
    meta.update(optimizer=opt_name, optimizer_hyper=opt_hyper, added_for_verdict=added)
    payload = {"meta": meta, "configs": rows, "verdict": verdict(rows, steps, seeds, rs.quick, opt_name)}
    write_outputs(rs, "convergence_q8", payload, write_report)
    common.log(payload["verdict"])
    return payload


if __name__ == "__main__":
    main()
