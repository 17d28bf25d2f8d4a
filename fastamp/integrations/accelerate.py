"""Put a :class:`fastamp.Scaler` into a Hugging Face ``Accelerator``.

Usage::

    from accelerate import Accelerator
    from fastamp.integrations.accelerate import use_fastamp_scaler

    accelerator = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=4)
    scaler = use_fastamp_scaler(accelerator)           # before prepare()
    model, opt = accelerator.prepare(model, fastamp.optim.AdamW(model.parameters()))
    for x, y in data:
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)   # fused, no sync
            opt.step()
            opt.zero_grad()

Importing this module imports ``accelerate``; ``import fastamp`` does not.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import Tensor
from torch.amp.grad_scaler import OptState

from fastamp.integrations._pending import all_stepped, enabled, stage, step_again, update_if_pending
from fastamp.scaler import Scaler

__all__ = ["use_fastamp_scaler"]

# the single-process and DDP setups, where Accelerate itself uses torch.amp.GradScaler
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
_WHERE = "fastamp.integrations.accelerate.use_fastamp_scaler"


def use_fastamp_scaler(accelerator: Accelerator, scaler: Scaler | None = None, **scaler_options: Any) -> Scaler:
    """Make ``accelerator`` scale losses with a :class:`fastamp.Scaler`; returns the scaler.

    Call it after creating the ``Accelerator`` (for ``transformers.Trainer``: on
    ``trainer.accelerator`` before ``trainer.train()``) and before ``accelerator.prepare``.
    Everything else stays Accelerate's: ``accelerator.backward`` scales with this scaler,
    prepared optimizers step and update through it (only when ``sync_gradients``: gradient
    accumulation works unchanged), ``save_state``/``load_state`` write and read its
    ``state_dict`` (fastamp's keys; a torch ``GradScaler`` state from an earlier run loads too).

    What changes on the accelerator:
      * ``accelerator.scaler`` is the fastamp scaler. On CPU, where Accelerate skips its fp16
        setup altogether (no autocast, no scaler: ``mixed_precision="fp16"`` would silently
        train in fp32), fp16 autocast is switched on as Accelerate does on a GPU.
      * ``accelerator.clip_grad_norm_(params, max_norm)``: when ``params`` are the params of
        one prepared optimizer (those with a grad; frozen ones may be passed too), it runs
        :meth:`fastamp.Scaler.clip_grad_norm_` on that optimizer: one fused unscale + check +
        norm pass, no host sync, and with an amp-aware optimizer (``fastamp.optim.AdamW``,
        ``torch.optim.AdamW(fused=True)``) the grads are not even rewritten. Otherwise
        Accelerate's own path runs (unscale every optimizer, then torch's clip).
        ``clip_grad_value_`` and ``unscale_gradients`` are Accelerate's, on fastamp's ``unscale_``.
      * Several prepared optimizers: one ``scaler.update()`` per iteration, as in torch's
        hand-written loop (``step(o1); step(o2); update()``, and a GAN's ``backward(loss_d);
        step(opt_d); backward(loss_g); step(opt_g); update()``), not one after each
        optimizer's step as Accelerate does. A prepared optimizer's ``step()`` runs
        ``scaler.step`` on it and updates the scale once every prepared optimizer has stepped
        this iteration; until then the others keep what this iteration gave them (an
        ``unscale_``, a pending fused clip) and are unscaled with the scale their grads were
        made with. With one optimizer nothing changes. Skips are torch's, per optimizer step:
        each skips when its own grads overflowed; the scale backs off when any did.
      * Iterations in which some prepared optimizer does not step: the update runs when the
        iteration ends, which Accelerate shows in two ways: the next batch (or the end) of a
        prepared dataloader, and the end of an ``accelerator.accumulate(...)`` block; then
        every loss of an iteration is scaled with the same scale, bit for bit as in torch's
        loop. A loop with neither (an ``accelerator.backward`` outside both) gets no such
        signal: an update left pending runs at its next ``accelerator.backward``, which is
        torch's loop when every backward starts an iteration, but in a GAN's second backward
        gives two updates per iteration, as Accelerate's own ``GradScaler`` path does (one
        after each step). ``save_state`` runs a pending update first. A batch fetched from
        a prepared dataloader in the middle of an iteration ends it there. An optimizer that
        steps twice in one iteration (a critic stepped several times): each step unscales
        with the iteration's scale, each step's overflow counts in the iteration's update.
      * A disabled scaler (``Scaler(enabled=False)``, ``GradScalerKwargs(enabled=False)``):
        Accelerate's own paths with a disabled ``GradScaler`` (autocast, no scaling, no
        skips); ``clip_grad_norm_`` is torch's clip.
      * Prepared optimizers report ``step_was_skipped`` for their own step, amp-aware
        optimizers too. Accelerate decides it by whether ``optimizer.step()`` was called,
        which an amp-aware optimizer always is (it skips on the device), so Accelerate would
        say False and let a prepared LR scheduler step on skipped iterations (with torch's
        fused AdamW as well). Here it reads the optimizer's own ``found_inf`` of its last
        step: a host sync, only when read. ``step_was_skipped_tensor`` is that device flag.

    Host syncs that remain: a prepared LR scheduler reads ``step_was_skipped`` after every
    optimizer step (one sync per step; use :class:`fastamp.DeviceLR` and do not prepare the
    scheduler to avoid it); an ordinary optimizer's step reads ``found_inf`` once (as torch);
    ``save_state`` reads the scale.

    Args:
        accelerator: an ``Accelerator(mixed_precision="fp16")``, single process or DDP.
        scaler: a :class:`fastamp.Scaler`; default: one on ``accelerator.device``'s type,
            built from ``GradScalerKwargs`` given to the accelerator, updated with
            ``scaler_options``.
        **scaler_options: :class:`fastamp.Scaler` arguments (``growth_interval``,
            ``hysteresis``, ``min_scale``, ...); only without ``scaler``.

    Raises:
        ValueError: mixed precision other than ``"fp16"`` (bf16 needs no loss scaler; fastamp's
            optimizers work with ``mixed_precision="bf16"`` as they are), or a distributed
            setup with its own scaling (FSDP, DeepSpeed, Megatron-LM, XLA).
        RuntimeError: called after ``prepare`` or twice.
        TypeError: ``scaler`` is not a :class:`fastamp.Scaler`.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"{_WHERE}: expected an accelerate.Accelerator, got {type(accelerator).__qualname__}")
    if accelerator.mixed_precision != "fp16":
        raise ValueError(
            f"{_WHERE}: needs Accelerator(mixed_precision='fp16'), got {accelerator.mixed_precision!r}; bf16 needs "
            "no loss scaler (fastamp's optimizers work with mixed_precision='bf16' as they are)"
        )
    if accelerator.distributed_type not in _SUPPORTED:
        raise ValueError(
            f"{_WHERE}: {accelerator.distributed_type} does its own loss scaling; supported: single process and DDP"
        )
    if getattr(accelerator, "_fastamp_scaler", None) is not None:
        raise RuntimeError(f"{_WHERE}: this accelerator uses a fastamp.Scaler already")
    if accelerator._models or accelerator._optimizers:
        raise RuntimeError(
            f"{_WHERE}: call it before accelerator.prepare(...): the model's autocast and the optimizers' "
            "scaler are set up there"
        )
    if scaler is not None and scaler_options:
        raise ValueError(f"{_WHERE}: pass either a scaler or scaler options, not both; got {scaler_options}")
    if scaler is not None and not isinstance(scaler, Scaler):
        raise TypeError(f"{_WHERE}: scaler must be a fastamp.Scaler, got {type(scaler).__qualname__}")
    if scaler is None:
        handler = accelerator.scaler_handler
        options = {**(handler.to_kwargs() if handler is not None else {}), **scaler_options}
        scaler = Scaler(accelerator.device.type, **options)

    accelerator.native_amp = True
    accelerator.scaler = scaler
    accelerator._fastamp_scaler = scaler
    accelerator.prepare_optimizer = _prepare_optimizer(accelerator, accelerator.prepare_optimizer)
    accelerator.clip_grad_norm_ = _clip_grad_norm(accelerator, accelerator.clip_grad_norm_)
    accelerator.backward = _backward(accelerator, accelerator.backward)
    accelerator.save_state = _update_first(accelerator, accelerator.save_state)
    accelerator._fastamp_blocks = 0
    accelerator.accumulate = _accumulate(accelerator, accelerator.accumulate)
    accelerator.prepare_data_loader = _hooks_batches(scaler, accelerator.prepare_data_loader)
    accelerator.skip_first_batches = _hooks_batches(scaler, accelerator.skip_first_batches)
    for dataloader in accelerator._dataloaders:
        _hook_batches(scaler, dataloader)
    return scaler


