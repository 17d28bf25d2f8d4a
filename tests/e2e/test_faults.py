"""Fault storms: injected inf/nan in grads, step after step; nothing may change on a skipped step.

Optimizers: ``fastamp.optim.AdamW`` over bf16 params with fp32 masters (amp-aware path: the
skip happens on the device, grads are never written) and ``torch.optim.SGD`` with momentum
(ordinary path: fastamp.Scaler unscales the grads in place, as torch does, and does not call
``step()``). After a skipped step every param, master, moment, step count and momentum
buffer is compared bit for bit (NaN payloads included) with a snapshot taken before it.
"""

import math
import warnings

import pytest
import torch
from helpers import bits

import fastamp

INF, NAN = float("inf"), float("nan")


def snapshot(opts, params, with_grads: bool):
    snap = {"params": [bits(p) for p in params]}
    if with_grads:
        snap["grads"] = [bits(p.grad) for p in params if p.grad is not None]
    for k, opt in enumerate(opts):
        for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
            for key, v in sorted(opt.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    snap[f"opt{k}/{i}/{key}"] = bits(v)
    return snap


def assert_same(a, b, what=""):
    """``b`` equals ``a`` bit for bit; state first created by a skipped step must be fresh.

    A skipped first step creates the optimizer state, as torch's fused optimizers do:
    ``step`` 0, zero moments and a master equal to the param; anything else is a change.
    """
    for k in b.keys() - a.keys():
        if k.endswith("/step") or k.endswith("/exp_avg") or k.endswith("/exp_avg_sq"):
            assert not b[k].any(), f"{what}: new state {k} is not zero"
        elif k.endswith("/master_param"):
            i = int(k.split("/")[1])
            param = torch.tensor([], dtype=torch.int16) if "params" not in a else a["params"][i]
            assert torch.equal(b[k].view(torch.float32).bfloat16().view(torch.int16), param), f"{what}: {k}"
        else:
            raise AssertionError(f"{what}: unexpected new state {k}")
        a = dict(a, **{k: b[k]})
    assert a.keys() == b.keys(), what
    for k in a:
        if isinstance(a[k], list):
            assert len(a[k]) == len(b[k])
            for i, (x, y) in enumerate(zip(a[k], b[k])):
                assert torch.equal(x, y), f"{what}: {k}[{i}] changed"
        else:
            assert torch.equal(a[k], b[k]), f"{what}: {k} changed"


def _mk_params(sizes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]


def _set_grads(params, scale, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2 * scale).to(p.dtype)


@pytest.fixture(autouse=True)
def _quiet_health_warnings():
    # The scale-collapse / pitfall warnings (issue #8) are not what these tests check.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ----------------------------------------------------------------------------- one element of thousands


def _many_sizes():
    g = torch.Generator().manual_seed(5)
    sizes = torch.randint(1, 40, (2000,), generator=g).tolist()
    sizes[777] = 70_001  # crosses the kernels' chunk boundaries
    return sizes


@pytest.mark.parametrize(
    "tensor_idx, where, value",
    [(0, 0, INF), (1999, -1, NAN), (777, 65_536, -INF), (777, 70_000, NAN), (1234, -1, INF), (777, 4095, INF)],
)
def test_one_bad_element_among_thousands_of_tensors(tensor_idx, where, value):
    sizes = _many_sizes()
    bf = _mk_params(sizes[:1000], torch.bfloat16, 0)
    fp = _mk_params(sizes[1000:], torch.float32, 1)
    adam = fastamp.optim.AdamW(bf, lr=1e-3)
    sgd = torch.optim.SGD(fp, lr=1e-2, momentum=0.9)
    scaler = fastamp.Scaler(init_scale=2.0**12)
    allp = bf + fp

    # one clean step first, so that masters, moments and momentum buffers exist
    scaler.scale(torch.ones(()))
    _set_grads(allp, 2.0**12, 11)
    scaler.step(adam)
    scaler.step(sgd)
    scaler.update()
    assert not scaler.last_step_skipped

    scaler.scale(torch.ones(()))
    _set_grads(allp, 2.0**12, 12)
    victim = allp[tensor_idx]
    victim.grad.view(-1)[where] = value
    before = snapshot([adam, sgd], allp, with_grads=False)
    bf_grads = [bits(p.grad) for p in bf]
    scaler.step(adam)
    scaler.step(sgd)
    scaler.update()
    after = snapshot([adam, sgd], allp, with_grads=False)

    owner_skipped = adam if tensor_idx < 1000 else sgd
    other = sgd if owner_skipped is adam else adam
    other_params = fp if other is sgd else bf
    # only the optimizer that saw the bad element skipped (torch's per-optimizer semantics)
    for k in before:
        touched = k.startswith("opt0/" if owner_skipped is adam else "opt1/")
        if touched:
            assert torch.equal(before[k], after[k]), k
    owner_params = bf if owner_skipped is adam else fp
    for p_before, p in zip(
        before["params"][: len(bf)] if owner_skipped is adam else before["params"][len(bf) :], owner_params
    ):
        assert torch.equal(p_before, bits(p))
    changed = [
        not torch.equal(b, bits(p))
        for b, p in zip(before["params"][len(bf) :] if other is sgd else before["params"][: len(bf)], other_params)
    ]
    assert sum(changed) > len(other_params) // 2
    # the amp-aware path never writes grads
    assert all(torch.equal(a, bits(p.grad)) for a, p in zip(bf_grads, bf))
    assert scaler.get_scale() == 2.0**11
    assert scaler.last_step_skipped


# ----------------------------------------------------------------------------- storms


def _run_storm(scaler, steps, overflow_at, grad_scale_fn=None, sizes=(257, 64, 1, 4099)):
    bf = _mk_params(sizes, torch.bfloat16, 2)
    fp = _mk_params(sizes, torch.float32, 3)
    adam = fastamp.optim.AdamW(bf, lr=1e-3)
    sgd = torch.optim.SGD(fp, lr=1e-2, momentum=0.9)
    scales, skipped_record = [], []
    for step in range(steps):
        scaler.scale(torch.ones(()))
        _set_grads(bf + fp, scaler.get_scale(), 100 + step)
        bad = overflow_at(step)
        if bad:
            bf[step % len(bf)].grad.view(-1)[step % 7 % bf[step % len(bf)].numel()] = NAN if step % 3 else INF
            fp[step % len(fp)].grad.view(-1)[0] = -INF
        before = snapshot([adam, sgd], bf + fp, with_grads=False)
        scaler.step(adam)
        scaler.step(sgd)
        scaler.update()
        if bad:
            assert_same(before, snapshot([adam, sgd], bf + fp, with_grads=False), f"step {step}")
        else:
            assert not torch.equal(before["params"][0], bits(bf[0])), f"clean step {step} did not move"
        s = scaler.get_scale()
        assert math.isfinite(s) and s >= 0
        scales.append(s)
        skipped_record.append(scaler.last_step_skipped)
        for p in bf + fp:
            assert torch.isfinite(p).all()
    return scales, skipped_record, (adam, sgd, bf, fp)


def test_overflow_every_step_for_200_steps_with_min_scale():
    scaler = fastamp.Scaler(init_scale=2.0**16, growth_interval=3, min_scale=1.0)
    scales, skipped, _ = _run_storm(scaler, 200, lambda s: True)
    assert all(skipped)
    assert int(scaler.skipped_steps) == 200
    # halves 16 times, then stays at the floor
    assert scales[:16] == [2.0 ** (15 - i) for i in range(16)]
    assert all(s == 1.0 for s in scales[15:])


def test_overflow_every_step_for_200_steps_without_bounds_never_nan():
    # torch's scale reaches exactly 0 after 166 backoffs from 2^16, and then 0 * inf = NaN
    # slips through its check and into the params. fastamp also flags overflow created by
    # unscaling (1/0 = inf), so the steps stay skipped and the params intact.
    scaler = fastamp.Scaler(init_scale=2.0**16, growth_interval=3)
    scales, skipped, _ = _run_storm(scaler, 200, lambda s: True)
    assert all(skipped)
    assert scales[-1] == 0.0
    assert scales.index(0.0) == 165
    assert all(a >= b for a, b in zip(scales, scales[1:]))


def test_recovery_after_a_storm():
    scaler = fastamp.Scaler(init_scale=2.0**16, growth_interval=2, min_scale=2.0**-4)
    scales, skipped, (adam, sgd, bf, fp) = _run_storm(scaler, 60, lambda s: s < 40)
    assert all(skipped[:40]) and not any(skipped[40:])
    assert scales[39] == 2.0**-4
    assert scales[-1] == 2.0**6  # 20 clean steps, growth every 2nd: 2^-4 * 2^10
    assert all(float(adam.state[p]["step"]) == 20 for p in bf)


def test_alternating_overflow_matches_torch_scale_trajectory():
    scaler = fastamp.Scaler(init_scale=2.0**10, growth_interval=2)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scales, skipped, (adam, *_rest) = _run_storm(scaler, 40, lambda s: s % 2 == 0)
    assert skipped == [s % 2 == 0 for s in range(40)]
    ref_scales = []
    for step in range(40):
        p = torch.nn.Parameter(torch.ones(3))
        o = torch.optim.SGD([p], lr=0.1)
        ref.scale(torch.ones(()))
        p.grad = torch.full((3,), INF if step % 2 == 0 else 1.0)
        ref.step(o)
        ref.update()
        ref_scales.append(ref.get_scale())
    assert scales == ref_scales
    assert float(adam.state[adam.param_groups[0]["params"][0]]["step"]) == 20


@pytest.mark.parametrize("bad", ["adamw", "sgd"])
def test_overflow_in_one_of_two_optimizers_sharing_a_scaler(bad):
    bf = _mk_params((33, 1000), torch.bfloat16, 4)
    fp = _mk_params((33, 1000), torch.float32, 5)
    adam = fastamp.optim.AdamW(bf, lr=1e-3)
    sgd = torch.optim.SGD(fp, lr=1e-2, momentum=0.9)
    scaler = fastamp.Scaler(init_scale=2.0**8)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    rp = [torch.nn.Parameter(p.detach().float().clone()) for p in bf]
    rq = [torch.nn.Parameter(p.detach().clone()) for p in fp]
    ro1, ro2 = torch.optim.SGD(rp, lr=1e-2), torch.optim.SGD(rq, lr=1e-2)
    for step in range(6):
        scaler.scale(torch.ones(()))
        ref.scale(torch.ones(()))
        _set_grads(bf + fp, scaler.get_scale(), 200 + step)
        for a, b in zip(rp + rq, bf + fp):
            a.grad = b.grad.detach().float().clone()
        inject = step in (2, 3)
        if inject:
            victims = (bf, rp) if bad == "adamw" else (fp, rq)
            for v in victims:
                v[1].grad[500] = INF
        snap_a = snapshot([adam], bf, with_grads=True)
        snap_s = snapshot([sgd], fp, with_grads=False)
        scaler.step(adam)
        scaler.step(sgd)
        scaler.update()
        ref.step(ro1)
        ref.step(ro2)
        ref.update()
        same_a = snapshot([adam], bf, with_grads=True)
        same_s = snapshot([sgd], fp, with_grads=False)
        if inject and bad == "adamw":
            assert_same(snap_a, same_a, f"adamw step {step}")
            assert not torch.equal(snap_s["params"][1], same_s["params"][1])
        elif inject:
            assert_same(snap_s, same_s, f"sgd step {step}")
            assert not torch.equal(snap_a["params"][1], same_a["params"][1])
        else:
            assert not torch.equal(snap_a["params"][1], same_a["params"][1])
            assert not torch.equal(snap_s["params"][1], same_s["params"][1])
        # one shared scale, halved once per overflowing iteration, exactly as torch's
        assert scaler.get_scale() == ref.get_scale()
        assert scaler.last_step_skipped == inject
    assert scaler.get_scale() == 2.0**6
    assert int(scaler.skipped_steps) == 2


def test_found_inf_from_unscale_and_clip_keeps_everything(tmp_path):
    """A storm through the explicit unscale_ + clip_grad_norm_ path (grads rewritten, step skipped)."""
    bf = _mk_params((100, 3), torch.bfloat16, 6)
    adam = fastamp.optim.AdamW(bf, lr=1e-3)
    scaler = fastamp.Scaler(init_scale=2.0**4, min_scale=1.0)
    for step in range(30):
        scaler.scale(torch.ones(()))
        _set_grads(bf, scaler.get_scale(), 300 + step)
        bad = step % 3 != 2
        if bad:
            bf[0].grad[step] = NAN
        before = snapshot([adam], bf, with_grads=False)
        if step % 2:
            scaler.unscale_(adam)
        norm = scaler.clip_grad_norm_(adam, 1.0)
        scaler.step(adam)
        scaler.update()
        assert bool(norm.isnan()) == bad
        if bad:
            assert_same(before, snapshot([adam], bf, with_grads=False), f"step {step}")
        assert scaler.get_scale() >= 1.0
    assert int(scaler.skipped_steps) == 20
