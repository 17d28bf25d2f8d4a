"""Benchmark the whole mixed-precision optimizer path of one training step (no forward/backward).

``torch``        fp32 params: ``GradScaler.unscale_`` + ``clip_grad_norm_(foreach=True)`` +
                 ``GradScaler.step(AdamW(fused=True))`` + ``GradScaler.update()``. Bytes per
                 element: unscale 8 (read+write), norm 4, clip multiply 8, fused AdamW 28 = 48.
``fastamp-<b>``  ``fastamp.Scaler.clip_grad_norm_`` (one read-only check+norm pass; the clip
                 factor is folded into the step on device) + ``Scaler.step(fastamp.optim.AdamW)``
                 + ``Scaler.update()``, with backend ``b`` for the scaler and the optimizer.
                 bf16 / fp16 params with fp32 masters: grad read 2 + AdamW 28 = 30 B/elem;
                 fp32 params: 4 + 28 = 32.

``<provider>-compiled``  the same calls as one function under ``torch.compile`` (inductor):
                 fastamp's with ``fullgraph=True`` (one graph); torch's without (its
                 ``GradScaler`` calls and fused AdamW's step graph-break and run eagerly: torch's
                 best compiled equivalent of the same path). Same bytes. ``--no-compiled`` drops them.

Timing keeps the grads fixed: the scale is 1 (so unscaling multiplies by exactly 1) and
``max_norm`` is huge (the clip factor is exactly 1); every provider still runs every pass.
Before timing, each provider runs 3 steps on small data (scale 1024, a clip that bites,
an inf injected in the second step) and is compared with the same pipeline built from
:mod:`fastamp.reference` ops: params (masters for low-precision params) and the final scale.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from bench_adamw import TRAFFIC as ADAMW_TRAFFIC  # noqa: E402
from common import Provider  # noqa: E402

import fastamp  # noqa: E402
from fastamp import reference  # noqa: E402
from fastamp.optim import AdamW as FastAdamW  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
CHECK_SIZES = [1, 7, 4099, 65537, 256, 3, 131]
HUGE_NORM = 1e30


def _torch_iteration(scaler, opt, params, max_norm):
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    scaler.step(opt)
    scaler.update()


def _fastamp_iteration(scaler, opt, max_norm):
    scaler.clip_grad_norm_(opt, max_norm)
    scaler.step(opt)
    scaler.update()


_compiled_torch = torch.compile(_torch_iteration)
_compiled_fastamp = torch.compile(_fastamp_iteration, fullgraph=True)


class TorchPath:
    """torch's best path on fp32 params (``compiled``: under torch.compile, where it graph-breaks)."""

    def __init__(self, params, init_scale: float, max_norm: float, device, compiled: bool = False):
        self.params = params
        self.opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=2**30)
        self.scaler.scale(torch.ones((), device=device))  # creates the scale tensor, as a loss would
        self.max_norm = max_norm
        self.run = _compiled_torch if compiled else _torch_iteration

    def __call__(self):
        self.run(self.scaler, self.opt, self.params, self.max_norm)

    def values(self):
        return [p.detach().float() for p in self.params]

    def scale(self):
        return self.scaler.get_scale()


class FastampPath:
    """fastamp.Scaler + fastamp.optim.AdamW, bf16/fp16 params with fp32 masters (or fp32 params)."""

    def __init__(self, params, init_scale: float, max_norm: float, device, backend: str, compiled: bool = False):
        self.params = params
        self.opt = FastAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, backend=backend)
        self.scaler = fastamp.Scaler(device.type, init_scale=init_scale, growth_interval=2**30, backend=backend)
        self.scaler.scale(torch.ones((), device=device))
        self.max_norm = max_norm
        self.backend = backend
        self.run = _compiled_fastamp if compiled else _fastamp_iteration

    def __call__(self):
        self.run(self.scaler, self.opt, self.max_norm)

    def values(self):
        out = []
        for p in self.params:
            st = self.opt.state.get(p, {})
            out.append(st["master_param"] if "master_param" in st else p.detach().float())
        return out

    def scale(self):
        return self.scaler.get_scale()


def reference_path(init, grads_per_step, init_scale, max_norm, device):
    """The same three steps from fastamp.reference ops: fp32 values and the final scale."""
    vals = [p.float().clone() for p in init]
    m = [torch.zeros_like(v) for v in vals]
    v = [torch.zeros_like(x) for x in vals]
    scale = torch.full((), init_scale, device=device)
    growth = torch.zeros((), dtype=torch.int32, device=device)
    hyst = torch.ones((), dtype=torch.int32, device=device)
    step = torch.zeros((), device=device)
    for grads in grads_per_step:
        found = torch.zeros(1, device=device)
        inv = (1.0 / scale.double()).float().reshape(1)
        sumsq = reference.unscale_check_(grads, found, inv, write_back=False, compute_sumsq=True)
        coef = torch.clamp(max_norm / (sumsq.sqrt() + 1e-6), max=1.0)
        step = step + (found.reshape(()) == 0).float()
        scalars = reference.adamw_step_scalars(LR, step, BETAS[0], BETAS[1], WD, grad_mul=coef / scale)
        reference.adamw_(vals, grads, [], m, v, [], scalars, found, BETAS[0], BETAS[1], EPS, False, False)
        reference.update_scale_(scale, growth, hyst, found.reshape(()), 2.0, 0.5, 2**30)
    return vals, float(scale)


