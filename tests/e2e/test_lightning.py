"""fastamp in a real Lightning Trainer on CPU: fp16 autocast, clipping, injected overflows, resume.

The plugin under test is ``fastamp.integrations.lightning.MixedPrecision``. Each run is a
small MLP for a few dozen steps with one or two injected infs in a grad (after backward, so
the scaler sees them) and a short growth interval, so the scale backs off and grows.
References: the same training written by hand with ``fastamp.Scaler`` (the plugin must do
exactly that: bit-identical), and Lightning's own plugin with ``torch.amp.GradScaler``.
"""

import subprocess
import sys
import warnings

import pytest
import torch

L = pytest.importorskip("lightning", reason="Lightning is not installed (requirements-dev.txt pins it)")

from e2e._frameworks import (  # noqa: E402
    GAN_OPTIMIZERS,
    GAN_PATTERNS,
    OPTIMIZERS,
    PATTERNS,
    TWO_OPTIMIZERS,
    HostReadGuard,
    assert_equal_lists,
    assert_equal_optimizer_states,
    assert_scales_move_both_ways,
    critic_twice_loop,
    gan_batches,
    gan_inject,
    gan_loop,
    gan_loss_d,
    gan_loss_g,
    gan_nets,
    gan_steps_g,
    inject_inf,
    inject_inf_into,
    mlp,
    params,
    two_batches,
    two_losses,
    two_nets,
    two_optimizer_loop,
)
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision  # noqa: E402
from tolerances import ADAMW_VS_TORCH_ATOL, ADAMW_VS_TORCH_RTOL  # noqa: E402

import fastamp  # noqa: E402
from fastamp.integrations.lightning import MixedPrecision  # noqa: E402

BATCHES = 24  # per epoch
OVERFLOW_AT = (5, 17)  # global steps whose grads get an inf
GROWTH_INTERVAL = 4  # short: the scale grows (and overflows naturally once it is high)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        # Lightning's own notices (no logger, dataloader workers, deprecations of its deps)
        warnings.simplefilter("ignore")
        yield


def _loader():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCHES * 8, 16, generator=g), torch.randn(BATCHES * 8, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class _Net(L.LightningModule):
    def __init__(self, optimizer: str, overflow_at=OVERFLOW_AT):
        super().__init__()
        self.net = mlp()
        self.optimizer, self.overflow_at = optimizer, overflow_at
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.detach())
        return loss

    def on_after_backward(self):
        inject_inf(self.net, self.trainer.global_step in self.overflow_at)

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer](self.parameters())


class _Record(L.Callback):
    """The scale and the skip flag after every step, as device tensors (no sync)."""

    def __init__(self):
        self.scales, self.skipped = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        scaler = trainer.precision_plugin.scaler
        if scaler is None or not scaler.is_enabled() or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self.scales.append(scaler._get_scale_async().clone())
        if isinstance(scaler, fastamp.Scaler):
            self.skipped.append(scaler.last_step_skipped_tensor.clone())


def _fit(module, plugin, clip=0.5, algorithm="norm", epochs=1, ckpt_path=None, accumulate=1, loader=None):
    record = _Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[plugin],
        max_epochs=epochs,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
        accumulate_grad_batches=accumulate,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, _loader() if loader is None else loader, ckpt_path=ckpt_path)
    return trainer, record


