"""The user-facing argument checks of every op: one place, one message per mistake.

Which layer checks what, and why:

* **here** (called by :mod:`fastamp.functional`): everything a caller can get wrong, with a
  message naming the op, the argument and the index: types, devices, list lengths, dtypes,
  element counts, layouts, contiguity, hyperparameter ranges, the step-scalar layouts
  (``[k]`` shared, or ``[n, k]``: one row per tensor). A
  refused call raises before any backend runs, so it changes nothing.
* **the native kernels** (``csrc/cpu/*.cpp`` with ``csrc/cpu/optim_checks.h``,
  ``csrc/cuda/bindings.cpp``): every check their memory accesses rely on, always, before
  touching anything (``torch.ops.fastamp.*`` is callable directly). Because they check, the
  native path of ``functional`` calls the kernel first and runs the checks here only when it
  refuses the input, for the clearer message: with thousands of small tensors these
  per-tensor Python checks cost more than the kernel.
* **the Triton launchers** (``kernels/``): cheap guards of what their pointer tables rely on
  (device, dtype, element count, contiguity), raising ``RuntimeError`` with a terse message
  (``kernels/_common.guard_lists``); the messages are here.
* **the torch reference**: the list and device checks below (``strict=False``); it accepts
  more layouts than the kernels (strided state, fp64), so the kernel-only checks are skipped.
"""

from __future__ import annotations

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_STATE_DTYPES = (torch.float32, torch.bfloat16)


def scalar_tensor(op: str, name: str, t, dtype=torch.float32) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} must be a 1-element tensor, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{op}: {name} must be a {dtype} tensor, got {t.dtype}")


def unscale_check(op: str, grads, found_inf, inv_scale, counts, absmax) -> None:
    """The scalars and statistics buffers of ``unscale_check_`` (each grad: :func:`unscale_grad`)."""
    scalar_tensor(op, "found_inf", found_inf)
    scalar_tensor(op, "inv_scale", inv_scale)
    dev = found_inf.device
    if inv_scale.device != dev:
        raise ValueError(f"{op}: inv_scale is on {inv_scale.device} but found_inf is on {dev}")
    if counts is None and absmax is None:
        return
    if counts is None or absmax is None:
        raise ValueError(f"{op}: counts and absmax must be given together")
    n = len(grads)
    if counts.dtype != torch.int64 or tuple(counts.shape) != (n, 3) or counts.device != dev:
        raise ValueError(
            f"{op}: counts must be an int64 [{n}, 3] tensor on {dev}, got {counts.dtype} "
            f"{tuple(counts.shape)} on {counts.device}"
        )
    if absmax.dtype != torch.float32 or tuple(absmax.shape) != (n,) or absmax.device != dev:
        raise ValueError(
            f"{op}: absmax must be an fp32 [{n}] tensor on {dev}, got {absmax.dtype} "
            f"{tuple(absmax.shape)} on {absmax.device}"
        )


def unscale_grad(op: str, i: int, g, dev: torch.device) -> Tensor:
    """Grad ``i`` of ``unscale_check_``: a floating-point tensor on ``dev``; its values (sparse grads)."""
    if not isinstance(g, Tensor):
        raise TypeError(f"{op}: grads[{i}] must be a Tensor, got {type(g).__name__}")
    if g.device != dev:
        raise ValueError(f"{op}: grads[{i}] is on {g.device} but found_inf is on {dev}")
    if not g.is_floating_point():
        raise TypeError(f"{op}: grads[{i}] must be floating point, got {g.dtype}")
    vals = g._values() if g.is_sparse else g
    if vals.layout != torch.strided:
        raise TypeError(f"{op}: grads[{i}] has unsupported layout {g.layout}")
    return vals


def update_scale(op: str, scale, growth_tracker, hysteresis_tracker, found_inf) -> None:
    scalar_tensor(op, "scale", scale)
    scalar_tensor(op, "growth_tracker", growth_tracker, torch.int32)
    scalar_tensor(op, "hysteresis_tracker", hysteresis_tracker, torch.int32)
    scalar_tensor(op, "found_inf", found_inf)
    dev = scale.device
    for name, t in (
        ("growth_tracker", growth_tracker),
        ("hysteresis_tracker", hysteresis_tracker),
        ("found_inf", found_inf),
    ):
        if t.device != dev:
            raise ValueError(f"{op}: {name} is on {t.device} but scale is on {dev}")
    for name, t in (("scale", scale), ("growth_tracker", growth_tracker), ("hysteresis_tracker", hysteresis_tracker)):
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")


