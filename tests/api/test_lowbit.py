"""Low-bit masters: int16 remainders (bit-identical to fp32 masters), stochastic rounding, bf16 moments."""

import os
import warnings

import pytest
import torch
from helpers import save_load, set_grads, spy_optim

import fastamp
from fastamp import reference
from fastamp.optim import SGD, AdamW

BF16_BACKENDS = [b for b in fastamp.backends.BACKENDS if fastamp.backends.available(b, "optim_", "cpu")[0]]
SGD_BACKENDS = [b for b in fastamp.backends.BACKENDS if fastamp.backends.available(b, "optim_", "cpu")[0]]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _steps(backend, n, slow=8):
    # the Triton interpreter costs tens of ms a step on CPU
    return min(n, slow) if backend == "triton" and INTERPRETED else n


def _bits(x):
    return x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _master_of(opt, p):
    return reference.join_master(p.detach(), opt.state[p]["master_remainder"])


def _assert_params_match_except_ties(p_rem, p_fp32, master):
    """The remainder param equals the RNE param except at exact ties, where it is the neighbour away from zero."""
    differ = p_rem != p_fp32
    low = _bits(master) & 0xFFFF
    assert bool((low[differ] == 0x8000).all()), "params differ away from an exact tie"
    away = (((_bits(master) + 0x8000) & 0xFFFFFFFF) >> 16)[differ]
    got = p_rem[differ].view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(got, away)
    return int(differ.sum())


# ---- remainder == fp32 master ------------------------------------------------------------


@pytest.mark.parametrize("backend", BF16_BACKENDS)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_remainder_bit_identical_to_fp32_master_adamw(backend, amsgrad):
    steps = _steps(backend, 2000 if not amsgrad else 300)
    g = torch.Generator().manual_seed(0)
    shapes = [(64,), (9, 13), (3,)]
    base = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    rem = [x.clone().requires_grad_() for x in base]
    ref = [x.clone().requires_grad_() for x in base]
    kw = dict(lr=1e-3, weight_decay=0.05, amsgrad=amsgrad, backend=backend)
    o_rem, o_ref = AdamW(rem, master_weights="remainder", **kw), AdamW(ref, master_weights=True, **kw)
    ties = 0
    for _ in range(steps):
        grads = [torch.randn(s, generator=g).bfloat16() for s in shapes]
        set_grads(rem, grads)
        set_grads(ref, grads)
        o_rem.step()
        o_ref.step()
        for p, q in zip(rem, ref):
            master = _master_of(o_rem, p)
            assert torch.equal(_bits(master), _bits(o_ref.state[q]["master_param"])), "masters differ"
            ties += _assert_params_match_except_ties(p, q, master)
    for p, q in zip(rem, ref):
        st = o_rem.state[p]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", "master_remainder"} | (
            {"max_exp_avg_sq"} if amsgrad else set()
        )
        assert st["master_remainder"].dtype == torch.int16
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], o_ref.state[q][key])
    if steps == 2000:
        assert ties > 0, "2,000 random steps over ~180 elements should hit a few exact ties"


@pytest.mark.parametrize("backend", SGD_BACKENDS)
def test_remainder_bit_identical_to_fp32_master_sgd(backend):
    steps = _steps(backend, 1000)
    g = torch.Generator().manual_seed(1)
    shapes = [(50,), (7, 11)]
    base = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    rem = [x.clone().requires_grad_() for x in base]
    ref = [x.clone().requires_grad_() for x in base]
    kw = dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3, backend=backend)
    o_rem, o_ref = SGD(rem, master_weights="remainder", **kw), SGD(ref, **kw)
    for _ in range(steps):
        grads = [torch.randn(s, generator=g).bfloat16() for s in shapes]
        set_grads(rem, grads)
        set_grads(ref, grads)
        o_rem.step()
        o_ref.step()
        for p, q in zip(rem, ref):
            master = _master_of(o_rem, p)
            assert torch.equal(_bits(master), _bits(o_ref.state[q]["master_param"]))
            _assert_params_match_except_ties(p, q, master)
            assert torch.equal(o_rem.state[p]["momentum_buffer"], o_ref.state[q]["momentum_buffer"])


