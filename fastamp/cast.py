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

import warnings
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

    Tied tensors: a tensor has one dtype, so a tensor reached from several modules (tied
    weights such as ``model.head.weight = model.emb.weight``, a buffer registered in two
    modules, a module at two paths, or two Parameters over overlapping memory such as
    ``nn.Parameter(enc.weight.data.t())``) is cast once and stays tied: the same object, or
    the same views of one new memory. If any module holding it is kept, it stays fp32 for
    all of them: every cast module holding it is kept too (its subtree, with the boundary
    hooks), and a ``UserWarning`` names them (list them in ``keep_fp32`` to silence it).
    Everything is decided before anything changes; a tie between a kept module and the
    model's own (root) tensors, or tensors of different dtypes over one memory, raise
    ``ValueError`` and leave the model as it was.

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

    # Decide everything before changing anything: a tensor reached from a kept module and
    # from a cast one (tied weights, shared buffers, a module at two paths, or two tensors
    # over one memory) can have only one dtype, and the kept one wins: the cast modules
    # holding it are kept too (their subtree, with the boundary hooks). Repeat until no
    # such tie is left, since a newly kept subtree can hold further ties.
    promoted: dict[str, list[str]] = {}
    while True:
        slots, kept_roots, lowered_norms = _walk(model, kinds_t, names, instances)
        groups = _tie_groups(slots)
        conflicts = [
            g for g in groups if _needs_cast(g, dtype) and any(s.keep for s in g) and not all(s.keep for s in g)
        ]
        if not conflicts:
            break
        for g in conflicts:
            kept = next(s for s in g if s.keep)
            for s in g:
                if s.keep:
                    continue
                if s.path == "":
                    raise ValueError(
                        f"fastamp.cast_model: {s.describe()} is tied to {kept.describe()} (kept fp32); keeping it "
                        "fp32 would keep the whole model fp32. Untie them, move the tensor into a submodule, "
                        f"or drop {kept.path!r} from keep_fp32"
                    )
                names.add(s.path)
                promoted.setdefault(s.path, []).append(f"{s.describe()} is tied to {kept.describe()}")
    for g in groups:
        if _needs_cast(g, dtype) and not any(s.keep for s in g):
            _check_castable(g, dtype)
    for g in groups:
        if _needs_cast(g, dtype) and not any(s.keep for s in g):
            _cast_group(g, dtype)

    handles = list(getattr(model, "_fastamp_cast_handles", []))
    to_fp32 = _LOW
    hooked: set[int] = set()
    for m in kept_roots:
        if m is model or id(m) in hooked:
            continue
        hooked.add(id(m))
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

    if promoted:
        lines = "; ".join(f"{path!r} kept fp32 ({', '.join(why)})" for path, why in promoted.items())
        warnings.warn(
            f"fastamp.cast_model: tied tensors keep one dtype, and a tie with a kept-fp32 module keeps both "
            f"sides fp32: {lines}. Add these modules to keep_fp32 to silence this, or untie the tensors to "
            "cast them.",
            UserWarning,
            stacklevel=2,
        )
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


class _Slot:
    """One place a tensor is registered: ``module._parameters[name]`` or ``module._buffers[name]`` at ``path``."""

    __slots__ = ("path", "module", "kind", "name", "tensor", "keep")

    def __init__(self, path: str, module: nn.Module, kind: str, name: str, tensor: Tensor, keep: bool) -> None:
        self.path, self.module, self.kind, self.name, self.tensor, self.keep = path, module, kind, name, tensor, keep

    def describe(self) -> str:
        if self.path:
            return f"{self.kind} '{self.path}.{self.name}'"
        return f"{self.kind} '{self.name}' of the model itself"


def _walk(
    model: nn.Module, kinds: tuple[type, ...], names: set, instances: set
) -> tuple[list[_Slot], list[nn.Module], list[str]]:
    """Every tensor slot with whether its module is kept, the kept subtree roots, and the norms to be cast."""
    slots: list[_Slot] = []
    kept_roots: list[nn.Module] = []
    lowered_norms: list[str] = []

    def visit(prefix: str, module: nn.Module, inside_kept: bool) -> None:
        kept_here = not inside_kept and _is_kept(prefix, module, kinds, names, instances)
        if kept_here:
            kept_roots.append(module)
        keep = inside_kept or kept_here
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, t in table.items():
                if t is not None:
                    slots.append(_Slot(prefix, module, kind, name, t, keep))
        if not keep and isinstance(module, nn.modules.batchnorm._NormBase):
            if module.affine or module.track_running_stats:
                lowered_norms.append(prefix or type(module).__name__)
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child, keep)

    visit("", model, False)
    return slots, kept_roots, lowered_norms


