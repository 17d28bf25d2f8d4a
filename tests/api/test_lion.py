"""fastamp.optim.Lion: the rule against fp64, exact masters, amp skip, validation, state_dict, compile.

Kernel-level agreement of every backend with ``fastamp.reference.lion_`` is the test matrix's
(``tests/backends/_matrix.py``, the "lion" row); here the optimizer as a user meets it.
"""

import math

import pytest
import tolerances
import torch
from helpers import assert_bits_equal, save_load, set_grads

import fastamp
from fastamp.optim import Lion

BACKENDS = [b for b in fastamp.backends.BACKENDS if fastamp.backends.available(b, "optim_", "cpu")[0]]
SHAPES = [(37, 5), (300,), (1,)]


def _leaves(tensors, dtype=None):
    return [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in tensors]


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _rule_fp64(p, m, g, lr, beta1, beta2, wd, maximize=False):
    """One Lion step in fp64 from fp32 state; the hyperparameters as the kernels hold them (fp32)."""
    p, m, g = p.double(), m.double(), g.double()
    if maximize:
        g = -g
    b1, omb1, b2, omb2 = (_f32(x) for x in (beta1, 1 - beta1, beta2, 1 - beta2))
    c = b1 * m + omb1 * g
    decay = _f32(1 - lr * wd)
    new_p = p * decay - _f32(lr) * torch.sign(c)
    new_m = b2 * m + omb2 * g
    # what each result adds up: its rounding budget
    return (
        new_p,
        new_m,
        c,
        (b1 * m).abs() + (omb1 * g).abs(),
        (p * decay).abs() + _f32(lr),
        (b2 * m).abs() + (omb2 * g).abs(),
    )


_RULE_KWS = {
    "kw0": dict(),
    "kw1": dict(weight_decay=0.5, maximize=True),
    "kw2": dict(betas=(0.95, 0.98), weight_decay=1.0),
}
# Triton under the interpreter (~6 s a case) runs kw0 and kw1: the Lion rule of its one kernel (kernels/optim.py,
# RULE=2) has one runtime branch, maximize, which those two take both ways (the decay is a value in the step scalars);
# kw2 only changes the values (betas, decay factor) the same code computes with. Triton's lion_ equals the reference
# bit for bit in tests/backends (the matrix's "lion" rows, wd-maximize included).
_RULE_CASES = [
    pytest.param(kw, backend, id=f"{name}-{backend}")
    for name, kw in _RULE_KWS.items()
    for backend in BACKENDS
    if not (backend == "triton" and name == "kw2")
]


