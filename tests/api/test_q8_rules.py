"""``SGD`` / ``Lion`` with ``state_format="q8"``: 8-bit moments for the one-state rules (issue 22).

Their q8 ops (``sgd_q8_``, ``lion_q8_``) are fused on the native CPU backend and, elsewhere, the
rule's dense kernel on the decoded moments with the result encoded again
(``fastamp.reference.one_state_q8``). The defining check: q8 equals the same
rule with fp32 moments replaced by ``decode(encode(.))`` after every step, with the random bits
of the stream AdamW's fused kernel uses for its first moment (``4 * tid + 1``), bit for bit, on
every backend. Then what a user does to it: skip, compile, checkpoint, resume, switch formats,
reset state, pass bad options.
"""

import inspect

import pytest
import torch
from helpers import (
    COMPILE_BACKENDS,
    assert_bits_equal,
    assert_same_state,
    cuda_syncs_raise,
    heavy_tailed_grads,
    master_of,
    save_load,
    seeded_params,
    set_grads,
    state_snapshot,
)

import fastamp
from fastamp import reference
from fastamp.optim import SGD, Lion
from fastamp.reference import q8

SHAPES = [(96, 40), (33,), (7, 5), (4097,)]


def _params(dtype=torch.bfloat16, seed=0):
    return seeded_params(SHAPES, dtype, seed)


