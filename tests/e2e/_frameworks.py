"""What the framework tests (test_lightning.py, test_accelerate.py) share."""

import contextlib
import warnings

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


# ---------------------------------------------------------------- a GAN: backward, step, backward, step
# The loop of torch's DCGAN example, scaled as torch's amp recipe scales a loop with several
# optimizers: each loss scaled and its optimizer stepped in turn, one update per iteration.
# G: Linear(8, 8), D: Linear(8, 1). The G loss backpropagates through D (D's grads from it are
# zeroed before D's next backward, as in the example).

GAN_STEPS = 12
GAN_OVERFLOW_AT = {2: "D", 5: "G", 8: "D", 9: "G"}  # iteration -> the net whose (scaled) grad gets an inf
# "every": both optimizers step every iteration; "G every 2nd": D steps every iteration, G every
# other one (a critic trained more often), so some iterations end with one optimizer not stepped
GAN_PATTERNS = {"every": 1, "G every 2nd": 2}
GAN_OPTIMIZERS = ("fastamp.SGD", "torch.AdamW(fused)", "torch.SGD")


def gan_nets() -> tuple:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)


def gan_batches(n: int = GAN_STEPS) -> list:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def gan_loss_d(G, D, x):
    real, fake = D(x).float(), D(G(x).detach()).float()
    return torch.nn.functional.mse_loss(real, torch.ones_like(real)) + torch.nn.functional.mse_loss(
        fake, torch.zeros_like(fake)
    )


def gan_loss_g(G, D, x):
    fake = D(G(x)).float()
    return torch.nn.functional.mse_loss(fake, torch.ones_like(fake))


def gan_inject(G, D, i, net) -> None:
    """After ``net``'s backward of iteration ``i``: an inf in its grad where GAN_OVERFLOW_AT says so."""
    if GAN_OVERFLOW_AT.get(i) == net:
        (G if net == "G" else D).weight.grad.view(-1)[3] = float("inf")


def gan_steps_g(i: int, every: int) -> bool:
    return i % every == every - 1


def gan_loop(optimizer, every, scaler, batches=None, update_after_each_step=False):
    """torch's hand-written loop with ``scaler`` (torch.amp.GradScaler): backward(lossD), step(optD),
    backward(lossG), step(optG) (every ``every`` iterations), update(). Returns the nets, the scale
    each loss was scaled with, and the scale after every iteration. ``update_after_each_step``: an
    update after each step instead (what Lightning's and Accelerate's own GradScaler paths do)."""
    G, D = gan_nets()
    opt_g, opt_d = TWO_OPTIMIZERS[optimizer](G.parameters()), TWO_OPTIMIZERS[optimizer](D.parameters())
    scaled_with, scales = [], []

    def backward(loss_fn, net, i, x):
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = loss_fn(G, D, x)
        scaled_with.append(scaler.get_scale())
        scaler.scale(loss).backward()
        gan_inject(G, D, i, net)

    for i, x in enumerate(gan_batches() if batches is None else batches):
        opt_d.zero_grad()
        backward(gan_loss_d, "D", i, x)
        scaler.step(opt_d)
        if update_after_each_step:
            scaler.update()
        if gan_steps_g(i, every):
            opt_g.zero_grad()
            backward(gan_loss_g, "G", i, x)
            scaler.step(opt_g)
            if update_after_each_step:
                scaler.update()
        if not update_after_each_step:
            scaler.update()
        scales.append(scaler.get_scale())
    return (G, D), scaled_with, scales


def assert_scales_move_both_ways(scales) -> None:
    moves = {b / a for a, b in zip([2.0**16] + scales, scales)}
    assert {0.5, 2.0} <= moves, moves  # backoffs at the overflows, growth in between


def critic_twice_loop(optimizer="torch.SGD"):
    """D stepped twice per iteration (on the two halves of the batch, a backward each), then G once, all
    losses scaled with the iteration's one scale, written out without a GradScaler: grads unscaled by hand
    (by a power of two: exact), a step skipped where its grads are not finite, and torch's update rule once
    per iteration (backoff 0.5 on any overflow, growth 2 after 2 clean iterations). torch's loop cannot
    step an optimizer twice between updates; this is what one update per iteration means then. Returns
    the nets, the scale each loss was scaled with, the scale after every iteration, the skipped iterations."""
    G, D = gan_nets()
    opt_g, opt_d = TWO_OPTIMIZERS[optimizer](G.parameters()), TWO_OPTIMIZERS[optimizer](D.parameters())
    scale, tracker, scaled_with, scales, skips = 2.0**16, 0, [], [], 0

    def backward_and_step(loss_fn, x, net, opt, i):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = loss_fn(G, D, x)
        scaled_with.append(scale)
        (loss * torch.tensor(scale)).backward()
        gan_inject(G, D, i, net)
        grads = [p.grad for group in opt.param_groups for p in group["params"]]
        for g in grads:
            g.mul_(1.0 / scale)
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if finite:
            opt.step()
        return not finite

    for i, x in enumerate(gan_batches()):
        found = [backward_and_step(gan_loss_d, half, "D", opt_d, i) for half in (x[:2], x[2:])]
        found.append(backward_and_step(gan_loss_g, x, "G", opt_g, i))
        if any(found):
            scale, tracker, skips = scale * 0.5, 0, skips + 1
        else:
            tracker += 1
            if tracker == 2:
                scale, tracker = scale * 2.0, 0
        scales.append(scale)
    return (G, D), scaled_with, scales, skips


@contextlib.contextmanager
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state: reset before and after, its warnings silenced in between."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
