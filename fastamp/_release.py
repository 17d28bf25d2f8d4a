"""Gradient release: each bucket of params is stepped inside backward and its grads freed at once.

``h = fastamp.release(model, opt)``; each training step is then ``h.backward(loss)``, which
does what ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)`` does, bit for bit,
while holding at most the grads of the buckets not yet stepped instead of every grad of the
model. ``h.remove()`` restores the ordinary path. See :func:`release`.
"""

from __future__ import annotations

import numbers
import operator
import sys
from itertools import repeat
from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from fastamp._dtensor import is_dtensor
from fastamp.ops import backends, functional
from fastamp.scaler.device_scalars import (
    _clip_coef,
    _fold_found_inf,
    _grad_scale_after_clip,
    _inv_scale,
    _new_found_inf,
    _step_grad_scale,
    _total_norm,
)

_grad_of = operator.attrgetter("grad")
_requires_grad_of = operator.attrgetter("requires_grad")

DEFAULT_BUCKET_BYTES = 32 << 20


def release(
    model: torch.nn.Module,
    optimizer: Any,
    scaler: Any = None,
    max_norm: float | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    norm_type: float = 2.0,
) -> Release:
    """Run ``optimizer``'s step inside backward, bucket by bucket, and free each grad right after.

    Each param of the optimizer gets a ``register_post_accumulate_grad_hook``. The params are
    batched into buckets in reverse registration order (the order backward produces their
    grads), each of about ``bucket_bytes`` bytes of params; a bucket is stepped
    (:meth:`FusedOptimizer.step_bucket <fastamp.optim.engine.base.FusedOptimizer.step_bucket>`, one
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
        model: the module whose params ``optimizer`` updates (not wrapped in DDP or FSDP).
        optimizer: a fastamp optimizer (:class:`fastamp.AdamW`, :class:`fastamp.SGD`,
            :class:`fastamp.Lion`) holding exactly the model's trainable params (and any
            frozen ones: see below).
        scaler: a :class:`fastamp.Scaler`: each ``h.backward(loss)`` is then
            ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` (with
            ``max_norm``: ``scaler.clip_grad_norm_(opt, max_norm)`` before the step), bit for
            bit, skips included. A disabled scaler is the same as None (as in the ordinary
            loop, where it scales, clips, steps and updates nothing of its own).
        max_norm: global clipping by the 2-norm of every grad of ``opt`` (``>= 0``; ``inf``
            never clips). With a scaler it is the scaler's fused clip; without one it is
            ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` (what a disabled
            ``fastamp.Scaler.clip_grad_norm_`` runs) before ``opt.step()``.
        bucket_bytes: the bytes of params per bucket (a param larger than that is a bucket of
            its own); 0 makes every param a bucket.
        norm_type: 2 only (the norm the fused check pass computes).

    With a scaler or ``max_norm``, ``h.backward`` runs two backwards over one graph (see
    :meth:`Release.backward`): the first only checks each bucket's grads (non-finite flag,
    and for clipping each grad's partial sums of squares into its slots of a device buffer)
    and frees them; the skip decision and the clip coefficient are then computed on the
    device, folding the partials in the order the ordinary check pass folds them (so the
    norm has its bits); the second backward steps each bucket with them. Cost: one more
    backward, and the activations live until the second one ends. On one device: CPU or one
    CUDA device (native, Triton and torch backends); params spread over several devices are
    refused.

    Refused before anything is registered (release() registers all its hooks or none), with an
    error that says what to do instead: a scaler that is not a ``fastamp.Scaler``, or one with
    ``track_stats`` or a ``process_group``; a ``max_norm`` that is not a number >= 0, or
    ``norm_type`` other than 2; with a scaler or ``max_norm``, params not all on one CPU or CUDA
    device or of a dtype other than fp32/fp16/bf16; an optimizer that is not a fastamp fused
    optimizer; a model param with ``requires_grad`` missing from the optimizer, or an optimizer
    param not in the model; a model that is, or holds, a ``DistributedDataParallel`` or an FSDP1
    ``torch.distributed.fsdp.FullyShardedDataParallel`` module; DTensor (FSDP2) params; an
    optimizer already under release. :meth:`Release.backward` refuses a step that finds a grad
    already there (gradient accumulation, or a ``loss.backward()`` outside the handle).

    DDP around the model given as its inner module (``ddp = DDP(model); release(model, opt)``)
    leaves no mark on the model: :meth:`Release.backward` finds the grads that DDP's reducer
    writes back into ``.grad`` when backward ends, drops them and raises. With a scaler or
    ``max_norm`` that happens after the first backward, before anything is stepped; without
    them the step has already run on the process's own (not all-reduced) grads.

    Frozen params and params added later: a param of the optimizer with ``requires_grad=False``
    gets no hook (torch refuses one) and, getting no grad, is not stepped, as in ``opt.step()``.
    Each :meth:`Release.backward` first checks, in a few steps per param group, whether the
    param groups changed (a group added or removed, a param appended to or removed from a
    group's list: ``opt.add_param_group`` to unfreeze a layer) or a frozen param now requires
    grad; if so it runs release()'s checks on the params as they are now (refusing as release()
    does, with nothing run) and buckets and hooks them again, so training goes on as
    ``opt.step()`` would. Not noticed: a param replaced in place inside a group's list (same
    length), and a hooked param frozen later, which simply gets no grad and is not stepped (its
    bucket is then stepped when backward ends rather than when its other grads arrive); call
    ``h.remove()`` and ``fastamp.release(...)`` again after such changes.

    Bit-identity with ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``: a
    param is written only after every backward node that reads it has run (its grad is
    complete), the update is elementwise, and each param's step scalars come from its own
    count (see ``step_bucket``). Stochastic rounding (of params, ulp8 corrections and q8
    moments) included: a launch draws its random bits from its param group's counter (one
    per group and device, :mod:`fastamp.optim.engine.rng`) and each param's own stream, and each
    ``h.backward`` is one :meth:`FusedOptimizer.bucket_step
    <fastamp.optim.engine.base.FusedOptimizer.bucket_step>`: every bucket reads the counters as the
    step began, and they advance once when it ends, as ``opt.step()`` advances them.
    Checkpoints: ``opt.state_dict()`` between two ``h.backward`` calls is the ordinary one.

    No host sync: a hook does a dict lookup and a counter increment; a bucket's step is the
    fused step of a plan that fits (host work of a few identity tests per param).

    torch.compile: :meth:`Release.backward` is not compiled (it is marked
    ``torch.compiler.disable``: a compiled function that calls it runs it eagerly, a graph
    break); compile the model. Without a scaler and ``max_norm`` nothing more is needed. With
    them, the two backwards run the model's compiled backward twice, the first time with
    ``retain_graph=True``, which a backward compiled with donated buffers (AOTAutograd reuses
    the memory of saved activations; ``torch._functorch.config.donated_buffer``, on by default
    in torch 2.13) refuses. A compiled backward first run under release is compiled without
    them; one compiled first for an ordinary backward (earlier in the process, of this model
    or of another whose forward has the same code, which share it, or taken from
    torch.compile's on-disk cache) makes :meth:`Release.backward` raise, with nothing stepped
    and the grads dropped, saying what to do. Safe in every case: whenever a compiled model is
    released with a scaler or ``max_norm``, set ``torch._functorch.config.donated_buffer =
    False`` and ``torch.compiler.config.force_disable_caches = True`` before its first compiled
    call. Both, because in torch 2.13 inductor's FX graph cache does not key on donation: with
    the caches on, a backward compiled with donated buffers by an ordinary run can be handed
    back where torch does not check (under ``donated_buffer=False``, or when AOTAutograd's cache
    misses, even for a backward first run under release), and its second run then reads
    overwritten activations with no error (measured: other grads, other params).

    Compiled autograd (``torch._dynamo.compiled_autograd``) runs it and gives the same bits:
    the backward graph is captured once, dynamo traces the release hooks into small graphs,
    breaking the graph at each call it cannot trace (fastamp's C++ planning helpers; about 40
    breaks and 50 graphs on the first step of a 5-layer model with a bucket per param), and
    ``step_bucket`` runs eagerly between them. It costs compile time and buys nothing here.
    """
    from fastamp import optim as fused
    from fastamp.optim.engine.base import FusedOptimizer

    scaler, max_norm = _check_amp(scaler, max_norm, norm_type)
    if not isinstance(optimizer, FusedOptimizer):
        names = ", ".join(
            f"fastamp.{name}"
            for name in fused.__all__
            if isinstance(getattr(fused, name), type) and issubclass(getattr(fused, name), FusedOptimizer)
        )
        raise TypeError(
            f"fastamp.release: the optimizer must be a fastamp fused optimizer ({names}), got "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}; gradient release "
            "steps buckets of params with FusedOptimizer.step_bucket"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fastamp.release: model must be a torch.nn.Module, got {type(model).__name__}")
    _refuse_wrappers(model)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"fastamp.release: bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
    if optimizer.__dict__.get("_release") is not None:
        raise RuntimeError(
            "fastamp.release: this optimizer is already under gradient release (a handle that was not removed); "
            "call h.remove() on it first"
        )
    params, frozen = _param_sets(model, optimizer, scaler is not None or max_norm is not None)
    return Release(model, optimizer, params, frozen, bucket_bytes, scaler, max_norm)