def make_check(kind: str, dtype, device, backend=None, compiled=False):
    def check():
        gen = torch.Generator().manual_seed(5)
        # Values exactly representable in the param dtype, so the fp32 reference run and the
        # master-weight run see the same numbers.
        init = [torch.randn(n, generator=gen).to(dtype).to(device) for n in CHECK_SIZES]
        grads = [[(torch.randn(n, generator=gen) * 1024).to(dtype).to(device) for n in CHECK_SIZES] for _ in range(3)]
        grads[1][2][5] = float("inf")
        ref_grads = [[g.float() for g in gs] for gs in grads]
        first_norm = float(torch.cat([g.float().reshape(-1) / 1024 for g in ref_grads[0]]).norm())
        max_norm = 0.5 * first_norm
        want, want_scale = reference_path(init, ref_grads, 1024.0, max_norm, device)
        params = [p.clone() for p in init]
        path = TorchPath(params, 1024.0, max_norm, device, compiled) if kind == "torch" else FastampPath(
            params, 1024.0, max_norm, device, backend, compiled
        )  # fmt: skip
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            path()
        got = path.values()
        err = max(common.assert_close(f"param[{i}]", a, b) for i, (a, b) in enumerate(zip(got, want)))
        if path.scale() != want_scale:
            raise AssertionError(f"scale {path.scale()} != reference {want_scale} (one overflow step expected)")
        return f"3 steps (clip, inf skip) vs reference: max abs error {err:.2g}, scale {want_scale:g}"

    return check


def make_providers(args, device):
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"--dtypes: unknown dtype {d!r}; expected some of {list(DTYPES)}")

    compiled_rows = getattr(args, "compiled", True)

    def build(n_tensors, per, backends):
        if compiled_rows:
            # every config compiles anew (new objects): keep dynamo's per-function cache small
            torch._dynamo.reset()

        def setup(kind, dt, b=None, compiled=False):
            params = [torch.randn(per, device=device).to(dt) for _ in range(n_tensors)]
            for p in params:
                p.grad = torch.randn(per, device=device).to(dt)
            if kind == "torch":
                return TorchPath(params, 1.0, HUGE_NORM, device, compiled)
            return FastampPath(params, 1.0, HUGE_NORM, device, b, compiled)

        out = [
            Provider(
                "torch",
                "step",
                "fp32",
                48,
                lambda: setup("torch", torch.float32),
                make_check("torch", torch.float32, device),
                notes="GradScaler.unscale_ (8 B) + clip_grad_norm_(foreach) (norm 4 B, multiply 8 B) + "
                "AdamW(fused=True) via GradScaler.step (28 B) + update: 48 B/elem",
                traffic="g:rw4 ; g:r4 ; g:rw4 ; " + ADAMW_TRAFFIC["fp32"],
            )
        ]
        if compiled_rows:
            out.append(
                Provider(
                    "torch-compiled",
                    "step",
                    "fp32",
                    48,
                    lambda: setup("torch", torch.float32, compiled=True),
                    make_check("torch", torch.float32, device, compiled=True),
                    baseline="torch",
                    notes="the torch row's calls in one function under torch.compile (inductor, graph breaks at "
                    "every GradScaler call and inside AdamW.step): 48 B/elem",
                    traffic=out[0].traffic,
                )
            )
        for b in backends:
            for d in dtypes:
                dt = DTYPES[d]
                nbytes = dt.itemsize + 28
                notes = (
                    f"Scaler.clip_grad_norm_ (check+norm read, {dt.itemsize} B) + Scaler.step(fastamp AdamW"
                    + (", fp32 master" if dt != torch.float32 else "")
                    + f") (28 B) + update: {nbytes} B/elem"
                )
                for compiled in (False, True) if compiled_rows and b != "torch" else (False,):
                    out.append(
                        Provider(
                            f"fastamp-{b}" + ("-compiled" if compiled else ""),
                            "step",
                            d,
                            nbytes,
                            lambda dt=dt, b=b, c=compiled: setup("fastamp", dt, b, c),
                            make_check("fastamp", dt, device, b, compiled),
                            baseline="torch",
                            notes=notes
                            + ("; compiled with fullgraph=True (inductor): one graph" if compiled else "")
                            + ("; the torch backend is the plain-torch reference" if b == "torch" else ""),
                            traffic=f"g:r{dt.itemsize} ; " + ADAMW_TRAFFIC[d],
                        )
                    )
        return out

    return build


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--dtypes", default="bf16,fp32", help="param dtypes of the fastamp rows (fp32,bf16,fp16)")
    parser.add_argument(
        "--no-compiled",
        dest="compiled",
        action="store_false",
        help="leave out the torch.compile rows (torch-compiled, fastamp-<backend>-compiled)",
    )
    args = parser.parse_args(argv)
    device = common.resolve_device(args.device)
    return common.run_benchmark(
        args,
        "bench_step",
        "adamw_",
        make_providers(args, device),
        "whole optimizer path (check, clip, AdamW, scale update): fastamp vs torch",
    )


if __name__ == "__main__":
    main()
