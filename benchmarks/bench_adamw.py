"""Benchmark one fused AdamW pass: torch's ``AdamW(fused=True)`` vs fastamp's ``adamw_`` op.

Providers (each checked against :func:`fastamp.reference.adamw_` before being timed):

``torch``          ``torch.optim.AdamW(fused=True).step()`` on fp32 params and grads: reads
                   param, grad, m, v and writes param, m, v: 28 B/elem.
``fastamp-<b>``    :func:`fastamp.functional.adamw_` with backend ``b`` (plus the tiny on-device
                   step-scalar computation the optimizer does per step), for
                   fp32 params (28 B/elem, as torch) and bf16 / fp16 params with fp32 masters
                   (reads grad 2, master 4, m 4, v 4; writes master, m, v and the 2-byte param:
                   28 B/elem). This is the kernel alone; ``bench_step.py`` times the optimizer
                   class and the scaler around it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import Provider  # noqa: E402

from fastamp import functional as F  # noqa: E402
from fastamp import reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
CHECK_SIZES = [1, 7, 4099, 65537, 256, 3, 131]


class _FastampState:
    """The tensors fastamp's AdamW keeps for a list of params, and one call of the fused op."""

    def __init__(self, params, grads, use_master: bool, backend: str):
        self.params, self.grads = params, grads
        self.masters = [p.float().clone() for p in params] if use_master else []
        self.m = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        self.v = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        self.step_t = torch.zeros((), dtype=torch.float32, device=params[0].device)
        self.backend = backend

    def __call__(self):
        self.step_t += 1
        scalars = reference.adamw_step_scalars(LR, self.step_t, BETAS[0], BETAS[1], WD)
        F.adamw_(
            self.params, self.grads, self.masters, self.m, self.v, [], scalars, None,
            beta1=BETAS[0], beta2=BETAS[1], eps=EPS, backend=self.backend,
        )  # fmt: skip


def _torch_opt(params, grads):
    for p, g in zip(params, grads):
        p.grad = g
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)


def _check_data(dtype, device):
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=gen).to(dtype).to(device) for n in CHECK_SIZES]
    grads = [[torch.randn(n, generator=gen).to(dtype).to(device) for n in CHECK_SIZES] for _ in range(3)]
    return params, grads


def _reference_run(params, grads_per_step, use_master):
    st = _FastampState([p.clone() for p in params], None, use_master, "torch")
    for grads in grads_per_step:
        st.grads = grads
        st()
    return st.masters if use_master else st.params


def make_torch_check(device):
    def check():
        params, grads = _check_data(torch.float32, device)
        want = _reference_run(params, grads, False)
        mine = [p.clone() for p in params]
        opt = _torch_opt(mine, grads[0])
        for g in grads:
            for p, gi in zip(mine, g):
                p.grad = gi
            opt.step()
        err = max(common.assert_close(f"param[{i}]", a, b) for i, (a, b) in enumerate(zip(mine, want)))
        return f"vs reference after 3 steps: max abs error {err:.2g}"

    return check


def make_fastamp_check(dtype, backend, device):
    use_master = dtype != torch.float32

    def check():
        params, grads = _check_data(dtype, device)
        want = _reference_run(params, grads, use_master)
        st = _FastampState([p.clone() for p in params], None, use_master, backend)
        for g in grads:
            st.grads = g
            st()
        got = st.masters if use_master else st.params
        err = max(common.assert_close(f"value[{i}]", a, b) for i, (a, b) in enumerate(zip(got, want)))
        if use_master:
            for i, (p, m) in enumerate(zip(st.params, st.masters)):
                if not torch.equal(p, m.to(dtype)):
                    raise AssertionError(f"param[{i}] is not its master rounded to {dtype}")
        return f"vs reference after 3 steps: max abs error {err:.2g}" + (
            "; params == rounded masters" if use_master else ""
        )

    return check


def make_providers(args, device):
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"--dtypes: unknown dtype {d!r}; expected some of {list(DTYPES)}")

    def build(n_tensors, per, backends):
        def torch_setup():
            params = [torch.randn(per, device=device) for _ in range(n_tensors)]
            grads = [torch.randn(per, device=device) for _ in range(n_tensors)]
            opt = _torch_opt(params, grads)
            return opt.step

        out = [
            Provider(
                "torch",
                "adamw",
                "fp32",
                28,
                torch_setup,
                make_torch_check(device),
                notes="torch.optim.AdamW(fused=True).step(): reads p, g, m, v, writes p, m, v (7 x 4 B)",
            )
        ]
        for b in backends:
            for d in dtypes:
                dt = DTYPES[d]

                def fa_setup(dt=dt, b=b):
                    params = [torch.randn(per, device=device).to(dt) for _ in range(n_tensors)]
                    grads = [torch.randn(per, device=device).to(dt) for _ in range(n_tensors)]
                    return _FastampState(params, grads, dt != torch.float32, b)

                note = (
                    "fp32 params: reads p, g, m, v, writes p, m, v (28 B)"
                    if dt == torch.float32
                    else f"{d} params + fp32 master: reads g ({dt.itemsize} B), master, m, v; writes master, m, v, "
                    f"param ({dt.itemsize} B): 28 B"
                )
                out.append(
                    Provider(
                        f"fastamp-{b}",
                        "adamw",
                        d,
                        28,
                        fa_setup,
                        make_fastamp_check(dt, b, device),
                        baseline="torch",
                        notes=note + ("; the torch backend is the plain-torch reference" if b == "torch" else ""),
                    )
                )
        return out

    return build


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--dtypes", default="fp32,bf16", help="param dtypes of the fastamp rows (fp32,bf16,fp16)")
    args = parser.parse_args(argv)
    device = common.resolve_device(args.device)
    return common.run_benchmark(
        args, "bench_adamw", "adamw_", make_providers(args, device), "fused AdamW pass: fastamp vs torch fused"
    )


if __name__ == "__main__":
    main()
