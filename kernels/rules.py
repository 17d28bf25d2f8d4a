"""The update rules of the generic optimizer kernel (``optim.py``): each rule's element maths, once.

Twins of the ``step`` functions of :data:`fastamp.reference.optim.RULES`, on fp32 values: the value
optimised ``p`` (decoded from its master format), the raw grad ``g`` (fp32, not yet multiplied by
``grad_mul``), the rule's states (decoded from their format) and its step-scalar row at
``scalars_ptr`` (``[k]`` floats, read per block: one address for every lane, cached; live across
the chunk loop their pointer takes fewer registers than the values do). Each returns the new fp32
value and states, which the kernel encodes again. One rounding per operation, in the reference's
order, no FMA (the kernel is compiled without contraction); AdamW's square root and divisions are
the correctly rounded ones of ``RN`` (``_common.sqrt_rn`` / ``div_rn``).

Hyperparameters arrive as fp32 numbers rounded on the host (``_common.to_f32``, as the reference's
``_f32``), the flags that only pick an operation (maximize, torch.lerp's branch, nesterov, weight
decay on/off) as runtime ints: they compile no new variant.
"""

import triton
import triton.language as tl
from fastamp.kernels import _common as C

RULE_ADAMW, RULE_SGD, RULE_LION = 0, 1, 2


@triton.jit
def adamw(
    p, g, m, v, vmax, scalars_ptr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, maximize, lerp_small,
    AMSGRAD: tl.constexpr, RN: tl.constexpr,
):  # fmt: skip
    """AdamW (``[step_size, bc2_sqrt, decay, grad_mul]``): ``(p, exp_avg, exp_avg_sq, d, sqrt_rn(d))``,
    ``d`` the second moment the update divides by (max_exp_avg_sq under AMSGRAD, else exp_avg_sq)."""
    step_size = tl.load(scalars_ptr)
    bc2_sqrt = tl.load(scalars_ptr + 1)
    decay = tl.load(scalars_ptr + 2)
    grad_mul = tl.load(scalars_ptr + 3)
    g = g * grad_mul
    if maximize != 0:
        g = C.neg(g)
    pv = p * decay
    diff = g - m
    # torch.lerp(m, g, 1 - beta1), on the branch lerp_small picked on the host (the reference's _lerp_low)
    if lerp_small != 0:
        mv = m + one_minus_beta1 * diff
    else:
        mv = g - diff * beta1
    vv = v * beta2 + (one_minus_beta2 * g) * g
    if AMSGRAD:
        d = C.nan_maximum(vmax, vv)
    else:
        d = vv
    root = C.sqrt_rn(d, RN)
    denom = C.div_rn(root, bc2_sqrt, RN) + eps
    pv = pv - C.div_rn(step_size * mv, denom, RN)
    return pv, mv, vv, d, root


@triton.jit
def sgd(
    p, g, buf, scalars_ptr, momentum, one_minus_dampening, weight_decay, maximize, nesterov, has_weight_decay,
    HAS_MOMENTUM: tl.constexpr,
):  # fmt: skip
    """SGD, torch.optim.SGD's update (``[lr, grad_mul, is_first]``): ``(p, momentum_buffer)`` (the
    buffer unchanged without a momentum). On the first step the old buffer is never read (it may hold
    anything): the new one is the grad."""
    lr = tl.load(scalars_ptr)
    grad_mul = tl.load(scalars_ptr + 1)
    first = tl.load(scalars_ptr + 2) != 0
    g = g * grad_mul
    if maximize != 0:
        g = C.neg(g)
    if has_weight_decay != 0:
        g = g + weight_decay * p
    nb = buf
    if HAS_MOMENTUM:
        nb = tl.where(first, g, buf * momentum + one_minus_dampening * g)
        if nesterov != 0:
            g = g + momentum * nb
        else:
            g = nb
    return p - lr * g, nb


@triton.jit
def lion_sign(c):
    """reference.lion_sign: +-1, or ``c`` itself for +-0 and NaN (its two comparisons, in its order)."""
    return tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, c))


@triton.jit
def lion(p, g, m, scalars_ptr, beta1, one_minus_beta1, beta2, one_minus_beta2, maximize):
    """Lion (``[lr, decay, grad_mul]``): ``(p, exp_avg)``: decoupled decay, the sign of the interpolated momentum."""
    lr = tl.load(scalars_ptr)
    decay = tl.load(scalars_ptr + 1)
    grad_mul = tl.load(scalars_ptr + 2)
    g = g * grad_mul
    if maximize != 0:
        g = C.neg(g)
    c = m * beta1 + g * one_minus_beta1
    pv = p * decay - lr * lion_sign(c)
    return pv, m * beta2 + g * one_minus_beta2
