"""Gradient health statistics (Scaler(track_stats=True)) and the mixed-precision pitfall guards."""

import copy
import pickle
import warnings

import pytest
import torch
from helpers import spy_kernels
from torch import nn

import fastamp
from fastamp import reference
from fastamp.health import AmpPitfallWarning


def _mlp(dtype=None, seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    return fastamp.cast_model(m, dtype) if dtype is not None else m


def _iteration(model, opt, scaler, x, *, loss_mul=1.0, scaled=True, poison=None):
    opt.zero_grad(set_to_none=True)
    loss = model(x).float().square().mean() * loss_mul
    scaled_loss = scaler.scale(loss)
    (scaled_loss if scaled else loss).backward()  # scaled=False: the bug, backward on the unscaled loss
    if poison is not None:
        poison()
    scaler.step(opt)
    scaler.update()
    return loss


@pytest.fixture
def no_pitfalls():
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpPitfallWarning)
        yield


# --------------------------------------------------------------------------- statistics


def _expected(grads, inv_scale):
    counts = torch.zeros((len(grads), 3), dtype=torch.int64)
    absmax = torch.zeros(len(grads))
    reference.unscale_check_stats_(
        [g.clone() for g in grads], torch.zeros(()), torch.tensor(inv_scale), False, False, counts, absmax
    )
    return counts, absmax


@pytest.mark.parametrize("path", ["step_plain", "unscale", "clip_amp_aware", "step_amp_aware"])
def test_stats_match_the_reference_and_are_named(path, no_pitfalls):
    model = _mlp(torch.float16)
    amp_aware = path in ("clip_amp_aware", "step_amp_aware")
    opt = (
        fastamp.optim.AdamW(model.parameters(), lr=1e-3)
        if amp_aware
        else torch.optim.SGD(
            [{"params": [p for p in model.parameters() if p.dtype == torch.float32]}], lr=1e-3
        )  # a plain optimizer over the fp32 (kept) params only
    )
    scaler = fastamp.Scaler(init_scale=2.0**10, track_stats=True).watch(model, prefix="net.")
    assert scaler.grad_stats() is None
    opt.zero_grad()
    (scaler.scale(model(torch.randn(6, 8)).float().square().mean())).backward()
    with torch.no_grad():
        for mod in (model[0], model[1]):  # an fp16 and an fp32 grad; raw (still scaled) values
            g = mod.weight.grad.view(-1)
            g[:3] = torch.tensor([float("inf"), 0.0, 2.0**-30], dtype=g.dtype)
    params = [p for grp in opt.param_groups for p in grp["params"]]
    raw = [p.grad.clone() for p in params]
    if path == "unscale":
        scaler.unscale_(opt)
    elif path == "clip_amp_aware":
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    stats = scaler.grad_stats()
    counts, absmax = _expected(raw, 2.0**-10)
    names = {id(p): "net." + n for n, p in model.named_parameters()}
    assert [t.name for t in stats] == [names[id(p)] for p in params]
    for i, t in enumerate(stats):
        assert (t.nonfinite, t.zeros, t.fp16_underflow) == tuple(counts[i].tolist()), t.name
        assert t.absmax == absmax[i].item() and t.numel == params[i].numel()
    assert stats.skipped is True and stats.scale == 2.0**10
    bad = ["net.0.weight", "net.1.weight"] if amp_aware else ["net.1.weight"]
    assert stats.nonfinite == bad and stats.first_nonfinite == "net.1.weight"
    assert "first met by backward: 'net.1.weight'" in stats.summary()
    for name in bad:
        assert stats[name].nonfinite == 1 and stats[name].zeros >= 1 and stats[name].fp16_underflow >= 1
    # model= names override, unnamed params get their optimizer position
    assert [t.name for t in scaler.grad_stats(model=model)][0] == [
        n for n, p in model.named_parameters() if p is params[0]
    ][0]
    anon = fastamp.Scaler(init_scale=2.0**10, track_stats=True)
    opt.zero_grad()
    anon.scale(model(torch.randn(2, 8)).float().square().mean()).backward()
    anon.step(opt)
    anon.update()
    assert next(iter(anon.grad_stats())).name == "opt0.group0.param0"
    assert anon.grad_stats().skipped is False


