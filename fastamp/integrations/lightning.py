"""A Lightning precision plugin on :class:`fastamp.Scaler`, with fused gradient clipping.

Usage::

    import lightning as L
    from fastamp.integrations.lightning import MixedPrecision

    trainer = L.Trainer(
        plugins=[MixedPrecision("16-mixed", "cuda")],   # builds a fastamp.Scaler
        gradient_clip_val=1.0,                          # fused clip, no host sync
    )
    trainer.fit(module)   # configure_optimizers may return fastamp.optim.AdamW

Importing this module imports ``lightning``; ``import fastamp`` does not.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Callable, Literal

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import LBFGS

from fastamp.integrations._pending import all_stepped, enabled, stage, step_again, update_if_pending
from fastamp.scaler import OptState, Scaler

__all__ = ["MixedPrecision"]

_SCALER_OPTIONS = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
    "backend",
    "track_stats",
)


def _amp_aware(optimizer) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _peers(model, optimizer) -> list:
    """The optimizers of ``model``'s trainer (the ones stepping in an iteration), unwrapped."""
    trainer = getattr(model, "_trainer", None)
    optimizers = list(getattr(trainer, "optimizers", None) or [])
    unwrapped = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in optimizers]
    return unwrapped if any(o is optimizer for o in unwrapped) else [optimizer]