class _FastampAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper: one scale update per iteration, and its own skip flag.

    Set by ``prepare_optimizer`` (a class swap, no ``__init__``): ``_fastamp_accelerator``
    (a weak reference to the accelerator, whose prepared optimizers are this one's peers)
    and ``_fastamp_skipped`` (this optimizer's found_inf of its last step, a device bool).
    """

    def step(self, closure=None):
        scaler = self.scaler
        if not enabled(scaler) or not self.gradient_state.sync_gradients:
            return super().step(closure)  # bf16 (no scaler), a disabled scaler, or accumulating: Accelerate's
        if stage(scaler, self.optimizer) is OptState.STEPPED:
            step_again(scaler, self.optimizer)  # a second step in one iteration: see use_fastamp_scaler
        self.optimizer.step = self._optimizer_patched_step_method
        try:
            scaler.step(self.optimizer, closure)
        finally:
            self.optimizer.step = self._optimizer_original_step_method
        self._is_overflow = not self._accelerate_step_called  # Accelerate's (ordinary optimizers)
        self._accelerate_step_called = False
        self._fastamp_skipped = _own_found_inf(scaler, self.optimizer)
        if all_stepped(scaler, [peer.optimizer for peer in self._fastamp_peers()]):
            scaler.update()

    def _fastamp_peers(self) -> list[AcceleratedOptimizer]:
        ref = self.__dict__.get("_fastamp_accelerator")
        accelerator = ref() if ref is not None else None
        if accelerator is None:
            return [self]
        return [o for o in accelerator._optimizers if isinstance(o, _FastampAcceleratedOptimizer)]

    @property
    def step_was_skipped(self) -> bool:
        skipped = self.__dict__.get("_fastamp_skipped")
        if skipped is not None and getattr(self.optimizer, "_step_supports_amp_scaling", False):
            return bool(skipped)  # syncs
        return self._is_overflow  # Accelerate's: the scaler did not call optimizer.step()

    @property
    def step_was_skipped_tensor(self) -> Tensor | bool:
        """Whether this optimizer's last step was skipped, as a device tensor (no sync)."""
        if not isinstance(self.scaler, Scaler):
            return self._is_overflow
        skipped = self.__dict__.get("_fastamp_skipped")
        return skipped if skipped is not None else self.scaler.last_step_skipped_tensor

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_fastamp_accelerator", None)  # a weak reference does not pickle
        return state


def _own_found_inf(scaler: Scaler, optimizer) -> Tensor | None:
    """``optimizer``'s own overflow flag of the step just taken (a new device bool; no sync)."""
    found = list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
    if not found:
        return None  # an optimizer taking the legacy grad_scaler argument records none
    device = scaler._get_scale_async().device
    return torch.stack([f.to(device, torch.float32) for f in found]).sum() > 0


def _update_first(accelerator: Accelerator, original):
    """Run a scale update left pending (an optimizer that did not step) before ``original``."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        update_if_pending(accelerator.scaler)
        return original(*args, **kwargs)

    return wrapper


def _backward(accelerator: Accelerator, original):
    """``accelerator.backward``: a pending update runs first only where no iteration end will come.

    Inside an ``accumulate`` block or while a prepared dataloader is iterated, the block's end
    or the next batch closes the iteration: a backward there may be a GAN's second one, whose
    loss torch's loop scales with the iteration's scale. Elsewhere a backward is taken to start
    the next iteration.
    """

    @functools.wraps(original)
    def backward(*args, **kwargs):
        if not accelerator._fastamp_blocks and not _hooked(accelerator.gradient_state.active_dataloader):
            update_if_pending(accelerator.scaler)
        return original(*args, **kwargs)

    return backward


def _accumulate(accelerator: Accelerator, original):
    """``accelerator.accumulate(...)``: the end of the block ends an iteration (a pending update runs)."""

    @functools.wraps(original)
    @contextlib.contextmanager
    def accumulate(*models):
        accelerator._fastamp_blocks += 1
        try:
            with original(*models):
                yield
        finally:
            accelerator._fastamp_blocks -= 1
        update_if_pending(accelerator.scaler)

    return accumulate


class _IterationEnd:
    """A prepared dataloader's ``_update_state_dict`` or ``end``, which Accelerate calls as the user's
    ``next()`` fetches the next batch or finds none: the iteration before is over, its pending update runs.

    Set on the dataloader instance (its class reports the wrapped dataloader's ``__class__``);
    pickling it gives back the plain method.
    """

    def __init__(self, scaler: Scaler, original) -> None:
        self.scaler, self.original = scaler, original

    def __call__(self, *args, **kwargs):
        update_if_pending(self.scaler)
        return self.original(*args, **kwargs)

    def __reduce__(self):
        return (getattr, (self.original.__self__, self.original.__name__))


def _hook_batches(scaler: Scaler, dataloader):
    for name in ("_update_state_dict", "end"):
        method = getattr(type(dataloader), name, None) and getattr(dataloader, name)
        if method is not None and not isinstance(method, _IterationEnd):
            setattr(dataloader, name, _IterationEnd(scaler, method))
    return dataloader


def _hooked(dataloader) -> bool:
    return dataloader is not None and isinstance(getattr(dataloader, "__dict__", {}).get("end"), _IterationEnd)


def _hooks_batches(scaler: Scaler, original):
    """``prepare_data_loader`` / ``skip_first_batches``, whose dataloaders end iterations (see ``_IterationEnd``)."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return _hook_batches(scaler, original(*args, **kwargs))

    return wrapper


def _prepare_optimizer(accelerator: Accelerator, original):
    @functools.wraps(original)
    def prepare_optimizer(optimizer, device_placement=None):
        prepared = original(optimizer, device_placement=device_placement)
        if type(prepared) is AcceleratedOptimizer:
            prepared.__class__ = _FastampAcceleratedOptimizer
            prepared._fastamp_accelerator = weakref.ref(accelerator)
            prepared._fastamp_skipped = None
        return prepared

    return prepare_optimizer


def _clip_grad_norm(accelerator: Accelerator, original):
    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        optimizer = _sole_owner(accelerator, parameters)
        if optimizer is None:
            return original(parameters, max_norm, norm_type=norm_type)
        return accelerator.scaler.clip_grad_norm_(optimizer, max_norm, norm_type)

    return clip_grad_norm_


def _sole_owner(accelerator: Accelerator, parameters: list[Tensor]):
    """The prepared (unwrapped) optimizer whose params with a grad are exactly those of ``parameters``."""
    wanted = {id(p) for p in parameters if p.grad is not None}
    if not wanted:
        return None
    for prepared in accelerator._optimizers:
        optimizer = prepared
        while isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        owned = {id(p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
        if owned == wanted:
            return optimizer
    return None