def _by_hand(
    optimizer: str,
    clip=0.5,
    algorithm="norm",
    precision="16-mixed",
    overflow_at=OVERFLOW_AT,
    accumulate=1,
    enabled=True,
):
    """The loop the plugin must run, written out: Lightning's order of calls, fastamp.Scaler."""
    module = _Net(optimizer)
    opt = module.configure_optimizers()
    scaler = fastamp.Scaler("cpu", growth_interval=GROWTH_INTERVAL, enabled=precision == "16-mixed" and enabled)
    dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
    losses, scales, skipped = [], [], []
    for batch, (x, y) in enumerate(_loader()):
        step = batch // accumulate
        with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
            loss = torch.nn.functional.mse_loss(module(x), y)
        losses.append(loss.detach())
        if batch % accumulate == 0:
            opt.zero_grad()
        scaler.scale(loss / accumulate).backward()
        inject_inf(module.net, step in overflow_at)
        if (batch + 1) % accumulate:
            continue
        amp_aware = getattr(opt, "_step_supports_amp_scaling", False)
        if precision == "bf16-mixed":
            clip_fn = torch.nn.utils.clip_grad_norm_ if algorithm == "norm" else torch.nn.utils.clip_grad_value_
            clip_fn(list(module.parameters()), clip)
        elif algorithm == "norm":
            if not amp_aware:
                scaler.unscale_(opt)
            scaler.clip_grad_norm_(opt, clip)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_value_(list(module.parameters()), clip)
        scaler.step(opt)
        scaler.update()
        if scaler.is_enabled():
            scales.append(scaler._get_scale_async().clone())
            skipped.append(scaler.last_step_skipped_tensor.clone())
    return module, opt, scaler, torch.stack(losses), scales, skipped


@pytest.mark.parametrize(
    "optimizer, algorithm, accumulate",
    [
        ("fastamp.AdamW", "norm", 1),
        ("torch.AdamW(fused)", "norm", 1),
        ("torch.SGD", "norm", 1),
        ("fastamp.AdamW", "value", 1),
        ("fastamp.AdamW", "norm", 2),
    ],
)
def test_plugin_runs_exactly_the_fastamp_loop(optimizer, algorithm, accumulate):
    """Trainer + plugin == the hand-written fastamp loop, bit for bit: losses, params, scale, skips.

    Amp-aware optimizers included (Lightning's own plugin refuses to clip them).
    """
    clip = 0.5 if algorithm == "norm" else 0.02
    module = _Net(optimizer)
    plugin = MixedPrecision("16-mixed", "cpu", growth_interval=GROWTH_INTERVAL)
    trainer, record = _fit(module, plugin, clip=clip, algorithm=algorithm, accumulate=accumulate)
    ref, _, ref_scaler, ref_losses, ref_scales, ref_skipped = _by_hand(
        optimizer, clip=clip, algorithm=algorithm, accumulate=accumulate
    )

    assert torch.equal(torch.stack(module.losses), ref_losses)
    assert_equal_lists(params(module), params(ref))
    assert_equal_lists(record.scales, ref_scales)
    assert_equal_lists(record.skipped, ref_skipped)
    skipped_at = [i for i, s in enumerate(record.skipped) if bool(s)]
    assert len(record.skipped) == BATCHES // accumulate
    assert {s for s in OVERFLOW_AT if s < BATCHES // accumulate} <= set(skipped_at)
    # the scale moved both ways: backoffs at the skips, growth in between
    scales = [float(s) for s in record.scales]
    moves = [b / a for a, b in zip([2.0**16] + scales, scales)]
    assert 2.0 in moves and 0.5 in moves
    assert int(plugin.skipped_steps) == len(skipped_at) == int(ref_scaler.skipped_steps)
    assert float(trainer.callback_metrics["fastamp/skipped_steps"]) == len(skipped_at)
    assert float(trainer.callback_metrics["fastamp/loss_scale"]) == scales[-1]
    if algorithm == "norm":
        assert plugin.last_grad_norm is not None and plugin.last_grad_norm.dim() == 0


class _ManualNet(_Net):
    """Manual optimization: the user clips with self.clip_gradients before opt.step()."""

    def __init__(self, optimizer: str):
        super().__init__(optimizer)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.detach())
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()