def _edge_masters():
    """fp32 masters at the edges of the split: exact ties (even and odd top halves, both signs),
    the values around them, signed zeros, subnormals, bf16 max and beyond (rounds to inf)."""
    words = []
    for top in (0x3F80, 0x3F81, 0x0001, 0x7F7E, 0x7F7F, 0x4049):
        for low in (0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF):
            w = (top << 16) | low
            words += [w, w | 0x80000000]
    words += [0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x7F7FFFFF, 0xFF7FFFFF]
    t = torch.tensor(words, dtype=torch.int64)
    return torch.where(t >= 2**31, t - 2**32, t).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("backend", BF16_BACKENDS)
@pytest.mark.parametrize("opt_cls", ["adamw", "sgd"])
def test_ties_subnormals_and_bf16_max(backend, opt_cls):
    masters = _edge_masters()
    tie = (_bits(masters) & 0xFFFF) == 0x8000
    n = masters.numel()

    def make(master_weights):
        p = masters.bfloat16().requires_grad_()
        if opt_cls == "adamw":
            opt = AdamW([p], lr=0.0, weight_decay=0.0, master_weights=master_weights, backend=backend)
        else:
            opt = SGD([p], lr=0.0, momentum=0.9, master_weights=master_weights, backend=backend)
        # hand the optimizer the exact fp32 masters through the documented fp32 state-dict form
        p.grad = torch.zeros(n, dtype=torch.bfloat16)
        opt.step()
        sd = opt.state_dict(master_format="fp32")
        sd["state"][0]["master_param"] = masters.clone()
        opt.load_state_dict(sd)
        return p, opt

    p_rem, o_rem = make("remainder")
    p_ref, o_ref = make(True)
    assert "master_param" in o_rem.state[p_rem] and "master_remainder" not in o_rem.state[p_rem]
    # lr = 0: the step only splits the master
    for p in (p_rem, p_ref):
        p.grad = torch.zeros(n, dtype=torch.bfloat16)
    o_rem.step()
    o_ref.step()
    assert torch.equal(_bits(_master_of(o_rem, p_rem)), _bits(o_ref.state[p_ref]["master_param"]))
    assert torch.equal(_bits(o_ref.state[p_ref]["master_param"]), _bits(masters)), "lr=0 moved the master"
    assert _assert_params_match_except_ties(p_rem, p_ref, masters) == int(((p_rem != p_ref) & tie).sum())
    # the tie behaviour is the documented one: away from zero, where RNE would have gone to even
    hi = _bits(masters) >> 16
    odd_top_tie = tie & ((hi & 1) == 1)
    even_top_tie = tie & ((hi & 1) == 0)
    assert torch.equal(p_rem[odd_top_tie], p_ref[odd_top_tie]), "odd top half: both round away (RNE goes to even)"
    assert bool((p_rem[even_top_tie] != p_ref[even_top_tie]).all()), "even top half: RNE stays, remainder goes away"
    beyond = (_bits(masters) & 0x7FFFFFFF) >= 0x7F7F8000  # at or past bf16 max + half an ulp
    assert int(beyond.sum()) >= 4 and torch.isinf(p_rem[beyond]).all() and torch.isinf(p_ref[beyond]).all()
    assert not torch.isinf(p_rem[~beyond]).any()
    # then real steps from the edges: masters stay bit-identical
    for lr in (1e-30, 1e-3):
        for group in o_rem.param_groups + o_ref.param_groups:
            group["lr"] = lr
        g = torch.Generator().manual_seed(2)
        for _ in range(5):
            grad = torch.randn(n, generator=g).bfloat16()
            p_rem.grad, p_ref.grad = grad.clone(), grad.clone()
            o_rem.step()
            o_ref.step()
            master = _master_of(o_rem, p_rem)
            ref_master = o_ref.state[p_ref]["master_param"]
            assert torch.equal(_bits(master), _bits(ref_master))
            fin = torch.isfinite(ref_master)
            _assert_params_match_except_ties(p_rem[fin], p_ref[fin], master[fin])


