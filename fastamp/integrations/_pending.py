"""What both framework adapters read of a :class:`fastamp.Scaler`'s iteration (no framework import).

With several optimizers the adapters keep torch's contract of one ``update()`` per iteration:
an optimizer's stage (torch's per-optimizer record) says whether it has stepped since the last
update, and an update left pending (some optimizer did not step) runs before the next loss is
scaled.
"""

from __future__ import annotations

from torch.amp.grad_scaler import OptState

from fastamp.scaler import Scaler


def stage(scaler: Scaler, optimizer) -> OptState:
    """READY, UNSCALED or STEPPED since the last update, read without creating an entry."""
    states = scaler._per_optimizer_states
    return states[id(optimizer)]["stage"] if id(optimizer) in states else OptState.READY


def all_stepped(scaler: Scaler, optimizers) -> bool:
    return all(stage(scaler, optimizer) is OptState.STEPPED for optimizer in optimizers)


def update_if_pending(scaler: Scaler | None) -> None:
    """Run the update of an iteration in which some optimizer stepped but not all did."""
    if isinstance(scaler, Scaler) and scaler.is_enabled():
        if any(state["stage"] is OptState.STEPPED for state in scaler._per_optimizer_states.values()):
            scaler.update()