def _byte_span(t: Tensor) -> tuple[Any, int, int] | None:
    """``(storage key, first byte, end byte)`` of the memory ``t`` can reach, or None if it has none to share."""
    if isinstance(t, nn.parameter.UninitializedTensorMixin) or t.numel() == 0 or t.device.type == "meta":
        return None  # lazy modules' placeholders, empty and meta tensors hold no memory to share
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without a plain storage
        return None
    if ptr == 0:
        return None
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.storage_offset() * t.element_size()
    return (t.device, ptr), start, start + extent * t.element_size()


def _tie_groups(slots: list[_Slot]) -> list[list[_Slot]]:
    """Slots grouped by tie: the same tensor object, or tensors whose memory overlaps."""
    parent = list(range(len(slots)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(i: int, j: int) -> None:
        parent[find(i)] = find(j)

    first_of: dict[int, int] = {}
    spans: dict[Any, list[tuple[int, int, int]]] = {}
    for i, s in enumerate(slots):
        j = first_of.setdefault(id(s.tensor), i)
        if j != i:
            union(i, j)
            continue
        span = _byte_span(s.tensor)
        if span is not None:
            spans.setdefault(span[0], []).append((span[1], span[2], i))
    for items in spans.values():
        items.sort()
        end, last = -1, -1
        for lo, hi, i in items:
            # interval overlap: conservative for interleaved strided views, which are tied then
            if lo < end:
                union(i, last)
            if hi > end:
                end, last = hi, i
    groups: dict[int, list[_Slot]] = {}
    for i, s in enumerate(slots):
        groups.setdefault(find(i), []).append(s)
    return list(groups.values())


def _members(group: list[_Slot]) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for s in group:
        seen.setdefault(id(s.tensor), s.tensor)
    return list(seen.values())


def _needs_cast(group: list[_Slot], dtype: torch.dtype) -> bool:
    return any(t.is_floating_point() and t.dtype != dtype for t in _members(group))


def _check_castable(group: list[_Slot], dtype: torch.dtype) -> None:
    members = _members(group)
    if len(members) > 1 and len({t.dtype for t in members}) > 1:
        by_dtype: dict[torch.dtype, _Slot] = {}
        for s in group:
            by_dtype.setdefault(s.tensor.dtype, s)
        a, b = list(by_dtype.values())[:2]
        raise ValueError(
            f"fastamp.cast_model: {a.describe()} ({a.tensor.dtype}) and {b.describe()} ({b.tensor.dtype}) share "
            f"memory with different dtypes; they cannot be cast to {dtype} and stay tied. Keep one of their "
            "modules fp32 (keep_fp32), or untie them"
        )


@torch.no_grad()
def _cast_group(group: list[_Slot], dtype: torch.dtype) -> None:
    """Cast the tensors of one tie group so that they stay tied: one new tensor per object, over one new memory."""
    members = _members(group)
    new: dict[int, Tensor] = {}
    if len(members) == 1:
        t = members[0]
        new[id(t)] = t.data.to(dtype)
    else:
        # tensors over one memory: cast the span they cover once, and rebuild each as the
        # same view (offset, sizes, strides) of the new memory
        spans = [_byte_span(t) for t in members]
        item = members[0].element_size()
        lo = min(s[1] for s in spans if s is not None) // item
        hi = max(s[2] for s in spans if s is not None) // item
        ref = members[0]
        flat = torch.empty(0, dtype=ref.dtype, device=ref.device)
        flat.set_(ref.untyped_storage(), lo, (hi - lo,), (1,))
        flat = flat.to(dtype)
        for t in members:
            new[id(t)] = flat.as_strided(t.shape, t.stride(), t.storage_offset() - lo)
    for t in members:
        if isinstance(t, nn.Parameter):
            t.data = new[id(t)]
            if t.grad is not None and t.grad.is_floating_point() and t.grad.dtype != dtype:
                t.grad = t.grad.to(dtype)
    for s in group:
        if s.kind == "buffer" and not isinstance(s.tensor, nn.Parameter):
            s.module._buffers[s.name] = new[id(s.tensor)]
