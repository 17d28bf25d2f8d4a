"""Benchmark a whole optimizer step of the 8-bit optimizers, side by side: fastamp vs torchao and bitsandbytes.

``bench_adamw.py`` times fastamp's kernels; this times what a user calls, ``opt.step()``, for
every optimizer with low-bit state that runs on this machine, at the same sizes in the same
interleaved rounds (issue 22: "ahead of torchao/bitsandbytes on CPU"). bf16 params and grads
throughout except torch's fp32 baseline, each library at its defaults for small tensors
(fastamp ``lowbit_min_numel=4096``, torchao ``min_quant_size`` and bitsandbytes
``min_8bit_size`` 4096: tensors below that keep 32-bit moments in all three, so at 20,000 x 256
the rows time each library's dense path and its per-tensor overhead, not its 8-bit codec).

Providers (``--providers``; the ones whose package is missing are listed as not timed):

``torch``              ``torch.optim.AdamW(fused=True)`` on fp32 params: the baseline (28 B/elem).
``fastamp 10-B``       ``fastamp.optim.AdamW(master_weights="remainder", state_dtype=bf16,
                       stochastic_rounding=True)``: bf16 moments (18 B/elem).
``fastamp remainder+q8`` ``master_weights="remainder", state_format="q8"`` (14 B/elem + scales).
``fastamp ulp8+q8``    ``master_weights="ulp8", state_format="q8"`` (12 B/elem + scales).
``fastamp SR+q8``      ``master_weights=False, stochastic_rounding=True, state_format="q8"``
                       (10 B/elem + scales).
``torchao AdamW8bit``  ``torchao.optim.AdamW8bit(bf16_stochastic_round=True)`` (blocks of 256,
                       fp32 scales; 10 B/elem + scales): compiled per param by torchao.
``torchao AdamW4bit``  ``torchao.optim.AdamW4bit(bf16_stochastic_round=True)`` (8 B/elem + scales).
``bnb AdamW8bit``      ``bitsandbytes.optim.AdamW8bit`` (blockwise dynamic 8-bit; bf16 params
                       updated in place, no stochastic rounding; 10 B/elem + scales).

B/elem counts the params, grads and state bytes the update reads and writes (the scale bytes
are not counted, for anyone); the ceiling of a row is torch in-place ops moving exactly those
bytes (``common.ceiling``), timed in the same rounds.

Check before timing (the same for every provider, since the 8-bit formats differ): one step
with lr 0.1 from the same params and grads must move the params like fp32 AdamW does, cosine
similarity of the update >= 0.9 (the step happened, in the right direction) and no NaN.

Install the other libraries beside the pinned torch, without letting pip replace it:
``pip install --no-deps torchao==0.18.0 bitsandbytes==0.50.2`` (or ``--target DIR`` and
``PYTHONPATH=DIR``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import Provider  # noqa: E402

from fastamp.optim import AdamW as FastAdamW  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
CHECK_LR = 0.1
CHECK_SHAPES = [(4099,), (64, 257), (3,)]
MIN_COSINE = 0.9
DEFAULT_CONFIGS = "256x262144,20000x256"

# name -> (keyword arguments of fastamp.optim.AdamW, traffic spec (common.parse_traffic), note)
FASTAMP = {
    "fastamp 10-B": (
        {"master_weights": "remainder", "state_dtype": torch.bfloat16, "stochastic_rounding": True},
        "g:r2 p:rw2 rem:rw2 m:rw2 v:rw2",
        "remainder master + bf16 moments, stochastic rounding: our 10-B config",
    ),
    "fastamp remainder+q8": (
        {"master_weights": "remainder", "state_format": "q8"},
        "g:r2 p:rw2 rem:rw2 q:rw2",
        "exact remainder master + q8 moments (stochastic codes): 8.06 B/param",
    ),
    "fastamp ulp8+q8": (
        {"master_weights": "ulp8", "state_format": "q8"},
        "g:r2 p:rw2 e:rw1 q:rw2",
        "int8 master correction + q8 moments: 7.06 B/param",
    ),
    "fastamp SR+q8": (
        {"master_weights": False, "stochastic_rounding": True, "state_format": "q8"},
        "g:r2 p:rw2 q:rw2",
        "no master, stochastic rounding, q8 moments: 6.06 B/param",
    ),
}


def _torchao(cls: str):
    try:
        import torchao.optim as ao
    except Exception as e:  # missing, or built for another torch
        return None, f"torchao not importable ({type(e).__name__}: {e})"
    return (
        lambda ps, lr=LR: getattr(ao, cls)(ps, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, bf16_stochastic_round=True)
    ), ""


def _bnb():
    try:
        import bitsandbytes as bnb
    except Exception as e:
        return None, f"bitsandbytes not importable ({type(e).__name__}: {e})"
    return (lambda ps, lr=LR: bnb.optim.AdamW8bit(ps, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD)), ""


OTHERS = {
    "torchao AdamW8bit": (lambda: _torchao("AdamW8bit"), "g:r2 p:rw2 q:rw2", "block 256, fp32 scales, bf16 SR"),
    "torchao AdamW4bit": (lambda: _torchao("AdamW4bit"), "g:r2 p:rw2 q:rw1", "block 128, fp32 scales, bf16 SR"),
    "bnb AdamW8bit": (lambda: _bnb(), "g:r2 p:rw2 q:rw2", "blockwise dynamic 8-bit, bf16 params rounded to nearest"),
}


def _fastamp_factory(kw: dict, backend: str | None):
    return lambda ps, lr=LR: FastAdamW(ps, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, backend=backend, **kw)


def _check(make) -> str:
    """One step at lr 0.1 moves bf16 params like fp32 AdamW (cosine >= 0.9), finite.

    ``make(params, lr=...)`` builds the optimizer (every factory here takes the lr).
    """
    gen = torch.Generator().manual_seed(0)
    p0 = [torch.randn(s, generator=gen) for s in CHECK_SHAPES]
    g0 = [torch.randn(s, generator=gen) for s in CHECK_SHAPES]
    ref = [torch.nn.Parameter(p.clone()) for p in p0]
    for r, g in zip(ref, g0):
        r.grad = g.clone()
    torch.optim.AdamW(ref, lr=CHECK_LR, betas=BETAS, eps=EPS, weight_decay=WD).step()
    ps = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in p0]
    for p, g in zip(ps, g0):
        p.grad = g.to(torch.bfloat16)
    start = [p.detach().float().clone() for p in ps]
    make(ps, lr=CHECK_LR).step()
    worst = 1.0
    for i, (p, s, r, q) in enumerate(zip(ps, start, ref, p0)):
        got = p.detach().float() - s
        want = r.detach() - q
        if not torch.isfinite(got).all():
            raise AssertionError(f"param {i}: non-finite values after one step")
        cos = float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0))
        if not cos >= MIN_COSINE:
            raise AssertionError(f"param {i} {tuple(p.shape)}: update cosine {cos:.3f} vs fp32 AdamW < {MIN_COSINE}")
        worst = min(worst, cos)
    return f"update cosine vs fp32 AdamW >= {worst:.4f} (lr {CHECK_LR}, shapes {CHECK_SHAPES})"


def _opt_setup(make, n_tensors: int, per: int, dtype: torch.dtype, device):
    def setup():
        gen = torch.Generator().manual_seed(1)
        params = []
        for _ in range(n_tensors):
            p = torch.nn.Parameter(torch.randn(per, generator=gen).to(device=device, dtype=dtype))
            p.grad = torch.randn(per, generator=gen).to(device=device, dtype=dtype)
            params.append(p)
        opt = make(params)
        opt.step()  # state allocated, compiled paths compiled: not timed
        return opt.step

    return setup


def make_providers(args, device):
    wanted = [s.strip() for s in args.providers.split(",")] if args.providers else None
    skipped: list[str] = []

    def want(name):
        return wanted is None or name in wanted

    def build(n_tensors, per, backends):
        out = []
        if want("torch"):
            make = lambda ps, lr=LR: torch.optim.AdamW(ps, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)  # noqa: E731
            out.append(
                Provider(
                    "torch",
                    "adamw-step",
                    "fp32",
                    28,
                    _opt_setup(make, n_tensors, per, torch.float32, device),
                    lambda: "the baseline",
                    notes="torch.optim.AdamW(fused=True).step() on fp32 params",
                    traffic="p:rw4 g:r4 m:rw4 v:rw4",
                )
            )
        # The torch backend is fastamp's plain-torch reference: minutes per 64M step; only on request.
        fa = [b for b in backends if b != "torch" or (args.backends and "torch" in args.backends)]
        for b in fa:
            for name, (kw, traffic, note) in FASTAMP.items():
                if not want(name):
                    continue
                make = _fastamp_factory(kw, b)
                out.append(
                    Provider(
                        name if len(fa) == 1 else f"{name} [{b}]",
                        "adamw-step",
                        "bf16",
                        common.traffic_bytes(traffic),
                        _opt_setup(make, n_tensors, per, torch.bfloat16, device),
                        lambda make=make: _check(make),
                        baseline="torch",
                        notes=f"{note}; backend {b}",
                        traffic=traffic,
                    )
                )
        for name, (factory, traffic, note) in OTHERS.items():
            if not want(name):
                continue
            make, why = factory()
            if make is None:
                msg = f"{name}: {why}"
                if msg not in skipped:
                    skipped.append(msg)
                    common.log(f"[bench_lowbit] not timed: {msg}")
                continue
            out.append(
                Provider(
                    name,
                    "adamw-step",
                    "bf16",
                    common.traffic_bytes(traffic),
                    _opt_setup(make, n_tensors, per, torch.bfloat16, device),
                    lambda make=make: _check(make),
                    baseline="torch",
                    notes=note,
                    traffic=traffic,
                )
            )
        return out

    return build, skipped


def _summary(rows):
    """Each 8-bit row's time over our 10-B config's and over torchao AdamW8bit's, same config."""
    lines = []
    for base in ("fastamp 10-B", "torchao AdamW8bit", "bnb AdamW8bit"):
        pairs = []
        for r in rows:
            if r.get("ms") is None or r["provider"] in ("torch", base):
                continue
            b = [
                x
                for x in rows
                if x["provider"] == base and x["numel"] == r["numel"] and x["n_tensors"] == r["n_tensors"]
            ]
            if b and b[0].get("ms"):
                pairs.append(
                    f"- {r['n_tensors']}x{r['elems_per_tensor']}: {r['provider']} {r['ms']:.1f} ms = "
                    f"{r['ms'] / b[0]['ms']:.2f}x {base} ({b[0]['ms']:.1f} ms)"
                )
        if pairs:
            lines += [f"Time over {base}'s (same config, same run):", ""] + pairs + [""]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser)
    parser.add_argument(
        "--providers",
        default=None,
        help=f"comma-separated subset of {['torch', *FASTAMP, *OTHERS]} (default: all that import)",
    )
    args = parser.parse_args(argv)
    if args.configs is None and not args.quick:
        args.configs = DEFAULT_CONFIGS
    device = common.resolve_device(args.device)
    build, skipped = make_providers(args, device)
    return common.run_benchmark(
        args, "bench_lowbit", "adamw_q8_", build, "8-bit AdamW optimizer steps: fastamp vs torchao and bitsandbytes",
        summarise=_summary, not_timed=skipped,
    )  # fmt: skip


if __name__ == "__main__":
    main()