def adam_hyper(op: str, beta1: float, beta2: float, eps: float) -> None:
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1), got {b}")
    if not eps >= 0.0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")


def _lists(op: str, dev, params, lists: dict) -> None:
    """Every list as long as ``params``; every entry a Tensor on ``dev``."""
    n = len(params)
    for name, lst in lists.items():
        if len(lst) != n:
            raise ValueError(f"{op}: got {n} params but {len(lst)} {name}")
    for name, lst in {**lists, "params": params}.items():
        for i, t in enumerate(lst):
            if not isinstance(t, Tensor):
                raise TypeError(f"{op}: {name}[{i}] must be a Tensor, got {type(t).__name__}")
            if t.device != dev:
                raise ValueError(f"{op}: {name}[{i}] is on {t.device} but params[0] is on {dev}")


def _dtype_names(dtypes) -> str:
    if dtypes == FLOAT_DTYPES:
        return "a floating point tensor"
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def _streams(op: str, params, grads, param_dtypes, state: list) -> None:
    """The kernels' per-tensor rules: dense contiguous params, dense grads of as many elements,
    and each ``(name, tensors, dtypes)`` of ``state`` contiguous, of ``dtypes``, as long as its param
    (``(name, tensors, dtypes, numel_of)``: of ``numel_of(param numel)`` elements, e.g. block scales)."""
    for i, p in enumerate(params):
        g = grads[i]
        if p.dtype not in param_dtypes:
            raise TypeError(f"{op}: params[{i}] must be {_dtype_names(param_dtypes)}, got {p.dtype}")
        if g.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: grads[{i}] must be a floating point tensor, got {g.dtype}")
        if g.layout != torch.strided or p.layout != torch.strided:
            raise TypeError(f"{op}: params[{i}] and grads[{i}] must be dense, got {p.layout} and {g.layout}")
        if g.numel() != p.numel():
            raise ValueError(f"{op}: grads[{i}] has {g.numel()} elements but params[{i}] has {p.numel()}")
        if not p.is_contiguous():
            raise ValueError(f"{op}: params[{i}] must be contiguous")
        for name, lst, dtypes, *numel_of in state:
            s = lst[i]
            if s.dtype not in dtypes:
                raise TypeError(f"{op}: {name}[{i}] must be {_dtype_names(dtypes)}, got {s.dtype}")
            want = numel_of[0](p.numel()) if numel_of else p.numel()
            if s.numel() != want:
                raise ValueError(
                    f"{op}: {name}[{i}] has {s.numel()} elements but params[{i}] has {p.numel()}"
                    + ("" if want == p.numel() else f", which need {want}")
                )
            if not s.is_contiguous():
                raise ValueError(f"{op}: {name}[{i}] must be contiguous")


def step_scalar_rows(op: str, step_scalars, n: int, count: int, layout: str) -> int:
    """The row stride of ``step_scalars``: 0 for ``count`` floats shared by the ``n`` tensors (shape
    ``[count]``), ``count`` for one row per tensor (shape ``[n, count]``, contiguous fp32, row i for
    tensor i). Anything else raises ValueError naming both shapes."""
    if isinstance(step_scalars, Tensor) and step_scalars.is_floating_point():
        shape = tuple(step_scalars.shape)
        if shape == (count,):
            return 0
        if shape == (n, count) and step_scalars.dtype == torch.float32 and step_scalars.is_contiguous():
            return count
    got = (
        f"shape {tuple(step_scalars.shape)} {step_scalars.dtype}"
        + ("" if step_scalars.is_contiguous() else " (not contiguous)")
        if isinstance(step_scalars, Tensor)
        else type(step_scalars).__name__
    )
    raise ValueError(
        f"{op}: step_scalars must be {count} floats {layout}, shape [{count}] or [{n}, {count}] "
        f"(shared by all tensors, or one contiguous fp32 row per tensor), got {got}"
    )


