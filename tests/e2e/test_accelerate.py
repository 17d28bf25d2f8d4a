"""fastamp in a real Hugging Face Accelerate loop on CPU: fp16, clipping, accumulation, save/load.

``use_fastamp_scaler`` puts a ``fastamp.Scaler`` into an ``Accelerator``. Each run is a small
MLP over 32 micro-batches with ``gradient_accumulation_steps=2`` (16 optimizer steps), one
or two injected infs in a grad and a short growth interval, so the scale backs off and
grows. References: the same training written by hand with ``fastamp.Scaler`` (bit-identical),
and Accelerate with torch's ``GradScaler`` set up as Accelerate sets it up on a GPU.
"""

import contextlib

import pytest
import torch

pytest.importorskip("accelerate", reason="Accelerate is not installed (requirements-dev.txt pins it)")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import GradScalerKwargs  # noqa: E402
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
    fresh_accelerate_state,
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
from tolerances import ADAMW_VS_TORCH_ATOL, ADAMW_VS_TORCH_RTOL, NORM_RTOL  # noqa: E402

import fastamp  # noqa: E402
from fastamp.integrations.accelerate import use_fastamp_scaler  # noqa: E402

MICRO_BATCHES = 32
ACCUMULATE = 2
OVERFLOW_AT = (5, 18)  # micro-batches whose grads get an inf (optimizer steps 2 and 9)
GROWTH_INTERVAL = 3
CLIP = 0.5


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    with fresh_accelerate_state():
        yield


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(MICRO_BATCHES)]


