"""The grad scaler, stage by stage of one iteration: ``fastamp.Scaler`` and its parts.

Public: :class:`Scaler` (and torch's ``OptState``, re-exported); everything else here is
internal. The modules, in the order an iteration meets them:

  grad_scaler.py     the Scaler: torch.amp.GradScaler's contract and state machine
  checks.py          the checks of the settings (constructor, setters, update, state dicts)
  grad_check.py      the check pass: grads gathered by device, the one-call native path,
                     the per-grad path, the statistics buffers
  device_scalars.py  inv_scale, found_inf folding, the norm, the clip coefficient, grad_scale
  dist.py            the all-reduce of the flags (and the squared norm) over a process group
  clip.py            clip_grad_norm_: unscale, check, norm and clip in the check pass (a mixin)
  diagnostics.py     the skip counters, watch and grad_stats (gradient health; a mixin)
  compiled.py        the entry points run eagerly under torch.compile, and the traced twins

Imports go one way: grad_scaler imports the others; none of them imports grad_scaler.
"""

from fastamp.scaler.grad_scaler import OptState, Scaler

__all__ = ["OptState", "Scaler"]
