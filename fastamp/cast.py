"""``fastamp.cast_model``: a whole model in fp16/bf16, with precision-sensitive layers kept fp32.

``model.half()`` puts BatchNorm's running statistics in fp16 (a variance above 65504 becomes
inf, after which the layer outputs a constant in eval mode) and its affine update in fp16.
:func:`cast_model` casts every parameter and floating buffer except those of the modules
named in ``keep_fp32``, and inserts casts at the boundaries of the kept modules (forward
pre/post hooks), so the low-precision layers see low-precision tensors and the kept ones
compute in fp32. Pair it with :class:`fastamp.optim.AdamW` (fp32 master weights for the
low-precision params; the kept fp32 params are their own masters) and, for fp16, with
:class:`fastamp.Scaler`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

import torch
from torch import Tensor, nn

from fastamp import health

__all__ = ["cast_model", "DEFAULT_KEEP_FP32"]


def _default_keep() -> tuple[type, ...]:
    # _NormBase covers BatchNorm{1,2,3}d, SyncBatchNorm, the lazy variants and InstanceNorm.
    kinds: list[type] = [nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm]
    if hasattr(nn, "RMSNorm"):  # torch >= 2.4
        kinds.append(nn.RMSNorm)
    return tuple(kinds)


DEFAULT_KEEP_FP32: tuple[type, ...] = _default_keep()

_LOW = (torch.float16, torch.bfloat16)


def _map_tensors(obj: Any, src: tuple[torch.dtype, ...], dst: torch.dtype) -> Any:
    if isinstance(obj, Tensor):
        return obj.to(dst) if obj.dtype in src else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(o, src, dst) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, src, dst) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, src, dst)) for k, v in obj.items())
    return obj


def _is_kept(name: str, module: nn.Module, kinds: tuple[type, ...], names: set, instances: set) -> bool:
    return isinstance(module, kinds) or name in names or id(module) in instances


def cast_model(
    model: nn.Module,
    dtype: torch.dtype = torch.float16,
    keep_fp32: Iterable[Union[type, str, nn.Module]] | None = None,
    *,
    cast_inputs: bool = True,
) -> nn.Module:
    """Cast ``model`` to ``dtype`` in place, keeping normalisation layers (and any you name) fp32.

    Example::

        >>> model = fastamp.cast_model(MyCNN(), torch.float16)          # BatchNorm stays fp32
        >>> model = fastamp.cast_model(net, torch.bfloat16, keep_fp32=fastamp.DEFAULT_KEEP_FP32 + ("head",))
        >>> opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)      # fp32 masters for fp16 params
        >>> scaler = fastamp.Scaler()                                   # fp16 needs loss scaling

    Args:
        model: the module; changed in place (parameters keep their identity, like ``.half()``)
            and returned. Cast before building the optimizer.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        keep_fp32: what stays fp32 (the whole subtree of each match): module classes,
            qualified module names (as in ``model.named_modules()``, e.g. ``"head"`` or
            ``"blocks.0.norm"``) and module instances, mixed freely. ``None`` (default) means
            :data:`DEFAULT_KEEP_FP32` (BatchNorm/InstanceNorm, LayerNorm, GroupNorm,
            LocalResponseNorm, RMSNorm); pass ``DEFAULT_KEEP_FP32 + (...)`` to add to it, or
            ``()`` to cast everything (as ``.half()``).
        cast_inputs: also cast the floating inputs of ``model.forward`` that are fp32 to
            ``dtype`` (so fp32 data can be fed as is). Outputs are left in the dtype of the
            last layer; compute the loss on ``out.float()``.

    A kept BatchNorm whose kernel takes low-precision input with fp32 weights and statistics
    (probed once per device type and dtype; true on CPU and CUDA in torch >= 2.6) keeps its
    fp32 params and statistics but gets no casts: it reads and writes ``dtype`` activations,
    as under autocast, so no fp32 copy of its input is kept for backward. Any other kept
    module gets a forward pre-hook that casts its fp16/bf16 floating tensor inputs to
    fp32 and a forward hook that casts its fp32 floating outputs to ``dtype``; integer
    tensors, fp64 tensors and non-tensors pass through. Integer buffers (e.g.
    ``num_batches_tracked``) are never cast. Existing ``.grad`` tensors are cast with their
    param. Hooks are registered once per call; the handles are in
    ``model._fastamp_cast_handles``.

    Guards: a BatchNorm (or InstanceNorm) that ends up in ``dtype`` warns once
    (:class:`fastamp.health.AmpPitfallWarning`); with ``dtype=torch.float16`` an optimizer
    step on fp16 params that no grad scaler drives warns once per optimizer (see
    :func:`fastamp.health.install_optimizer_guard`).
    """
    if dtype not in _LOW:
        raise ValueError(f"fastamp.cast_model: dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastamp.cast_model: model must be an nn.Module, got {type(model).__name__}")
    kinds: list[type] = []
    names = set()
    instances = set()
    all_names = {n for n, _ in model.named_modules()}
    for item in DEFAULT_KEEP_FP32 if keep_fp32 is None else keep_fp32:
        if isinstance(item, type) and issubclass(item, nn.Module):
            kinds.append(item)
        elif isinstance(item, str):
            if item not in all_names:
                raise ValueError(f"fastamp.cast_model: keep_fp32 names module {item!r}, which is not in the model")
            names.add(item)
        elif isinstance(item, nn.Module):
            instances.add(id(item))
        else:
            raise TypeError(
                "fastamp.cast_model: keep_fp32 entries must be nn.Module classes, module names or modules, "
                f"got {item!r}"
            )
    kinds_t = tuple(kinds)

    kept_roots: list[nn.Module] = []
    lowered_norms: list[str] = []

    def visit(prefix: str, module: nn.Module, inside_kept: bool) -> None:
        kept_here = not inside_kept and _is_kept(prefix, module, kinds_t, names, instances)
        if kept_here:
            kept_roots.append(module)
        keep = inside_kept or kept_here
        if not keep:
            _cast_own_tensors(module, dtype)
            if isinstance(module, nn.modules.batchnorm._NormBase) and (module.affine or module.track_running_stats):
                lowered_norms.append(prefix or type(module).__name__)
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child, keep)

    visit("", model, False)

    handles = list(getattr(model, "_fastamp_cast_handles", []))
    to_fp32 = _LOW
    for m in kept_roots:
        if m is model:
            continue
        if _batchnorm_takes_low_precision(m, dtype):
            # fp32 weights and statistics, low-precision input and output in one kernel: no
            # fp32 copy of the activation is kept for backward (what autocast does too).
            continue

        def pre_hook(_mod, args, kwargs):
            return _map_tensors(args, to_fp32, torch.float32), _map_tensors(kwargs, to_fp32, torch.float32)

        def post_hook(_mod, _args, output):
            return _map_tensors(output, (torch.float32,), dtype)

        handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(m.register_forward_hook(post_hook))
    if cast_inputs and model not in kept_roots:

        def input_hook(_mod, args, kwargs):
            return _map_tensors(args, (torch.float32,), dtype), _map_tensors(kwargs, (torch.float32,), dtype)

        handles.append(model.register_forward_pre_hook(input_hook, with_kwargs=True))
    model._fastamp_cast_handles = handles

    if lowered_norms:
        health.warn_norm_in_low_precision(lowered_norms, dtype, stacklevel=3)
    if dtype == torch.float16:
        health.install_optimizer_guard()
    return model


_MIXED_BN_OK: dict[tuple[str, torch.dtype], bool] = {}


def _batchnorm_takes_low_precision(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether this kept module is a BatchNorm whose kernel accepts ``dtype`` input with fp32
    params on its device (forward and backward), probed once per (device type, dtype)."""
    if type(module) not in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
        return False
    if any(m is not module for m in module.modules()):
        return False
    ref = next(iter(module.parameters()), None)
    if ref is None:
        ref = next(iter(module.buffers()), None)
    if ref is None or ref.dtype != torch.float32:
        return False
    dev = ref.device
    key = (dev.type, dtype)
    if key not in _MIXED_BN_OK:
        try:
            x = torch.randn(4, 3, 2, device=dev).to(dtype).requires_grad_()
            w = torch.ones(3, device=dev, requires_grad=True)
            b = torch.zeros(3, device=dev, requires_grad=True)
            rm, rv = torch.zeros(3, device=dev), torch.ones(3, device=dev)
            with torch.enable_grad():
                y = torch.nn.functional.batch_norm(x, rm, rv, w, b, training=True)
                y.float().sum().backward()
            _MIXED_BN_OK[key] = y.dtype == dtype and x.grad is not None and x.grad.dtype == dtype
        except (RuntimeError, NotImplementedError):
            _MIXED_BN_OK[key] = False
    return _MIXED_BN_OK[key]


@torch.no_grad()
def _cast_own_tensors(module: nn.Module, dtype: torch.dtype) -> None:
    for p in module._parameters.values():
        if p is not None and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
    for name, b in module._buffers.items():
        if b is not None and b.is_floating_point() and b.dtype != dtype:
            module._buffers[name] = b.to(dtype)