@pytest.mark.parametrize("optimizer", ["fastamp.AdamW", "torch.SGD"])
def test_manual_optimization_clips_unscaled_grads_once(optimizer):
    """self.clip_gradients(opt) gets Lightning's optimizer wrapper: the fused clip runs on the
    optimizer inside it (the step then neither unscales again nor misses the clip)."""
    module = _ManualNet(optimizer)
    _, record = _fit(module, MixedPrecision("16-mixed", "cpu", growth_interval=GROWTH_INTERVAL), clip=None)
    ref, _, _, ref_losses, ref_scales, ref_skipped = _by_hand(optimizer, clip=0.5)
    assert torch.equal(torch.stack(module.losses), ref_losses)
    assert_equal_lists(params(module), params(ref))
    assert_equal_lists(record.scales, ref_scales)
    assert_equal_lists(record.skipped, ref_skipped)


TWO_STEPS = 10
TWO_OVERFLOW_AT = {1: 0, 6: 1}  # step -> the net whose grad gets an inf (2 overflows naturally)


class _TwoOptimizerNet(L.LightningModule):
    """Manual optimization with two optimizers: clip both then step both, or clip and step each."""

    def __init__(self, optimizer: str, pattern: str, clip: float):
        super().__init__()
        self.nets = torch.nn.ModuleList(two_nets())
        self.optimizer, self.pattern, self.clip = optimizer, pattern, clip
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opts = self.optimizers()
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(two_losses([net(x) for net in self.nets], y))
        inject_inf_into(self.nets, TWO_OVERFLOW_AT.get(batch_idx))
        if self.pattern == "clip-all-then-step-all":
            for opt in opts:
                self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
            for opt in opts:
                opt.step()
        else:
            for opt in opts:
                self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
                opt.step()

    def configure_optimizers(self):
        return [TWO_OPTIMIZERS[self.optimizer](net.parameters()) for net in self.nets]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("optimizer", ["fastamp.SGD", "torch.SGD"])
def test_manual_optimization_with_two_optimizers_runs_torchs_loop(optimizer, pattern):
    """Two optimizers, clipped with self.clip_gradients: one scale update per iteration (after
    both stepped), each optimizer skips on its own overflow (torch's per-optimizer found_inf).

    Against the loop by hand with torch.amp.GradScaler (unscale_ + torch's clip), the clip not
    binding: scale trajectory and params bit-identical (unscaling by a power of two, a clip
    coefficient of 1: the same maths; equal params also mean the same steps were skipped).
    Binding: against the loop by hand with fastamp.Scaler (its fused clip), bit-identical.
    (Before the fix an update after each step threw away the other optimizer's clip, or
    unscaled it with a scale its grads were not made with.)
    """
    batches = two_batches(TWO_STEPS)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    for clip, scaler in ((1e9, torch.amp.GradScaler("cpu", growth_interval=2)), (0.05, None)):
        scaler = scaler or fastamp.Scaler("cpu", growth_interval=2)
        module = _TwoOptimizerNet(optimizer, pattern, clip)
        plugin = MixedPrecision("16-mixed", "cpu", growth_interval=2, log_metrics=False)
        _, record = _fit(module, plugin, clip=None, loader=loader)
        nets, scales, skipped = two_optimizer_loop(
            optimizer, pattern, clip, batches, TWO_OVERFLOW_AT, scaler, loss_in_autocast=True
        )
        assert [float(s) for s in record.scales] == scales
        assert skipped[1] == (True, False) and skipped[6] == (False, True)  # the injected infs
        assert {0.5, 2.0} <= {b / a for a, b in zip([2.0**16] + scales, scales)}
        for net, ref in zip(module.nets, nets):
            assert_equal_lists(params(net), params(ref))


class _SecondOptimizerEveryOtherStep(_TwoOptimizerNet):
    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(two_losses([net(x) for net in self.nets], y))
        self.scaled_with.append(self.trainer.precision_plugin.scaler.get_scale())
        inject_inf_into(self.nets, 0 if batch_idx == 2 else None)
        for opt in self.optimizers() if batch_idx % 2 else self.optimizers()[:1]:
            opt.step()
            opt.zero_grad()