def _refuse_wrappers(model: torch.nn.Module) -> None:
    """Refuse a model that is, or holds, a DDP or FSDP1 module: they own the grads that release would step."""
    ddp = torch.nn.parallel.DistributedDataParallel
    # a model can hold an FSDP1 module only once its module is imported: no import (and its cost) otherwise
    fsdp = getattr(
        sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel"), "FullyShardedDataParallel", None
    )
    for name, module in model.named_modules():
        where = "the model is" if not name else f"the model's submodule {name!r} is"
        if isinstance(module, ddp):
            raise NotImplementedError(
                f"fastamp.release: {where} wrapped in DistributedDataParallel, whose reducer all-reduces grads in "
                "its own buckets and copies them back into .grad after the hooks a release would use; gradient "
                "release under DDP is not supported: use the ordinary path (loss.backward(); opt.step()) without "
                "fastamp.release (giving release the inner module does not help: h.backward finds the grads DDP "
                "writes back and raises)"
            )
        if fsdp is not None and isinstance(module, fsdp):
            raise NotImplementedError(
                f"fastamp.release: {where} a torch.distributed.fsdp.FullyShardedDataParallel (FSDP1) module, which "
                "flattens its params into sharded FlatParameters and reduce-scatters their grads in its own "
                "post-backward hooks; gradient release under FSDP is not supported (nor FSDP2's DTensor params): "
                "use the ordinary path (loss.backward(); opt.step()) without fastamp.release"
            )


