"""The executable specification of every fastamp op, in plain torch.

Every backend (C++ CPU, CUDA, Triton) must agree with these functions; the per-op notes
say whether the agreement is bit for bit or within a tolerance (see
``tests/tolerances.py``). They are also the ``torch`` backend, used where nothing faster is
available. All maths is fp32 (fp64 for fp64 tensors), rounded once on store; no function
here reads a device value on the host.

The per-element results are the same on every CPU: they use only operations that are exact
or correctly rounded whatever torch dispatches to (IEEE ``+ - * /`` as separate kernels, never
``add(alpha=)``/``addcdiv``/``lerp``, which may fuse a multiply-add on some instruction sets;
conversions; comparisons; integer maths) and :func:`sqrt_rn` for square roots (torch's own
CPU ``sqrt`` varies with the CPU vendor). Not covered: the sum of squares (a torch
reduction, whose order follows the instruction set and thread count; within
``tolerances.SUMSQ_RTOL``) and the fp32 step scalars of :func:`adamw_step_scalars` (see there).

The per-element C++ twin of this package is ``csrc/fastamp_math.h``, and of each update rule ``csrc/rules/<name>.h``.

Modules: :mod:`~fastamp.reference.amp` (the scaler's ops), :mod:`~fastamp.reference.optim`
(the optimizers' generic op ``optim_``: update rules x master and state formats, the older
per-rule ops as wrappers of it, and the step scalars), :mod:`~fastamp.reference.formats` (random bits,
stochastic rounding, bf16 + int16 masters), :mod:`~fastamp.reference.q8` (8-bit block-scaled
moments), :mod:`~fastamp.reference.ulp8` (16-bit param + int8 master correction),
:mod:`~fastamp.reference.layout` (what each state format stores, bytes per param),
:mod:`~fastamp.reference.numerics` (:func:`sqrt_rn`). Every public name is re-exported
here: ``fastamp.reference.adamw_`` etc., and :func:`fastamp.backends.get_impl` finds the
``torch`` backend's op by its name here.
"""

from fastamp.reference.amp import inv_scale, unscale_check_, unscale_check_stats_, update_scale_
from fastamp.reference.formats import join_master, round_bf16_stochastic, split_master, sr_random16
from fastamp.reference.layout import state_bytes_per_param
from fastamp.reference.numerics import sqrt_rn
from fastamp.reference.optim import (
    adamw_,
    adamw_bf16_,
    adamw_q8_,
    adamw_step_scalars,
    lion_,
    lion_q8_,
    lion_sign,
    lion_step_scalars,
    one_state_q8,
    optim_,
    scalar_rows,
    sgd_,
    sgd_q8_,
    sgd_step_scalars,
)
from fastamp.reference.q8 import q8_decode_m, q8_decode_v, q8_encode_m, q8_encode_v
from fastamp.reference.ulp8 import ulp8_decode, ulp8_encode

__all__ = [
    "unscale_check_",
    "update_scale_",
    "inv_scale",
    "adamw_",
    "adamw_step_scalars",
    "adamw_bf16_",
    "adamw_q8_",
    "sgd_",
    "sgd_q8_",
    "one_state_q8",
    "sgd_step_scalars",
    "lion_",
    "lion_q8_",
    "lion_step_scalars",
    "lion_sign",
    "scalar_rows",
    "optim_",
    "unscale_check_stats_",
    "split_master",
    "join_master",
    "sr_random16",
    "round_bf16_stochastic",
    "sqrt_rn",
    "q8_encode_m",
    "q8_decode_m",
    "q8_encode_v",
    "q8_decode_v",
    "ulp8_encode",
    "ulp8_decode",
    "state_bytes_per_param",
]