def test_an_optimizer_that_does_not_step_defers_the_update_to_the_next_backward(tmp_path):
    """opt2 steps every other iteration only: in the others the scale update runs before the next
    backward (and when a checkpoint is written), so every loss is scaled with the scale torch's
    loop (step the optimizers that step, then update) would use; params and scale bit-identical."""
    module = _SecondOptimizerEveryOtherStep("fastamp.SGD", None, None)
    module.scaled_with = []
    plugin = MixedPrecision("16-mixed", "cpu", growth_interval=1, log_metrics=False)
    batches = two_batches(5)
    trainer, _ = _fit(module, plugin, clip=None, loader=torch.utils.data.DataLoader(batches, batch_size=None))
    trainer.save_checkpoint(tmp_path / "last.ckpt")  # the last iteration's update, pending: runs first

    nets = two_nets()
    opts = [TWO_OPTIMIZERS["fastamp.SGD"](net.parameters()) for net in nets]
    scaler, scaled_with = torch.amp.GradScaler("cpu", growth_interval=1), []
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = two_losses([net(x) for net in nets], y)
        scaled_with.append(scaler.get_scale())
        scaler.scale(loss).backward()
        inject_inf_into(nets, 0 if i == 2 else None)
        for opt in opts if i % 2 else opts[:1]:
            scaler.step(opt)
            opt.zero_grad()
        scaler.update()
    assert module.scaled_with == scaled_with and 0.5 in {b / a for a, b in zip(scaled_with, scaled_with[1:])}
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["MixedPrecision"]["scale"] == scaler.get_scale()
    for net, ref in zip(module.nets, nets):
        assert_equal_lists(params(net), params(ref))


class _Gan(L.LightningModule):
    """Manual optimization, a GAN's iteration: backward(loss_d), opt_d.step(), backward(loss_g), opt_g.step()
    (G every ``every`` iterations), as Lightning's GAN example writes it."""

    def __init__(self, optimizer: str, every: int, overflows: bool = True):
        super().__init__()
        self.G, self.D = gan_nets()
        self.optimizer, self.every, self.overflows = optimizer, every, overflows
        self.automatic_optimization = False
        self.scaled_with = []

    def _backward(self, loss, net, batch_idx):
        self.manual_backward(loss)
        # the scale the loss was scaled with (nothing updates it during a backward)
        self.scaled_with.append(self.trainer.precision_plugin.scaler.get_scale())
        if self.overflows:
            gan_inject(self.G, self.D, batch_idx, net)

    def training_step(self, x, batch_idx):
        opt_g, opt_d = self.optimizers()
        opt_d.zero_grad()
        self._backward(gan_loss_d(self.G, self.D, x), "D", batch_idx)
        opt_d.step()
        if gan_steps_g(batch_idx, self.every):
            opt_g.zero_grad()
            self._backward(gan_loss_g(self.G, self.D, x), "G", batch_idx)
            opt_g.step()

    def configure_optimizers(self):
        make = TWO_OPTIMIZERS[self.optimizer]
        return [make(self.G.parameters()), make(self.D.parameters())]


def _gan_loader():
    return torch.utils.data.DataLoader(gan_batches(), batch_size=None)


