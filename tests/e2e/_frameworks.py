"""What the framework tests (test_lightning.py, test_accelerate.py) share."""

import torch

import fastamp

# the optimizers the runs train with: fastamp's and torch's amp-aware ones, and ordinary ones
OPTIMIZERS = {
    "fastamp.AdamW": lambda p: fastamp.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
    "torch.AdamW(fused)": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01, fused=True),
    "torch.SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "torch.AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
}


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def inject_inf(mlp: torch.nn.Sequential, now: bool) -> None:
    """An overflow the scaler must see: one inf in the first layer's (scaled) grad."""
    if now:
        mlp[0].weight.grad.view(-1)[3] = float("inf")


def params(module) -> list:
    return [p.detach().clone() for p in module.parameters()]


def assert_equal_lists(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(torch.as_tensor(g), torch.as_tensor(w)), (g, w)


def assert_equal_optimizer_states(a, b) -> None:
    for key in a["state"]:
        for name, value in a["state"][key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][key][name])), (key, name)


_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


class HostReadGuard:
    """While ``on``, ``Tensor.item / tolist / bool / float / int`` raise AssertionError.

    Exempt: the scaler's health probe (first update, then every 32), which reads a snapshot
    on the host: on CUDA a non-blocking copy into pinned memory, read once its event has
    completed (no wait); on CPU the snapshot is that copy already.
    """

    def __init__(self, monkeypatch):
        self.on = False
        for name in _READS:
            monkeypatch.setattr(torch.Tensor, name, self._guarded(name, getattr(torch.Tensor, name)))
        evaluate = fastamp.health._Monitor._evaluate

        def probe_reads_a_host_copy(*a, **k):
            was, self.on = self.on, False
            try:
                return evaluate(*a, **k)
            finally:
                self.on = was

        monkeypatch.setattr(fastamp.health._Monitor, "_evaluate", probe_reads_a_host_copy)

    def _guarded(self, name, original):
        def read(*a, **k):
            if self.on:
                raise AssertionError(f"host sync (Tensor.{name})")
            return original(*a, **k)

        return read