@pytest.mark.parametrize("kw, backend", _RULE_CASES)
def test_200_steps_follow_the_rule_in_fp64(backend, kw):
    """Every step, from the optimizer's own fp32 state, lies within LION_STEP_RTOL of the rule in fp64;
    the sign agrees wherever the fp64 argument is farther from 0 than the fp32 rounding can move it."""
    g = torch.Generator().manual_seed(7)
    params = _leaves([torch.randn(s, generator=g) for s in SHAPES])
    lr = 3e-3
    opt = Lion(params, lr=lr, backend=backend, **kw)
    beta1, beta2 = kw.get("betas", (0.9, 0.99))
    wd, mx = kw.get("weight_decay", 0.0), kw.get("maximize", False)
    rtol = tolerances.LION_STEP_RTOL
    flips_allowed = 0
    for step in range(200):
        # grads of every magnitude, exact zeros, and grads that cancel the momentum's term exactly
        grads = [torch.randn(s, generator=g) * 10.0 ** torch.randint(-3, 2, s, generator=g) for s in SHAPES]
        grads[0].view(-1)[:3] = 0.0
        before_p = [p.detach().clone() for p in params]
        before_m = [opt.state[p]["exp_avg"].clone() if p in opt.state else torch.zeros_like(p) for p in params]
        set_grads(params, grads)
        opt.step()
        for i, p in enumerate(params):
            exp_p, exp_m, c, c_mag, p_mag, m_mag = _rule_fp64(
                before_p[i], before_m[i], grads[i], lr, beta1, beta2, wd, mx
            )
            clear = c.abs() > rtol * c_mag
            got_p, got_m = p.detach().double(), opt.state[p]["exp_avg"].double()
            assert ((got_p - exp_p).abs() <= rtol * p_mag)[clear].all(), (step, i)
            assert ((got_m - exp_m).abs() <= rtol * m_mag).all(), (step, i)
            flips_allowed += int((~clear).sum())
    # the exemption is for ties with 0, not a loophole: few elements come that close
    assert flips_allowed <= 200 * 3 + 50, flips_allowed


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_argument_moves_nothing_but_the_decay(backend):
    """sign(0) = 0: a zero grad on a zero momentum leaves the param (no weight decay) bit-identical."""
    p = torch.tensor([1.5, -2.0, 0.0, -0.0]).requires_grad_()
    opt = Lion([p], lr=0.1, backend=backend)
    before = p.detach().clone()
    p.grad = torch.zeros(4)
    opt.step()
    assert_bits_equal(p.detach(), before)
    p.grad = torch.tensor([1.0, -1.0, 0.0, 0.0])
    opt.step()
    assert_bits_equal(p.detach(), torch.tensor([1.4, -1.9, 0.0, -0.0]) + 0 * before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masters_fp32_and_remainder_give_one_trajectory(backend):
    """bf16 params: the remainder master is the fp32 master exactly, so the params agree bit for bit;
    without a master (nearest) they drift, and the fp16 param + fp32 master follows the fp32 run."""
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    runs = {}
    for name, dtype, mw in (("fp32", torch.bfloat16, True), ("rem", torch.bfloat16, "remainder"),
                            ("none", torch.bfloat16, False)):  # fmt: skip
        ps = _leaves(init, dtype)
        opt = Lion(ps, lr=1e-3, weight_decay=0.1, master_weights=mw, backend=backend)
        gg = torch.Generator().manual_seed(4)
        for _ in range(30):
            set_grads(ps, [torch.randn(s, generator=gg) for s in SHAPES])
            opt.step()
        runs[name] = (ps, opt)
    for a, b in zip(runs["fp32"][0], runs["rem"][0]):
        assert_bits_equal(a.detach(), b.detach())
    for pa, pb in zip(*(runs[k][0] for k in ("fp32", "rem"))):
        ma = runs["fp32"][1].state[pa]["master_param"]
        mb = fastamp.reference.join_master(pb.detach(), runs["rem"][1].state[pb]["master_remainder"])
        assert_bits_equal(ma, mb)
    # lr 1e-3 is below half a bf16 ulp of values ~1: without a master most updates are lost
    assert any(not torch.equal(a, b) for a, b in zip(runs["fp32"][0], runs["none"][0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_skipped_step_changes_nothing_with_scaler(backend):
    """fp16 params, fastamp.Scaler: an inf grad skips the step on the device; every state byte stays."""
    g = torch.Generator().manual_seed(5)
    ps = _leaves([torch.randn(s, generator=g) for s in SHAPES], torch.float16)
    opt = Lion(ps, lr=1e-3, backend=backend)
    scaler = fastamp.Scaler(init_scale=2.0**4)
    for k in range(4):
        loss = sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in ps)
        if k == 2:
            loss = loss * math.inf
        before = ([p.detach().clone() for p in ps], {id(p): {n: t.clone() for n, t in opt.state[p].items()}
                                                       for p in ps if p in opt.state})  # fmt: skip
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if k == 2:
            for p, b in zip(ps, before[0]):
                assert_bits_equal(p.detach(), b)
                for n, t in opt.state[p].items():
                    assert_bits_equal(t, before[1][id(p)][n], n)
    assert scaler.get_scale() == 2.0**3


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_round_trip_and_resume(backend):
    """state_dict through torch.save / load(weights_only=True), both master formats; a resumed run continues
    bit for bit; the fp32 export loads into a remainder optimizer and back."""
    g = torch.Generator().manual_seed(6)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(8)]

    def run(ps, opt, steps):
        for gr in steps:
            set_grads(ps, gr)
            opt.step()

    a = _leaves(init, torch.bfloat16)
    opt_a = Lion(a, lr=1e-3, weight_decay=0.1, master_weights="remainder", backend=backend)
    run(a, opt_a, grads[:4])
    sd = save_load(opt_a.state_dict())
    sd32 = save_load(opt_a.state_dict(master_format="fp32"))
    assert all(set(s) == {"exp_avg", "master_remainder"} for s in sd["state"].values())
    assert all(set(s) == {"exp_avg", "master_param"} for s in sd32["state"].values())
    for saved in (sd, sd32):
        b = [p.detach().clone().requires_grad_() for p in a]
        opt_b = Lion(b, lr=1e-3, weight_decay=0.1, master_weights="remainder", backend=backend)
        opt_b.load_state_dict(saved)
        run(b, opt_b, grads[4:])
        c = [p.detach().clone().requires_grad_() for p in a]
        opt_c = Lion(c, lr=1e-3, weight_decay=0.1, master_weights="remainder", backend=backend)
        opt_c.load_state_dict(sd)
        run(c, opt_c, grads[4:])
        for x, y in zip(b, c):
            assert_bits_equal(x.detach(), y.detach())
    run(a, opt_a, grads[4:])
    for x, y in zip(a, c):
        assert_bits_equal(x.detach(), y.detach())


def test_load_refuses_a_state_without_exp_avg_and_changes_nothing():
    p = torch.randn(5).requires_grad_()
    opt = Lion([p], lr=1e-3)
    p.grad = torch.randn(5)
    opt.step()
    before = opt.state_dict()
    bad = opt.state_dict()
    bad["state"][0] = {"momentum_buffer": torch.zeros(5)}
    with pytest.raises(ValueError, match="exp_avg"):
        opt.load_state_dict(bad)
    assert_bits_equal(opt.state[p]["exp_avg"], before["state"][0]["exp_avg"])


@pytest.mark.parametrize(
    "kw, exc, msg",
    [
        (dict(lr=-1.0), ValueError, "Invalid learning rate"),
        (dict(lr=math.inf), ValueError, "Invalid learning rate"),
        (dict(betas=(1.5, 0.99)), ValueError, "Invalid beta parameter at index 0"),
        (dict(betas=(0.9, math.nan)), ValueError, "Invalid beta parameter at index 1"),
        (dict(betas=(0.9,)), ValueError, "betas must be a pair"),
        (dict(betas=(torch.tensor(0.9), 0.99)), TypeError, r"betas\[0\] must be a float"),
        (dict(weight_decay=math.nan), ValueError, "Invalid weight_decay value"),
        (dict(lr=1e30, weight_decay=1e30), ValueError, "decay factor"),
        (dict(maximize=1), TypeError, "maximize must be a bool"),
        (dict(master_weights="fp8"), TypeError, "master_weights must be"),
    ],
)
def test_bad_hyperparameters_refused(kw, exc, msg):
    p = torch.randn(3).requires_grad_()
    with pytest.raises(exc, match=msg):
        Lion([p], **kw)
    opt = Lion([p], lr=1e-3)
    p.grad = torch.randn(3)
    before = p.detach().clone()
    opt.param_groups[0].update(kw)
    with pytest.raises(exc, match=msg):
        opt.step()
    assert_bits_equal(p.detach(), before)


def test_defaults_and_exports():
    p = torch.randn(3).requires_grad_()
    opt = fastamp.Lion([p])
    g = opt.param_groups[0]
    assert (g["lr"], tuple(g["betas"]), g["weight_decay"], g["maximize"]) == (1e-4, (0.9, 0.99), 0.0, False)
    assert fastamp.optim.Lion is fastamp.Lion