@pytest.mark.parametrize("pattern", list(GAN_PATTERNS))
@pytest.mark.parametrize("optimizer", GAN_OPTIMIZERS)
def test_a_gans_backward_step_backward_step_gets_one_update_per_iteration_as_torchs_loop(optimizer, pattern):
    """backward(loss_d), opt_d.step(), backward(loss_g), opt_g.step() in one training_step: one scale update
    per iteration, at its end, as torch's hand-written loop (step(opt_d) ... step(opt_g); update()) with
    torch.amp.GradScaler: the scale every loss was scaled with, the scale after every iteration and both nets'
    params bit-identical over 12 iterations with injected overflows in D's and in G's grads (skips and
    backoffs) and growth every 2 clean iterations. "G every 2nd": iterations where only D steps end with the
    update too. Lightning's own plugin (torch's GradScaler) updates after each step instead: two updates per
    GAN iteration, exactly the hand-written loop with an update after each step. (Before the fix the plugin
    updated at the second backward: Lightning's sequence, not torch's.)
    """
    every = GAN_PATTERNS[pattern]
    module = _Gan(optimizer, every)
    plugin = MixedPrecision("16-mixed", "cpu", growth_interval=2, log_metrics=False)
    _, record = _fit(module, plugin, clip=None, loader=_gan_loader())
    nets, scaled_with, scales = gan_loop(optimizer, every, torch.amp.GradScaler("cpu", growth_interval=2))
    assert module.scaled_with == scaled_with
    assert [float(s) for s in record.scales] == scales
    assert_scales_move_both_ways(scales)
    # every backoff is an iteration with an overflow (the 4 injected ones and natural ones at a grown scale)
    backoffs = sum(b / a == 0.5 for a, b in zip([2.0**16] + scales, scales))
    assert int(plugin.skipped_steps) == backoffs >= 4
    for net, ref in zip((module.G, module.D), nets):
        assert_equal_lists(params(net), params(ref))

    theirs = _Gan(optimizer, every)
    _fit(theirs, LightningMixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", growth_interval=2)), clip=None,
         loader=_gan_loader())  # fmt: skip
    each_step = gan_loop(optimizer, every, torch.amp.GradScaler("cpu", growth_interval=2), update_after_each_step=True)
    assert theirs.scaled_with == each_step[1] != scaled_with
    for net, ref in zip((theirs.G, theirs.D), each_step[0]):
        assert_equal_lists(params(net), params(ref))


class _CriticTwice(_Gan):
    """D steps twice per training_step (two backwards), G once: D's second step has no update before it."""

    def training_step(self, x, batch_idx):
        opt_g, opt_d = self.optimizers()
        for half in (x[:2], x[2:]):
            opt_d.zero_grad()
            self._backward(gan_loss_d(self.G, self.D, half), "D", batch_idx)
            opt_d.step()
        opt_g.zero_grad()
        self._backward(gan_loss_g(self.G, self.D, x), "G", batch_idx)
        opt_g.step()


def test_an_optimizer_stepped_twice_in_one_training_step_unscales_with_the_scale_its_grads_were_made_with():
    """A critic stepped twice per training_step: every loss of the iteration is scaled with one scale, D's
    second step unscales with it too (no update in between: an update there would have to come before D's
    second backward, and torch's loop has no place for it), and the iteration's one update counts every
    step's overflow: e2e._frameworks.critic_twice_loop, bit for bit."""
    module = _CriticTwice("torch.SGD", 1)
    plugin = MixedPrecision("16-mixed", "cpu", growth_interval=2, log_metrics=False)
    _, record = _fit(module, plugin, clip=None, loader=_gan_loader())

    (G, D), scaled_with, scales, skips = critic_twice_loop()
    assert module.scaled_with == scaled_with
    assert [float(s) for s in record.scales] == scales
    assert skips == int(plugin.skipped_steps) >= 4  # the injected overflows, and natural ones
    assert_scales_move_both_ways(scales)
    for net, ref in zip((module.G, module.D), (G, D)):
        assert_equal_lists(params(net), params(ref))