class MixedPrecision(_LightningMixedPrecision):
    """Lightning's ``MixedPrecision`` plugin with a :class:`fastamp.Scaler` and fused clipping.

    A subclass of ``lightning.pytorch.plugins.precision.MixedPrecision`` with the same
    ``__class__.__qualname__``, so its state goes under the same checkpoint key: a
    checkpoint written with Lightning's plugin (torch's ``GradScaler``) resumes here, and
    one written here resumes with Lightning's plugin (torch's scaler reads its own keys).

    What it changes:
      * ``"16-mixed"`` builds a :class:`fastamp.Scaler` (options below); a scaler you pass
        must be a :class:`fastamp.Scaler`.
      * ``gradient_clip_val`` with ``gradient_clip_algorithm="norm"`` (and
        ``LightningModule.clip_gradients``) runs :meth:`fastamp.Scaler.clip_grad_norm_`:
        one fused check + norm pass, no host sync, for amp-aware optimizers too
        (``fastamp.optim.AdamW``, ``torch.optim.AdamW(fused=True)``), which Lightning's
        plugin refuses to clip. Its result (the unscaled total norm, a device tensor) is
        kept in :attr:`last_grad_norm`.
      * ``gradient_clip_algorithm="value"`` unscales the grads first (for an amp-aware
        optimizer: one extra write pass) and clamps them with ``clip_grad_value_``; an
        overflow is recorded before the clamp, so the step is still skipped.
      * ``"bf16-mixed"`` (no scaler): clipping of either kind clips the grads as they are,
        also for amp-aware optimizers (Lightning's plugin refuses those there too, although
        nothing is scaled).
      * With ``log_metrics=True`` (default) every optimizer step logs
        ``fastamp/skipped_steps`` (iterations skipped so far) and ``fastamp/loss_scale``
        (the scale for the next step) as device tensors, ``on_step`` only, to the loggers:
        no host sync here; Lightning reads them when it writes its logs (every
        ``log_every_n_steps``). They are in ``trainer.callback_metrics`` as well.
        :attr:`skipped_steps` is the counter itself.

    Hooks: ``on_before_optimizer_step`` sees unscaled grads with an ordinary optimizer and
    still-scaled grads with an amp-aware one (as with Lightning's plugin: the fused clip and
    step unscale in registers, the grads are never rewritten).

    Manual optimization: call ``self.clip_gradients(opt, gradient_clip_val=...)`` before
    ``opt.step()`` as usual; the clip then sees (and computes on) unscaled values, and the step
    does not unscale twice.

    Several optimizers (manual optimization): one ``scaler.update()`` per iteration (one
    ``training_step``), as in torch's hand-written loop, bit for bit: once every optimizer of
    the trainer has stepped, or when ``training_step`` returns (an iteration in which some
    optimizer did not step). That holds for optimizers stepped one after the other
    (``step(o1); step(o2)``) and for a GAN's ``manual_backward(loss_d); opt_d.step();
    manual_backward(loss_g); opt_g.step()``: every loss of an iteration is scaled with the same
    scale, every optimizer's overflow counts in the one update. Lightning's plugin updates
    after each step instead: two updates per GAN iteration (the second loss is scaled with a
    scale already updated after the first step), and with ``step(o1); step(o2)`` a second
    optimizer's clip or unscale of the same iteration was thrown away, or its grads unscaled
    with a scale they were not made with. An optimizer that steps twice in one
    ``training_step`` (a critic stepped several times): each of its steps unscales with the
    iteration's scale, and each step's overflow counts in the iteration's update. A
    ``manual_backward`` outside ``training_step`` (in another hook) first runs an update left
    pending; so does writing a checkpoint. Skips are torch's, per optimizer step: each skips
    when its own grads overflowed; the scale backs off when any did.

    A disabled scaler (``Scaler(enabled=False)``, or what ``"cuda"`` gives on a machine
    without CUDA, as torch's ``GradScaler`` does): training runs as Lightning's plugin runs it
    with a disabled ``GradScaler`` (autocast, no scaling, no skips, no metrics logged), and
    clipping clips the grads as they are, for amp-aware optimizers too (as with bf16).

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + loss scaling) or ``"bf16-mixed"``.
        device: the device type for ``torch.autocast`` (``"cuda"``, ``"cpu"``).
        scaler: a :class:`fastamp.Scaler`; default: one built from the options below.
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
            max_scale, backend, track_stats: passed to :class:`fastamp.Scaler` (its defaults
            where not given); only when ``scaler`` is not given, and only for ``"16-mixed"``.
        log_metrics: log the skip counter and the scale (see above).

    Host syncs: none in the plugin with an amp-aware optimizer. With an ordinary optimizer
    :meth:`fastamp.Scaler.step` reads ``found_inf`` once (Python decides whether to call
    ``optimizer.step()``), as torch's scaler does. Lightning itself syncs when it logs and
    checkpoints (the scaler's ``state_dict`` reads the scale).
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str,
        scaler: Scaler | None = None,
        *,
        init_scale: float | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        growth_interval: int | None = None,
        hysteresis: int | None = None,
        min_scale: float | None = None,
        max_scale: float | None = None,
        backend: str | None = None,
        track_stats: bool | None = None,
        log_metrics: bool = True,
    ) -> None:
        arguments = locals()
        given = {k: arguments[k] for k in _SCALER_OPTIONS if arguments[k] is not None}
        where = f"fastamp.integrations.lightning.MixedPrecision(precision={precision!r})"
        if precision == "bf16-mixed" and given:
            raise ValueError(f"{where}: bf16 needs no loss scaler, so scaler options make no sense, got {given}")
        if scaler is not None and given:
            raise ValueError(f"{where}: pass either a scaler or scaler options, not both; got options {given}")
        if scaler is not None and not isinstance(scaler, Scaler):
            raise TypeError(
                f"{where}: scaler must be a fastamp.Scaler, got {type(scaler).__module__}.{type(scaler).__qualname__}; "
                "for torch's GradScaler use lightning.pytorch.plugins.precision.MixedPrecision"
            )
        if scaler is None and precision == "16-mixed":
            scaler = Scaler(device, **given)
        super().__init__(precision, device, scaler)
        self.log_metrics = bool(log_metrics)
        self.last_grad_norm: Tensor | None = None
        # set while Lightning runs the clipping hooks after a backward that was skipped
        self._backward_skipped = False
        # > 0 while a training_step runs: the iteration's update waits for its end
        self._in_training_step = 0

    @property
    def skipped_steps(self) -> Tensor | int:
        """Iterations skipped so far for overflow (a device tensor, no sync; 0 without a scaler or with a disabled one)."""
        return self.scaler.skipped_steps if enabled(self.scaler) else 0

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if not enabled(self.scaler):
            # bf16, or a disabled scaler: Lightning's own path (a disabled scaler's unscale_,
            # step and update are torch's no-ops; only clip_gradients below is this plugin's)
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        if self._stage(optimizer) is OptState.STEPPED:
            step_again(self.scaler, optimizer)  # a second step since the last update: see the class doc
        closure_result = closure()
        # automatic optimization with a training_step that returned None: no backward ran
        skip = closure_result is None and model.automatic_optimization
        # Ordinary optimizers: unscale before the hooks, as Lightning does, so that
        # on_before_optimizer_step sees unscaled grads. Amp-aware ones keep them scaled: the
        # clip reads them once and folds everything into the step's grad_scale. A clip the
        # user ran already (manual optimization) counts as this iteration's unscale.
        if not skip and not _amp_aware(optimizer) and self._stage(optimizer) is OptState.READY:
            self.scaler.unscale_(optimizer)
        self._backward_skipped = skip
        try:
            self._after_closure(model, optimizer)
        finally:
            self._backward_skipped = False
        if skip:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)
        # one update per iteration (torch's loop): once every optimizer of the trainer has
        # stepped; until then the others keep their unscale_ / fused clip of this iteration
        if all_stepped(self.scaler, _peers(model, optimizer)):
            self.scaler.update()
        if self.log_metrics:
            self._log(model)
        return step_output

    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        # One training_step is one iteration: its update runs when it returns, if some optimizer
        # stepped and not all did (torch's loop: step the ones that step, then update). An update
        # still pending at its start comes from steps taken outside it (in another hook).
        update_if_pending(self.scaler)
        self._in_training_step += 1
        try:
            with super().train_step_context():
                yield
        finally:
            self._in_training_step -= 1
        update_if_pending(self.scaler)

    def pre_backward(self, tensor: Tensor, module) -> Tensor:
        if not self._in_training_step:
            # a backward outside training_step (automatic optimization's, or one in another hook):
            # an update left pending runs before its loss is scaled. Inside one, a pending update
            # waits for the iteration's end: a GAN's second backward belongs to the same iteration.
            update_if_pending(self.scaler)
        return super().pre_backward(tensor, module)

    def state_dict(self) -> dict[str, Any]:
        update_if_pending(self.scaler)  # the scale a checkpoint holds is the next iteration's
        return super().state_dict()

    def clip_gradients(
        self,
        optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val is None or clip_val <= 0 or self._backward_skipped:
            return
        if isinstance(optimizer, LightningOptimizer):
            # manual optimization hands the wrapper to clip_gradients; the scaler's per-optimizer
            # state (and the step) are keyed by the optimizer inside it
            optimizer = optimizer.optimizer
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm)
        if not enabled(self.scaler):
            # bf16 or a disabled scaler: nothing is scaled, so torch's clipping is right for every optimizer
            super(_LightningMixedPrecision, self).clip_gradients(optimizer, clip_val, algorithm)
            return
        if algorithm is GradClipAlgorithmType.NORM:
            self.last_grad_norm = self.scaler.clip_grad_norm_(optimizer, clip_val)
            return
        if self._stage(optimizer) is OptState.READY:
            self.scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_value_(list(self.main_params(optimizer)), clip_value=clip_val)

    def _stage(self, optimizer) -> OptState:
        # the scaler's own per-optimizer record (torch's layout): READY, UNSCALED or STEPPED
        return stage(self.scaler, optimizer)

    def _log(self, model) -> None:
        scale = self.scaler._get_scale_async()
        if scale is None:
            return
        log = {"on_step": True, "on_epoch": False, "prog_bar": False, "logger": bool(model.trainer.loggers)}
        model.log("fastamp/skipped_steps", self.scaler.skipped_steps.to(torch.float32), **log)
        model.log("fastamp/loss_scale", scale, **log)
