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

from fastamp.reference.optim import NESTEROV

RULE_ADAMW, RULE_SGD, RULE_LION = 0, 1, 2
# the kernel's RULE for each name optim_ takes (the ids of csrc/optim_rules.h: one order for every backend)
RULE_IDS = {"adamw": RULE_ADAMW, "sgd": RULE_SGD, "lion": RULE_LION}


def host_args(rule: str, hyper, flags: int, n_state: int, maximize: bool) -> tuple:
    """What the kernel takes for a call of ``rule``, computed on the host once per call: its five fp32
    hyperparameters (rounded as the reference's ``_f32``) and its runtime ints ``(maximize,
    lerp_small, nesterov, has_weight_decay)``: flags that only pick an operation (0 where the rule has
    no such choice)."""
    f = C.to_f32
    if rule == "adamw":
        beta1, beta2, eps = hyper
        hyper5 = (f(beta1), f(1.0 - beta1), f(beta2), f(1.0 - beta2), f(eps))
        return hyper5, (int(maximize), int(C.lerp_small(beta1)), 0, 0)
    if rule == "sgd":
        momentum, dampening, weight_decay = hyper
        nesterov = int(bool(flags & NESTEROV) and n_state > 0)
        hyper5 = (f(momentum), f(1.0 - dampening), f(weight_decay), 0.0, 0.0)
        return hyper5, (int(maximize), 0, nesterov, int(weight_decay != 0))
    beta1, beta2 = hyper
    return (f(beta1), f(1.0 - beta1), f(beta2), f(1.0 - beta2), 0.0), (int(maximize), 0, 0, 0)


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


@triton.jit
def step(
    p, g, s0, s1, s2, scalars_ptr, hyper0, hyper1, hyper2, hyper3, hyper4, maximize, lerp_small, nesterov,
    has_weight_decay, RULE: tl.constexpr, N_STATE: tl.constexpr, RN: tl.constexpr,
):  # fmt: skip
    """The rule ``RULE`` (:data:`RULE_IDS`) on one block: ``(p, state 0, state 1, state 2, root)``, the
    states a rule does not keep standing in as its first one, ``root`` the square root a q8 v code of
    AdamW encodes (the first state for the other rules; unused). The arguments as the kernel got them
    from :func:`host_args`; ``s0``-``s2`` the decoded states (``p`` where there are none)."""
    if RULE == 0:
        pv, n0, n1, n2, root = adamw(
            p, g, s0, s1, s2, scalars_ptr, hyper0, hyper1, hyper2, hyper3, hyper4, maximize, lerp_small,
            N_STATE > 2, RN,
        )  # fmt: skip
    elif RULE == 1:
        pv, n0 = sgd(
            p, g, s0, scalars_ptr, hyper0, hyper1, hyper2, maximize, nesterov, has_weight_decay, N_STATE > 0
        )  # fmt: skip
        n1 = n0
        n2 = n0
        root = n0
    else:
        pv, n0 = lion(p, g, s0, scalars_ptr, hyper0, hyper1, hyper2, hyper3, maximize)
        n1 = n0
        n2 = n0
        root = n0
    return pv, n0, n1, n2, root