# ---- foreign writes ----------------------------------------------------------------------


def _pair(lr=1e-3):
    g = torch.Generator().manual_seed(4)
    base = torch.randn(40, generator=g).bfloat16()
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    return a, b, AdamW([a], lr=lr, master_weights="remainder"), AdamW([b], lr=lr, master_weights=True), g


def _step_both(a, b, oa, ob, g, n=3):
    for _ in range(n):
        grad = torch.randn(40, generator=g).bfloat16()
        a.grad, b.grad = grad.clone(), grad.clone()
        oa.step()
        ob.step()


def test_param_copy_is_detected_and_master_resynced():
    a, b, oa, ob, g = _pair()
    _step_both(a, b, oa, ob, g)
    new = torch.randn(40, generator=g).bfloat16()
    with torch.no_grad():
        a.copy_(new)
        b.copy_(new)
    ob.reset_master_weights()
    a.grad = b.grad = None
    with pytest.warns(UserWarning, match="written outside the optimizer"):
        _step_both(a, b, oa, ob, g, n=1)
    assert torch.equal(_bits(_master_of(oa, a)), _bits(ob.state[b]["master_param"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step_both(a, b, oa, ob, g)  # no warning once re-synced


def test_model_load_state_dict_is_detected():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).bfloat16()
    other = torch.nn.Linear(6, 3).bfloat16()
    opt = AdamW(model.parameters(), lr=1e-2, master_weights="remainder")
    for _ in range(3):
        model(torch.randn(2, 6).bfloat16()).sum().backward()
        opt.step()
    model.load_state_dict(other.state_dict())
    with pytest.warns(UserWarning, match="re-synced"):
        opt.step()
    # the master restarted from the loaded weights (not the old remainder glued to them)
    for p in model.parameters():
        assert opt.state[p]["step"].item() == 4


def test_data_copy_needs_reset_master_weights():
    a, b, oa, ob, g = _pair()
    _step_both(a, b, oa, ob, g)
    new = torch.randn(40, generator=g).bfloat16()
    a.data.copy_(new)  # bypasses the version counter: documented, not detectable
    b.data.copy_(new)
    oa.reset_master_weights()
    ob.reset_master_weights()
    assert torch.equal(_master_of(oa, a), new.float())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step_both(a, b, oa, ob, g)
    assert torch.equal(_bits(_master_of(oa, a)), _bits(ob.state[b]["master_param"]))


# ---- state_dict --------------------------------------------------------------------------


def test_state_dict_native_and_fp32_forms_resume_exactly():
    a, b, oa, ob, g = _pair()
    _step_both(a, b, oa, ob, g, n=5)
    param_at_ckpt = a.detach().clone()
    native = save_load(oa.state_dict())
    fp32 = save_load(oa.state_dict(master_format="fp32"))
    assert native["state"][0]["master_remainder"].dtype == torch.int16
    assert "master_remainder" not in fp32["state"][0]
    assert torch.equal(fp32["state"][0]["master_param"], _master_of(oa, a))
    with pytest.raises(ValueError, match="master_format"):
        oa.state_dict(master_format="bf16")
    g_state = g.get_state()
    _step_both(a, b, oa, ob, g, n=5)
    final = _master_of(oa, a)
    # resume each form, into a remainder or an fp32-master optimizer, from the checkpoint's param
    for form, mw in ((native, "remainder"), (fp32, "remainder"), (fp32, True), (native, True)):
        g.set_state(g_state)
        p = param_at_ckpt.clone().requires_grad_()
        opt = AdamW([p], lr=1e-3, master_weights=mw)
        # as in torch, the saved group settings win on load: switch the mode in the dict
        opt.load_state_dict({**form, "param_groups": [{**grp, "master_weights": mw} for grp in form["param_groups"]]})
        for _ in range(5):
            p.grad = torch.randn(40, generator=g).bfloat16()
            opt.step()
        master = _master_of(opt, p) if mw == "remainder" else opt.state[p]["master_param"]
        assert torch.equal(_bits(master), _bits(final)), (mw, "native" if form is native else "fp32")
        sd = opt.state_dict()
        assert ("master_remainder" in sd["state"][0]) == (mw == "remainder")


def test_bad_remainder_state_rejected():
    a, b, oa, ob, g = _pair()
    _step_both(a, b, oa, ob, g, n=1)
    sd = oa.state_dict()
    sd["state"][0]["master_remainder"] = sd["state"][0]["master_remainder"].float()
    with pytest.raises(ValueError, match="master_remainder"):
        oa.load_state_dict(sd)
    sd["state"][0]["master_remainder"] = torch.zeros(3, dtype=torch.int16)
    with pytest.raises(ValueError, match="shape"):
        oa.load_state_dict(sd)


# ---- stochastic rounding -----------------------------------------------------------------

ULP1 = 2.0**-7  # bf16 spacing in [1, 2)


@pytest.mark.parametrize("backend", BF16_BACKENDS)
@pytest.mark.parametrize("opt_cls", ["adamw", "sgd"])
def test_stochastic_rounding_is_unbiased(backend, opt_cls):
    n = 200_000 if not (backend == "triton" and INTERPRETED) else 20_000
    frac = 0.3
    p = torch.ones(n, dtype=torch.bfloat16, requires_grad=True)
    if opt_cls == "adamw":
        # first Adam step: m/sqrt(v) = sign(g) exactly, so the update is lr
        opt = AdamW([p], lr=frac * ULP1, weight_decay=0.0, eps=0.0, stochastic_rounding=True, backend=backend)
        p.grad = torch.full((n,), -1.0, dtype=torch.bfloat16)
    else:
        opt = SGD([p], lr=1.0, stochastic_rounding=True, backend=backend)
        p.grad = torch.full((n,), -frac * ULP1, dtype=torch.bfloat16)
    opt.step()
    assert "master_param" not in opt.state[p] and "master_remainder" not in opt.state[p]
    vals = p.detach().double()
    assert set(vals.unique().tolist()) <= {1.0, 1.0 + ULP1}
    up = float((vals > 1).double().mean())
    # binomial: 6 sigma of the fraction rounded up
    sigma = (frac * (1 - frac) / n) ** 0.5
    assert abs(up - frac) < 6 * sigma, (up, frac)
    assert abs(float(vals.mean()) - (1 + frac * ULP1)) < 6 * sigma * ULP1
    # round-to-nearest would not have moved at all
    q = torch.ones(n, dtype=torch.bfloat16, requires_grad=True)
    rne = SGD([q], lr=1.0, master_weights=False, backend=backend)
    q.grad = torch.full((n,), -frac * ULP1, dtype=torch.bfloat16)
    rne.step()
    assert bool((q == 1).all())


def _sr_run(seed, steps=5, skip_at=None, opt_cls=AdamW, **kw):
    g = torch.Generator().manual_seed(7)
    params = [torch.randn(s, generator=g).bfloat16().requires_grad_() for s in ((300,), (17, 3))]
    params.insert(1, torch.randn(5, generator=g).requires_grad_())  # an fp32 param in between
    opt = opt_cls(params, lr=1e-3, stochastic_rounding=True, seed=seed, **kw)
    for i in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        if i == skip_at:
            opt.found_inf = torch.ones(())
            opt.grad_scale = torch.ones(())
        opt.step()
        for attr in ("found_inf", "grad_scale"):
            if hasattr(opt, attr):
                delattr(opt, attr)
    return params, opt


@pytest.mark.parametrize("opt_cls", [AdamW, SGD])
def test_stochastic_rounding_reproducible_and_seeded(opt_cls):
    a, oa = _sr_run(0, opt_cls=opt_cls)
    b, ob = _sr_run(0, opt_cls=opt_cls)  # another data-parallel rank: same seed, same order
    c, _ = _sr_run(1, opt_cls=opt_cls)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert any(not torch.equal(x, z) for x, z in zip(a, c) if x.dtype == torch.bfloat16)
    for p in (a[0], a[2]):
        assert oa.state[p]["rng"].dtype == torch.int64
        assert oa.state[p]["rng"].tolist() == [0, 5]
    assert "rng" not in oa.state.get(a[1], {})


@pytest.mark.parametrize("opt_cls", [AdamW, SGD])
def test_stochastic_rounding_skipped_step_changes_nothing(opt_cls):
    params, opt = _sr_run(3, steps=3, opt_cls=opt_cls, **({"momentum": 0.9} if opt_cls is SGD else {}))
    before = [p.detach().clone() for p in params] + [t.clone() for p in params for t in opt.state[p].values()]
    for p in params:
        p.grad = torch.randn(p.shape).to(p.dtype)
    opt.found_inf = torch.ones(())
    opt.grad_scale = torch.ones(())
    opt.step()
    after = [p.detach().clone() for p in params] + [t.clone() for p in params for t in opt.state[p].values()]
    for x, y in zip(before, after):
        assert torch.equal(x, y)
    assert opt.state[params[0]]["rng"].tolist() == [3, 3]
    # a run with one skipped step draws the same bits afterwards as one without it, counter-wise
    sp, skipped = _sr_run(3, steps=4, skip_at=1, opt_cls=opt_cls)
    assert skipped.state[sp[0]]["rng"].tolist() == [3, 3]


def test_sr_ids_are_bf16_indices_and_fp32_params_do_not_split_launches(monkeypatch):
    calls = []

    def spy(params, grads, masters, states, scalars, found_inf, rng=None, rng_base=0, **kw):
        if params[0].dtype == torch.bfloat16:  # the launches of the bf16 params (fp32 ones draw no bits)
            calls.append((len(params), rng_base))

    spy_optim(monkeypatch, spy)
    _sr_run(0, steps=1)
    assert calls == [(2, 0)]
    calls.clear()
    # a bf16 param without grad splits the ids: two launches, each numbered from its own id
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(4, generator=g).bfloat16().requires_grad_() for _ in range(4)]
    opt = AdamW(ps, stochastic_rounding=True)
    for i, p in enumerate(ps):
        p.grad = None if i == 1 else torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    assert sorted(calls) == [(1, 0), (2, 2)]


def test_rng_counter_is_one_per_group_and_device_and_advances_once_per_applied_step(monkeypatch):
    """The rule of fastamp.optim.engine.rng: every launch of a step reads its group's counter as the step began.

    A param whose state is created late joins the counter; a param without a grad draws, when it steps again,
    from the group's count (where a per-param counter would lag); a skipped step and a group without grads do not
    advance it; the state dict holds a copy per param; a loaded dict of per-param counters is made one (the first's
    seed, the largest count); a new group and a state cleared start at 0 with their seed.
    """
    seen = []

    def spy(params, grads, masters, states, scalars, found_inf, rng=None, rng_base=0, **kw):
        if params[0].dtype == torch.bfloat16:  # the launches of the bf16 params (fp32 ones draw no bits)
            seen.append((rng_base, len(params), rng.tolist()))

    spy_optim(monkeypatch, spy)
    g = torch.Generator().manual_seed(3)
    a, c, d, e = (torch.randn(n, generator=g).bfloat16().requires_grad_() for n in (300, 51, 40, 9))
    b = torch.randn(5, generator=g).requires_grad_()  # fp32: no rng
    opt = AdamW([{"params": [a, b, c]}, {"params": [d], "seed": 11}], lr=1e-3, stochastic_rounding=True)

    def step(*with_grad, skip=False):
        for p in (a, b, c, d, e):
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype) if any(p is q for q in with_grad) else None
        if skip:
            opt.found_inf, opt.grad_scale = torch.ones(()), torch.ones(())
        seen.clear()
        opt.step()
        opt.__dict__.pop("found_inf", None)
        opt.__dict__.pop("grad_scale", None)
        return sorted(seen)

    assert step(a, b) == [(0, 1, [0, 0])]
    assert step(a, b, c, d) == [(0, 2, [0, 1]), (2, 1, [11, 0])]  # c's state is created now: it joins at 1
    counter = opt.state[a]["rng"]
    assert opt.state[c]["rng"] is counter and opt.state[d]["rng"] is not counter and "rng" not in opt.state[b]
    assert step(a, c, skip=True) == [(0, 2, [0, 2])] and counter.tolist() == [0, 2]  # skipped: no advance
    assert step(c) == [(1, 1, [0, 2])]  # c alone: the group's count (its own would have been 1)
    assert counter.tolist() == [0, 3] and opt.state[d]["rng"].tolist() == [11, 1]  # d's group had no grad
    sd = opt.state_dict()
    assert [sd["state"][i]["rng"].tolist() for i in (0, 2, 3)] == [[0, 3], [0, 3], [11, 1]]
    assert all(sd["state"][i]["rng"] is not counter for i in (0, 2))  # a copy per param, as one loads anywhere
    sd["state"][0]["rng"] = torch.tensor([4, 3])  # a dict of per-param counters (an older fastamp)
    sd["state"][2]["rng"] = torch.tensor([0, 7])
    opt.load_state_dict(save_load(sd))
    counter = opt.state[a]["rng"]
    assert opt.state[c]["rng"] is counter and counter.tolist() == [4, 7]
    assert step(a, c) == [(0, 2, [4, 7])]
    opt.add_param_group({"params": [e], "seed": 5})
    assert step(a, e) == [(0, 1, [4, 8]), (3, 1, [5, 0])]  # a new group: its own counter, from 0
    opt.state[c] = {}  # a layer reset: it joins the group's counter again
    assert step(c) == [(1, 1, [4, 9])] and opt.state[c]["rng"] is counter
    opt.state.clear()
    assert step(a, c) == [(0, 2, [0, 0])]  # no state left: a new counter, with the group's seed (the loaded 0)