def _device_scalars(op: str, dev, step_scalars, n: int, count: int, layout: str, found_inf, rng) -> None:
    step_scalar_rows(op, step_scalars, n, count, layout)
    if step_scalars.device != dev:
        raise ValueError(f"{op}: step_scalars is on {step_scalars.device} but params are on {dev}")
    if found_inf is not None:
        if found_inf.numel() != 1:
            raise ValueError(f"{op}: found_inf must be a 1-element tensor, got shape {tuple(found_inf.shape)}")
        if found_inf.device != dev:
            raise ValueError(f"{op}: found_inf is on {found_inf.device} but params are on {dev}")
    if rng is not None:
        if rng.dtype != torch.int64 or rng.numel() < 2:
            raise ValueError(f"{op}: rng must be an int64 tensor [seed, counter], got {rng.dtype} {tuple(rng.shape)}")
        if rng.device != dev:
            raise ValueError(f"{op}: rng is on {rng.device} but params are on {dev}")


def adamw(
    op: str,
    dev,
    params,
    grads,
    masters,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    step_scalars,
    found_inf,
    amsgrad: bool,
    rng=None,
    *,
    strict: bool,
) -> None:
    """``adamw_`` / ``adamw_bf16_`` (``masters`` are the remainders of the latter, ``rng`` its own)."""
    bf16 = op == "adamw_bf16_"
    masters_name = "remainders" if bf16 else "masters"
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if len(masters):
        lists[masters_name] = masters
    if amsgrad:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    _lists(op, dev, params, lists)
    if not strict:
        return
    _device_scalars(op, dev, step_scalars, len(params), 4, "[step_size, bc2_sqrt, decay, grad_mul]", found_inf, rng)
    moments = _STATE_DTYPES if bf16 else (torch.float32,)
    state = [("exp_avgs", exp_avgs, moments), ("exp_avg_sqs", exp_avg_sqs, moments)]
    if len(masters):
        state.append((masters_name, masters, (torch.int16,) if bf16 else (torch.float32,)))
    if amsgrad:
        state.append(("max_exp_avg_sqs", max_exp_avg_sqs, moments))
    _streams(op, params, grads, (torch.bfloat16,) if bf16 else FLOAT_DTYPES, state)


def adamw_q8(
    op: str,
    dev,
    params,
    grads,
    masters,
    exp_avg_codes,
    exp_avg_scales,
    exp_avg_sq_codes,
    exp_avg_sq_scales,
    step_scalars,
    found_inf,
    rng,
    sr_param: bool,
    sr_codes: bool,
    *,
    strict: bool,
) -> None:
    """``adamw_q8_``: uint8 codes shaped like the params, uint8 scales of ``ceil(n / 32)`` per moment."""
    from fastamp.reference.q8 import num_blocks

    lists = {
        "grads": grads,
        "exp_avg_codes": exp_avg_codes,
        "exp_avg_scales": exp_avg_scales,
        "exp_avg_sq_codes": exp_avg_sq_codes,
        "exp_avg_sq_scales": exp_avg_sq_scales,
    }
    if len(masters):
        lists["masters"] = masters
    _lists(op, dev, params, lists)
    if (sr_param or sr_codes) and rng is None:
        raise ValueError(f"{op}: sr_param / sr_codes need rng (an int64 tensor [seed, counter] on the device)")
    # every backend, the reference included (strict or not): it would write tensor 0 before
    # finding tensor 1's scales of the wrong length
    _device_scalars(op, dev, step_scalars, len(params), 4, "[step_size, bc2_sqrt, decay, grad_mul]", found_inf, rng)
    mdt = masters[0].dtype if len(masters) else None
    for i, p in enumerate(params):
        if mdt == torch.int16 and p.dtype != torch.bfloat16:
            raise TypeError(f"{op}: int16 remainders need bfloat16 params, but params[{i}] is {p.dtype}")
        if mdt == torch.int8 and p.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(
                f"{op}: int8 ulp8 corrections need bfloat16 or float16 params, but params[{i}] is {p.dtype}"
            )
    u8 = (torch.uint8,)
    state = [
        ("exp_avg_codes", exp_avg_codes, u8),
        ("exp_avg_scales", exp_avg_scales, u8, num_blocks),
        ("exp_avg_sq_codes", exp_avg_sq_codes, u8),
        ("exp_avg_sq_scales", exp_avg_sq_scales, u8, num_blocks),
    ]
    if len(masters):
        state.append(("masters", masters, (mdt,) if mdt in (torch.int16, torch.int8) else (torch.float32,)))
    _streams(op, params, grads, (torch.float32, torch.float16, torch.bfloat16), state)


