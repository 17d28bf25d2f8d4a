"""Loading of the native extension and fake (meta) impls of its ops.

The schemas are defined in C++ (``csrc/ops.cpp``, ``TORCH_LIBRARY(fastamp, m)``). Importing
this module never fails: if ``fastamp._C`` is missing or does not load against the
installed torch, ``NATIVE_ERROR`` says why and the native backend is unavailable.
"""

from __future__ import annotations

import torch

NATIVE_LOADED = False
NATIVE_ERROR: str | None = None

try:
    from fastamp import _C  # noqa: F401  (loading it runs the TORCH_LIBRARY registrations)

    NATIVE_LOADED = True
except Exception as e:  # ImportError, or OSError / undefined symbol against another torch
    NATIVE_ERROR = f"{type(e).__name__}: {e}"

NATIVE_OPS = ("unscale_check_", "update_scale_", "adamw_", "adamw_bf16_", "sgd_", "unscale_check_stats_")


def native_has_kernel(op: str, device_type: str) -> bool:
    """Whether ``fastamp::op`` has a kernel registered for ``device_type`` ('cpu'/'cuda')."""
    if not NATIVE_LOADED:
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"fastamp::{op}", key))
    except RuntimeError:
        return False


def build_info() -> str | None:
    return torch.ops.fastamp.build_info() if NATIVE_LOADED else None


def _register_fakes() -> None:
    """Fake impls for the native ops this build of _C defines (a stale build may lack new ones)."""
    if not NATIVE_LOADED:
        return

    @_fake("unscale_check_")
    def _unscale_check_fake(grads, found_inf, inv_scale, write_back, compute_sumsq):
        _only_fake("unscale_check_", found_inf)
        return found_inf.new_empty((), dtype=torch.float32)

    @_fake("update_scale_")
    def _update_scale_fake(
        scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
        min_scale,
        max_scale,
    ):
        _only_fake("update_scale_", scale)
        return None

    @_fake("adamw_")
    def _adamw_fake(
        params,
        grads,
        masters,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        step_scalars,
        found_inf,
        beta1,
        beta2,
        eps,
        amsgrad,
        maximize,
    ):
        _only_fake("adamw_", step_scalars)
        return None

    @_fake("adamw_bf16_")
    def _adamw_bf16_fake(
        params,
        grads,
        remainders,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        step_scalars,
        found_inf,
        rng,
        rng_base,
        beta1,
        beta2,
        eps,
        amsgrad,
        maximize,
    ):
        _only_fake("adamw_bf16_", step_scalars)
        return None

    @_fake("sgd_")
    def _sgd_fake(
        params,
        grads,
        masters,
        momentum_buffers,
        step_scalars,
        found_inf,
        rng,
        rng_base,
        momentum,
        dampening,
        weight_decay,
        nesterov,
        maximize,
    ):
        _only_fake("sgd_", step_scalars)
        return None

    @_fake("unscale_check_stats_")
    def _unscale_check_stats_fake(grads, found_inf, inv_scale, write_back, compute_sumsq, counts, absmax):
        _only_fake("unscale_check_stats_", found_inf)
        return found_inf.new_empty((), dtype=torch.float32)


def _only_fake(op: str, t) -> None:
    # The fake impl also serves the Meta dispatch key: a call mixing real tensors with meta
    # ones lands here instead of on a kernel. Refuse it rather than return garbage.
    from torch._subclasses.fake_tensor import is_fake

    if not (t.is_meta or is_fake(t)):
        raise RuntimeError(f"fastamp::{op}: tensors on different devices (a meta tensor among {t.device} tensors)")


def _fake(op: str):
    def deco(fn):
        if hasattr(torch.ops.fastamp, op):
            torch.library.register_fake(f"fastamp::{op}")(fn)
        return fn

    return deco


_register_fakes()