def _accelerator(precision="fp16", scaler="fastamp", accumulate=ACCUMULATE, growth_interval=GROWTH_INTERVAL):
    """``scaler``: "fastamp" (use_fastamp_scaler), "torch" (Accelerate's GPU setup, see below), None (Accelerate
    alone), or the disabled settings: "fastamp, GradScalerKwargs(enabled=False)", "fastamp, Scaler('cuda')"
    (disabled on a machine without CUDA), and torch's GradScaler in the same two settings."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    handlers = [GradScalerKwargs(enabled=False)] if scaler and "enabled=False" in scaler else []
    accelerator = Accelerator(
        mixed_precision=precision, cpu=True, gradient_accumulation_steps=accumulate, kwargs_handlers=handlers
    )
    if scaler == "fastamp":
        use_fastamp_scaler(accelerator, growth_interval=growth_interval)
    elif scaler == "torch":
        # What Accelerate builds for fp16 on a GPU (native_amp: autocast in the prepared
        # forward; torch's GradScaler); on CPU it builds neither.
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    elif scaler == "fastamp, GradScalerKwargs(enabled=False)":
        use_fastamp_scaler(accelerator)
    elif scaler == "fastamp, Scaler('cuda')":
        use_fastamp_scaler(accelerator, fastamp.Scaler("cuda"))
    elif scaler == "torch, GradScalerKwargs(enabled=False)":
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", **accelerator.scaler_handler.to_kwargs())
    elif scaler == "torch, GradScaler('cuda')":
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cuda")
    return accelerator


class _Run:
    def __init__(
        self, optimizer, precision="fp16", scaler="fastamp", overflow_at=OVERFLOW_AT, clip=CLIP, lr=False, by="norm"
    ):
        self.accelerator = _accelerator(precision, scaler)
        model = mlp()
        opt = OPTIMIZERS[optimizer](model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step) if lr else None
        if lr:
            self.model, self.opt, self.scheduler = self.accelerator.prepare(model, opt, self.scheduler)
        else:
            self.model, self.opt = self.accelerator.prepare(model, opt)
        self.overflow_at, self.clip, self.by = overflow_at, clip, by
        self.losses, self.scales, self.skipped = [], [], []

    def train(self, start=0, stop=MICRO_BATCHES):
        acc = self.accelerator
        for i, (x, y) in enumerate(_batches()[start:stop], start):
            with acc.accumulate(self.model):
                loss = torch.nn.functional.mse_loss(self.model(x), y)
                self.losses.append(loss.detach())
                acc.backward(loss)
                inject_inf(self.model, i in self.overflow_at)
                if acc.sync_gradients and self.by == "norm":
                    acc.clip_grad_norm_(self.model.parameters(), self.clip)
                elif acc.sync_gradients:
                    acc.clip_grad_value_(self.model.parameters(), self.clip)
                self.opt.step()
                if self.scheduler is not None:
                    self.scheduler.step()
                self.opt.zero_grad()
                if acc.sync_gradients and acc.scaler is not None:
                    if acc.scaler.is_enabled():
                        self.scales.append(acc.scaler._get_scale_async().clone())
                    self.skipped.append(self.opt.step_was_skipped)
        return self


def _by_hand(optimizer, precision="fp16", overflow_at=OVERFLOW_AT, by="norm", clip=CLIP):
    """The loop Accelerate runs with the fastamp scaler, written out."""
    model = mlp()
    opt = OPTIMIZERS[optimizer](model.parameters())
    fp16 = precision == "fp16"
    scaler = fastamp.Scaler("cpu", growth_interval=GROWTH_INTERVAL, enabled=fp16)
    losses, scales, skipped = [], [], []
    for i, (x, y) in enumerate(_batches()):
        with torch.autocast("cpu", dtype=torch.float16 if fp16 else torch.bfloat16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)  # Accelerate returns fp32 outputs
        losses.append(loss.detach())
        scaler.scale(loss / ACCUMULATE).backward()
        inject_inf(model, i in overflow_at)
        if (i + 1) % ACCUMULATE == 0:
            if by == "norm":
                scaler.clip_grad_norm_(opt, clip)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_value_(list(model.parameters()), clip)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if fp16:
                scales.append(scaler._get_scale_async().clone())
                skipped.append(scaler.last_step_skipped)
    return model, torch.stack(losses), scales, skipped


@pytest.mark.parametrize(
    "precision, optimizer, by",
    [
        ("fp16", "fastamp.AdamW", "norm"),
        ("fp16", "torch.AdamW(fused)", "norm"),
        ("fp16", "torch.SGD", "norm"),
        ("fp16", "fastamp.AdamW", "value"),
        ("bf16", "fastamp.AdamW", "norm"),
    ],
)
def test_accelerate_runs_exactly_the_fastamp_loop(precision, optimizer, by, monkeypatch):
    """Accelerator + use_fastamp_scaler == the hand-written fastamp loop, bit for bit.

    fp16: the fused clip is what accelerator.clip_grad_norm_ runs; step_was_skipped is right
    for amp-aware optimizers too (Accelerate alone reports False for them); clip_grad_value_ is
    Accelerate's (unscale with fastamp's unscale_, then clamp). bf16: no scaler, Accelerate's
    own clip, fastamp's optimizer.
    """
    fused_clips = []
    if precision == "fp16":
        fused_clip = fastamp.Scaler.clip_grad_norm_

        def counting_clip(self, *a, **k):
            fused_clips.append(1)
            return fused_clip(self, *a, **k)

        monkeypatch.setattr(fastamp.Scaler, "clip_grad_norm_", counting_clip)
    overflow_at = OVERFLOW_AT if precision == "fp16" else ()
    clip = CLIP if by == "norm" else 0.02
    run = _Run(optimizer, precision, "fastamp" if precision == "fp16" else None, overflow_at, clip, by=by).train()
    ref, ref_losses, ref_scales, ref_skipped = _by_hand(optimizer, precision, overflow_at, by, clip)

    assert torch.equal(torch.stack(run.losses), ref_losses)
    assert_equal_lists(params(run.model), params(ref))
    if precision == "bf16":
        assert run.accelerator.scaler is None
        return
    steps = MICRO_BATCHES // ACCUMULATE
    assert len(fused_clips) == (2 * steps if by == "norm" else 0)  # the run's and the reference's
    assert_equal_lists(run.scales, ref_scales)
    assert run.skipped == ref_skipped
    skipped_at = [i for i, s in enumerate(run.skipped) if s]
    assert {i // ACCUMULATE for i in OVERFLOW_AT} <= set(skipped_at)
    assert int(run.accelerator.scaler.skipped_steps) == len(skipped_at)
    moves = [b / a for a, b in zip([2.0**16] + [float(s) for s in run.scales], [float(s) for s in run.scales])]
    assert 2.0 in moves and 0.5 in moves  # the scale backed off and grew


@pytest.mark.parametrize("clip", [1e9, CLIP], ids=["clip-never-binds", "clip-binds"])
def test_matches_accelerates_torch_amp_path(clip):
    """Against Accelerate with torch.amp.GradScaler (its GPU setup), the same torch AdamW.

    Scale trajectory and skipped steps: bit-identical. Losses and params: bit-identical when
    the clip does not bind; when it binds, the clip coefficient differs in its last bits (torch:
    norm of per-tensor fp32 norms with torch's sqrt; fastamp: fp64 sum of squares rounded
    once, tolerances.NORM_RTOL), carried through AdamW: params within ADAMW_VS_TORCH_*, losses
    within one fp16 ulp (the forward runs in fp16: an output may round to the neighbouring value).
    """
    ours = _Run("torch.AdamW", clip=clip).train()
    theirs = _Run("torch.AdamW", scaler="torch", clip=clip).train()
    assert isinstance(theirs.accelerator.scaler, torch.amp.GradScaler)
    assert not isinstance(theirs.accelerator.scaler, fastamp.Scaler)

    assert_equal_lists(ours.scales, theirs.scales)
    assert ours.skipped == theirs.skipped and any(ours.skipped)
    got, want = torch.stack(ours.losses), torch.stack(theirs.losses)
    if clip == 1e9:
        assert torch.equal(got, want)
        assert_equal_lists(params(ours.model), params(theirs.model))
    else:
        for g, w in zip(params(ours.model), params(theirs.model)):
            torch.testing.assert_close(g, w, atol=ADAMW_VS_TORCH_ATOL, rtol=ADAMW_VS_TORCH_RTOL)
        torch.testing.assert_close(got, want, atol=0, rtol=torch.finfo(torch.float16).eps)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_save_state_load_state_resumes_bit_exactly(precision, tmp_path):
    """32 micro-batches straight == 16, save_state, a fresh Accelerator + load_state, 16 more.

    fp16: an overflow in each half; the fastamp scaler's state goes through scaler.pt.
    """
    overflow_at = (5, 21) if precision == "fp16" else ()
    scaler = "fastamp" if precision == "fp16" else None
    straight = _Run("fastamp.AdamW", precision, scaler, overflow_at).train()
    first = _Run("fastamp.AdamW", precision, scaler, overflow_at).train(0, MICRO_BATCHES // 2)
    first.accelerator.save_state(output_dir=str(tmp_path))
    resumed = _Run("fastamp.AdamW", precision, scaler, overflow_at)
    resumed.accelerator.load_state(str(tmp_path))
    resumed.train(MICRO_BATCHES // 2, MICRO_BATCHES)

    assert torch.equal(torch.stack(resumed.losses), torch.stack(straight.losses[MICRO_BATCHES // 2 :]))
    assert_equal_lists(params(resumed.model), params(straight.model))
    assert_equal_optimizer_states(straight.opt.state_dict(), resumed.opt.state_dict())
    if precision == "fp16":
        a, b = straight.accelerator.scaler, resumed.accelerator.scaler
        assert isinstance(b, fastamp.Scaler) and a.state_dict() == b.state_dict()
        assert int(b.skipped_steps) >= 2  # one skip in each half, counted across the resume


def test_prepared_lr_scheduler_does_not_advance_on_skipped_steps():
    """Accelerate's scheduler wrapper steps only when step_was_skipped is False; with fastamp's
    AdamW (amp-aware: its step always runs) that flag must come from the scaler."""
    run = _Run("fastamp.AdamW", lr=True).train()
    applied = sum(not s for s in run.skipped)
    assert 0 < applied < MICRO_BATCHES // ACCUMULATE
    assert run.scheduler.scheduler.last_epoch == applied
    assert run.opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.9**applied, rel=1e-12)


def test_clip_of_other_params_takes_accelerates_path():
    """Params that are not one optimizer's: Accelerate's own clip (unscale every optimizer with
    fastamp's unscale_, then torch's clip on those params); the step then uses the unscaled grads."""
    run = _Run("fastamp.AdamW", overflow_at=())
    acc, first_layer = run.accelerator, list(run.model[0].parameters())
    x, y = _batches()[0]
    for _ in range(ACCUMULATE):
        with acc.accumulate(run.model):
            acc.backward(torch.nn.functional.mse_loss(run.model(x), y))
    scale = acc.scaler.get_scale()
    want = [p.grad / scale for p in run.model.parameters()]
    norm = acc.clip_grad_norm_(first_layer, 1e-3)
    # torch's clip takes the norm of per-tensor norms: another reduction order than one norm
    want_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in want[:2]]))
    torch.testing.assert_close(norm, want_norm, rtol=NORM_RTOL, atol=0)
    coef = 1e-3 / (norm + 1e-6)
    for p, g in zip(run.model.parameters(), want):
        clipped = any(p is q for q in first_layer)
        torch.testing.assert_close(p.grad, g * coef if clipped else g, rtol=NORM_RTOL, atol=0)
    run.opt.step()
    assert not run.opt.step_was_skipped


def test_no_host_sync_in_clip_and_step_with_an_amp_aware_optimizer(monkeypatch):
    """accelerator.clip_grad_norm_ + opt.step() + zero_grad (fused clip, step, scale update) read
    no value on the host; step_was_skipped does (once, when read), step_was_skipped_tensor not."""
    run = _Run("fastamp.AdamW")
    acc, guard = run.accelerator, HostReadGuard(monkeypatch)
    flags = []
    for i, (x, y) in enumerate(_batches()):
        with acc.accumulate(run.model):
            acc.backward(torch.nn.functional.mse_loss(run.model(x), y))
            inject_inf(run.model, i in OVERFLOW_AT)
            guard.on = True
            if acc.sync_gradients:
                acc.clip_grad_norm_(run.model.parameters(), CLIP)
            run.opt.step()
            run.opt.zero_grad()
            if acc.sync_gradients:
                flags.append(run.opt.step_was_skipped_tensor.clone())
                with pytest.raises(AssertionError, match="host sync"):
                    run.opt.step_was_skipped  # noqa: B018  (a Python bool: read on the host)
            guard.on = False
    skipped_at = {n for n, f in enumerate(flags) if bool(f)}
    assert {i // ACCUMULATE for i in OVERFLOW_AT} <= skipped_at
    assert int(acc.scaler.skipped_steps) == len(skipped_at)


TWO_STEPS = 8  # optimizer steps of the two-optimizer runs (16 micro-batches)
TWO_OVERFLOW_AT = {3: 0, 8: 1}  # micro-batch -> the net whose grad gets an inf (steps 1 and 4)


def _two_optimizer_run(optimizer, pattern, clip, overflow_at=TWO_OVERFLOW_AT):
    """Two prepared models and optimizers (and an LR scheduler each), one summed loss, accumulation 2."""
    accelerator = _accelerator()
    nets = two_nets()
    opts = [TWO_OPTIMIZERS[optimizer](net.parameters()) for net in nets]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step) for opt in opts]
    *nets, o1, o2, s1, s2 = accelerator.prepare(*nets, *opts, *schedulers)
    opts, schedulers = [o1, o2], [s1, s2]
    scales, skipped = [], []
    for i, (x, y) in enumerate(two_batches(TWO_STEPS * ACCUMULATE)):
        with accelerator.accumulate(*nets):
            accelerator.backward(two_losses([net(x) for net in nets], y))
            inject_inf_into(nets, overflow_at.get(i))
            if pattern == "clip-all-then-step-all":
                for net in nets:
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(net.parameters(), clip)
                for opt in opts:
                    opt.step()
            else:
                for net, opt in zip(nets, opts):
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(net.parameters(), clip)
                    opt.step()
            for scheduler in schedulers:
                scheduler.step()
            for opt in opts:
                opt.zero_grad()
            if accelerator.sync_gradients:
                scales.append(accelerator.scaler.get_scale())
                skipped.append(tuple(opt.step_was_skipped for opt in opts))
    return nets, scales, skipped, schedulers


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("optimizer", list(TWO_OPTIMIZERS))
def test_two_optimizers_run_torchs_loop(optimizer, pattern):
    """Two prepared optimizers == torch's multi-optimizer loop (step each, then one update).

    Against the loop by hand with torch.amp.GradScaler (unscale_ + torch's clip): the scale
    after every iteration and each optimizer's skips bit-identical, and with a clip that does
    not bind the params too (unscaling by a power of two and a clip coefficient of 1 are exact:
    the same maths). With a binding clip against the loop by hand with fastamp.Scaler (its fused
    clip: the same maths, bit for bit; torch's clip coefficient differs in its last bits).
    Skips are torch's, per optimizer: an inf in one net's grads skips that optimizer only and
    backs the scale off once; each prepared LR scheduler stays put when its optimizer skipped.
    (Before the fix: an update after each optimizer's step threw away the other's clip.)
    """
    batches, accumulate = two_batches(TWO_STEPS * ACCUMULATE), ACCUMULATE
    loose = _two_optimizer_run(optimizer, pattern, 1e9)
    torch_scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    ref = two_optimizer_loop(optimizer, pattern, 1e9, batches, TWO_OVERFLOW_AT, torch_scaler, accumulate, schedule=True)
    assert loose[1] == ref[1] and loose[2] == ref[2]
    for net, ref_net in zip(loose[0], ref[0]):
        assert_equal_lists(params(net), params(ref_net))
    assert ref[2][1] == (True, False) and ref[2][4] == (False, True)  # the injected infs, per optimizer
    moves = {b / a for a, b in zip([2.0**16] + ref[1], ref[1])}
    assert {0.5, 2.0} <= moves  # the scale backed off and grew
    for k, scheduler in enumerate(loose[3]):
        assert scheduler.scheduler.last_epoch == sum(not s[k] for s in loose[2])

    tight = _two_optimizer_run(optimizer, pattern, 0.05)
    fused = two_optimizer_loop(
        optimizer, pattern, 0.05, batches, TWO_OVERFLOW_AT, _fastamp_scaler(), accumulate, schedule=True
    )
    torch_scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    ref = two_optimizer_loop(
        optimizer, pattern, 0.05, batches, TWO_OVERFLOW_AT, torch_scaler, accumulate, schedule=True
    )
    assert tight[1] == fused[1] == ref[1] and tight[2] == fused[2] == ref[2]
    for net, fused_net in zip(tight[0], fused[0]):
        assert_equal_lists(params(net), params(fused_net))


def _fastamp_scaler():
    return fastamp.Scaler("cpu", growth_interval=GROWTH_INTERVAL)


@pytest.mark.parametrize("optimizer", ["fastamp.SGD", "torch.SGD"])
def test_two_optimizers_both_clipped_before_either_steps(optimizer):
    """The reviewer's case: clip both, then step both (one SGD step, lr 0.1, no momentum): each
    update is lr * a gradient of norm max_norm. Before the fix o2 was not clipped (amp-aware:
    update-norm/lr 0.39 here) or unscaled twice (ordinary: 0); now both 1e-3. Relative 1e-2:
    the update is read back as a difference of fp32 params of magnitude ~0.3 (an ulp of the
    param is ~3e-3 of an update element)."""
    accelerator = _accelerator()
    nets = two_nets()
    make = {"fastamp.SGD": fastamp.optim.SGD, "torch.SGD": torch.optim.SGD}[optimizer]
    *nets, o1, o2 = accelerator.prepare(*nets, *(make(net.parameters(), lr=0.1) for net in nets))
    before = [params(net) for net in nets]
    x, y = two_batches(1)[0]
    for _ in range(ACCUMULATE):
        with accelerator.accumulate(*nets):
            accelerator.backward(two_losses([net(x) for net in nets], y))
            if accelerator.sync_gradients:
                for net in nets:
                    accelerator.clip_grad_norm_(net.parameters(), 1e-3)
            o1.step()
            o2.step()
    for net, was in zip(nets, before):
        update = torch.cat([(p.detach() - b).flatten() for p, b in zip(net.parameters(), was)])
        assert float(update.norm()) / 0.1 == pytest.approx(1e-3, rel=1e-2)
    assert accelerator.scaler._per_optimizer_states == {}  # updated once, at the last step


@pytest.mark.parametrize("optimizer", ["fastamp.SGD", "torch.SGD"])
def test_each_optimizer_reports_its_own_skip(optimizer):
    """An inf in the first net's grads only: o1 skips and says so, o2 steps and says so (torch's
    per-optimizer found_inf), o1's scheduler stays put, o2's advances; the scale backs off once.
    (Before the fix an amp-aware o1 read the scaler's last_step_skipped, overwritten by o2's update.)"""
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    use_fastamp_scaler(accelerator)
    nets = two_nets()
    opts = [TWO_OPTIMIZERS[optimizer](net.parameters()) for net in nets]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step) for opt in opts]
    *nets, o1, o2, s1, s2 = accelerator.prepare(*nets, *opts, *schedulers)
    before = [params(net) for net in nets]
    x, y = two_batches(1)[0]
    accelerator.backward(two_losses([net(x) for net in nets], y))
    inject_inf_into(nets, 0)
    o1.step()
    o2.step()
    s1.step()
    s2.step()
    assert (o1.step_was_skipped, o2.step_was_skipped) == (True, False)
    assert (bool(o1.step_was_skipped_tensor), bool(o2.step_was_skipped_tensor)) == (True, False)
    assert (s1.scheduler.last_epoch, s2.scheduler.last_epoch) == (0, 1)
    assert_equal_lists(params(nets[0]), before[0])
    assert not torch.equal(params(nets[1])[0], before[1][0])
    assert accelerator.scaler.get_scale() == 2.0**15 and int(accelerator.scaler.skipped_steps) == 1


def test_an_optimizer_that_does_not_step_defers_the_update_to_the_next_backward(tmp_path):
    """o2 steps every other iteration only: in the others the scale update runs at the next
    accelerator.backward (and at save_state), so every loss is scaled with the scale torch's loop
    (step the optimizers that step, then update) would use; params and scale bit-identical."""
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    use_fastamp_scaler(accelerator, growth_interval=1)
    nets, ref_nets = two_nets(), two_nets()
    opts = [TWO_OPTIMIZERS["fastamp.SGD"](net.parameters()) for net in nets]
    *nets, o1, o2 = accelerator.prepare(*nets, *opts)
    ref_opts = [TWO_OPTIMIZERS["fastamp.SGD"](net.parameters()) for net in ref_nets]
    ref_scaler = torch.amp.GradScaler("cpu", growth_interval=1)
    scaled_with, ref_scaled_with = [], []
    for i, (x, y) in enumerate(two_batches(5)):
        loss = two_losses([net(x) for net in nets], y)
        accelerator.backward(loss)
        scaled_with.append(accelerator.scaler.get_scale())
        inject_inf_into(nets, 0 if i == 2 else None)
        for opt in (o1, o2) if i % 2 else (o1,):
            opt.step()
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            outputs = [net(x) for net in ref_nets]
        ref_scaled_with.append(ref_scaler.get_scale())
        ref_scaler.scale(two_losses([out.float() for out in outputs], y)).backward()
        inject_inf_into(ref_nets, 0 if i == 2 else None)
        for opt in ref_opts if i % 2 else ref_opts[:1]:
            ref_scaler.step(opt)
            opt.zero_grad()
        ref_scaler.update()
    assert scaled_with == ref_scaled_with and 0.5 in {b / a for a, b in zip(scaled_with, scaled_with[1:])}
    accelerator.save_state(output_dir=str(tmp_path))  # the last iteration's update, pending: runs first
    assert accelerator.scaler.get_scale() == ref_scaler.get_scale()
    assert accelerator.scaler._get_growth_tracker() == ref_scaler._get_growth_tracker()
    for net, ref_net in zip(nets, ref_nets):
        assert_equal_lists(params(net), params(ref_net))


def test_refusals_and_why_the_helper_switches_fp16_on_on_cpu():
    plain = _accelerator("fp16", scaler=None)
    # Accelerate alone: fp16 on CPU has no autocast and no scaler (it would train in fp32)
    assert plain.native_amp is False and plain.scaler is None
    scaler = use_fastamp_scaler(plain)
    assert plain.native_amp is True and plain.scaler is scaler
    with pytest.raises(RuntimeError, match="already"):
        use_fastamp_scaler(plain)

    late = _accelerator("fp16", scaler=None)
    late.prepare(mlp())
    with pytest.raises(RuntimeError, match="before accelerator.prepare"):
        use_fastamp_scaler(late)
    with pytest.raises(ValueError, match="bf16 needs no loss scaler"):
        use_fastamp_scaler(_accelerator("bf16", scaler=None))
    with pytest.raises(ValueError, match="either a scaler or scaler options"):
        use_fastamp_scaler(_accelerator("fp16", scaler=None), fastamp.Scaler("cpu"), growth_interval=5)
    with pytest.raises(TypeError, match="must be a fastamp.Scaler"):
        use_fastamp_scaler(_accelerator("fp16", scaler=None), torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="expected an accelerate.Accelerator"):
        use_fastamp_scaler(object())


# ---- a GAN: backward, step, backward, step --------------------------------------------------

GAN_LOOPS = ("prepared dataloader", "accumulate block", "neither")


def _gan_run(optimizer, every, loop, scaler="fastamp"):
    """The GAN iteration of e2e._frameworks with two prepared models and optimizers, no accumulation; the batches
    from a prepared dataloader, or inside ``accelerator.accumulate(G, D)``, or neither."""
    accelerator = _accelerator(scaler=scaler, accumulate=1, growth_interval=2)
    G, D = gan_nets()
    make = TWO_OPTIMIZERS[optimizer]
    G, D, opt_g, opt_d = accelerator.prepare(G, D, make(G.parameters()), make(D.parameters()))
    batches = gan_batches()
    if loop == "prepared dataloader":
        batches = accelerator.prepare(torch.utils.data.DataLoader(batches, batch_size=None))
    scaled_with, scales = [], []

    def backward(loss, net, i):
        accelerator.backward(loss)
        scaled_with.append(accelerator.scaler.get_scale())  # the scale the loss was scaled with
        gan_inject(G, D, i, net)

    for i, x in enumerate(batches):
        with accelerator.accumulate(G, D) if loop == "accumulate block" else contextlib.nullcontext():
            opt_d.zero_grad()
            backward(gan_loss_d(G, D, x), "D", i)
            opt_d.step()
            if gan_steps_g(i, every):
                opt_g.zero_grad()
                backward(gan_loss_g(G, D, x), "G", i)
                opt_g.step()
        scales.append(accelerator.scaler.get_scale())
    return (G, D), scaled_with, scales, accelerator


@pytest.mark.parametrize("loop", GAN_LOOPS)
@pytest.mark.parametrize("pattern", list(GAN_PATTERNS))
@pytest.mark.parametrize("optimizer", GAN_OPTIMIZERS)
def test_a_gans_backward_step_backward_step_gets_one_update_per_iteration_as_torchs_loop(optimizer, pattern, loop):
    """backward(loss_d), opt_d.step(), backward(loss_g), opt_g.step() per iteration, 12 iterations, injected
    overflows in D's and in G's grads, growth every 2 clean iterations.

    Iterating a prepared dataloader or inside ``accelerator.accumulate(...)``: one update per iteration, as
    torch's hand-written loop with torch.amp.GradScaler: the scale every loss was scaled with, the scale after
    every iteration and both nets' params bit-identical ("G every 2nd": iterations where only D steps are
    closed by the next batch / the block's end). Neither: no iteration end to wait for, so a pending update
    runs at the next backward: an update after each step, which is what Accelerate does with torch's
    GradScaler (bit for bit, also shown here). (Before the fix every loop gave the latter.)
    """
    every = GAN_PATTERNS[pattern]
    nets, scaled_with, scales, accelerator = _gan_run(optimizer, every, loop)
    torch_loop = gan_loop(optimizer, every, torch.amp.GradScaler("cpu", growth_interval=2))
    each_step = gan_loop(optimizer, every, torch.amp.GradScaler("cpu", growth_interval=2), update_after_each_step=True)
    theirs = _gan_run(optimizer, every, loop, scaler="torch")
    assert theirs[1] == each_step[1] != torch_loop[1]  # Accelerate's own: an update after each step
    ref = torch_loop if loop != "neither" else each_step
    assert scaled_with == ref[1]
    if loop == "accumulate block":
        assert scales == ref[2]  # the update runs as the block ends
    elif loop == "prepared dataloader":
        # the update runs as the next batch is fetched (where only D stepped) or the loop ends
        assert scales[-1] == ref[2][-1]
    assert_scales_move_both_ways(torch_loop[2])
    for net, ref_net in zip(nets, ref[0]):
        assert_equal_lists(params(net), params(ref_net))
    if loop != "neither":
        backoffs = sum(b / a == 0.5 for a, b in zip([2.0**16] + torch_loop[2], torch_loop[2]))
        assert int(accelerator.scaler.skipped_steps) == backoffs >= 4


@pytest.mark.parametrize("optimizer", ["fastamp.AdamW", "torch.AdamW(fused)", "torch.SGD"])
@pytest.mark.parametrize("setting", ["GradScalerKwargs(enabled=False)", "Scaler('cuda') without CUDA"])
def test_a_disabled_scaler_runs_accelerates_paths_as_with_a_disabled_gradscaler(setting, optimizer):
    """A disabled fastamp scaler (``GradScalerKwargs(enabled=False)``, or a "cuda" scaler on a machine without
    CUDA) == Accelerate with a disabled torch GradScaler: fp16 autocast, no scaling, nothing skipped (the
    prepared LR scheduler steps every time), accelerator.clip_grad_norm_ (torch's clip), accumulation, bit for
    bit: losses and params."""
    if setting.endswith("without CUDA") and torch.cuda.is_available():
        pytest.skip("a machine without CUDA is the setting")
    ours_scaler, theirs_scaler = {
        "GradScalerKwargs(enabled=False)": ("fastamp, GradScalerKwargs(enabled=False)",
                                            "torch, GradScalerKwargs(enabled=False)"),
        "Scaler('cuda') without CUDA": ("fastamp, Scaler('cuda')", "torch, GradScaler('cuda')"),
    }[setting]  # fmt: skip
    ours = _Run(optimizer, scaler=ours_scaler, overflow_at=(), lr=True).train()
    theirs = _Run(optimizer, scaler=theirs_scaler, overflow_at=(), lr=True).train()
    assert isinstance(ours.accelerator.scaler, fastamp.Scaler) and not ours.accelerator.scaler.is_enabled()
    assert not theirs.accelerator.scaler.is_enabled()
    assert torch.equal(torch.stack(ours.losses), torch.stack(theirs.losses))
    assert_equal_lists(params(ours.model), params(theirs.model))
    steps = MICRO_BATCHES // ACCUMULATE
    assert ours.skipped == theirs.skipped == [False] * steps
    assert ours.scheduler.scheduler.last_epoch == theirs.scheduler.scheduler.last_epoch == steps
    assert ours.opt.step_was_skipped_tensor is False


def test_an_optimizer_stepped_twice_in_one_iteration_unscales_with_the_scale_its_grads_were_made_with():
    """A critic stepped twice per batch of a prepared dataloader (a backward each), then G: every loss of the
    iteration is scaled with one scale, D's second step unscales with it too, and the iteration's one update
    (at the next batch) counts every step's overflow: e2e._frameworks.critic_twice_loop, bit for bit."""
    accelerator = _accelerator(accumulate=1, growth_interval=2)
    G, D = gan_nets()
    make = TWO_OPTIMIZERS["torch.SGD"]
    G, D, opt_g, opt_d = accelerator.prepare(G, D, make(G.parameters()), make(D.parameters()))
    loader = accelerator.prepare(torch.utils.data.DataLoader(gan_batches(), batch_size=None))
    scaled_with = []

    def backward_and_step(loss, net, opt, i):
        opt.zero_grad()
        accelerator.backward(loss)
        scaled_with.append(accelerator.scaler.get_scale())
        gan_inject(G, D, i, net)
        opt.step()

    for i, x in enumerate(loader):
        for half in (x[:2], x[2:]):
            backward_and_step(gan_loss_d(G, D, half), "D", opt_d, i)
        backward_and_step(gan_loss_g(G, D, x), "G", opt_g, i)
    nets, ref_scaled_with, ref_scales, skips = critic_twice_loop()
    assert scaled_with == ref_scaled_with
    assert accelerator.scaler.get_scale() == ref_scales[-1]
    assert int(accelerator.scaler.skipped_steps) == skips >= 4
    assert_scales_move_both_ways(ref_scales)
    for net, ref in zip((G, D), nets):
        assert_equal_lists(params(net), params(ref))
