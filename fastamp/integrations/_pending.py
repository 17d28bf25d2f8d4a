"""What both framework adapters read of a :class:`fastamp.Scaler`'s iteration (no framework import).

The adapters keep torch's contract of one ``update()`` per iteration, as torch's hand-written
loop has it (``step(o1); step(o2); update()``, also when the optimizers step after backwards
of their own: ``backward(lossD); step(optD); backward(lossG); step(optG); update()``). An
optimizer's stage (torch's per-optimizer record) says whether it has stepped since the last
update. The update runs once every optimizer has stepped, or when the framework says the
iteration is over (see each adapter), which is where an iteration in which some optimizer did
not step is closed. A disabled scaler keeps no records: these helpers do nothing then.
"""

from __future__ import annotations

from torch.amp.grad_scaler import OptState

from fastamp.scaler import Scaler


def enabled(scaler) -> bool:
    """Whether ``scaler`` is a :class:`fastamp.Scaler` that scales (a disabled one keeps no per-optimizer state)."""
    return isinstance(scaler, Scaler) and scaler.is_enabled()


def stage(scaler: Scaler, optimizer) -> OptState:
    """READY, UNSCALED or STEPPED since the last update, read without creating an entry."""
    states = scaler._per_optimizer_states
    return states[id(optimizer)]["stage"] if id(optimizer) in states else OptState.READY


def all_stepped(scaler: Scaler, optimizers) -> bool:
    return all(stage(scaler, optimizer) is OptState.STEPPED for optimizer in optimizers)


def update_if_pending(scaler: Scaler | None) -> None:
    """Run the update of an iteration in which some optimizer stepped but not all did."""
    if enabled(scaler):
        if any(state["stage"] is OptState.STEPPED for state in scaler._per_optimizer_states.values()):
            scaler.update()


def step_again(scaler: Scaler, optimizer) -> None:
    """Let ``optimizer`` step a second time in one iteration (no update since its last step).

    Its grads now come from a backward scaled with this iteration's scale (there was no update
    since), so they are unscaled with it: the optimizer starts over READY. The record of its
    earlier step moves to a key of its own (never an ``id``), so the iteration's one update
    still counts that step's overflow.
    """
    states = scaler._per_optimizer_states
    states[object()] = states.pop(id(optimizer))
