"""The fused clip: unscale, overflow check, global norm and clip in the check pass.

:meth:`Scaler.clip_grad_norm_` (an extra: torch has no such method) reads the grads once for
the non-finite check and the sum of squares. With an amp-aware optimizer the grads are never
rewritten: the clip coefficient is folded into the ``grad_scale`` handed to its step (kept in
``_per_optimizer_clip_scales`` until :meth:`Scaler.step` reads it through
:meth:`_ClipMixin._clip_grad_scale`); with an ordinary optimizer unscale and clip are one
write pass. A mixin of :class:`fastamp.Scaler`: it works on the scaler's state.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from fastamp.scaler.checks import _refuse_released
from fastamp.scaler.compiled import _eager_under_compile, _traced_clip_grad_norm_
from fastamp.scaler.device_scalars import (
    _clip_coef,
    _grad_scale_after_clip,
    _inv_scale,
    _merge_found,
    _new_found_inf,
    _total_norm,
    _unscale_clip_mul,
)
from fastamp.scaler.dist import _all_reduce_clip_check, _all_reduce_flags
from fastamp.scaler.grad_check import _check_grads, _params_with_grads


class _ClipMixin:
    """:meth:`clip_grad_norm_` of :class:`fastamp.Scaler`, and the grad_scale it leaves for step."""

    @_eager_under_compile(traced=_traced_clip_grad_norm_)
    def clip_grad_norm_(
        self,
        optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> Tensor:
        """Unscale (if not done yet), check and clip ``optimizer``'s grads by their global norm.

        Returns the total norm of the *unscaled* grads, as ``torch.nn.utils.clip_grad_norm_``
        would after ``unscale_``. For the 2-norm the norm is computed in the same read as the
        overflow check: with an amp-aware optimizer the grads are never rewritten (the clip
        coefficient is folded into the ``grad_scale`` handed to its step, on device); with an
        ordinary optimizer unscale and clip are one write pass. Other norms fall back to
        ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``. Counts as this iteration's
        ``unscale_``. No host sync unless ``error_if_nonfinite``.
        """
        max_norm = float(max_norm)
        norm_type = float(norm_type)
        if not max_norm >= 0:
            # a negative max_norm would give a negative clip coefficient (flipping every grad)
            raise ValueError(f"fastamp.Scaler.clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
        if not self._enabled:
            return torch.nn.utils.clip_grad_norm_(
                _params_with_grads(optimizer), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
            )
        _refuse_released(optimizer, "clip_grad_norm_")
        self._check_scale_growth_tracker("clip_grad_norm_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step().")
        if norm_type != 2.0:
            if optimizer_state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            return torch.nn.utils.clip_grad_norm_(
                _params_with_grads(optimizer), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
            )
        if self._clip_grad_scale(optimizer, optimizer_state) is not None:
            raise RuntimeError("clip_grad_norm_() has already been called on this optimizer since the last update().")

        ready = optimizer_state["stage"] is OptState.READY
        amp_aware = getattr(optimizer, "_step_supports_amp_scaling", False)
        # READY: grads still scaled; read them once with the real inverse scale.
        # UNSCALED: the user already unscaled them; read them as they are.
        inv_scale = _inv_scale(self._scale) if ready else torch.ones((), dtype=torch.float32, device=self._scale.device)
        found_inf = _new_found_inf(self._scale)
        found, sumsq = _check_grads(
            self, optimizer, inv_scale, found_inf, allow_fp16=True, write_back=False, compute_sumsq=True, stats=ready
        )
        found, sumsq = _all_reduce_clip_check(self._process_group, self._sharded, self._scale, found, sumsq)
        if ready:
            optimizer_state["found_inf_per_device"] = found
        if not sumsq:
            return torch.zeros((), dtype=torch.float32, device=self._scale.device)
        total_norm = _total_norm(sumsq)
        if error_if_nonfinite and not bool(torch.isfinite(total_norm)):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        clip_coef = _clip_coef(max_norm, total_norm)
        if amp_aware:
            # Fold the clip into the optimizer's grad_scale: it divides raw grads by it.
            grad_scale = _grad_scale_after_clip(self._scale if ready else None, clip_coef)
            self._per_optimizer_clip_scales[id(optimizer)] = (optimizer_state, grad_scale)
        else:
            mul = _unscale_clip_mul(inv_scale, clip_coef)
            refound, _ = _check_grads(
                self, optimizer, mul, _new_found_inf(self._scale), allow_fp16=True, write_back=True, compute_sumsq=False
            )
            if ready:
                # the write pass can flag more (a value that overflows fp16 when rounded back)
                merged = _merge_found(found, refound)
                optimizer_state["found_inf_per_device"] = _all_reduce_flags(self._process_group, self._scale, merged)[0]
        optimizer_state["stage"] = OptState.UNSCALED
        return total_norm

    def _clip_grad_scale(self, optimizer, optimizer_state) -> Tensor | None:
        """The grad_scale a fused clip left for ``optimizer`` this iteration (None if none)."""
        entry = self._per_optimizer_clip_scales.get(id(optimizer))
        # only while the per-optimizer state it was made for is current (update(), or code
        # outside that resets _per_optimizer_states, makes it stale)
        if entry is None or entry[0] is not optimizer_state:
            return None
        return entry[1]