def test_stats_same_on_the_one_call_path_and_the_per_grad_path(monkeypatch):
    """Dense grads are checked in one native call without Python work per grad; a strided grad
    sends the check through the per-grad path. Both must report the same rows."""
    per_grad_calls = []
    real = fastamp.Scaler._grads_by_device
    monkeypatch.setattr(
        fastamp.Scaler, "_grads_by_device", lambda self, *a, **k: per_grad_calls.append(1) or real(self, *a, **k)
    )
    model = _mlp(torch.float16)

    def run(strided):
        m = copy.deepcopy(model)
        opt = fastamp.optim.AdamW(m.parameters(), lr=1e-3)
        scaler = fastamp.Scaler(init_scale=2.0**10, track_stats=True).watch(m)
        torch.manual_seed(3)
        scaler.scale(m(torch.randn(6, 8)).float().square().mean()).backward()
        m[1].bias.grad = None  # a param without grad: the rows skip it
        with torch.no_grad():
            m[3].weight.grad.view(-1)[:3] = torch.tensor([float("inf"), 0.0, 2.0**-30])
        if strided:
            m[0].weight.grad = m[0].weight.grad.t().contiguous().t()  # same values, not contiguous
        calls = len(per_grad_calls)
        scaler.unscale_(opt)
        assert (len(per_grad_calls) > calls) == strided
        return list(scaler.grad_stats())

    one_call, per_grad = run(False), run(True)
    assert one_call == per_grad
    assert len(one_call) == len(list(model.parameters())) - 1 and one_call[3].nonfinite == 1


def test_stats_track_the_last_iteration_and_worst():
    model = _mlp(torch.bfloat16)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fastamp.Scaler(track_stats=True).watch(model)
    x = torch.randn(4, 8)
    _iteration(model, opt, scaler, x)
    first = scaler.grad_stats()
    assert first.skipped is False and not first.nonfinite and first.update == 1

    def dead_bias():
        model[3].bias.grad.zero_()

    _iteration(model, opt, scaler, x, poison=dead_bias)
    st = scaler.grad_stats()
    assert st.update == 2 and st["3.bias"].frac_zero == 1.0 and st["3.bias"].absmax == 0.0
    assert st.worst(1, "frac_zero")[0].name == "3.bias"
    assert st.worst(1, "absmin")[0].name == "3.bias"
    assert "3.bias" in st.summary() and "most zeros" in st.summary()
    with pytest.raises(ValueError, match="unknown key"):
        st.worst(1, "nope")


def test_stats_off_never_calls_the_stats_op(monkeypatch):
    asked = []

    def spy(op, backend, impl):
        def kernel(*args):
            asked.append(op)
            return impl(*args)

        return kernel

    spy_kernels(monkeypatch, spy)
    model = _mlp(torch.float16)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    off = fastamp.Scaler()
    for _ in range(3):
        _iteration(model, opt, off, torch.randn(4, 8))
    assert "unscale_check_stats_" not in asked and "unscale_check_" in asked
    with pytest.raises(RuntimeError, match="track_stats=True"):
        off.grad_stats()
    asked.clear()
    on = fastamp.Scaler(track_stats=True)
    _iteration(model, opt, on, torch.randn(4, 8))
    assert asked.count("unscale_check_stats_") == 1 and "unscale_check_" not in asked  # same single pass


def test_stats_buffers_are_reused_and_scaler_pickles():
    model = _mlp(torch.float16)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fastamp.Scaler(track_stats=True).watch(model)
    _iteration(model, opt, scaler, torch.randn(4, 8))
    buf = next(iter(scaler._stats.values())).counts
    _iteration(model, opt, scaler, torch.randn(4, 8))
    assert next(iter(scaler._stats.values())).counts is buf
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.grad_stats() is None  # statistics and names do not travel; the scale does
        assert clone.get_scale() == scaler.get_scale()
        _iteration(model, opt, clone, torch.randn(4, 8))
        assert len(clone.grad_stats()) == 6


# --------------------------------------------------------------------------- guards