@pytest.mark.parametrize("clip", [1e9, 0.5], ids=["clip-never-binds", "clip-binds"])
def test_matches_lightnings_torch_amp_path(clip):
    """Against Lightning's own MixedPrecision plugin with torch.amp.GradScaler, same torch AdamW.

    Scale trajectory and skipped steps: bit-identical (the same overflow decisions). Losses and
    params: bit-identical when the clip does not bind (unscaling by a power of two is exact,
    a clip coefficient of 1 changes nothing, the optimizer is the same). When it binds, the
    clip coefficient max_norm / (norm + 1e-6) differs in its last bits: torch takes the norm
    of per-tensor fp32 norms with its sqrt, fastamp an fp64 sum of squares rounded once
    (tolerances.NORM_RTOL). That ulp-level difference in every update then passes through
    AdamW for the whole run, like fastamp's AdamW against torch's: params within
    ADAMW_VS_TORCH_*. Losses within one fp16 ulp (the reason is at the assertion).
    """
    ours = _Net("torch.AdamW")
    _, ours_record = _fit(ours, MixedPrecision("16-mixed", "cpu", growth_interval=GROWTH_INTERVAL), clip=clip)
    theirs = _Net("torch.AdamW")
    torch_scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    _, theirs_record = _fit(theirs, LightningMixedPrecision("16-mixed", "cpu", scaler=torch_scaler), clip=clip)

    assert_equal_lists(ours_record.scales, theirs_record.scales)
    got_losses, want_losses = torch.stack(ours.losses), torch.stack(theirs.losses)
    if clip == 1e9:
        assert torch.equal(got_losses, want_losses)
        assert_equal_lists(params(ours), params(theirs))
    else:
        for g, w in zip(params(ours), params(theirs)):
            torch.testing.assert_close(g, w, atol=ADAMW_VS_TORCH_ATOL, rtol=ADAMW_VS_TORCH_RTOL)
        # the forward runs in fp16: params that differ by ulps can round an output to the
        # neighbouring fp16 value, so a loss may move by up to one fp16 ulp (relative 2^-10)
        torch.testing.assert_close(got_losses, want_losses, atol=0, rtol=torch.finfo(torch.float16).eps)


DISABLED = {
    # what a user writes, and what Lightning's own plugin gets in the same setting
    "Scaler(enabled=False)": (
        lambda: MixedPrecision("16-mixed", "cpu", scaler=fastamp.Scaler("cpu", enabled=False)),
        lambda: LightningMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False)),
    ),
    # torch disables a "cuda" GradScaler on a machine without CUDA (with a warning), and so does fastamp
    "16-mixed on cuda, no CUDA": (
        lambda: MixedPrecision("16-mixed", "cuda"),
        lambda: LightningMixedPrecision("16-mixed", "cuda"),
    ),
}


@pytest.mark.parametrize(
    "optimizer, clip, algorithm",
    [("torch.SGD", 0.5, "norm"), ("torch.AdamW", 0.02, "value"), ("fastamp.AdamW", None, "norm"),
     ("torch.AdamW(fused)", None, "norm")],
)  # fmt: skip
@pytest.mark.parametrize("setting", list(DISABLED))
def test_a_disabled_scaler_trains_as_lightnings_plugin_with_a_disabled_gradscaler(setting, optimizer, clip, algorithm):
    """A disabled scaler: fp16 autocast, no scaling, no skips, as Lightning's plugin with a disabled GradScaler:
    losses and params bit-identical, clipping included (amp-aware optimizers unclipped: Lightning's plugin
    refuses to clip them). No metrics logged, skipped_steps 0, an empty checkpoint entry. (Before the fix:
    AttributeError '_per_optimizer_states' at the first step.)"""
    if setting.endswith("no CUDA") and torch.cuda.is_available():
        pytest.skip("a machine without CUDA is the setting")
    ours, theirs = (make() for make in DISABLED[setting])
    assert not ours.scaler.is_enabled() and not theirs.scaler.is_enabled()
    a, b = _Net(optimizer, overflow_at=()), _Net(optimizer, overflow_at=())
    trainer, _ = _fit(a, ours, clip=clip, algorithm=algorithm)
    _fit(b, theirs, clip=clip, algorithm=algorithm)
    assert torch.equal(torch.stack(a.losses), torch.stack(b.losses))
    assert_equal_lists(params(a), params(b))
    assert ours.skipped_steps == 0 and not any(k.startswith("fastamp/") for k in trainer.callback_metrics)
    assert ours.state_dict() == theirs.state_dict() == {}


