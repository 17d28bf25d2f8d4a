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


# ---------------------------------------------------------------- two optimizers
# Two Linear(8, 8) nets, one summed loss, an optimizer each: the multi-optimizer loop of
# torch's amp recipe (step every optimizer, then one update), written once for both frameworks.

TWO_OPTIMIZERS = {
    "fastamp.SGD": lambda p: fastamp.optim.SGD(p, lr=0.1, momentum=0.9),
    "torch.AdamW(fused)": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "torch.SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
}
# the two orders a user writes: every clip, then every step; or clip and step one optimizer at a time
PATTERNS = ("clip-all-then-step-all", "clip-and-step-each")


def two_nets() -> list:
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]


def two_batches(n: int) -> list:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(n)]


def two_losses(outputs, y):
    return sum(torch.nn.functional.mse_loss(out, y) for out in outputs)


def inject_inf_into(nets, which) -> None:
    """An overflow in one net's (scaled) grad only: ``which`` is its index, or None."""
    if which is not None:
        nets[which].weight.grad.view(-1)[3] = float("inf")


def own_skips(scaler, opts) -> tuple:
    """Each optimizer's own found_inf of this iteration (torch's per-optimizer record), before update()."""
    return tuple(bool(sum(float(v) for v in scaler._found_inf_per_device(o).values())) for o in opts)


def two_optimizer_loop(
    optimizer, pattern, clip, batches, overflow_at, scaler, accumulate=1, loss_in_autocast=False, schedule=False
):
    """The loop by hand: backward, (overflow), per optimizer unscale + clip and step, one update.

    ``scaler``: a torch.amp.GradScaler (unscale_ + torch's clip) or a fastamp.Scaler (its fused
    clip_grad_norm_). ``schedule``: an LR scheduler per optimizer (``0.9**step``), stepped when
    that optimizer did not skip. Returns the nets, the scale after every update and each
    optimizer's skips.
    """
    nets = two_nets()
    opts = [TWO_OPTIMIZERS[optimizer](net.parameters()) for net in nets]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step) for opt in opts] if schedule else []

    def clip_one(opt, net):
        if isinstance(scaler, fastamp.Scaler):
            scaler.clip_grad_norm_(opt, clip)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)

    scales, skipped = [], []
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            outputs = [net(x) for net in nets]
            loss = two_losses(outputs, y) if loss_in_autocast else None
        if loss is None:
            loss = two_losses([out.float() for out in outputs], y)  # Accelerate hands back fp32 outputs
        scaler.scale(loss / accumulate).backward()
        inject_inf_into(nets, overflow_at.get(i))
        if (i + 1) % accumulate:
            continue
        if pattern == "clip-all-then-step-all":
            for opt, net in zip(opts, nets):
                clip_one(opt, net)
            for opt in opts:
                scaler.step(opt)
        else:
            for opt, net in zip(opts, nets):
                clip_one(opt, net)
                scaler.step(opt)
        skipped.append(own_skips(scaler, opts))
        for scheduler, skip in zip(schedulers, skipped[-1]):
            if not skip:
                scheduler.step()
        scaler.update()
        scales.append(scaler.get_scale())
        for opt in opts:
            opt.zero_grad(set_to_none=True)
    return nets, scales, skipped
