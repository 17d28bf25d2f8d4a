"""Benchmark one fused AdamW pass: torch's ``AdamW(fused=True)`` vs fastamp's ``adamw_`` / ``adamw_bf16_`` ops.

Providers (each checked against :mod:`fastamp.reference` before being timed):

``torch``          ``torch.optim.AdamW(fused=True).step()`` on fp32 params and grads: reads
                   param, grad, m, v and writes param, m, v: 28 B/elem.
``fastamp-<b>``    backend ``b`` of fastamp's fused ops (plus the tiny on-device step-scalar
                   computation the optimizer does per step), one row per ``--dtypes`` entry:

                   ``fp32``            :func:`fastamp.functional.adamw_`, fp32 params: 28 B/elem, as torch.
                   ``bf16`` / ``fp16`` ``adamw_`` with fp32 masters: reads grad 2, master 4, m 4,
                                       v 4; writes master, m, v and the 2-byte param (never
                                       read): 28 B/elem.
                   ``bf16-remainder``  :func:`fastamp.functional.adamw_bf16_` with int16 master
                                       remainders (issue #7): reads grad 2, param 2, remainder 2,
                                       m 4, v 4; writes param, remainder, m, v: 26 B/elem.
                   ``bf16-sr``         ``adamw_bf16_`` without master, stochastic rounding: reads
                                       grad, param, m, v; writes param, m, v: 22 B/elem.
                   ``bf16-10B``        ``adamw_bf16_`` with remainders and bf16 moments, stochastic
                                       rounding: reads grad, param, remainder, m, v (2 B each);
                                       writes param, remainder, m, v: 18 B/elem.
                   ``bf16-q8``         :func:`fastamp.functional.adamw_q8_`: remainders and q8
                                       moments (one code byte + 1/32 scale byte each), stochastic
                                       codes: reads and writes p, rem (2 B each), m, v codes (1 B
                                       each), reads g: 14 B/elem + 1/8 B of scales (not in the ceiling).
                   ``bf16-sr-q8``      ``adamw_q8_`` without master, stochastic rounding: 10 B/elem
                                       + 1/8 B of scales.
                   ``bf16-ulp8-q8``    ``adamw_q8_`` with int8 ulp8 master corrections (issue 22),
                                       rounded stochastically: reads and writes p (2 B), the correction
                                       (1 B), the m, v codes (1 B each), reads g: 12 B/elem + 1/8 B of
                                       scales.

The q8 rows run only on the backends that have ``adamw_q8_`` (native CPU and CUDA, Triton, the reference).

Byte counts are what each kernel reads and writes; write-allocate traffic (a store to a line
that was not read) is not counted, for any provider. This is the kernel alone; ``bench_step.py``
times the optimizer class and the scaler around it.
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

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "bf16-remainder": torch.bfloat16,
    "bf16-sr": torch.bfloat16,
    "bf16-10B": torch.bfloat16,
    "bf16-q8": torch.bfloat16,
    "bf16-sr-q8": torch.bfloat16,
    "bf16-ulp8-q8": torch.bfloat16,
}
# dtype entry -> (master kind, moment dtype, stochastic rounding, bytes per element)
KINDS = {
    "fp32": ("none", torch.float32, False, 28),
    "bf16": ("fp32", torch.float32, False, 28),
    "fp16": ("fp32", torch.float32, False, 28),
    "bf16-remainder": ("remainder", torch.float32, False, 26),
    "bf16-sr": ("none", torch.float32, True, 22),
    "bf16-10B": ("remainder", torch.bfloat16, True, 18),
    "bf16-q8": ("remainder", "q8", True, 14),
    "bf16-sr-q8": ("none", "q8", True, 10),
    "bf16-ulp8-q8": ("ulp8", "q8", True, 12),
}
Q8_KINDS = ("bf16-q8", "bf16-sr-q8", "bf16-ulp8-q8")
# dtype entry -> the same bytes stream by stream (common.parse_traffic): the ceiling of the row.
TRAFFIC = {
    "fp32": "p:rw4 g:r4 m:rw4 v:rw4",
    "bf16": "g:r2 master:rw4 m:rw4 v:rw4 p:w2",
    "fp16": "g:r2 master:rw4 m:rw4 v:rw4 p:w2",
    "bf16-remainder": "g:r2 p:rw2 rem:rw2 m:rw4 v:rw4",
    "bf16-sr": "g:r2 p:rw2 m:rw4 v:rw4",
    "bf16-10B": "g:r2 p:rw2 rem:rw2 m:rw2 v:rw2",
    # the two 1-byte code streams as one 2-byte stream (the ceiling's buffers are 2, 4 or 8 B wide)
    "bf16-q8": "g:r2 p:rw2 rem:rw2 q:rw2",
    "bf16-sr-q8": "g:r2 p:rw2 q:rw2",
    "bf16-ulp8-q8": "g:r2 p:rw2 e:rw1 q:rw2",  # e: the 1-byte ulp8 correction
}
NOTES = {
    "fp32": "fp32 params, adamw_: reads p, g, m, v, writes p, m, v (28 B)",
    "bf16": "bf16 params + fp32 master, adamw_: reads g (2 B), master, m, v; writes master, m, v, param (2 B): 28 B",
    "fp16": "fp16 params + fp32 master, adamw_: reads g (2 B), master, m, v; writes master, m, v, param (2 B): 28 B",
    "bf16-remainder": "bf16 params + int16 remainder, adamw_bf16_: reads g, p, rem (2 B each), m, v (4 B each); "
    "writes p, rem, m, v: 26 B",
    "bf16-sr": "bf16 params, no master, stochastic rounding, adamw_bf16_: reads g, p (2 B), m, v (4 B); writes p, m, "
    "v: 22 B",
    "bf16-10B": "bf16 params + int16 remainder + bf16 moments, stochastic rounding, adamw_bf16_: reads g, p, rem, m, "
    "v; writes p, rem, m, v (2 B each): 18 B",
    "bf16-q8": "bf16 params + int16 remainder + q8 moments (stochastic codes), adamw_q8_: reads g, p, rem (2 B), m, v "
    "codes (1 B) and scales (1/32 B each); writes p, rem, codes, scales: 14 B + 1/8",
    "bf16-sr-q8": "bf16 params, no master, stochastic rounding, q8 moments, adamw_q8_: reads g, p, codes, scales; "
    "writes p, codes, scales: 10 B + 1/8",
    "bf16-ulp8-q8": "bf16 params + int8 ulp8 correction (rounded stochastically) + q8 moments, adamw_q8_: reads g, "
    "p (2 B), correction, codes (1 B) and scales; writes p, correction, codes, scales: 12 B + 1/8",
}
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
CHECK_SIZES = [1, 7, 4099, 65537, 256, 3, 131]


class _FastampState:
    """The tensors fastamp's AdamW keeps for a list of params, and one call of the fused op.

    ``kind`` is a :data:`KINDS` key. Remainder and ulp8 masters start from the params
    (remainder or correction 0, as the optimizer's first step does); the stochastic-rounding counter advances on every
    call, as the optimizer's does on every applied step.
    """

    def __init__(self, params, grads, kind: str, backend: str):
        master, mdt, sr, _ = KINDS[kind]
        self.params, self.grads, self.kind, self.backend = params, grads, kind, backend
        self.masters = [p.float().clone() for p in params] if master == "fp32" else []
        self.remainders = [torch.zeros(p.shape, dtype=torch.int16, device=p.device) for p in params] if (
            master == "remainder"
        ) else []  # fmt: skip
        self.corrections = [torch.zeros(p.shape, dtype=torch.int8, device=p.device) for p in params] if (
            master == "ulp8"
        ) else []  # fmt: skip
        # what adamw_q8_ takes as masters, and whether it rounds the param (or the correction) stochastically
        self.q8_masters = self.remainders or self.corrections
        self.sr_param = master in ("none", "ulp8")
        self.q8 = mdt == "q8"
        if self.q8:
            from fastamp.optim.formats import moments as _formats

            m = [_formats.Q8.create(p, "exp_avg") for p in params]
            v = [_formats.Q8.create(p, "exp_avg_sq") for p in params]
            self.m = [d["exp_avg_q"] for d in m]
            self.ms = [d["exp_avg_scale"] for d in m]
            self.v = [d["exp_avg_sq_q"] for d in v]
            self.vs = [d["exp_avg_sq_scale"] for d in v]
        else:
            self.m = [torch.zeros(p.shape, dtype=mdt, device=p.device) for p in params]
            self.v = [torch.zeros(p.shape, dtype=mdt, device=p.device) for p in params]
        self.step_t = torch.zeros((), dtype=torch.float32, device=params[0].device)
        self.rng = torch.tensor([0, 0], dtype=torch.int64, device=params[0].device) if sr else None
        self.lowbit = kind.startswith("bf16-")

    def __call__(self):
        self.step_t += 1
        scalars = reference.adamw_step_scalars(LR, self.step_t, BETAS[0], BETAS[1], WD)
        if self.q8:
            F.adamw_q8_(
                self.params, self.grads, self.q8_masters, self.m, self.ms, self.v, self.vs, scalars, None, self.rng, 0,
                beta1=BETAS[0], beta2=BETAS[1], eps=EPS, sr_param=self.sr_param, sr_codes=True,
                backend=self.backend,
            )  # fmt: skip
            self.rng[1] += 1
        elif self.lowbit:
            F.adamw_bf16_(
                self.params, self.grads, self.remainders, self.m, self.v, [], scalars, None, self.rng, 0,
                beta1=BETAS[0], beta2=BETAS[1], eps=EPS, backend=self.backend,
            )  # fmt: skip
            if self.rng is not None:
                self.rng[1] += 1
        else:
            F.adamw_(
                self.params, self.grads, self.masters, self.m, self.v, [], scalars, None,
                beta1=BETAS[0], beta2=BETAS[1], eps=EPS, backend=self.backend,
            )  # fmt: skip

    def values(self):
        """The values being optimised: fp32 masters (joined from remainders, decoded from ulp8), else the params."""
        if self.masters:
            return self.masters
        if self.remainders:
            return [reference.join_master(p, r) for p, r in zip(self.params, self.remainders)]
        if self.corrections:
            return [reference.ulp8_decode(p, c) for p, c in zip(self.params, self.corrections)]
        return self.params


def _torch_opt(params, grads):
    for p, g in zip(params, grads):
        p.grad = g
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)


def _check_data(dtype, device):
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=gen).to(dtype).to(device) for n in CHECK_SIZES]
    grads = [[torch.randn(n, generator=gen).to(dtype).to(device) for n in CHECK_SIZES] for _ in range(3)]
    return params, grads


def _reference_run(params, grads_per_step, kind):
    st = _FastampState([p.clone() for p in params], None, kind, "torch")
    for grads in grads_per_step:
        st.grads = grads
        st()
    return st


def make_torch_check(device):
    def check():
        params, grads = _check_data(torch.float32, device)
        want = _reference_run(params, grads, "fp32").params
        mine = [p.clone() for p in params]
        opt = _torch_opt(mine, grads[0])
        for g in grads:
            for p, gi in zip(mine, g):
                p.grad = gi
            opt.step()
        err = max(common.assert_close(f"param[{i}]", a, b) for i, (a, b) in enumerate(zip(mine, want)))
        return f"vs reference after 3 steps: max abs error {err:.2g}"

    return check


def make_fastamp_check(kind, backend, device):
    dtype = DTYPES[kind]
    master, _, sr, _ = KINDS[kind]

    def check():
        params, grads = _check_data(dtype, device)
        ref = _reference_run(params, grads, kind)
        st = _FastampState([p.clone() for p in params], None, kind, backend)
        for g in grads:
            st.grads = g
            st()
        err = max(common.assert_close(f"value[{i}]", a, b) for i, (a, b) in enumerate(zip(st.values(), ref.values())))
        msg = f"vs reference after 3 steps: max abs error {err:.2g}"
        if kind in Q8_KINDS:
            for name in ("m", "ms", "v", "vs", "corrections"):
                for i, (a, b) in enumerate(zip(getattr(st, name), getattr(ref, name))):
                    if not torch.equal(a, b):
                        raise AssertionError(f"q8 {name}[{i}] differs from the reference's bytes")
            msg += "; q8 codes and scales" + (" and ulp8 corrections" if master == "ulp8" else "")
            msg += " bit-identical to the reference"
        if master == "remainder" and not KINDS[kind][2]:
            # the remainder master must follow the fp32-master trajectory bit for bit (issue #7)
            fp32_master = _reference_run(params, grads, "bf16").masters
            for i, (a, b) in enumerate(zip(st.values(), fp32_master)):
                if not torch.equal(a, b):
                    raise AssertionError(f"remainder master[{i}] is not bit-identical to the fp32-master run")
            msg += "; joined masters bit-identical to the fp32-master reference"
        if master != "none" or sr:
            for i, (a, b) in enumerate(zip(st.params, ref.params)):
                if not torch.equal(a, b):
                    raise AssertionError(f"param[{i}] differs from the reference's bf16 param")
            msg += "; params bit-identical to the reference"
        if master == "fp32":
            for i, (p, m) in enumerate(zip(st.params, st.masters)):
                if not torch.equal(p, m.to(dtype)):
                    raise AssertionError(f"param[{i}] is not its master rounded to {dtype}")
            msg += "; params == rounded masters"
        return msg

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
                traffic=TRAFFIC["fp32"],
            )
        ]
        from fastamp import backends as fb

        for b in backends:
            for d in dtypes:
                dt = DTYPES[d]
                if d in Q8_KINDS and not fb.available(b, "adamw_q8_", device)[0]:
                    continue

                def fa_setup(d=d, dt=dt, b=b):
                    params = [torch.randn(per, device=device).to(dt) for _ in range(n_tensors)]
                    grads = [torch.randn(per, device=device).to(dt) for _ in range(n_tensors)]
                    return _FastampState(params, grads, d, b)

                out.append(
                    Provider(
                        f"fastamp-{b}",
                        "adamw",
                        d,
                        KINDS[d][3],
                        fa_setup,
                        make_fastamp_check(d, b, device),
                        baseline="torch",
                        notes=NOTES[d] + ("; the torch backend is the plain-torch reference" if b == "torch" else ""),
                        traffic=TRAFFIC[d],
                    )
                )
        return out

    return build


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser)
    parser.add_argument(
        "--dtypes",
        default="fp32,bf16,bf16-remainder,bf16-sr,bf16-10B",
        help=f"fastamp rows: param dtype and master kind, some of {','.join(DTYPES)}",
    )
    args = parser.parse_args(argv)
    device = common.resolve_device(args.device)
    return common.run_benchmark(
        args,
        "bench_adamw",
        "adamw_",
        make_providers(args, device),
        "fused AdamW pass: fastamp vs torch fused",
        summarise=_remainder_vs_master,
    )


def _remainder_vs_master(rows):
    """Issue #7: the remainder step (26 B) side by side with the fp32-master step (28 B), same backend and size."""
    return common.ratio_lines(
        rows,
        [("adamw", "bf16-remainder", "adamw", "bf16")],
        "Remainder masters vs fp32 masters (bf16 params, same backend, same run; issue #7 asks for a time ratio <= 1):",
    )


if __name__ == "__main__":
    main()