def test_a_disabled_scaler_clips_amp_aware_optimizers_as_they_are():
    """With nothing scaled, the clip is torch's on the grads as they are, for amp-aware optimizers too
    (Lightning's plugin refuses those): the hand-written loop with the disabled scaler, bit for bit."""
    module = _Net("fastamp.AdamW", overflow_at=())
    _fit(module, MixedPrecision("16-mixed", "cpu", scaler=fastamp.Scaler("cpu", enabled=False)), clip=0.5)
    ref, *_ = _by_hand("fastamp.AdamW", clip=0.5, overflow_at=(), enabled=False)
    assert_equal_lists(params(module), params(ref))


@pytest.mark.parametrize("pattern", list(GAN_PATTERNS))
def test_a_gan_with_a_disabled_scaler_trains_as_lightnings_plugin(pattern):
    """Manual optimization with two optimizers and a disabled scaler: as Lightning's plugin with a disabled
    GradScaler (no updates to count, nothing pending), bit for bit."""
    nets = []
    for plugin in (
        MixedPrecision("16-mixed", "cpu", scaler=fastamp.Scaler("cpu", enabled=False)),
        LightningMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False)),
    ):
        module = _Gan("fastamp.SGD", GAN_PATTERNS[pattern], overflows=False)
        _fit(module, plugin, clip=None, loader=_gan_loader())
        assert module.scaled_with == [1.0] * len(module.scaled_with)
        nets.append((module.G, module.D))
    for net, ref in zip(*nets):
        assert_equal_lists(params(net), params(ref))


def test_lightnings_plugin_refuses_what_this_one_does():
    """The reason for the plugin: Lightning's refuses to clip any amp-aware optimizer."""
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(_Net("fastamp.AdamW"), LightningMixedPrecision("16-mixed", "cpu", scaler=fastamp.Scaler("cpu")))


def test_checkpoint_resume_is_bit_exact(tmp_path):
    """Two epochs straight == one epoch, save, a fresh Trainer resumes from the file, one more.

    An overflow in each epoch; the scaler state (scale, growth tracker, skip counter) goes
    through Lightning's checkpoint under the plugin's key.
    """
    overflow_at = (5, BATCHES + 6)

    def run(epochs, ckpt_path=None):
        module = _Net("fastamp.AdamW", overflow_at)
        plugin = MixedPrecision("16-mixed", "cpu", growth_interval=GROWTH_INTERVAL)
        trainer, _ = _fit(module, plugin, epochs=epochs, ckpt_path=ckpt_path)
        return module, trainer

    straight, straight_trainer = run(2)
    first, first_trainer = run(1)
    path = tmp_path / "epoch1.ckpt"
    first_trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["MixedPrecision"]["skipped_steps"] >= 1
    resumed, resumed_trainer = run(2, ckpt_path=path)

    assert torch.equal(torch.stack(resumed.losses), torch.stack(straight.losses[BATCHES:]))
    assert_equal_lists(params(resumed), params(straight))
    a, b = straight_trainer.precision_plugin.scaler, resumed_trainer.precision_plugin.scaler
    assert a.state_dict() == b.state_dict()
    assert int(b.skipped_steps) >= 2
    assert_equal_optimizer_states(
        straight_trainer.optimizers[0].state_dict(), resumed_trainer.optimizers[0].state_dict()
    )


