"""Numerics shared by the reference ops: the compute dtype, a correctly rounded sqrt, fp32 constants.

Only operations that are exact or correctly rounded whatever torch dispatches to are used
(see :mod:`fastamp.reference`); :func:`sqrt_rn` is the one square root of the spec.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def sqrt_rn(x: Tensor) -> Tensor:
    """Correctly rounded square root of an fp32 (or fp16/bf16) tensor, the same on every CPU.

    torch's CPU ``sqrt`` is not correctly rounded and its error depends on the CPU: its
    vectorised kernels go through vendor-dispatched libraries (measured with torch 2.13:
    fp32 one ulp off on ~17% of inputs on an AMD EPYC, ~0.7% on a Xeon; fp64 one ulp off on
    ~1.3% on the EPYC; ``benchmarks/portable_ops_check.py``). So the root is taken in fp64
    and rounded once. That is correctly rounded whenever the fp64 sqrt is merely faithful
    (error below one fp64 ulp), not only when it is exact: the square root of an fp32 value
    is never within 2 fp64 ulps of an fp32 rounding midpoint (a midpoint ``m`` has 25
    significant bits, so ``m * m`` has 49-50 and differs from any 24-bit fp32 by at least
    ``2**-50 * m * m``, which puts ``sqrt`` at least ``2**-51 * m`` from ``m``), so an error
    of one fp64 ulp cannot move it across. ``tests/spec/test_reference.py`` checks this on the
    hardest inputs with the fp64 root pushed one ulp either way. This is what ``sqrtf``
    (the native kernels) and ``tl.sqrt_rn`` (Triton) compute.

    fp64 input is returned as ``x.sqrt()`` (fp64 has no wider type to round from); on MPS,
    which has no fp64, fp32 ``sqrt`` is used.
    """
    if x.dtype == torch.float64 or x.device.type == "mps":
        return x.sqrt()
    return x.double().sqrt().to(x.dtype)


def _round_f32(x: float) -> float:
    # Python float -> nearest fp32 value on the host (inf past fp32's range, as the kernels'
    # static_cast<float>), so torch.full never sees an out-of-range value.
    return float(torch.tensor(float(x), dtype=torch.float64).float())


def _f32(x: float, dev) -> Tensor:
    # torch.full, not torch.tensor: the latter copies from host memory (a sync on CUDA)
    return torch.full((), x, dtype=torch.float32, device=dev)
