"""The Scaler's diagnostics: skip counters and per-tensor gradient health.

:attr:`Scaler.last_step_skipped` / :attr:`Scaler.skipped_steps` (device counters that
:meth:`Scaler.update` advances, no sync until read), :meth:`Scaler.watch` (names params,
checks the model once for low-precision BatchNorm) and :meth:`Scaler.grad_stats` (reads the
statistics buffers the check pass fills with ``track_stats=True``; see :mod:`fastamp.health`).
Extras over ``torch.amp.GradScaler``; a mixin of :class:`fastamp.Scaler`, on its state.
"""

from __future__ import annotations

import weakref
from typing import Any, Union

import torch
from torch import Tensor

from fastamp import health
from fastamp.scaler.compiled import _eager_under_compile


class _DiagnosticsMixin:
    """The skip counters, :meth:`watch` and :meth:`grad_stats` of :class:`fastamp.Scaler`."""

    def _init_diagnostics(self, track_stats: bool) -> None:
        # the state of the extras below (set last by Scaler.__init__ when enabled)
        self._init_skipped_steps = 0
        self._skipped_steps: Tensor | None = None
        self._init_last_step_skipped = False
        self._last_step_skipped: Tensor | None = None
        self._track_stats = bool(track_stats)
        # (id(optimizer), device) -> the last check's statistics buffers for it
        self._stats: dict[tuple[int, torch.device], health._StatsRows] = {}
        self._param_names: dict[int, tuple[Any, str]] = {}
        self._health = health._Monitor()
        self._last_stats_update = 0

    @property
    def last_step_skipped(self) -> bool:
        """Whether the iteration closed by the last :meth:`update` skipped a step (syncs when read).

        Use :attr:`last_step_skipped_tensor` to keep it on the device.
        """
        t = self.last_step_skipped_tensor
        return bool(t) if isinstance(t, Tensor) else t

    @property
    def last_step_skipped_tensor(self) -> Union[Tensor, bool]:
        if not self._enabled:
            return False
        if self._last_step_skipped is None:
            return self._init_last_step_skipped
        return self._last_step_skipped

    @property
    def skipped_steps(self) -> Union[Tensor, int]:
        """Number of iterations with a skipped step so far, as a device int64 tensor (no sync)."""
        if not self._enabled:
            return 0
        if self._skipped_steps is None:
            return self._init_skipped_steps
        return self._skipped_steps

    # ------------------------------------------------------------------ gradient health

    def watch(self, model: torch.nn.Module, prefix: str = "") -> _DiagnosticsMixin:
        """Name ``model``'s params in :meth:`grad_stats` (``prefix`` + their ``named_parameters`` names).

        Also checks the model once for BatchNorm layers in fp16/bf16 (an
        :class:`fastamp.health.AmpPitfallWarning`). Returns the scaler. Names are held by param
        id with a weak reference, so a freed param is never mistaken for a new one.
        """
        health.check_model(model)
        if not self._enabled:
            return self
        for name, p in model.named_parameters():
            self._param_names[id(p)] = (weakref.ref(p), prefix + name)
        return self

    @_eager_under_compile
    def grad_stats(self, model: torch.nn.Module | None = None) -> health.GradStats | None:
        """Per-tensor gradient statistics of the last checked iteration (syncs: reads the device buffers).

        Needs ``track_stats=True``. Values are of the unscaled gradients, computed in the first
        check of the iteration (``unscale_``, ``clip_grad_norm_`` or ``step``). Params are
        named by ``model`` if given, else by :meth:`watch`, else by optimizer position. Returns
        None before the first check (and when the scaler is disabled). See
        :class:`fastamp.health.GradStats` (``.summary()``, ``.worst()``, ``.first_nonfinite``).
        """
        if not self._enabled:
            return None
        if not self._track_stats:
            raise RuntimeError(
                "fastamp.Scaler.grad_stats: statistics are off; construct the scaler with track_stats=True"
            )
        skipped = None
        if self._last_step_skipped is not None and self._last_stats_update < self._health.updates:
            skipped = bool(self._last_step_skipped)
        for key in [k for k, r in self._stats.items() if r.optimizer() is None]:
            del self._stats[key]
        return health.read_stats(list(self._stats.values()), self._param_names, model, self._health.updates, skipped)
