"""Skip-aware lr schedules: DeviceLR (count and lr on the device) and SkipAwareLR (any torch scheduler)."""

import warnings

import pytest
import torch
from torch import nn

import fastamp
from fastamp import schedule


def _setup(init_scale=2.0**8):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, fastamp.Scaler(init_scale=init_scale)


def _iteration(model, opt, scaler, poison):
    opt.zero_grad()
    scaler.scale(model(torch.randn(3, 4)).square().mean()).backward()
    if poison:
        model.bias.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()


SKIPS = [True, False, False, True, True, False, False, False, True, False, False, False]


@pytest.mark.parametrize(
    "fn", [schedule.warmup_cosine(3, 10, 0.1), schedule.warmup_linear(2, 8), schedule.exponential(0.9)]
)
def test_schedule_functions_match_lambda_lr(fn):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    ref = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(fn(torch.tensor(s))))
    want = []
    for _ in range(12):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    model, _ = _setup()
    dopt = fastamp.optim.AdamW(model.parameters(), lr=0.5)
    sched = fastamp.DeviceLR(dopt, fn)  # no scaler: every step counts
    got = []
    for _ in range(12):
        got.append(float(dopt.param_groups[0]["lr"]))
        sched.step()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)


def test_device_lr_advances_only_on_applied_steps_without_a_sync(monkeypatch):
    fn = schedule.warmup_cosine(2, 8)
    model, scaler = _setup()
    opt = fastamp.optim.AdamW(model.parameters(), lr=0.1)
    sched = fastamp.DeviceLR(opt, fn, scaler)
    lr_tensor = opt.param_groups[0]["lr"]
    assert isinstance(lr_tensor, torch.Tensor) and opt.param_groups[0]["initial_lr"] == 0.1

    def no_sync(*a, **k):
        raise AssertionError("host sync in DeviceLR.step")

    seen, applied = [], 0
    for skip in SKIPS:
        seen.append(float(lr_tensor))
        _iteration(model, opt, scaler, skip)
        with monkeypatch.context() as mp:
            for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu"):
                mp.setattr(torch.Tensor, name, no_sync)
            sched.step()
        applied += not skip
        assert opt.param_groups[0]["lr"] is lr_tensor  # updated in place: the optimizer reads it
    want = [0.1 * float(fn(torch.tensor(float(n)))) for n in [0] + _cumulative_applied(SKIPS)[:-1]]
    torch.testing.assert_close(torch.tensor(seen), torch.tensor(want), rtol=1e-6, atol=0)
    assert int(sched.applied_steps) == applied == int(opt.state[model.weight]["step"])
    assert int(scaler.skipped_steps) == sum(SKIPS)

    state = sched.state_dict()
    assert state == {"applied_steps": applied, "base_lrs": [0.1]}
    model2, _ = _setup()
    opt2 = fastamp.optim.AdamW(model2.parameters(), lr=0.1)
    again = fastamp.DeviceLR(opt2, fn)
    again.load_state_dict(state)
    assert float(opt2.param_groups[0]["lr"]) == float(lr_tensor)
    with pytest.raises(ValueError, match="base lrs"):
        again.load_state_dict({"applied_steps": 1, "base_lrs": []})


def _cumulative_applied(skips):
    out, n = [], 0
    for s in skips:
        n += not s
        out.append(n)
    return out


def test_torch_warns_when_the_first_step_is_skipped_and_skip_aware_does_not():
    # What torch really does: a plain optimizer whose first step is skipped by the scaler never
    # ran optimizer.step(), so the scheduler's first step() warns (pytorch#44511).
    model, scaler = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raw = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _iteration(model, opt, scaler, poison=True)
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        raw.step()

    model, scaler = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = fastamp.SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), scaler)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for skip in SKIPS:
            lrs.append(opt.param_groups[0]["lr"])
            _iteration(model, opt, scaler, skip)
            assert wrapped.step() is (not skip)
    applied = _cumulative_applied(SKIPS)
    assert lrs == [0.1 * 0.5 ** (n // 2) for n in [0] + applied[:-1]]
    assert wrapped.last_epoch == applied[-1] and wrapped.skipped == sum(SKIPS)
    assert wrapped.get_last_lr() == [opt.param_groups[0]["lr"]]  # forwarded
    state = wrapped.state_dict()
    clone = fastamp.SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), scaler)
    clone.load_state_dict(state)
    assert clone.last_epoch == wrapped.last_epoch and clone.skipped == wrapped.skipped


def test_bad_arguments():
    with pytest.raises(ValueError, match="warmup_steps"):
        schedule.warmup_cosine(10, 5)
    model, _ = _setup()
    with pytest.raises(TypeError, match="callable"):
        fastamp.DeviceLR(fastamp.optim.AdamW(model.parameters()), 3)