def _param_sets(model: torch.nn.Module, optimizer: Any, two_pass: bool) -> tuple[list[Tensor], list[Tensor]]:
    """The optimizer's params that require grad and those that do not (frozen), in the model's order.

    Raises, changing nothing, where :func:`release` refuses a param; run again by
    :meth:`Release.backward` when the optimizer's params changed.
    """
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    in_opt: set[int] = set()
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            in_opt.add(id(p))
            if id(p) not in names:
                raise ValueError(
                    f"fastamp.release: param {i} of param group {gi} of the optimizer (shape {tuple(p.shape)}) is not "
                    "a param of the model; release needs the optimizer to hold exactly the model's trainable params"
                )
    params: list[Tensor] = []
    # held by the optimizer but frozen: they get no grad, so no hook (torch refuses one) and no step, as in
    # opt.step(); h.backward watches them and takes one in once it requires grad
    frozen: list[Tensor] = []
    for name, p in model.named_parameters():
        if id(p) in in_opt:
            (params if p.requires_grad else frozen).append(p)
        elif p.requires_grad:
            raise ValueError(
                f"fastamp.release: the model's param {name!r} (shape {tuple(p.shape)}) requires grad but is not in "
                "the optimizer; its grad would never be freed: add it to the optimizer or set requires_grad=False"
            )
    for p in params:
        if is_dtensor(p):
            raise NotImplementedError(
                f"fastamp.release: the model's param {names[id(p)]!r} is a DTensor (FSDP2); gradient release of "
                "sharded params is not supported yet: use the ordinary path"
            )
    if two_pass:
        for p in params:
            if p.device.type not in ("cpu", "cuda"):
                raise NotImplementedError(
                    f"fastamp.release: the model's param {names[id(p)]!r} is on {p.device}; gradient release with a "
                    "loss scaler or max_norm runs on one CPU or CUDA device: use the ordinary path "
                    "(scaler.scale(loss).backward(); scaler.clip_grad_norm_(opt, max_norm); scaler.step(opt); "
                    "scaler.update()), or release without scaler and max_norm"
                )
            if p.device != params[0].device:
                raise NotImplementedError(
                    f"fastamp.release: the model's param {names[id(p)]!r} is on {p.device} but "
                    f"{names[id(params[0])]!r} is on {params[0].device}; gradient release with a loss scaler or "
                    "max_norm runs on one device (its skip decision and clip coefficient are folded on that "
                    "device): use the ordinary path (scaler.scale(loss).backward(); scaler.clip_grad_norm_(opt, "
                    "max_norm); scaler.step(opt); scaler.update()), or release without scaler and max_norm"
                )
            if p.dtype not in _CHECK_DTYPES:
                raise NotImplementedError(
                    f"fastamp.release: the model's param {names[id(p)]!r} is {p.dtype}; gradient release with a "
                    "loss scaler or max_norm takes float32, float16 and bfloat16 params: use the ordinary path"
                )
    return params, frozen