def test_checkpoints_move_between_lightnings_plugin_and_this_one(tmp_path):
    """Epoch 1 with Lightning's plugin (torch GradScaler), epoch 2 resumed with this one ==
    two epochs with Lightning's (clip not binding: the same maths, bit for bit); this one's
    checkpoint loads into torch's GradScaler (it reads its own keys)."""
    overflow_at = (5, BATCHES + 6)

    def torch_plugin():
        return LightningMixedPrecision(
            "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
        )

    straight = _Net("torch.AdamW", overflow_at)
    _, straight_record = _fit(straight, torch_plugin(), clip=1e9, epochs=2)
    first_trainer, _ = _fit(_Net("torch.AdamW", overflow_at), torch_plugin(), clip=1e9)
    first_trainer.save_checkpoint(tmp_path / "torch.ckpt")
    resumed = _Net("torch.AdamW", overflow_at)
    plugin = MixedPrecision("16-mixed", "cpu", growth_interval=GROWTH_INTERVAL)
    trainer, record = _fit(resumed, plugin, clip=1e9, epochs=2, ckpt_path=tmp_path / "torch.ckpt")

    assert torch.equal(torch.stack(resumed.losses), torch.stack(straight.losses[BATCHES:]))
    assert_equal_lists(params(resumed), params(straight))
    assert_equal_lists(record.scales, straight_record.scales[BATCHES:])
    trainer.save_checkpoint(tmp_path / "fastamp.ckpt")
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(torch.load(tmp_path / "fastamp.ckpt", weights_only=False)["MixedPrecision"])
    assert torch_scaler.get_scale() == plugin.scaler.get_scale()
    assert torch_scaler._get_growth_tracker() == plugin.scaler._get_growth_tracker()


def test_no_host_sync_after_backward_with_an_amp_aware_optimizer(monkeypatch):
    """From the end of backward to the end of the step (hooks, fused clip, step, update, logging):
    no value is read on the host (Tensor.item / bool / float / int / tolist raise)."""
    plugin = MixedPrecision("16-mixed", "cpu", growth_interval=GROWTH_INTERVAL)
    guard, steps = HostReadGuard(monkeypatch), [0]
    after_closure, optimizer_step = plugin._after_closure, plugin.optimizer_step

    def guarded_after_closure(*a, **k):
        guard.on = True
        return after_closure(*a, **k)

    def guarded_optimizer_step(*a, **k):
        try:
            return optimizer_step(*a, **k)
        finally:
            guard.on = False
            steps[0] += 1

    monkeypatch.setattr(plugin, "_after_closure", guarded_after_closure)
    monkeypatch.setattr(plugin, "optimizer_step", guarded_optimizer_step)
    _fit(_Net("fastamp.AdamW"), plugin)
    assert steps[0] == BATCHES


def test_bf16_mixed_clips_amp_aware_optimizers():
    """bf16 needs no scaler: the plugin clips grads as they are (Lightning's refuses amp-aware ones)."""
    module = _Net("fastamp.AdamW", overflow_at=())
    trainer, _ = _fit(module, MixedPrecision("bf16-mixed", "cpu"), clip=0.5)
    assert trainer.precision_plugin.scaler is None
    ref, *_ = _by_hand("fastamp.AdamW", clip=0.5, precision="bf16-mixed", overflow_at=())
    assert_equal_lists(params(module), params(ref))


def test_constructor_refuses_unclear_setups():
    with pytest.raises(TypeError, match="must be a fastamp.Scaler"):
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="either a scaler or scaler options"):
        MixedPrecision("16-mixed", "cpu", scaler=fastamp.Scaler("cpu"), growth_interval=10)
    with pytest.raises(ValueError, match="bf16 needs no loss scaler"):
        MixedPrecision("bf16-mixed", "cpu", init_scale=2.0**10)
    with pytest.raises(ValueError, match="Precision must be"):
        MixedPrecision("16-true", "cpu")
    plugin = MixedPrecision("16-mixed", "cpu", init_scale=2.0**10, hysteresis=2)
    assert isinstance(plugin.scaler, fastamp.Scaler) and plugin.scaler.get_scale() == 2.0**10
    assert type(plugin).__qualname__ == LightningMixedPrecision.__qualname__  # the same checkpoint key


def test_import_fastamp_does_not_import_the_frameworks():
    code = (
        "import sys, fastamp, fastamp.integrations\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'lightning', 'pytorch_lightning', 'accelerate'})\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