def test_rng_counter_of_dtensor_params_is_a_plain_tensor_and_gives_the_bits_of_plain_params(tmp_path):
    """FSDP2 params (DTensor, one rank here): the group's counter is one plain tensor on the device, as for plain params."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(0)
        base = [torch.randn(s, generator=g).bfloat16() for s in ((8, 4), (6,), (5, 3))]
        plain = [torch.nn.Parameter(t.clone()) for t in base]
        sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in base]
        kw = dict(lr=1e-2, master_weights=False, stochastic_rounding=True, seed=3)
        o1, o2 = AdamW(plain, **kw), AdamW(sharded, **kw)
        for step in range(4):
            grads = [torch.randn(t.shape, generator=g).bfloat16() for t in base]
            grads[0] = None if step % 2 else grads[0]  # the first param misses every other step
            for p, q, grad in zip(plain, sharded, grads):
                p.grad = None if grad is None else grad.clone()
                q.grad = None if grad is None else distribute_tensor(grad.clone(), mesh, [Shard(0)])
            o1.step()
            o2.step()
        for p, q in zip(plain, sharded):
            assert torch.equal(p.detach(), q.detach().full_tensor())
        counter = o2.state[sharded[1]]["rng"]
        assert type(counter) is torch.Tensor and counter.tolist() == [3, 4]
        assert all(o2.state[q]["rng"] is counter for q in sharded)
        o2.load_state_dict(o2.state_dict())
        assert o2.state[sharded[0]]["rng"] is o2.state[sharded[2]]["rng"]
    finally:
        dist.destroy_process_group()


def _loss_fn(w, x, y):
    return ((x @ w.float() - y) ** 2).mean()


@pytest.mark.parametrize("opt_cls", [AdamW, SGD])
def test_stochastic_rounding_trains_where_rne_stalls(opt_cls):
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    # |w| in [4, 8): bf16 spacing 2^-5, far above lr-sized steps
    w_true = torch.sign(torch.randn(32, 1)) * (4.5 + 3 * torch.rand(32, 1))
    y = x @ w_true
    w0 = w_true + 0.05 * torch.randn(32, 1)
    kw = dict(lr=1e-4) if opt_cls is AdamW else dict(lr=1e-4, momentum=0.9)
    results = {}
    for name, extra in (("sr", dict(stochastic_rounding=True)), ("rne", dict(master_weights=False)), ("fp32", {})):
        w = w0.clone() if name == "fp32" else w0.bfloat16()
        w.requires_grad_()
        opt = opt_cls([w], **kw, **extra)
        start = _loss_fn(w.detach(), x, y).item()
        for _ in range(200):
            opt.zero_grad()
            _loss_fn(w, x, y).backward()
            opt.step()
        results[name] = (start, _loss_fn(w.detach(), x, y).item(), w.detach().float().clone())
    assert torch.equal(results["rne"][2], w0.bfloat16().float()), "RNE was expected to stall at lr=1e-4"
    start, end, w_sr = results["sr"]
    _, end32, w32 = results["fp32"]
    assert end < 0.9 * start
    # the SR trajectory follows the fp32 one within the rounding noise (a few bf16 ulps at |w|~4)
    assert (w_sr - w32).abs().max().item() < 4 * 2.0**-5


# ---- bf16 moments ------------------------------------------------------------------------


@pytest.mark.parametrize("master_weights, sr", [("remainder", True), ("remainder", False), (None, True)])
def test_bf16_moments_train(master_weights, sr):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    ref_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    ref_model.load_state_dict(model.state_dict())
    model = model.bfloat16()
    opt = AdamW(
        model.parameters(), lr=3e-3, master_weights=master_weights, stochastic_rounding=sr, state_dtype=torch.bfloat16
    )
    ref = AdamW(ref_model.parameters(), lr=3e-3)
    x = torch.randn(128, 16)
    y = torch.sin(x.sum(1, keepdim=True))
    losses, ref_losses = [], []
    for _ in range(100):
        for m, o, ls in ((model, opt, losses), (ref_model, ref, ref_losses)):
            o.zero_grad()
            loss = ((m(x.to(next(m.parameters()).dtype)).float() - y) ** 2).mean()
            loss.backward()
            o.step()
            ls.append(loss.item())
    for p in model.parameters():
        st = opt.state[p]
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.bfloat16
        assert ("master_remainder" in st) == (master_weights == "remainder")
    assert losses[-1] < 0.5 * losses[0]
    assert losses[-1] < 1.5 * ref_losses[-1] + 0.02  # the documented accuracy trade-off: close to fp32 moments
    sd = save_load(opt.state_dict())
    assert sd["param_groups"][0]["state_dtype"] == torch.bfloat16


def test_bf16_state_dtype_validation():
    p = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="state_dtype"):
        AdamW([p], state_dtype=torch.bfloat16)  # bf16 params would keep fp32 masters
    with pytest.raises(ValueError, match="state_dtype"):
        AdamW([p], master_weights=True, state_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="state_dtype"):
        AdamW([p], master_weights=False, state_dtype=torch.float16)
    with pytest.raises(ValueError, match="no effect"):
        SGD([p], master_weights=True, stochastic_rounding=True)
    with pytest.raises(TypeError, match="seed"):
        AdamW([p], stochastic_rounding=True, seed=1.5)
    with pytest.raises(TypeError, match="'remainder'"):
        SGD([p], master_weights="fp32")


# ---- memory ------------------------------------------------------------------------------


def _state_bytes_per_param(opt, params):
    n = sum(p.numel() for p in params)
    total = 0
    for p in params:
        for t in opt.state[p].values():
            if isinstance(t, torch.Tensor) and t.numel() == p.numel():
                total += t.numel() * t.element_size()
    return total / n


@pytest.mark.parametrize(
    "kw, expected",
    [
        (dict(master_weights=True), 12),
        (dict(master_weights="remainder"), 10),
        (dict(master_weights="remainder", state_dtype=torch.bfloat16), 6),
        (dict(stochastic_rounding=True), 8),
        (dict(stochastic_rounding=True, state_dtype=torch.bfloat16), 4),
        (dict(master_weights=False), 8),
    ],
)
def test_adamw_state_bytes_per_param(kw, expected):
    params = [torch.randn(64, 64).bfloat16().requires_grad_() for _ in range(3)]
    opt = AdamW(params, **kw)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert _state_bytes_per_param(opt, params) == expected