_CHECK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_amp(scaler: Any, max_norm: Any, norm_type: Any) -> tuple[Any, float | None]:
    """The scaler (None for a disabled one) and max_norm (a float) of :func:`release`, or a clear error."""
    from fastamp.scaler import Scaler

    if scaler is not None:
        if not isinstance(scaler, Scaler):
            raise TypeError(
                f"fastamp.release: scaler must be a fastamp.Scaler, got {type(scaler).__module__}."
                f"{type(scaler).__qualname__}; release drives the scaler's own check, clip and update: replace "
                "torch.amp.GradScaler(...) with fastamp.Scaler(...) (same arguments), or use the ordinary path"
            )
        if not scaler.is_enabled():
            scaler = None  # the ordinary loop with a disabled scaler: nothing scaled, checked or updated
        elif scaler._track_stats:
            raise NotImplementedError(
                "fastamp.release: the scaler has track_stats=True; gradient release frees each grad after its "
                "check and writes no per-tensor statistics: use a scaler without track_stats, or the ordinary path"
            )
        elif scaler._process_group is not None:
            raise NotImplementedError(
                "fastamp.release: the scaler has a process_group; gradient release is single-process (DDP and FSDP "
                "are not supported under release): use the ordinary path"
            )
    if max_norm is not None:
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
            raise TypeError(f"fastamp.release: max_norm must be a real number or None, got {type(max_norm).__name__}")
        max_norm = float(max_norm)
        if not max_norm >= 0:
            # as Scaler.clip_grad_norm_: a negative max_norm would flip every grad
            raise ValueError(f"fastamp.release: max_norm must be >= 0 (inf: never clip), got {max_norm}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or float(norm_type) != 2.0:
        raise NotImplementedError(
            f"fastamp.release: norm_type must be 2, got {norm_type!r}; the fused check pass computes the 2-norm "
            "(Scaler.clip_grad_norm_ runs other norms on unscaled grads that release does not keep): use the ordinary "
            "path for other norms"
        )
    return scaler, max_norm


class Release:
    """The handle :func:`release` returns: :meth:`backward` for each step, :meth:`remove` to go back.

    Attributes (with a scaler or ``max_norm``): ``total_norm``, the last step's global grad
    norm as the ordinary clip returns it (a device tensor; None before the first step or
    without ``max_norm``); ``mismatches`` (with a scaler), an int64 device count of buckets
    whose grads were non-finite in the second backward but not in the first (a
    non-deterministic backward): such a bucket is not stepped, and the iteration counts as
    an overflow for the scaler's update.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        params: list[Tensor],
        frozen: list[Tensor],
        bucket_bytes: int,
        scaler: Any = None,
        max_norm: float | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.bucket_bytes = bucket_bytes
        self.scaler = scaler
        self.max_norm = max_norm
        self.total_norm: Tensor | None = None
        self.mismatches: Tensor | None = None
        self._active = False
        self._handles: list[Any] | None = None
        self._install(params, frozen)
        optimizer._release = self
        # dynamo is imported here, not by ``import fastamp`` (it costs about half of that import)
        self.backward = torch.compiler.disable(self._backward)

    def _install(self, params: list[Tensor], frozen: list[Tensor]) -> None:
        """Bucket ``params`` and hook each of them, replacing the hooks there were: all of it or, if it raises, none."""
        buckets: list[list[Tensor]] = []
        size = self.bucket_bytes + 1  # start a bucket at the first param
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if not buckets or size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        two = None
        if self.scaler is not None or self.max_norm is not None:
            two = _TwoPass(self, self.optimizer, params)
        hooked = [p for b in buckets for p in b]
        handles = []
        try:
            for p in hooked:
                handles.append(p.register_post_accumulate_grad_hook(self._hook))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        for handle in self._handles or ():
            handle.remove()
        self._handles = handles
        self.buckets: list[tuple[Tensor, ...]] = [tuple(b) for b in buckets]
        self._params = hooked
        self._bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self._sizes = [len(b) for b in self.buckets]
        self._arrived = [0] * len(self.buckets)
        self._frozen = frozen
        # the lists themselves (not their ids, which a new list could reuse) and their lengths, to notice at
        # each h.backward, in a few steps per group, a group added or removed or a param appended or removed
        self._groups_seen = [(g["params"], len(g["params"])) for g in self.optimizer.param_groups]
        self._two = two
        if self.scaler is not None:
            if self.mismatches is None:
                self.mismatches = torch.zeros((), dtype=torch.int64, device=two.device)
            elif self.mismatches.device != two.device:
                self.mismatches = self.mismatches.to(two.device)

    def _params_changed(self) -> bool:
        """Whether the optimizer's param set, or a frozen param's requires_grad, changed since the hooks were set."""
        groups = self.optimizer.param_groups
        seen = self._groups_seen
        if len(groups) != len(seen):
            return True
        for group, (held, n) in zip(groups, seen):
            if group["params"] is not held or len(held) != n:
                return True
        return any(map(_requires_grad_of, self._frozen))

    def _rebuild(self) -> None:
        """The buckets and hooks of the optimizer's params as they are now, checked as :func:`release` checks them."""
        try:
            params, frozen = _param_sets(self.model, self.optimizer, self._two is not None)
        except (ValueError, NotImplementedError) as e:
            raise type(e)(
                f"{e} (the optimizer's params changed since fastamp.release(); h.backward checked them as release() "
                "does and ran nothing)"
            ) from None
        self._install(params, frozen)

    def _hook(self, p: Tensor) -> None:
        if not self._active:
            return  # a backward outside the handle: the grads stay (the next h.backward refuses them)
        k = self._bucket_of[id(p)]
        n = self._arrived[k] = self._arrived[k] + 1
        if n == self._sizes[k]:
            self._step(k)

    def _step(self, k: int) -> None:
        bucket = self.buckets[k]
        if self._two is not None:
            self._two.bucket(bucket)
        else:
            self.optimizer.step_bucket(bucket)
        for q in bucket:
            q.grad = None

    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """One training step: the ordinary step's bits, each bucket stepped inside backward.

        Without a scaler or ``max_norm``: ``loss.backward(**kwargs); opt.step();
        opt.zero_grad(set_to_none=True)``, in one backward.

        With them: ``scaler.scale(loss).backward(); scaler.clip_grad_norm_(opt, max_norm);
        scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)`` (the clip only
        with ``max_norm``; without a scaler, ``torch.nn.utils.clip_grad_norm_`` of ``opt``'s
        params and ``opt.step()``), in two backwards over one graph: the first (with
        ``retain_graph=True``) checks each bucket as its grads arrive and frees them; then
        the global norm, the clip coefficient and the skip flag are computed on the device;
        the second steps each bucket with them (the ``grad_scale`` / ``found_inf`` the scaler
        hands an amp-aware optimizer) and frees its grads; then ``scaler.update()``. The only
        keyword taken then is ``retain_graph`` (for the second backward). No host sync.

        First, if ``opt``'s param groups changed or a frozen param of it now requires grad,
        the params are checked as :func:`release` checks them and bucketed and hooked again
        (see there).

        Refuses (before backward runs, changing nothing) a step that finds a grad of the
        optimizer's params already there: a previous ``loss.backward()`` outside the handle,
        gradient accumulation (not supported under release), or a backward that failed
        midway; and, with a scaler, a step whose scaler already unscaled, clipped or stepped
        ``opt`` since its last ``update()`` (the error says how to end that iteration).
        ``opt``'s hyperparameters are validated before backward runs; a grad that a step
        cannot take (e.g. a wrong dtype) raises from inside backward, after the buckets before
        it were stepped.

        Raises after backward, dropping them, if grads were written back after the hooks freed
        them (DDP around the model, see :func:`release`).

        If the first of the two backwards raises, its grads are dropped (nothing was stepped):
        a compiled backward with donated buffers raises there, saying what to do (see
        :func:`release`).

        The scaler's own calls are refused on an optimizer under release (``scaler.step(opt)``,
        ``unscale_``, ``clip_grad_norm_``), before anything changes, and a leftover
        ``scaler.update()`` raises saying that ``h.backward`` made the update: each step is
        ``h.backward(loss)`` alone.

        Marked ``torch.compiler.disable`` (on the handle): a compiled function that calls it
        runs it eagerly.
        """
        self._backward(loss, **kwargs)

    def _backward(self, loss: Tensor, **kwargs: Any) -> None:
        if self._handles is None:
            raise RuntimeError("fastamp.release: this handle was removed; call loss.backward() and opt.step() instead")
        if self._params_changed():
            self._rebuild()
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
        if self._two is not None:
            self._two.run(loss, kwargs)
            return
        self._one_backward(loss, kwargs)
        self._check_grads_freed(stepped=True)

    def _one_backward(self, loss: Tensor, kwargs: dict[str, Any]) -> None:
        """One backward with the hooks on; then the buckets some of whose params got no grad."""
        arrived = self._arrived
        for k in range(len(arrived)):
            arrived[k] = 0
        # one step of the optimizer: every bucket reads the rng counters as they were, and they advance
        # once when the step ends (see FusedOptimizer.bucket_step); the first of two backwards steps nothing
        with self.optimizer.bucket_step():
            self._active = True
            try:
                torch.autograd.backward(loss, **kwargs)
            finally:
                self._active = False
            for k, n in enumerate(arrived):
                if 0 < n < self._sizes[k]:
                    self._step(k)

    def _drop_grads(self) -> None:
        for p in self._params:
            p.grad = None

    def _check_grads_freed(self, stepped: bool) -> None:
        """Refuse grads written after the hooks freed them: DDP's reducer (wrapping the model out of release's sight)."""
        params = self._params
        if all(map(operator.is_, map(_grad_of, params), repeat(None))):
            return
        name = self._name_of(next(p for p in params if p.grad is not None))
        self._drop_grads()
        if stepped:
            done = (
                "This step was taken on this process's own grads, before any all-reduce: with several processes "
                "the params may now differ between them: reload them from a checkpoint."
            )
        else:
            done = "Nothing was stepped."
        raise RuntimeError(
            f"fastamp.release: the param {name!r} has a grad again after the released backward: something wrote "
            "grads after the release hooks freed them, most likely torch.nn.parallel.DistributedDataParallel "
            "wrapping this model (its reducer copies the all-reduced grads back into .grad when backward ends; "
            "fastamp.release given the inner module cannot see the wrapper). Gradient release under DDP is not "
            f"supported: call h.remove() and use the ordinary path (loss.backward(); opt.step()). {done} The grads "
            "were dropped."
        )

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


class _TwoPass:
    """The two backwards of a release with a scaler and/or ``max_norm`` (see :meth:`Release.backward`).

    The global sum of squares keeps the ordinary check pass's bits: that pass folds, in
    fp64, partials that each depend on one grad only (the native CPU kernel: one per chunk
    of 16384 elements, in chunk order; the native CUDA kernel: one per chunk of 65536, dtype
    group after dtype group (fp32, fp16, bf16), folded by one block's strided sums; Triton:
    one per chunk, launch group after launch group; the torch reference: one per grad), in
    the optimizer's param order. So the first
    backward writes each grad's partials into its own slots of a device buffer (the op
    ``unscale_check_partials_`` of its backend), and once every bucket is checked the
    backend's own fold (``sumsq_fold``) sums the slots of the params that got a grad in the
    order the ordinary call would have them. Without a scaler the clip is torch's
    ``clip_grad_norm_``: each grad's norm (``torch._foreach_norm``, per tensor) is kept and
    the norms are stacked in its (device, dtype) group order.
    """

    def __init__(self, handle: Release, optimizer: Any, params: list[Tensor]) -> None:
        self.handle = handle
        self.optimizer = optimizer
        self.scaler = handle.scaler
        self.max_norm = handle.max_norm
        flat = [p for group in optimizer.param_groups for p in group["params"]]
        self.flat = flat  # the ordinary check pass's order
        self.pos = {id(p): j for j, p in enumerate(flat)}
        self.device = params[0].device if params else torch.device("cpu")
        self.keys: list[Any] = [None] * len(flat)
        self.norms: list[Tensor | None] = [None] * len(flat)
        self.layouts: dict[str, tuple[Any, Tensor, list[int]]] = {}
        self.folds: dict[tuple, tuple[Tensor, list[int]]] = {}
        self.phase = 0
        self.backend = ""
        self.sumsq: _SumsqBackend | None = None

    # ---------------------------------------------------------------- one step

    def run(self, loss: Tensor, kwargs: dict[str, Any]) -> None:
        extra = set(kwargs) - {"retain_graph"}
        if extra:
            raise TypeError(
                f"fastamp.release: h.backward with a scaler or max_norm takes only retain_graph (for its second "
                f"backward), got {sorted(extra)}"
            )
        handle, opt, scaler = self.handle, self.optimizer, self.scaler
        state = None
        if scaler is not None:
            state = scaler._per_optimizer_states[id(opt)]
            if state["stage"] is not OptState.READY or scaler._clip_grad_scale(opt, state) is not None:
                if state["found_inf_per_device"]:
                    fix = "call scaler.update() first"
                else:
                    # update() would raise (no inf checks recorded): a new_scale ends the iteration without them
                    fix = (
                        "scaler.update() cannot end this iteration, whose scaler calls found no grads (no inf checks "
                        "were recorded): call scaler.update(new_scale=scaler.get_scale()), which keeps the scale"
                    )
                raise RuntimeError(
                    "fastamp.release: the scaler already unscaled, clipped or stepped this optimizer since its last "
                    f"update(); h.backward does all of that itself: {fix} (and drop the extra scaler calls)"
                )
            loss = scaler.scale(loss)
            scale = scaler._scale
            self.inv_scale = _inv_scale(scale)
            self.found = _new_found_inf(scale)
            self.backend = backends.resolve("unscale_check_", self.device, scaler._backend)
            if self.max_norm is not None:
                self.sumsq = self._layout(self.backend)
        for j in range(len(self.keys)):
            self.keys[j] = None
            self.norms[j] = None
        self.phase = 1
        try:
            handle._one_backward(loss, {"retain_graph": True})
        except BaseException as e:
            # the first backward steps nothing: without its grads everything is as before h.backward
            self.phase = 0
            handle._drop_grads()
            if isinstance(e, RuntimeError) and "donated buffers" in str(e):
                raise RuntimeError(_DONATED_BUFFERS) from e
            raise
        handle._check_grads_freed(stepped=False)
        present = [j for j, key in enumerate(self.keys) if key is not None]
        clip_mul = None
        if scaler is not None:
            if present:
                self._hand_over(state, scale)
        elif present:
            clip_mul = self._torch_clip_coef(present)
        self.clip_mul = clip_mul
        self.phase = 2
        saved = {k: opt.__dict__.get(k, _MISSING) for k in ("grad_scale", "found_inf")}
        done = False
        try:
            if scaler is not None and present:
                opt.grad_scale = self.grad_scale
                self.late = torch.zeros((), dtype=torch.float32, device=self.device)
            handle._one_backward(loss, {"retain_graph": kwargs.get("retain_graph", False)})
            done = True
        finally:
            self.phase = 0
            for k, v in saved.items():
                if done or v is _MISSING:
                    opt.__dict__.pop(k, None)
                else:
                    setattr(opt, k, v)
        if scaler is not None:
            if present:
                state["stage"] = OptState.STEPPED
                # an overflow seen only by the second backward backs the scale off too
                state["found_inf_per_device"] = {self.device: torch.maximum(self.found, self.late)}
            scaler.update()
            # names this handle in the error of a leftover scaler.update() (see Scaler.update)
            scaler._updated_by_release = True

    def _hand_over(self, state: dict[str, Any], scale: Tensor) -> None:
        """The scaler's state after ``clip_grad_norm_`` (or a check) and what its ``step`` hands the optimizer."""
        scaler, opt = self.scaler, self.optimizer
        found = {self.device: self.found}
        state["found_inf_per_device"] = found
        if self.max_norm is not None:
            sumsq = self._fold()
            total_norm = _total_norm({self.device: sumsq})
            self.handle.total_norm = total_norm
            clip_coef = _clip_coef(self.max_norm, total_norm)
            scaler._per_optimizer_clip_scales[id(opt)] = (state, _grad_scale_after_clip(scale, clip_coef))
            state["stage"] = OptState.UNSCALED
        self.found_inf = _fold_found_inf(found, scale)
        clip_scale = scaler._clip_grad_scale(opt, state)
        self.grad_scale = _step_grad_scale(
            scale, clip_scale, getattr(opt, "grad_scale", None), state["stage"] is OptState.UNSCALED
        )

    # ---------------------------------------------------------------- per bucket

    def bucket(self, bucket: tuple[Tensor, ...]) -> None:
        """The hook's work on one bucket whose grads are there: check (first backward) or step (second)."""
        with_grad = [p for p in bucket if p.grad is not None]
        if not with_grad:
            return
        grads = [p.grad for p in with_grad]
        if self.phase == 1:
            self._check(with_grad, grads)
            return
        opt = self.optimizer
        if self.scaler is not None:
            # non-finite now but not in the first backward (a non-deterministic backward): skip this bucket
            again = _new_found_inf(self.found)
            with torch.no_grad():
                functional._unscale_check(grads, again, self.inv_scale, False, False, None, None, self.backend)
            late = again * (1.0 - self.found_inf)
            self.handle.mismatches.add_(late.to(torch.int64))
            self.late = torch.maximum(self.late, late)
            opt.found_inf = torch.maximum(self.found_inf, again)
        elif self.clip_mul is not None:
            with torch.no_grad():
                for same in _by_dtype(grads).values():
                    torch._foreach_mul_(same, self.clip_mul)
        opt.step_bucket(bucket)

    def _check(self, with_grad: list[Tensor], grads: list[Tensor]) -> None:
        pos, keys = self.pos, self.keys
        scaler = self.scaler
        if scaler is None:
            with torch.no_grad():
                for idx, same in _by_dtype(grads, True).items():
                    for i, norm in zip(idx, torch._foreach_norm(same, 2.0)):
                        j = pos[id(with_grad[i])]
                        self.norms[j] = norm
                        keys[j] = grads[i].dtype
            return
        if scaler._health.wants_dtypes():
            scaler._health.note_grads(grads)
        with torch.no_grad():
            if self.sumsq is None:
                functional._unscale_check(grads, self.found, self.inv_scale, False, False, None, None, self.backend)
                for p in with_grad:
                    keys[pos[id(p)]] = True
                return
            sumsq = self.sumsq
            offsets = self.offsets
            dense = [g if g.is_contiguous() else g.contiguous() for g in grads]
            at = []
            for p, g in zip(with_grad, grads):
                j = pos[id(p)]
                keys[j] = sumsq.key(g)
                at.append(offsets[j])
            sumsq.partials_(dense, self.found, self.inv_scale, self.slots, at)

    # ---------------------------------------------------------------- the fold

    def _layout(self, backend: str) -> _SumsqBackend:
        entry = self.layouts.get(backend)
        if entry is None:
            impl = _SumsqBackend(backend, self.device)
            offsets, total = [], 0
            for p in self.flat:
                offsets.append(total)
                total += impl.count(p.numel())
            slots = torch.zeros(max(total, 1), dtype=torch.float64, device=self.device)
            entry = self.layouts[backend] = (impl, slots, offsets)
        impl, self.slots, self.offsets = entry
        return impl

    def _fold(self) -> Tensor:
        """The ordinary check pass's sum of squares from the slots, in its order (cached per grad pattern)."""
        impl = self.sumsq
        pattern = (self.backend, tuple(self.keys))
        entry = self.folds.get(pattern)
        if entry is None:
            groups: dict[Any, list[int]] = {}
            for j, key in enumerate(self.keys):
                if key is not None:
                    groups.setdefault(impl.group(key), []).append(j)
            index: list[int] = []
            ordered = sorted(groups.items()) if impl.sorted_groups else groups.items()
            for _, members in ordered:
                for j in members:
                    start = self.offsets[j]
                    index.extend(range(start, start + impl.count(self.flat[j].numel())))
            # on the slots' device: the native CUDA fold reads it there
            entry = self.folds[pattern] = (torch.tensor(index, dtype=torch.int64, device=self.device), index)
        return impl.fold(self.slots, *entry)

    def _torch_clip_coef(self, present: list[int]) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_``'s clamped coefficient from the kept per-grad norms."""
        norms = [self.norms[j] for j in present]
        pattern = ("torch-clip", tuple(self.keys))
        order = self.folds.get(pattern)
        if order is None:
            from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

            stand_ins = [torch.empty(0, dtype=self.keys[j], device=self.device) for j in present]
            grouped = _group_tensors_by_device_and_dtype([stand_ins], with_indices=True)
            order = self.folds[pattern] = [i for _, (_, idx) in grouped.items() for i in idx]
        first = norms[0].device
        with torch.no_grad():
            total_norm = torch.linalg.vector_norm(torch.stack([norms[i].to(first) for i in order]), 2.0)
            self.handle.total_norm = total_norm
            return torch.clamp(self.max_norm / (total_norm + 1e-6), max=1.0)


class _SumsqBackend:
    """One backend's partials op and fold, and how many partials each grad has (see :class:`_TwoPass`)."""

    def __init__(self, backend: str, device: torch.device | None = None) -> None:
        self.name = backend
        device = torch.device("cpu") if device is None else device
        self.cuda = device.type == "cuda"
        # whether the groups fold in the order of their keys (the native CUDA plan: dtype index order) rather than
        # in the order they are first seen
        self.sorted_groups = False
        if backend == "native":
            from fastamp.ops import registry

            if not hasattr(torch.ops.fastamp, "unscale_check_partials_") or not all(
                registry.native_has_kernel(op, device.type) for op in ("unscale_check_partials_", "sumsq_fold")
            ):
                raise RuntimeError(
                    f"fastamp.release: fastamp._C has no {device.type.upper()} kernel of unscale_check_partials_ "
                    "(an older build): rebuild the extension, or force another backend (FASTAMP_BACKEND=torch)"
                )
            self.partials_ = torch.ops.fastamp.unscale_check_partials_
            self.fold = _native_fold
            if self.cuda:
                self.count = _native_cuda_partial_count
                self.group = _as_is
                self.sorted_groups = True
            else:
                self.count = _native_partial_count
                self.group = _one_group
        elif backend == "triton":
            from fastamp.kernels import amp

            self.partials_ = amp.unscale_check_partials_
            self.count = amp.sumsq_partial_count
            self.group = _as_is
            self.fold = lambda slots, index, _: amp.sumsq_fold(slots, index)
        else:
            from fastamp.reference import amp

            self.partials_ = amp.unscale_check_partials_
            self.count = amp.sumsq_partial_count
            self.group = _one_group
            self.fold = lambda slots, _, index: amp.sumsq_fold(slots, index)

    def key(self, grad: Tensor) -> Any:
        if self.name == "triton":
            from fastamp.kernels import amp

            return amp.sumsq_key(grad)
        if self.name == "native" and self.cuda:
            return _NATIVE_CUDA_DTYPE_RANK[grad.dtype]
        return True


# the chunk of csrc/cpu/multi_tensor.h (kChunkElems): one partial per chunk, an empty grad none
_NATIVE_CHUNK = 16384


def _native_partial_count(numel: int) -> int:
    return -(-numel // _NATIVE_CHUNK)


# the chunk of csrc/cuda/launch_plan.h (kChunkSize), and the order of its dtype groups (DType): grad chunks are
# numbered dtype group by dtype group, list order within one, and unscale_check_ folds them in that order
_NATIVE_CUDA_CHUNK = 65536
_NATIVE_CUDA_DTYPE_RANK = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _native_cuda_partial_count(numel: int) -> int:
    return -(-numel // _NATIVE_CUDA_CHUNK)


def _native_fold(slots: Tensor, index: Tensor, _: list[int]) -> Tensor:
    return torch.ops.fastamp.sumsq_fold(slots, index)


def _one_group(key: Any) -> bool:
    return True


def _as_is(key: Any) -> Any:
    return key


def _by_dtype(grads: list[Tensor], with_index: bool = False) -> dict:
    """The grads by dtype (first-seen order); with ``with_index``, keyed by their positions."""
    out: dict[torch.dtype, list] = {}
    for i, g in enumerate(grads):
        out.setdefault(g.dtype, []).append(i if with_index else g)
    if with_index:
        return {tuple(idx): [grads[i] for i in idx] for idx in out.values()}
    return out


_MISSING = object()

_DONATED_BUFFERS = (
    "fastamp.release: torch.compile compiled this model's backward with donated buffers (AOTAutograd reuses the "
    "memory of saved activations; torch._functorch.config.donated_buffer, on by default), which cannot run with "
    "retain_graph=True, and release with a scaler or max_norm runs two backwards over one graph, the first with "
    "retain_graph=True. It was compiled for an ordinary backward first (in this process, of this model or of "
    "another whose forward has the same code, which share it, or taken from torch.compile's cache). Set torch._functorch.config.donated_buffer = False and "
    "torch.compiler.config.force_disable_caches = True before the model's first compiled call (then "
    "torch._dynamo.reset() and compile again if it ran already): with torch's caches on, a backward compiled with "
    "donated buffers can come back even so, and then gives wrong grads without an error. Or release without "
    "scaler and max_norm (one backward). Nothing was stepped; the grads were dropped"
)