def sgd(
    op: str, dev, params, grads, masters, momentum_buffers, step_scalars, found_inf, rng, momentum, *, strict: bool
) -> None:
    state = ("momentum_buffers", momentum_buffers) if momentum != 0 else None
    _master_and_state(
        op, dev, params, grads, masters, state, step_scalars, found_inf, rng, "[lr, grad_mul, is_first]", strict
    )


def lion(op: str, dev, params, grads, masters, exp_avgs, step_scalars, found_inf, rng, *, strict: bool) -> None:
    _master_and_state(op, dev, params, grads, masters, ("exp_avgs", exp_avgs), step_scalars, found_inf, rng,
                      "[lr, decay, grad_mul]", strict)  # fmt: skip


def lion_hyper(op: str, beta1: float, beta2: float) -> None:
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= b <= 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1], got {b}")


def _master_and_state(
    op: str, dev, params, grads, masters, state, step_scalars, found_inf, rng, layout: str, strict: bool
) -> None:
    """The ops of one optional master (fp32, or int16 remainders of bf16 params) and at most one fp32
    state stream ``state = (name, tensors)`` per param: ``sgd_`` and ``lion_``."""
    lists = {"grads": grads}
    if len(masters):
        lists["masters"] = masters
    if state is not None:
        lists[state[0]] = state[1]
    _lists(op, dev, params, lists)
    if not strict:
        return
    _device_scalars(op, dev, step_scalars, len(params), 3, layout, found_inf, rng)
    streams = _one_state_masters(op, params, masters)
    if state is not None:
        streams.append((*state, (torch.float32,)))
    _streams(op, params, grads, FLOAT_DTYPES, streams)


def _one_state_masters(op: str, params, masters) -> list:
    """The master stream of a one-state op (fp32, or int16 remainders of bf16 params), as :func:`_streams` takes it."""
    if not len(masters):
        return []
    remainder = masters[0].dtype == torch.int16
    if remainder:
        for i, p in enumerate(params):
            if p.dtype != torch.bfloat16:
                raise TypeError(f"{op}: int16 remainders need bfloat16 params, but params[{i}] is {p.dtype}")
    return [("masters", masters, (torch.int16,) if remainder else (torch.float32,))]


def one_state_q8(
    op: str, dev, params, grads, masters, codes, scales, step_scalars, found_inf, rng, sr_param, sr_codes, names,
    layout: str, *, strict: bool,
) -> None:  # fmt: skip
    """``sgd_q8_`` / ``lion_q8_``: uint8 codes shaped like the params, uint8 scales of ``ceil(n / 32)``.

    Every backend, the reference included (strict or not): the composed step writes tensor 0
    before it would find tensor 1's scales of the wrong length. ``names``: the two lists' names.
    """
    from fastamp.reference.q8 import num_blocks

    lists = {"grads": grads, names[0]: codes, names[1]: scales}
    if len(masters):
        lists["masters"] = masters
    _lists(op, dev, params, lists)
    if (sr_param or sr_codes) and rng is None:
        raise ValueError(f"{op}: sr_param / sr_codes need rng (an int64 tensor [seed, counter] on the device)")
    _device_scalars(op, dev, step_scalars, len(params), 3, layout, found_inf, rng)
    u8 = (torch.uint8,)
    streams = _one_state_masters(op, params, masters)
    streams += [(names[0], codes, u8), (names[1], scales, u8, num_blocks)]
    _streams(op, params, grads, (torch.float32, torch.float16, torch.bfloat16), streams)