RULES = {
    "sgd": (SGD, "optim_", "momentum_buffer", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "nesterov": (SGD, "optim_", "momentum_buffer", dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
    "lion": (Lion, "optim_", "exp_avg", dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}


def _backends(op):
    return [b for b in fastamp.backends.BACKENDS if fastamp.backends.available(b, op, "cpu")[0]]


def _run(opt, ps, steps, start=1):
    for step in range(start, start + steps):
        set_grads(ps, heavy_tailed_grads(ps, step))
        opt.step()


def _make(rule, ps, **kw):
    cls, _, _, hyper = RULES[rule]
    kw = {"master_weights": "remainder", "state_format": "q8", "lowbit_min_numel": 64, "seed": 5, **kw}
    return cls(ps, **hyper, **kw)


# Triton runs interpreted here: stochastic rounding and the remainder master only (each run costs seconds)
CASES = [
    (rule, backend, rounding, masters, None)
    for rule in RULES
    for backend in _backends(RULES[rule][1])
    for rounding in ("stochastic", "nearest")
    for masters in ("remainder", "sr")
    if backend != "triton" or (rounding == "stochastic" and masters == "remainder" and rule != "nesterov")
] + [
    # the eager step in slices of 64 elements (3840 and 4097: many slices, a partial last block)
    (rule, "torch", rounding, "remainder", 64)
    for rule in ("sgd", "lion")
    for rounding in ("stochastic", "nearest")
]


@pytest.mark.parametrize("rule,backend,rounding,masters,slice_numel", CASES)
def test_q8_equals_the_rule_with_requantised_fp32_moments(rule, backend, rounding, masters, slice_numel, monkeypatch):
    """``masters="sr"``: bf16 params without a master, rounded with stream ``4 * tid`` (the moment takes ``+1``)."""
    if slice_numel is not None:
        from fastamp.reference import optim as reference_optim

        monkeypatch.setattr(reference_optim, "Q8_SLICE", slice_numel)
    cls, _, key, hyper = RULES[rule]
    mkw = {"master_weights": "remainder"} if masters == "remainder" else {"master_weights": False,
                                                                         "stochastic_rounding": True}  # fmt: skip
    ps_q8, ps_ref = _params(), _params()
    opt = cls(ps_q8, **hyper, **mkw, state_format="q8", lowbit_min_numel=0, state_rounding=rounding, seed=11,
              backend=backend)  # fmt: skip
    ref_masters = {"master_weights": True} if masters == "remainder" else mkw
    ref = cls(ps_ref, **hyper, **ref_masters, seed=11, backend="torch")
    sr = rounding == "stochastic"
    for step in range(1, 6):
        grads = heavy_tailed_grads(ps_q8, step)
        set_grads(ps_q8, grads)
        set_grads(ps_ref, grads)
        opt.step()
        ref.step()
        for tid, (p, r) in enumerate(zip(ps_q8, ps_ref)):
            st, rs = opt.state[p], ref.state[r]
            bits = reference.sr_random16(11, torch.tensor(step - 1), 4 * tid + 1, p.numel(), "cpu") if sr else None
            codes, scales = q8.q8_encode_m(rs[key], bits)
            assert_bits_equal(st[key + "_q"], codes, f"step {step} param {tid} {key} codes")
            assert_bits_equal(st[key + "_scale"], scales, f"step {step} param {tid} {key} scales")
            rs[key].copy_(q8.q8_decode_m(codes, scales))
            assert_bits_equal(master_of(opt, p), master_of(ref, r), f"step {step} param {tid} master")
            if masters == "sr":  # a remainder param is its master's top half, not its rounding
                assert_bits_equal(p.detach(), r.detach(), f"step {step} param {tid}")
            if "step" in rs:
                assert_bits_equal(st["step"], rs["step"], "step")
            uses_rng = sr or masters == "sr"
            assert int(st["rng"][1]) == step if uses_rng else "rng" not in st


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_threshold_bytes_and_no_momentum(rule):
    ps = _params(torch.float32)
    opt = _make(rule, ps, lowbit_min_numel=100, master_weights=None)
    _run(opt, ps, 2)
    key = RULES[rule][2]
    for p in ps:
        st = opt.state[p]
        if p.numel() >= 100:
            assert key not in st and st[key + "_q"].dtype == torch.uint8 and st[key + "_q"].shape == p.shape
            assert st[key + "_scale"].numel() == -(-p.numel() // 32)
        else:
            assert st[key].dtype == torch.float32 and key + "_q" not in st
    big = ps[0]
    held = sum(t.numel() * t.element_size() for k, t in opt.state[big].items() if k.startswith(key))
    assert held / big.numel() == pytest.approx(1 + 1 / 32)
    if rule == "sgd":  # no momentum: no moment to quantise, no state at all, no random bits
        ps0 = _params(torch.float32)
        opt0 = SGD(ps0, lr=0.1, state_format="q8", lowbit_min_numel=0)
        _run(opt0, ps0, 2)
        assert all(not opt0.state[p] for p in ps0)


@pytest.mark.parametrize("rule", ["sgd", "lion"])
@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later-step"])
def test_skipped_step_changes_no_byte(rule, first):
    """fp16 params under the Scaler: an overflow skips the step on the device, every code and scale byte kept.

    The first step skipped keeps SGD's ``step == 0`` (the buffer initialises at the first applied step).
    """
    ps = _params(torch.float16)
    opt = _make(rule, ps, lowbit_min_numel=0)
    scaler = fastamp.Scaler(init_scale=2.0**10)
    if not first:
        scaler.scale(torch.ones(()))
        set_grads(ps, heavy_tailed_grads(ps, 1, scale=2.0**10))
        scaler.step(opt)
        scaler.update()
    before = state_snapshot(opt)
    params_before = [p.detach().clone() for p in ps]
    grads = heavy_tailed_grads(ps, 2, scale=2.0**10)
    grads[1].view(-1)[3] = float("inf")
    set_grads(ps, grads)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    after = state_snapshot(opt)
    if first:  # state is created at the first step, skipped or not: zero codes, step 0
        key = RULES[rule][2]
        assert all(int(after[(i, key + "_q")].count_nonzero()) == 0 for i in range(len(ps)))
        if rule == "sgd":
            assert all(float(after[(i, "step")]) == 0 for i in range(len(ps)))
    else:
        assert_same_state(before, after)
    for p, q in zip(ps, params_before):
        assert_bits_equal(p.detach(), q)


@pytest.mark.parametrize("compile_backend", COMPILE_BACKENDS)
@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_compiled_step_equals_eager(rule, compile_backend, fresh_dynamo):
    ps_e, ps_c = _params(), _params()
    eager, comp = _make(rule, ps_e), _make(rule, ps_c)
    step = torch.compile(comp.step, backend=compile_backend, fullgraph=True)
    for s in range(1, 4):
        set_grads(ps_e, heavy_tailed_grads(ps_e, s))
        set_grads(ps_c, heavy_tailed_grads(ps_c, s))
        eager.step()
        step()
    assert any(RULES[rule][2] + "_q" in comp.state[p] for p in ps_c)
    assert_same_state(state_snapshot(eager), state_snapshot(comp))
    for a, b in zip(ps_e, ps_c):
        assert_bits_equal(a.detach(), b.detach(), "param")


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_resume_native_and_fp32_exports_are_bit_exact(rule):
    key = RULES[rule][2]
    ps = _params()
    opt = _make(rule, ps)
    _run(opt, ps, 3)
    native, fp32 = save_load(opt.state_dict()), save_load(opt.state_dict(format="fp32"))
    for i, st in fp32["state"].items():
        assert key in st and key + "_q" not in st and st[key].dtype == torch.float32
        assert st[key].shape == ps[i].shape
    weights = [p.detach().clone() for p in ps]
    _run(opt, ps, 2, start=4)
    for sd in (native, fp32):  # fp32 -> native: encoding a decoded block gives its bytes back
        ps2 = [torch.nn.Parameter(t.clone()) for t in weights]
        opt2 = _make(rule, ps2)
        opt2.load_state_dict(sd)
        _run(opt2, ps2, 2, start=4)
        assert_same_state(state_snapshot(opt), state_snapshot(opt2))
        for p, q in zip(ps, ps2):
            assert_bits_equal(p.detach(), q.detach())


def _dense_twin(opt, ps, **kw):
    """A dense-moment (``state_format=None``) copy of ``opt`` and its params, on the torch backend."""
    twin_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    accepted = inspect.signature(type(opt)).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
    twin = type(opt)(twin_ps, **{**defaults, "state_format": None, "backend": "torch", **kw})
    twin.load_state_dict(save_load(opt.state_dict(format="fp32")))
    twin.param_groups[0].update({k: v for k, v in opt.param_groups[0].items() if k != "params"}, state_format=None)
    return twin, twin_ps


def _requantise(twin, twin_ps, key):
    """The twin's dense moments replaced by decode(encode(.)) to nearest: what a conversion to q8 keeps."""
    for q in twin_ps:
        twin.state[q][key].copy_(q8.q8_decode_m(*q8.q8_encode_m(twin.state[q][key])))


def _assert_codes_are_the_nearest_of(opt, ps, twin, twin_ps, key):
    for p, q in zip(ps, twin_ps):
        codes, scales = q8.q8_encode_m(twin.state[q][key])
        assert_bits_equal(opt.state[p][key + "_q"], codes, f"{key} codes")
        assert_bits_equal(opt.state[p][key + "_scale"], scales, f"{key} scales")


def test_torch_sgd_loads_the_fp32_export_and_ours_loads_torchs():
    ps = _params(torch.float32)
    opt = SGD(ps, lr=0.1, momentum=0.9, state_format="q8", lowbit_min_numel=0, state_rounding="nearest")
    _run(opt, ps, 2)
    exported = opt.state_dict(format="fp32")
    for st in exported["state"].values():  # our own keys: what a torch checkpoint has not
        st.pop("step"), st.pop("rng", None)
    t_opt = torch.optim.SGD([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=0.1, momentum=0.9)
    t_opt.load_state_dict(exported)
    for i, p in enumerate(t_opt.param_groups[0]["params"]):
        st = opt.state[ps[i]]
        assert_bits_equal(
            t_opt.state[p]["momentum_buffer"], q8.q8_decode_m(st["momentum_buffer_q"], st["momentum_buffer_scale"])
        )
    # and back: torch's buffers load (step = 1: initialised), are encoded (nearest) at the next
    # step, which runs on them and encodes its result
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = SGD(ps2, lr=0.1, momentum=0.9, state_format="q8", lowbit_min_numel=0, state_rounding="nearest")
    opt2.load_state_dict(t_opt.state_dict())
    twin, twin_ps = _dense_twin(opt2, ps2)
    _requantise(twin, twin_ps, "momentum_buffer")
    for o, group in ((opt2, ps2), (twin, twin_ps)):
        _run(o, group, 1, start=3)
    for p in ps2:
        assert float(opt2.state[p]["step"]) == 2 and "momentum_buffer" not in opt2.state[p]
    _assert_codes_are_the_nearest_of(opt2, ps2, twin, twin_ps, "momentum_buffer")


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_format_switches_and_state_reset(rule):
    """q8 -> dense decodes exactly; dense -> q8 encodes to nearest; a reset state starts afresh as q8."""
    key = RULES[rule][2]
    ps = _params(torch.float32)
    opt = _make(rule, ps, master_weights=None, lowbit_min_numel=0, state_rounding="nearest")
    _run(opt, ps, 2)
    twin, twin_ps = _dense_twin(opt, ps)  # loads the decoded moments
    opt.param_groups[0]["state_format"] = None
    for o, group in ((opt, ps), (twin, twin_ps)):
        _run(o, group, 1, start=3)
    assert_same_state(state_snapshot(twin), state_snapshot(opt))
    assert all(key + "_q" not in opt.state[p] and key + "_scale" not in opt.state[p] for p in ps)
    # dense -> q8: the moments are encoded (nearest) before the step, the step's result again
    opt.param_groups[0]["state_format"] = "q8"
    _requantise(twin, twin_ps, key)
    for o, group in ((opt, ps), (twin, twin_ps)):
        _run(o, group, 1, start=4)
    _assert_codes_are_the_nearest_of(opt, ps, twin, twin_ps, key)
    # a reset: the param's state replaced by an empty dict starts from zero codes again
    opt.state[ps[1]] = {}
    _run(opt, ps, 1, start=5)
    assert opt.state[ps[1]][key + "_q"].dtype == torch.uint8
    if rule == "sgd":
        assert float(opt.state[ps[1]]["step"]) == 1


BAD = [
    (dict(state_format="q4"), ValueError, "state_format must be None"),
    (dict(state_format=8), ValueError, "state_format must be None"),
    (dict(lowbit_min_numel=-1), TypeError, "lowbit_min_numel must be an int >= 0"),
    (dict(lowbit_min_numel=1.5), TypeError, "lowbit_min_numel must be an int >= 0"),
    (dict(lowbit_min_numel=True), TypeError, "lowbit_min_numel must be an int >= 0"),
    (dict(state_rounding="up"), ValueError, "state_rounding must be 'stochastic' or 'nearest'"),
]


@pytest.mark.parametrize("rule", ["sgd", "lion"])
@pytest.mark.parametrize("kw,err,match", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_options_are_refused_and_change_nothing(rule, kw, err, match):
    name = RULES[rule][0].__name__
    with pytest.raises(err, match=f"{name}: {match}"):
        _make(rule, _params(), **kw)
    # set on a live group between steps: refused at the step, before anything changes
    ps = _params()
    opt = _make(rule, ps)
    _run(opt, ps, 1)
    before, weights = state_snapshot(opt), [p.detach().clone() for p in ps]
    opt.param_groups[0].update(kw)
    set_grads(ps, heavy_tailed_grads(ps, 2))
    with pytest.raises(err, match=match):
        opt.step()
    assert_same_state(before, state_snapshot(opt))
    for p, w in zip(ps, weights):
        assert_bits_equal(p.detach(), w)
    # and in a state dict: refused at load, the optimizer unchanged
    sd = opt.state_dict()
    sd["param_groups"][0].update(kw)
    opt.param_groups[0].update({"state_format": "q8", "lowbit_min_numel": 64, "state_rounding": "stochastic"})
    with pytest.raises(err, match=match):
        opt.load_state_dict(sd)
    assert_same_state(before, state_snapshot(opt))
    assert opt.param_groups[0]["state_format"] == "q8"


class _Net(torch.nn.Module):
    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter((torch.randn(64, 80, generator=g) * 0.1).to(dtype))
        self.b = torch.nn.Parameter((torch.randn(80, 72, generator=g) * 0.1).to(dtype))
        self.c = torch.nn.Parameter(torch.randn(72, generator=g).to(dtype))

    def forward(self, x):
        return ((torch.tanh(x @ self.a) @ self.b + self.c).float() ** 2).mean()


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_gradient_release_equals_the_ordinary_step(rule):
    """Buckets of a released step read the group's rng counter once, as the ordinary step does."""
    nets = [_Net(), _Net()]
    opts = [_make(rule, list(n.parameters())) for n in nets]
    h = fastamp.release(nets[1], opts[1], max_norm=0.05, bucket_bytes=8000)
    assert len(h.buckets) > 1
    for step in range(5):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step)).bfloat16()
        nets[0](x).backward()
        torch.nn.utils.clip_grad_norm_(nets[0].parameters(), 0.05)
        opts[0].step()
        opts[0].zero_grad(set_to_none=True)
        h.backward(nets[1](x))
    h.remove()
    assert any(RULES[rule][2] + "_q" in opts[1].state[p] for p in nets[1].parameters())
    assert_same_state(state_snapshot(opts[0]), state_snapshot(opts[1]))
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        assert_bits_equal(p.detach(), q.detach())


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_groups_of_different_formats_and_tied_params(rule):
    """A q8 group beside a dense one steps each as on its own; a param listed twice is refused."""
    ps, ref_q8, ref_dense = _params(), _params(), _params()
    cls, _, key, hyper = RULES[rule]
    opt = cls([{"params": ps[:2], "state_format": "q8"}, {"params": ps[2:]}], **hyper,
              master_weights="remainder", lowbit_min_numel=0, seed=5)  # fmt: skip
    a = cls(ref_q8[:2], **hyper, master_weights="remainder", lowbit_min_numel=0, seed=5, state_format="q8")
    b = cls(ref_dense[2:], **hyper, master_weights="remainder", lowbit_min_numel=0, seed=5)
    for step in range(1, 4):
        for group in (ps, ref_q8, ref_dense):
            set_grads(group, heavy_tailed_grads(group, step))
        opt.step()
        a.step()
        b.step()
    for p, r in zip(ps[:2], ref_q8[:2]):
        assert_bits_equal(opt.state[p][key + "_q"], a.state[r][key + "_q"])
        assert_bits_equal(p.detach(), r.detach())
    for p, r in zip(ps[2:], ref_dense[2:]):
        assert opt.state[p][key].dtype == torch.float32
        assert_bits_equal(p.detach(), r.detach())
    # the same param twice: refused at construction (torch only warns), as for dense moments
    t = _params()[0]
    with pytest.raises(ValueError, match="duplicate|twice|more than once|appears"):
        cls([t, t], **hyper, state_format="q8", lowbit_min_numel=0)


@pytest.mark.parametrize("rule", ["sgd", "lion"])
@pytest.mark.parametrize("device", ["cuda"])
def test_cuda_backends_give_the_cpu_bytes(rule, device):
    """On a GPU (benchmarks/gpu_check.sh): every CUDA backend's q8 step writes the bytes of the CPU torch backend's."""
    ref_ps = _params()
    ref = _make(rule, ref_ps, backend="torch")
    _run(ref, ref_ps, 3)
    for backend in [b for b in fastamp.backends.BACKENDS if fastamp.backends.available(b, RULES[rule][1], device)[0]]:
        ps = [torch.nn.Parameter(p.detach().clone().to(device)) for p in _params()]
        opt = _make(rule, ps, backend=backend)
        for step in range(1, 4):
            set_grads(ps, [g.to(device) for g in heavy_tailed_grads(_params(), step)])
            opt.step()
        got = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in state_snapshot(opt).items()}
        assert_same_state(state_snapshot(ref), got)
        for p, r in zip(ps, ref_ps):
            assert_bits_equal(p.detach().cpu(), r.detach(), backend)


@pytest.mark.parametrize("rule", ["sgd", "lion"])
@pytest.mark.parametrize("device", ["cuda"])
def test_cuda_q8_step_does_not_sync(rule, device):
    """The composed step (decode, kernel, encode, the skip's where) reads nothing on the host."""
    ps = [torch.nn.Parameter(p.detach().to(device)) for p in _params()]
    opt = _make(rule, ps, lowbit_min_numel=0)
    opt.grad_scale = torch.tensor(1024.0, device=device)
    opt.found_inf = torch.zeros((), device=device)
    set_grads(ps, [g.to(device) for g in heavy_tailed_grads(_params(), 1)])
    opt.step()  # creates the state
    with cuda_syncs_raise():
        for _ in range(3):
            opt.step()
    assert all(opt.state[p][RULES[rule][2] + "_q"].device.type == "cuda" for p in ps)