def test_fp16_without_scaler_and_without_master_weights():
    model = _mlp(torch.float16)  # installs the optimizer guard
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).float().sum().backward()
    with pytest.warns(AmpPitfallWarning, match="fp16_without_scaler") as rec:
        opt.step()
    assert not any("fp16_without_master" in str(w.message) for w in rec)  # AdamW keeps fp32 masters
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpPitfallWarning)
        opt.step()  # once per optimizer

    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = fastamp.Scaler(init_scale=2.0**8)  # no overflow: the step really runs
    sgd.zero_grad()
    scaler.scale(model(torch.randn(4, 8)).float().square().mean()).backward()
    with pytest.warns(AmpPitfallWarning, match="fp16_without_master") as rec:
        scaler.step(sgd)
    assert not any("fp16_without_scaler" in str(w.message) for w in rec)  # the scaler drives it


def test_fp16_correct_loop_is_silent(no_pitfalls):
    model = _mlp(torch.float16)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fastamp.Scaler(track_stats=True).watch(model)
    scaler._health.interval = 4
    x = torch.randn(16, 8)
    for _ in range(40):
        _iteration(model, opt, scaler, x, loss_mul=1e-4)
    bf = _mlp(torch.bfloat16)
    bopt = fastamp.optim.AdamW(bf.parameters(), lr=1e-3)
    for _ in range(3):  # bf16 without a scaler: nothing to warn about
        bopt.zero_grad()
        bf(x).float().square().mean().backward()
        bopt.step()


def test_grad_underflow_from_backward_on_the_unscaled_loss():
    # A small loss (here a term weighted by 1e-6; a regression near its target looks the same):
    # unscaled, its gradient flushes to zero in the fp16 output layer and nothing reaches the
    # layers below (even the fp32 LayerNorm's grads are zero). Scaled by 2**16 it is fine.
    model = _mlp(torch.float16)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fastamp.Scaler(track_stats=True).watch(model)
    x = torch.randn(16, 8)
    with pytest.warns(AmpPitfallWarning, match="grad_underflow.*scaler.scale\\(loss\\).backward\\(\\)"):
        _iteration(model, opt, scaler, x, loss_mul=1e-6, scaled=False)
    st = scaler.grad_stats()
    assert st.totals()["frac_zero"] == 1.0 and st.totals()["absmax"] == 0.0
    # the same loop with the loss scaled: silent (first probe is at the first update)
    good = fastamp.Scaler(track_stats=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpPitfallWarning)
        _iteration(model, opt, good, x, loss_mul=1e-6)
    assert good.grad_stats().totals()["frac_zero"] == 0.0


def test_scale_collapse_below_one():
    model = _mlp()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fastamp.Scaler(init_scale=2.0**4)
    x = torch.randn(4, 8)

    def poison():
        model[0].bias.grad[0] = float("nan")

    with pytest.warns(AmpPitfallWarning, match="scale_collapse.*fell to") as rec:
        for _ in range(32):  # the default probe runs at update 1, then every 32
            _iteration(model, opt, scaler, x, poison=poison)
    assert len([w for w in rec if "scale_collapse" in str(w.message)]) == 1
    assert scaler.get_scale() < 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpPitfallWarning)
        for _ in range(32):  # once per scaler
            _iteration(model, opt, scaler, x, poison=poison)


def test_bf16_with_a_scaler_that_never_backs_off():
    model = _mlp(torch.bfloat16)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = fastamp.Scaler()
    # defaults: probes at update 1 then every 32, decision at the first probe from update 100
    assert (scaler._health.interval, scaler._health.bf16_after) == (32, 100)
    scaler._health.interval, scaler._health.bf16_after = 8, 16
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpPitfallWarning)
        for _ in range(15):
            _iteration(model, opt, scaler, x)
    with pytest.warns(AmpPitfallWarning, match="bf16_scaler_unneeded"):
        _iteration(model, opt, scaler, x)  # update 16
    # an fp16 loop with the same schedule stays silent
    f16 = _mlp(torch.float16)
    fopt = fastamp.optim.AdamW(f16.parameters(), lr=1e-4)
    fs = fastamp.Scaler()
    fs._health.interval, fs._health.bf16_after = 8, 16
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpPitfallWarning)
        for _ in range(24):
            _iteration(f16, fopt, fs, x)