def optim_rule(op: str, rule, hyper, flags) -> None:
    """``optim_``'s rule, hyperparameters and flags (:data:`fastamp.reference.optim.RULES`)."""
    from fastamp.reference import optim as R

    r = R.RULES.get(rule) if isinstance(rule, str) else None
    if r is None:
        raise ValueError(f"{op}: unknown rule {rule!r}; expected one of {tuple(R.RULES)}")
    if len(hyper) != len(r.hyper):
        raise ValueError(f"{op}: rule {rule!r} takes hyper {list(r.hyper)}, got {len(hyper)} values")
    allowed = R.MAXIMIZE | R.SR_PARAM | R.SR_STATE | r.flags
    if isinstance(flags, bool) or not isinstance(flags, int) or flags & ~allowed:
        names = [name for bit, name in R.FLAG_NAMES.items() if bit & allowed]
        raise ValueError(f"{op}: flags {flags!r} are not a combination of rule {rule!r}'s {names}")
    try:
        r.check(hyper, flags)
    except ValueError as e:
        raise ValueError(f"{op}: {e}") from None


def optim(
    op: str, dev, params, grads, masters, states, step_scalars, found_inf, rng, rng_base, rule, hyper, flags, *,
    strict: bool,
) -> None:  # fmt: skip
    """``optim_``: the lists the rule and formats need, on ``dev``; with ``strict``, what the kernels rely on.

    ``masters``: empty, or one per param of one dtype (fp32; int16 remainders of bf16 params; int8
    ulp8 corrections of bf16 / fp16 params). ``states``: the rule's state lists
    (``RULES[rule].states(hyper, flags)``), each ``n`` tensors, all of one format: fp32, bf16,
    or q8 (uint8 codes shaped like the param, then uint8 scales of ``ceil(numel / 32)``).
    """
    from fastamp.reference import optim as R
    from fastamp.reference.q8 import num_blocks

    optim_rule(op, rule, hyper, flags)
    r = R.RULES[rule]
    n = len(params)
    defs = r.states(hyper, flags)
    fmt = R.state_format(states)
    per = R.streams_per_state(fmt)
    if fmt not in ("none", "fp32", "bf16", "q8"):
        raise TypeError(f"{op}: states must be float32, bfloat16 or uint8 (q8) tensors, got {states[0].dtype}")
    want = n * per * len(defs)
    if len(states) != want:
        keys = [d.key for d in defs]
        raise ValueError(
            f"{op}: rule {rule!r} keeps the states {keys} here, {per} list(s) of {n} tensors each in {fmt}: "
            f"{want} state tensors, got {len(states)}"
        )
    lists = {"grads": grads}
    if len(masters):
        lists["masters"] = masters
    names = []
    for j, d in enumerate(defs):
        for k in range(per):
            name = f"{d.key}{('_codes', '_scales')[k] if per == 2 else ''}"
            names.append(name)
            lists[name] = states[(j * per + k) * n : (j * per + k + 1) * n]
    _lists(op, dev, params, lists)
    if (flags & (R.SR_PARAM | R.SR_STATE)) and rng is None:
        raise ValueError(f"{op}: SR_PARAM / SR_STATE need rng (an int64 tensor [seed, counter] on the device)")
    _device_scalars(op, dev, step_scalars, n, len(r.scalars), f"[{', '.join(r.scalars)}]", found_inf, rng)
    mdt = masters[0].dtype if len(masters) else None
    for i, p in enumerate(params):
        if mdt == torch.int16 and p.dtype != torch.bfloat16:
            raise TypeError(f"{op}: int16 remainders need bfloat16 params, but params[{i}] is {p.dtype}")
        if mdt == torch.int8 and p.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(
                f"{op}: int8 ulp8 corrections need bfloat16 or float16 params, but params[{i}] is {p.dtype}"
            )
    if not strict and fmt != "q8":
        return
    streams = []
    if mdt is not None:
        streams.append(("masters", masters, (mdt,) if mdt in (torch.int16, torch.int8) else (torch.float32,)))
    dtype = {"fp32": (torch.float32,), "bf16": (torch.bfloat16,), "q8": (torch.uint8,)}.get(fmt)
    for k, name in enumerate(names):
        entry = (name, lists[name], dtype)
        streams.append(entry + (num_blocks,) if per == 2 and k % 2 else entry)
    _streams(op, params, grads, (torch.float32, torch.float16, torch.bfloat16) if strict else FLOAT_DTYPES, streams)
