"""Benchmark a whole optimizer step of the 8-bit optimizers, side by side: fastamp vs torchao and bitsandbytes.

``bench_adamw.py`` times fastamp's kernels; this times what a user calls, ``opt.step()``, for
every optimizer with low-bit state that runs on this machine, at the same sizes in the same
interleaved rounds (issue 22: "ahead of torchao/bitsandbytes on CPU"). bf16 params and grads
throughout except torch's fp32 baseline, each library at its defaults for small tensors: params
below 4096 elements (fastamp ``lowbit_min_numel``, bitsandbytes ``min_8bit_size``, torchao's
fixed threshold, which also wants a multiple of its block) keep dense moments: fp32 in fastamp
(whose ulp8 master then becomes the exact remainder one) and bitsandbytes, the param's dtype
(bf16 here) in torchao. So at 20,000 x 256 the rows time each library's dense path and its
per-tensor overhead, not its 8-bit codec, and their bytes are the dense ones (``DENSE``).

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
are not counted, for anyone): what :func:`streamed_bytes_per_elem` counts from the tensors each
optimizer holds (the smoke tests check every row against it); the ceiling of a row is torch
in-place ops moving exactly those bytes (``common.ceiling``), timed in the same rounds.

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

# Params with fewer elements keep dense moments in all three libraries (their defaults).
LOWBIT_MIN_NUMEL = 4096

# name -> (keyword arguments of fastamp.optim.AdamW, traffic spec (common.parse_traffic) of a param
# of LOWBIT_MIN_NUMEL elements or more, note); DENSE: the traffic below that, where it differs.
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
# torchao quantizes a param only when its size is also a multiple of the block
BLOCK = {"torchao AdamW8bit": 256, "torchao AdamW4bit": 128}
# The traffic of a param below LOWBIT_MIN_NUMEL: dense moments (fp32, or bf16 in torchao), and
# fastamp's ulp8 master replaced by the remainder one. The 10-B config has bf16 moments at any size.
DENSE = {
    "fastamp remainder+q8": "g:r2 p:rw2 rem:rw2 m:rw4 v:rw4",
    "fastamp ulp8+q8": "g:r2 p:rw2 rem:rw2 m:rw4 v:rw4",
    "fastamp SR+q8": "g:r2 p:rw2 m:rw4 v:rw4",
    "torchao AdamW8bit": "g:r2 p:rw2 m:rw2 v:rw2",
    "torchao AdamW4bit": "g:r2 p:rw2 m:rw2 v:rw2",
    "bnb AdamW8bit": "g:r2 p:rw2 m:rw4 v:rw4",
}


def traffic_at(name: str, traffic: str, per: int) -> str:
    """The traffic of provider ``name`` (``traffic`` when its state is low-bit) for params of ``per`` elements."""
    lowbit = per >= LOWBIT_MIN_NUMEL and per % BLOCK.get(name, 1) == 0
    return traffic if lowbit else DENSE.get(name, traffic)


def _state_tensors(value) -> list[torch.Tensor]:
    """The plain tensors of a state entry: itself, or the inner tensors of a subclass (torchao's codes, scales)."""
    if not isinstance(value, torch.Tensor):
        return []
    if hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        return [t for n in names for t in _state_tensors(getattr(value, n))]
    return [value]


def streamed_bytes_per_elem(opt: torch.optim.Optimizer) -> float:
    """Bytes per element one ``opt.step()`` streams, counted from the tensors it holds.

    Per param: its grad read, the param read and written, and every state tensor with one
    entry per element (``numel`` equal to the param's) or two 4-bit codes per byte (half of
    it), read and written. Block scales, code books, step counts and random-number counters
    are left out, for every library (as B/elem leaves them out). Pick param sizes for which
    no such small tensor has one of those two sizes.
    """
    total = numel = 0
    for group in opt.param_groups:
        for p in group["params"]:
            n = p.numel()
            nbytes = n * (p.grad.element_size() + 2 * p.element_size())
            for t in (t for v in opt.state[p].values() for t in _state_tensors(v)):
                if t.dim() > 0 and t.numel() in (n, n // 2):
                    nbytes += 2 * t.numel() * t.element_size()
            total, numel = total + nbytes, numel + n
    return total / numel


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
                traffic = traffic_at(name, traffic, per)
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
            traffic = traffic_at(name, traffic, per)
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
