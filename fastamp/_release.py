"""Gradient release: each bucket of params is stepped inside backward and its grads freed at once.

``h = fastamp.release(model, opt)``; each training step is then ``h.backward(loss)``, which
does what ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)`` does, bit for bit,
while holding at most the grads of the buckets not yet stepped instead of every grad of the
model. ``h.remove()`` restores the ordinary path. See :func:`release`.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any

import torch
from torch import Tensor

from fastamp._dtensor import is_dtensor

_grad_of = operator.attrgetter("grad")

DEFAULT_BUCKET_BYTES = 32 << 20


def release(
    model: torch.nn.Module,
    optimizer: Any,
    scaler: Any = None,
    max_norm: float | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Release:
    """Run ``optimizer``'s step inside backward, bucket by bucket, and free each grad right after.

    Each param of the optimizer gets a ``register_post_accumulate_grad_hook``. The params are
    batched into buckets in reverse registration order (the order backward produces their
    grads), each of about ``bucket_bytes`` bytes of params; a bucket is stepped
    (:meth:`FusedOptimizer.step_bucket <fastamp.optim._base.FusedOptimizer.step_bucket>`, one
    fused launch per kind of param, as :meth:`step` groups them) as soon as the last of its
    grads is accumulated, and its grads are set to None. When backward ends, the buckets some
    of whose params got no grad are stepped (a param without a grad is not stepped, as in
    ``opt.step()``) and their grads freed.

    Example::

        opt = fastamp.AdamW(model.parameters(), lr=1e-3, master_weights="remainder")
        h = fastamp.release(model, opt)
        for x, y in data:
            h.backward(loss_fn(model(x), y))  # = loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        h.remove()  # the ordinary path again

    Args:
        model: the module whose params ``optimizer`` updates (not wrapped in DDP).
        optimizer: a fastamp optimizer (:class:`fastamp.AdamW`, :class:`fastamp.SGD`,
            :class:`fastamp.Lion`) holding exactly the model's trainable params.
        scaler, max_norm: loss scaling and global clipping under release are not implemented
            yet (both must be None).
        bucket_bytes: the bytes of params per bucket (a param larger than that is a bucket of
            its own); 0 makes every param a bucket.

    Refused before anything is registered, with an error that says what to do instead: a
    ``scaler`` or ``max_norm``; an optimizer that is not a fastamp fused optimizer; a model
    param with ``requires_grad`` missing from the optimizer, or an optimizer param not in
    the model; a DDP-wrapped model; DTensor (FSDP2) params; stochastic rounding (the kernels
    draw a launch's random bits from the counter of its first param, and which param is first
    in ``opt.step()``'s launch depends on which params got a grad, known only when backward
    ends); an optimizer already under release. :meth:`Release.backward` refuses a step that
    finds a grad already there (gradient accumulation, or a ``loss.backward()`` outside the
    handle).

    Bit-identity with ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``: a
    param is written only after every backward node that reads it has run (its grad is
    complete), the update is elementwise, and each param's step scalars come from its own
    count (see ``step_bucket``). Checkpoints: ``opt.state_dict()`` between two
    ``h.backward`` calls is the ordinary one.

    No host sync: a hook does a dict lookup and a counter increment; a bucket's step is the
    fused step of a plan that fits (host work of a few identity tests per param).

    torch.compile: :meth:`Release.backward` is not compiled (it is marked
    ``torch.compiler.disable``: a compiled function that calls it runs it eagerly, a graph
    break); compile the model's forward. Under compiled autograd the hooks would be traced,
    and ``step_bucket`` refuses to be traced.
    """
    from fastamp.optim._base import FusedOptimizer

    if scaler is not None or max_norm is not None:
        what = " and ".join(
            name for name, v in (("a loss scaler", scaler), ("global clipping (max_norm)", max_norm)) if v is not None
        )
        raise NotImplementedError(
            f"fastamp.release: {what} under gradient release is not implemented yet (the skip on overflow and the "
            "clip coefficient need every grad before any param changes: a two-backward scheme is planned); use the "
            "ordinary path: scaler.scale(loss).backward(); scaler.clip_grad_norm_(...); scaler.step(opt); "
            "scaler.update()"
        )
    if not isinstance(optimizer, FusedOptimizer):
        raise TypeError(
            f"fastamp.release: the optimizer must be a fastamp fused optimizer (fastamp.AdamW, fastamp.SGD, "
            f"fastamp.Lion), got {type(optimizer).__module__}.{type(optimizer).__qualname__}; gradient release "
            "steps buckets of params with FusedOptimizer.step_bucket"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fastamp.release: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise NotImplementedError(
            "fastamp.release: the model is wrapped in DistributedDataParallel, whose reducer all-reduces grads in "
            "its own buckets and copies them back into .grad after the hooks a release would use; gradient "
            "release under DDP is not supported: use the ordinary path (loss.backward(); opt.step())"
        )
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"fastamp.release: bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
    if optimizer.__dict__.get("_release") is not None:
        raise RuntimeError(
            "fastamp.release: this optimizer is already under gradient release (a handle that was not removed); "
            "call h.remove() on it first"
        )
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    in_opt: dict[int, tuple[int, int]] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            in_opt[id(p)] = (gi, i)
            if id(p) not in names:
                raise ValueError(
                    f"fastamp.release: param {i} of param group {gi} of the optimizer (shape {tuple(p.shape)}) is not "
                    "a param of the model; release needs the optimizer to hold exactly the model's trainable params"
                )
            if group["stochastic_rounding"]:
                raise NotImplementedError(
                    f"fastamp.release: param group {gi} uses stochastic rounding, which gradient release does not "
                    "support: the kernels draw a launch's random bits from the rng counter of the launch's first "
                    "param, and which param comes first in opt.step() depends on which params got a grad this step, "
                    "known only when backward ends (a bucket's step would draw other bits once counters differ); use "
                    "master_weights='remainder' or True, or the ordinary path"
                )
    order = []
    for name, p in model.named_parameters():
        if id(p) in in_opt:
            order.append(p)
        elif p.requires_grad:
            raise ValueError(
                f"fastamp.release: the model's param {name!r} (shape {tuple(p.shape)}) requires grad but is not in "
                "the optimizer; its grad would never be freed: add it to the optimizer or set requires_grad=False"
            )
    for p in order:
        if is_dtensor(p):
            raise NotImplementedError(
                f"fastamp.release: the model's param {names[id(p)]!r} is a DTensor (FSDP2); gradient release of "
                "sharded params is not supported yet: use the ordinary path"
            )
    return Release(model, optimizer, order, bucket_bytes)


class Release:
    """The handle :func:`release` returns: :meth:`backward` for each step, :meth:`remove` to go back."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, params: list[Tensor], bucket_bytes: int) -> None:
        self.model = model
        self.optimizer = optimizer
        buckets: list[list[Tensor]] = []
        size = bucket_bytes + 1  # start a bucket at the first param
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if not buckets or size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        self.buckets: list[tuple[Tensor, ...]] = [tuple(b) for b in buckets]
        self._params = [p for b in self.buckets for p in b]
        self._bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self._sizes = [len(b) for b in self.buckets]
        self._arrived = [0] * len(self.buckets)
        self._active = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self._params]
        optimizer._release = self
        # dynamo is imported here, not by ``import fastamp`` (it costs about half of that import)
        self.backward = torch.compiler.disable(self._backward)

    def _hook(self, p: Tensor) -> None:
        if not self._active:
            return  # a backward outside the handle: the grads stay (the next h.backward refuses them)
        k = self._bucket_of[id(p)]
        n = self._arrived[k] = self._arrived[k] + 1
        if n == self._sizes[k]:
            self._step(k)

    def _step(self, k: int) -> None:
        bucket = self.buckets[k]
        self.optimizer.step_bucket(bucket)
        for q in bucket:
            q.grad = None

    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs); opt.step(); opt.zero_grad(set_to_none=True)``, stepping each bucket inside backward.

        Refuses (before backward runs, changing nothing) a step that finds a grad of the
        optimizer's params already there: a previous ``loss.backward()`` outside the handle,
        gradient accumulation (not supported under release), or a backward that failed
        midway. ``opt``'s hyperparameters are validated before backward runs; a grad that a
        step cannot take (e.g. a wrong dtype) raises from inside backward, after the buckets
        before it were stepped.

        Marked ``torch.compiler.disable`` (on the handle): a compiled function that calls it
        runs it eagerly.
        """
        self._backward(loss, **kwargs)

    def _backward(self, loss: Tensor, **kwargs: Any) -> None:
        if self._handles is None:
            raise RuntimeError("fastamp.release: this handle was removed; call loss.backward() and opt.step() instead")
        params = self._params
        if not all(map(operator.is_, map(_grad_of, params), repeat(None))):
            held = next(i for i, p in enumerate(params) if p.grad is not None)
            name = self._name_of(params[held])
            raise RuntimeError(
                f"fastamp.release: the param {name!r} already has a grad when h.backward starts: gradient "
                "accumulation (several backwards per step) is not supported under release, and a loss.backward() "
                "outside the handle leaves grads it cannot step; call opt.zero_grad(set_to_none=True) to drop them, "
                "or h.remove() and use the ordinary path"
            )
        opt = self.optimizer
        for gi, group in enumerate(opt.param_groups):
            opt._validate_group(group, f"param group {gi}")
        arrived = self._arrived
        for k in range(len(arrived)):
            arrived[k] = 0
        self._active = True
        try:
            torch.autograd.backward(loss, **kwargs)
        finally:
            self._active = False
        for k, n in enumerate(arrived):
            if 0 < n < self._sizes[k]:
                self._step(k)

    def _name_of(self, p: Tensor) -> str:
        for name, q in self.model.named_parameters():
            if q is p:
                return name
        return f"shape {tuple(p.shape)}"

    def remove(self) -> None:
        """Remove every hook: ``loss.backward(); opt.step()`` works as without release. Idempotent."""
        if self._handles is None:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = None
        if self.optimizer.__dict__.get("_release") is self:
            self.optimizer._release = None
