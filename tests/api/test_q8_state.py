"""``AdamW(state_format="q8")``: 8-bit block-scaled moments in the optimizer (issue 22).

What the optimizer adds to the op (``tests/spec/test_adamw_q8.py``): the state it keeps and
the random streams it draws, its threshold, conversions, state dicts, skips, refusals. The
defining check: q8 + remainder masters equals fp32-master AdamW whose moments are replaced
by ``decode(encode(.))`` after every step with the same random bits, bit for bit.
"""

import warnings

import pytest
import torch
from helpers import (
    COMPILE_BACKENDS,
    assert_bits_equal,
    assert_same_state,
    heavy_tailed_grads,
    master_of,
    save_load,
    seeded_params,
    set_grads,
    spy_kernels,
    state_snapshot,
)

import fastamp
from fastamp import reference
from fastamp.optim import AdamW
from fastamp.reference import q8

BACKENDS = [b for b in fastamp.backends.BACKENDS if fastamp.backends.available(b, "optim_", "cpu")[0]]
SHAPES = [(96, 40), (33,), (7, 5), (4097,)]


def _params(dtype=torch.bfloat16, seed=0):
    return seeded_params(SHAPES, dtype, seed)


# Triton runs interpreted here (~6 s a run): stochastic rounding only, its round-to-nearest codes
# are checked byte for byte against the op's reference by tests/backends/test_triton_q8.py
@pytest.mark.parametrize(
    "backend,rounding",
    [(b, r) for b in BACKENDS for r in ("stochastic", "nearest") if not (b == "triton" and r == "nearest")],
)
def test_q8_remainder_equals_fp32_master_adamw_with_requantised_moments(backend, rounding):
    ps_q8, ps_ref = _params(), _params()
    opt = AdamW(ps_q8, lr=3e-3, weight_decay=0.1, master_weights="remainder", state_format="q8",
                lowbit_min_numel=0, state_rounding=rounding, seed=11, backend=backend)  # fmt: skip
    ref = AdamW(ps_ref, lr=3e-3, weight_decay=0.1, master_weights=True, backend="torch")
    for step in range(1, 7):
        grads = heavy_tailed_grads(ps_q8, step)
        set_grads(ps_q8, grads)
        set_grads(ps_ref, grads)
        opt.step()
        ref.step()
        for tid, (p, r) in enumerate(zip(ps_q8, ps_ref)):
            st, rs = opt.state[p], ref.state[r]
            n = p.numel()
            sr = rounding == "stochastic"
            rm = reference.sr_random16(11, torch.tensor(step - 1), 4 * tid + 1, n, "cpu") if sr else None
            rv = reference.sr_random16(11, torch.tensor(step - 1), 4 * tid + 2, n, "cpu") if sr else None
            cm, sm = q8.q8_encode_m(rs["exp_avg"], rm)
            cv, sv = q8.q8_encode_v(rs["exp_avg_sq"], rv)
            assert_bits_equal(st["exp_avg_q"], cm, f"step {step} param {tid} exp_avg codes")
            assert_bits_equal(st["exp_avg_scale"], sm, f"step {step} param {tid} exp_avg scales")
            assert_bits_equal(st["exp_avg_sq_q"], cv, f"step {step} param {tid} exp_avg_sq codes")
            assert_bits_equal(st["exp_avg_sq_scale"], sv, f"step {step} param {tid} exp_avg_sq scales")
            rs["exp_avg"].copy_(q8.q8_decode_m(cm, sm))
            rs["exp_avg_sq"].copy_(q8.q8_decode_v(cv, sv))
            assert_bits_equal(master_of(opt, p), rs["master_param"], f"step {step} param {tid} master")
            assert int(st["rng"][1]) == step if sr else "rng" not in st


def test_threshold_keeps_small_tensors_dense_and_bytes_per_param():
    ps = _params()
    opt = AdamW(ps, state_format="q8", master_weights="remainder")  # default lowbit_min_numel=4096
    set_grads(ps, heavy_tailed_grads(ps, 1))
    opt.step()
    for p in ps:
        st = opt.state[p]
        if p.numel() >= 4096:
            assert (
                "exp_avg" not in st
                and st["exp_avg_q"].dtype == torch.uint8
                and st["exp_avg_sq_scale"].numel() == q8.num_blocks(p.numel())
            )
            state_bytes = sum(t.numel() * t.element_size() for k, t in st.items() if k not in ("step", "rng"))
            # remainder (2) + two moments of one code byte + one scale byte per 32 elements
            assert state_bytes == p.numel() * 4 + 2 * q8.num_blocks(p.numel())
        else:
            assert st["exp_avg"].dtype == torch.float32 and "exp_avg_q" not in st


def test_fp32_and_fp16_params_get_q8_moments_with_their_own_streams():
    ps32 = _params(torch.float32)
    opt = AdamW(ps32, lr=1e-3, state_format="q8", lowbit_min_numel=0, seed=3)
    set_grads(ps32, heavy_tailed_grads(ps32, 1))
    opt.step()
    # fp32 params are not bf16: their tensor ids start at 2^24 (no bf16 param's stream moves)
    ref = _params(torch.float32)
    m = torch.zeros(SHAPES[0])
    g = heavy_tailed_grads(ref, 1)[0].float()
    m = m + (1 - torch.tensor(0.9, dtype=torch.float32)) * (g - m)
    rm = reference.sr_random16(3, torch.tensor(0), 4 * (1 << 24) + 1, m.numel(), "cpu")
    codes, scales = q8.q8_encode_m(m, rm)
    assert_bits_equal(opt.state[ps32[0]]["exp_avg_q"], codes)
    assert_bits_equal(opt.state[ps32[0]]["exp_avg_scale"], scales)
    ps16 = _params(torch.float16)
    opt16 = AdamW(ps16, lr=1e-3, state_format="q8", lowbit_min_numel=0)
    set_grads(ps16, heavy_tailed_grads(ps16, 1))
    opt16.step()
    assert opt16.state[ps16[0]]["master_param"].dtype == torch.float32
    assert opt16.state[ps16[0]]["exp_avg_q"].dtype == torch.uint8


# The master kinds q8 moments go with (issue 22's configurations, and fp32 masters), each skipped on an overflow
SKIP_CONFIGS = {
    "fp32-fp16": (torch.float16, {}),
    "remainder-bf16": (torch.bfloat16, {"master_weights": "remainder"}),
    "ulp8-bf16": (torch.bfloat16, {"master_weights": "ulp8"}),
    "ulp8-fp16": (torch.float16, {"master_weights": "ulp8"}),
    "sr-bf16": (torch.bfloat16, {"stochastic_rounding": True}),
}


def _scaled_grads(ps, step, scale):
    """Heavy-tailed grads with magnitudes in [2^-8, 2^4] (or 0), times ``scale``, in the params' dtype.

    In that range fp16 holds ``g * 2^9`` and ``g * 2^10`` exactly scaled (no overflow, no
    subnormal), so a run whose scale backed off unscales to the same grads as one whose did not.
    """
    out = []
    for g in heavy_tailed_grads([torch.empty(p.shape) for p in ps], step):
        g = g.sign() * g.abs().clamp(2.0**-8, 2.0**4)
        out.append((g * scale).to(ps[0].dtype))
    return out


def _scaler_step(opt, ps, scaler, grads):
    set_grads(ps, grads)
    scaler.scale(torch.ones(()))  # the grads above are set by hand, already scaled
    scaler.step(opt)
    scaler.update()


# Triton runs interpreted here (~10 s a case): the fp16 case, the one a scaler is there for; its q8 kernel's
# skip is checked for every master kind at the op level (tests/backends/test_triton_q8.py)
@pytest.mark.parametrize(
    "backend, config", [(b, c) for b in BACKENDS for c in SKIP_CONFIGS if b != "triton" or c == "ulp8-fp16"]
)
def test_an_overflow_skipped_by_the_scaler_changes_no_byte_and_the_run_goes_on_as_without_it(backend, config):
    """An inf in one grad, found by fastamp.Scaler: the step is skipped on the device (the ordinary path, not
    release). Every state byte (q8 codes and scales, masters, dense moments of the small tensors), every param
    byte, the step counts and the group's rng counter stay as they were; the next applied step then writes the
    bytes of a twin run that never saw the overflow."""
    dtype, kw = SKIP_CONFIGS[config]
    runs = []
    for _ in range(2):
        ps = _params(dtype)
        opt = AdamW(ps, lr=2e-3, weight_decay=0.1, state_format="q8", lowbit_min_numel=64, seed=5, backend=backend,
                    **kw)  # fmt: skip
        runs.append((ps, opt, fastamp.Scaler(init_scale=2.0**10)))
    for ps, opt, scaler in runs:
        for step in (1, 2):
            _scaler_step(opt, ps, scaler, _scaled_grads(ps, step, scaler.get_scale()))
            assert not scaler.last_step_skipped
    (ps, opt, scaler), (twin_ps, twin, twin_scaler) = runs
    assert {k for p in ps for k in opt.state[p]} >= {"exp_avg_q", "exp_avg_sq_scale", "exp_avg", "rng"}
    before = state_snapshot(opt)
    params_before = [p.detach().clone() for p in ps]
    grads = _scaled_grads(ps, 3, scaler.get_scale())
    grads[0].view(-1)[5] = float("inf")
    _scaler_step(opt, ps, scaler, grads)
    assert scaler.last_step_skipped and scaler.get_scale() == 2.0**9
    assert_same_state(before, state_snapshot(opt))
    for p, q in zip(ps, params_before):
        assert_bits_equal(p.detach(), q, "param")
    assert all(float(opt.state[p]["step"]) == 2 for p in ps)
    assert int(opt.state[ps[0]]["rng"][1]) == 2
    # the next applied step: as if the overflow had never happened (same grads once unscaled)
    for run_ps, run_opt, run_scaler in ((ps, opt, scaler), (twin_ps, twin, twin_scaler)):
        _scaler_step(run_opt, run_ps, run_scaler, _scaled_grads(run_ps, 3, run_scaler.get_scale()))
        assert not run_scaler.last_step_skipped
    assert_same_state(state_snapshot(twin), state_snapshot(opt))
    for p, q in zip(ps, twin_ps):
        assert_bits_equal(p.detach(), q.detach(), "param after the skip")
    assert int(opt.state[ps[0]]["rng"][1]) == 3 and not torch.equal(ps[0].detach(), params_before[0])


def _run(opt, ps, steps, start=1):
    for step in range(start, start + steps):
        set_grads(ps, heavy_tailed_grads(ps, step))
        opt.step()


def _make(ps, **kw):
    return AdamW(ps, lr=2e-3, master_weights="remainder", state_format="q8", lowbit_min_numel=64, seed=5, **kw)


def test_state_dict_native_resume_is_bit_exact_and_loads_weights_only():
    ps = _params()
    opt = _make(ps)
    _run(opt, ps, 3)
    sd = save_load(opt.state_dict())
    model_sd = [p.detach().clone() for p in ps]
    _run(opt, ps, 3, start=4)
    ps2 = [torch.nn.Parameter(t.clone()) for t in model_sd]
    opt2 = _make(ps2)
    opt2.load_state_dict(sd)
    _run(opt2, ps2, 3, start=4)
    assert_same_state(state_snapshot(opt), state_snapshot(opt2))
    for p, q in zip(ps, ps2):
        assert_bits_equal(p.detach(), q.detach())


def test_fp32_export_matches_torch_layout_and_round_trips_bit_exactly():
    ps = _params()
    opt = _make(ps)
    _run(opt, ps, 3)
    sd32 = opt.state_dict(format="fp32")
    for i, st in sd32["state"].items():
        assert sorted(st) == ["exp_avg", "exp_avg_sq", "master_param", "step"]  # the counter is the group's
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].shape == ps[i].shape
    assert sd32["param_groups"][0]["rng"] == [5, 3] and "rng" not in opt.param_groups[0]
    # native -> fp32 -> native: the same bytes
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = _make(ps2)
    opt2.load_state_dict(save_load(sd32))
    set_grads(ps, heavy_tailed_grads(ps, 4))
    set_grads(ps2, heavy_tailed_grads(ps2, 4))
    opt.step()
    opt2.step()
    assert_same_state(state_snapshot(opt), state_snapshot(opt2))
    # torch's AdamW loads the fp32 export of an fp32-param instance
    p32 = _params(torch.float32)
    o32 = AdamW(p32, lr=1e-3, state_format="q8", lowbit_min_numel=0, state_rounding="nearest")
    _run(o32, p32, 2)
    t_opt = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in p32], lr=1e-3)
    t_opt.load_state_dict(o32.state_dict(format="fp32"))
    for i, p in enumerate(t_opt.param_groups[0]["params"]):
        assert_bits_equal(
            t_opt.state[p]["exp_avg"],
            q8.q8_decode_m(o32.state[p32[i]]["exp_avg_q"], o32.state[p32[i]]["exp_avg_scale"]),
        )


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_torch_adamw_loads_the_fp32_export_of_bf16_remainder_q8_as_it_is(fused):
    """``state_dict(format="fp32")`` of bf16 params with remainder masters and q8 moments: torch.optim.AdamW over an
    fp32 copy of the model loads it untouched (nothing stripped by hand), holds the decoded moments and the exact
    masters, steps, and its own state dict, the group's rng counter included, loads back into fastamp."""
    ps = _params()
    opt = _make(ps)
    _run(opt, ps, 3)
    sd = save_load(opt.state_dict(format="fp32"))
    model32 = [torch.nn.Parameter(master_of(opt, p).clone()) for p in ps]
    t_opt = torch.optim.AdamW(model32, lr=1.0, fused=fused)
    t_opt.load_state_dict(sd)
    assert t_opt.param_groups[0]["lr"] == 2e-3 and t_opt.param_groups[0]["rng"] == [5, 3]
    for i, (p, q) in enumerate(zip(ps, model32)):
        st, ts = opt.state[p], t_opt.state[q]
        assert sorted(ts) == ["exp_avg", "exp_avg_sq", "master_param", "step"], sorted(ts)
        if "exp_avg_q" in st:
            m, v = q8.q8_decode_m(st["exp_avg_q"], st["exp_avg_scale"]), q8.q8_decode_v(st["exp_avg_sq_q"],
                                                                                       st["exp_avg_sq_scale"])  # fmt: skip
        else:
            m, v = st["exp_avg"], st["exp_avg_sq"]
        assert_bits_equal(ts["exp_avg"], m, f"param {i} exp_avg")
        assert_bits_equal(ts["exp_avg_sq"], v, f"param {i} exp_avg_sq")
        assert_bits_equal(ts["master_param"], master_of(opt, p), f"param {i} master")
        assert float(ts["step"]) == 3.0
    set_grads(model32, heavy_tailed_grads(model32, 4))
    t_opt.step()
    assert all(float(t_opt.state[q]["step"]) == 4.0 and bool(q.isfinite().all()) for q in model32)
    back = [torch.nn.Parameter(q.detach().bfloat16()) for q in model32]
    o2 = _make(back)
    # torch kept the exported masters but stepped the params: they are stale, dropped with a warning
    with pytest.warns(UserWarning, match=f"{len(back)} fp32 master\\(s\\) were exported .* at another step count"):
        o2.load_state_dict(save_load(t_opt.state_dict()))
    assert "rng" not in o2.param_groups[0]
    counters = [o2.state[p]["rng"] for p in back if "rng" in o2.state[p]]
    assert [p.numel() >= 64 for p in back] == ["rng" in o2.state[p] for p in back]  # the params with q8 codes
    assert counters[0].tolist() == [5, 3] and all(c is counters[0] for c in counters)  # one per group again
    # the masters are re-made from the params torch trained: a step of lr 0 leaves them as they are
    before = [p.detach().clone() for p in back]
    o2.param_groups[0]["lr"] = 0.0
    set_grads(back, heavy_tailed_grads(back, 5))
    o2.step()
    for p, b in zip(back, before):
        assert_bits_equal(p.detach(), b)


def test_fp32_export_loaded_back_without_steps_elsewhere_keeps_its_masters():
    """The export's masters are kept when nothing stepped the state since (native -> fp32 -> native is exact)."""
    ps = _params()
    opt = _make(ps)
    _run(opt, ps, 3)
    sd = save_load(opt.state_dict(format="fp32"))
    assert sd["param_groups"][0]["master_steps"] == [3.0] * len(ps)
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = _make(ps2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt2.load_state_dict(sd)
    assert "master_steps" not in opt2.param_groups[0]
    for p, q in zip(ps, ps2):
        assert_bits_equal(master_of(opt2, q), master_of(opt, p))
    bad = save_load(opt.state_dict(format="fp32"))
    bad["param_groups"][0]["master_steps"] = [3.0]
    before = state_snapshot(opt2)
    with pytest.raises(ValueError, match="'master_steps' must hold one step count \\(or None\\) per param"):
        opt2.load_state_dict(bad)
    assert_same_state(before, state_snapshot(opt2))


def test_fp32_export_keeps_differing_counters_per_param_and_a_bad_group_counter_is_refused():
    ps = _params()
    opt = _make(ps)
    _run(opt, ps, 2)
    opt.state[ps[3]]["rng"] = torch.tensor([5, 9])  # as a group whose params on another device missed steps
    sd = opt.state_dict(format="fp32")
    assert "rng" not in sd["param_groups"][0]
    assert sd["state"][0]["rng"].tolist() == [5, 2] and sd["state"][3]["rng"].tolist() == [5, 9]
    sd = opt.state_dict(format="fp32")
    sd["param_groups"][0]["rng"] = [5]
    before = state_snapshot(opt)
    with pytest.raises(ValueError, match=r"loaded param group 0: 'rng' must be \[seed, counter\], two ints"):
        opt.load_state_dict(sd)
    assert_same_state(before, state_snapshot(opt))


def test_torch_state_dict_loads_and_format_switch_converts():
    ps = _params(torch.float32)
    t_opt = torch.optim.AdamW(ps, lr=1e-3)
    _run(t_opt, ps, 2)
    opt = AdamW(ps, lr=1e-3, state_format="q8", lowbit_min_numel=0)
    opt.load_state_dict(t_opt.state_dict())
    m = t_opt.state[ps[0]]["exp_avg"].clone()
    set_grads(ps, heavy_tailed_grads(ps, 3))
    opt.step()
    assert opt.state[ps[0]]["exp_avg_q"].dtype == torch.uint8 and "exp_avg" not in opt.state[ps[0]]
    # switching back to dense moments decodes them (exactly) at the next step
    opt.param_groups[0]["state_format"] = None
    decoded = q8.q8_decode_m(opt.state[ps[0]]["exp_avg_q"], opt.state[ps[0]]["exp_avg_scale"])
    set_grads(ps, [torch.zeros_like(p) for p in ps])
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    st = opt.state[ps[0]]
    assert st["exp_avg"].dtype == torch.float32 and "exp_avg_q" not in st and "exp_avg_scale" not in st
    assert_bits_equal(st["exp_avg"], decoded + torch.tensor(1 - 0.9, dtype=torch.float32) * (0 - decoded))
    assert not torch.equal(m, decoded)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"state_format": "int8"}, ValueError, "state_format must be None"),
        ({"state_format": "q8", "amsgrad": True}, ValueError, "amsgrad=True is not supported"),
        ({"state_format": "q8", "state_dtype": torch.bfloat16, "master_weights": "remainder"}, ValueError,
         "does not combine"),
        ({"state_format": "q8", "lowbit_min_numel": -1}, TypeError, "lowbit_min_numel"),
        ({"state_format": "q8", "state_rounding": "up"}, ValueError, "state_rounding"),
    ],
)  # fmt: skip
def test_refusals_at_construction(kw, err, match):
    with pytest.raises(err, match=match):
        AdamW(_params(), **kw)


@pytest.mark.parametrize("corrupt", ["short_scales", "no_scales", "strided_codes", "wrong_dtype"])
def test_corrupted_q8_state_is_refused_before_anything_changes(corrupt):
    ps = _params()
    opt = _make(ps)
    _run(opt, ps, 1)
    st = opt.state[ps[0]]
    if corrupt == "short_scales":
        st["exp_avg_scale"] = st["exp_avg_scale"][:-1].clone()
    elif corrupt == "no_scales":
        del st["exp_avg_sq_scale"]
    elif corrupt == "strided_codes":
        st["exp_avg_q"] = st["exp_avg_q"].t().contiguous().t()
    else:
        st["exp_avg_scale"] = st["exp_avg_scale"].to(torch.int16)
    before = state_snapshot(opt)
    params_before = [p.detach().clone() for p in ps]
    set_grads(ps, heavy_tailed_grads(ps, 2))
    with pytest.raises(ValueError, match=r"param 0 of param group 0 \(shape \(96, 40\)\)"):
        opt.step()
    assert_same_state(before, state_snapshot(opt))
    for p, q in zip(ps, params_before):
        assert_bits_equal(p.detach(), q)


@pytest.mark.parametrize(
    "edit, match",
    [
        ("short_scale", r"'exp_avg_scale' must be a plain torch.uint8 tensor of shape \(120,\)"),
        ("no_scale", r"'exp_avg_q' is given but 'exp_avg_scale' is missing"),
        ("both_forms", r"holds moment 'exp_avg' twice"),
        ("codes_shape", r"'exp_avg_sq_q' must be a plain torch.uint8 tensor of shape \(96, 40\)"),
    ],
)
def test_load_refuses_bad_q8_state_and_changes_nothing(edit, match):
    ps = _params()
    opt = _make(ps)
    _run(opt, ps, 1)
    sd = opt.state_dict()
    st = sd["state"][0] = dict(sd["state"][0])
    if edit == "short_scale":
        st["exp_avg_scale"] = st["exp_avg_scale"][:3]
    elif edit == "no_scale":
        del st["exp_avg_scale"]
    elif edit == "both_forms":
        st["exp_avg"] = torch.zeros(ps[0].shape)
    else:
        st["exp_avg_sq_q"] = st["exp_avg_sq_q"].reshape(-1)
    before = state_snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert_same_state(before, state_snapshot(opt))


def test_compiled_step_equals_eager():
    ps_e, ps_c = _params(), _params()
    eager, comp = _make(ps_e), _make(ps_c)
    step = torch.compile(comp.step, fullgraph=True)
    for s in range(1, 4):
        set_grads(ps_e, heavy_tailed_grads(ps_e, s))
        set_grads(ps_c, heavy_tailed_grads(ps_c, s))
        eager.step()
        step()
    assert_same_state(state_snapshot(eager), state_snapshot(comp))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_compiled_ulp8_step_equals_eager(dtype):
    """A compiled step with ulp8 masters runs on the backend eager's does and writes the same bytes."""
    ps_e, ps_c = _params(dtype), _params(dtype)
    kw = dict(lr=2e-3, master_weights="ulp8", state_format="q8", lowbit_min_numel=64, seed=5)
    eager, comp = AdamW(ps_e, **kw), AdamW(ps_c, **kw)
    step = torch.compile(comp.step, fullgraph=True)
    for s in range(1, 4):
        set_grads(ps_e, heavy_tailed_grads(ps_e, s))
        set_grads(ps_c, heavy_tailed_grads(ps_c, s))
        eager.step()
        step()
    assert_same_state(state_snapshot(eager), state_snapshot(comp))
    assert any("master_ulp8" in comp.state[p] for p in ps_c)
    for a, b in zip(ps_e, ps_c):
        assert_bits_equal(a.detach(), b.detach(), "param")


@pytest.mark.parametrize("compile_backend", COMPILE_BACKENDS)
def test_compiled_sr_q8_step_equals_eager(compile_backend, fresh_dynamo):
    """No master, bf16 params rounded stochastically, q8 codes rounded stochastically: a compiled step draws the
    random bits eager draws (the group's counter read at run time) and writes the same bytes, step after step."""
    ps_e, ps_c = _params(), _params()
    kw = dict(lr=2e-3, weight_decay=0.1, stochastic_rounding=True, state_format="q8", lowbit_min_numel=64, seed=5)
    eager, comp = AdamW(ps_e, **kw), AdamW(ps_c, **kw)
    step = torch.compile(comp.step, backend=compile_backend, fullgraph=True)
    for s in range(1, 5):
        set_grads(ps_e, heavy_tailed_grads(ps_e, s))
        set_grads(ps_c, heavy_tailed_grads(ps_c, s))
        eager.step()
        step()
        assert_same_state(state_snapshot(eager), state_snapshot(comp))
        for a, b in zip(ps_e, ps_c):
            assert_bits_equal(a.detach(), b.detach(), f"step {s} param")
    assert comp._compiled["ran"] and not eager._compiled["ran"]  # the traced step ran, not an eager fallback
    st = comp.state[ps_c[0]]
    assert "exp_avg_q" in st and int(st["rng"][1]) == 4
    assert not {"master_param", "master_remainder", "master_ulp8"} & {k for p in ps_c for k in comp.state[p]}


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(64, 80, generator=g).bfloat16() * 0.1)
        self.b = torch.nn.Parameter(torch.randn(80, 72, generator=g).bfloat16() * 0.1)
        self.c = torch.nn.Parameter(torch.randn(72, generator=g).bfloat16())

    def forward(self, x):
        return ((torch.tanh(x @ self.a) @ self.b + self.c).float() ** 2).mean()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_gradient_release_with_q8_equals_the_ordinary_step(rounding):
    """Stochastic q8 rounding too: every bucket of a step reads the group's rng counter (fastamp.optim.engine.rng)."""
    nets = [_Net(), _Net()]
    opts = [_make(list(n.parameters()), state_rounding=rounding) for n in nets]
    h = fastamp.release(nets[1], opts[1], max_norm=0.05, bucket_bytes=8000)
    assert len(h.buckets) > 1
    for step in range(6):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step)).bfloat16()
        loss = nets[0](x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(nets[0].parameters(), 0.05)
        opts[0].step()
        opts[0].zero_grad(set_to_none=True)
        h.backward(nets[1](x))
    h.remove()
    assert_same_state(state_snapshot(opts[0]), state_snapshot(opts[1]))
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        assert_bits_equal(p.detach(), q.detach())


_ULP8_RULES = {
    "adamw": (AdamW, dict(lr=3e-3)),
    "sgd": (fastamp.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "sgd-no-momentum": (fastamp.optim.SGD, dict(lr=0.05)),
    "lion": (fastamp.optim.Lion, dict(lr=3e-4, weight_decay=0.1)),
}


@pytest.mark.parametrize(
    "backend, rule, dtype, rounding",
    [(b, "adamw", d, r) for b in BACKENDS for d in (torch.bfloat16, torch.float16) for r in ("stochastic", "nearest")]
    + [(b, r, torch.bfloat16, "stochastic") for b in BACKENDS for r in ("sgd", "sgd-no-momentum", "lion")]
    + [("native", r, torch.float16, "nearest") for r in ("sgd", "lion") if "native" in BACKENDS],
)
def test_ulp8_master_equals_fp32_master_rounded_through_ulp8_after_every_step(backend, rule, dtype, rounding):
    """Every rule with an ulp8 master: the fp32-master run whose master is replaced by decode(encode(.)) after each step."""
    cls, hyper = _ULP8_RULES[rule]
    ps_u, ps_f = _params(dtype), _params(dtype)
    kw = dict(state_format="q8", lowbit_min_numel=0, state_rounding=rounding, seed=4, **hyper)
    opt_u = cls(ps_u, master_weights="ulp8", backend=backend, **kw)
    opt_f = cls(ps_f, master_weights=True, **kw)
    ids = opt_u._rng_ids()
    for step in range(1, 6):
        grads = heavy_tailed_grads(ps_u, step)
        set_grads(ps_u, grads)
        set_grads(ps_f, grads)
        opt_u.step()
        opt_f.step()
        for k, (p, q) in enumerate(zip(ps_u, ps_f)):
            su, sf = opt_u.state[p], opt_f.state[q]
            n = p.numel()
            rand = None
            if rounding == "stochastic":
                rand = reference.sr_random16(4, torch.tensor(step - 1), 4 * ids[id(p)], n, "cpu")
            hi, corr = reference.ulp8_encode(sf["master_param"], dtype, rand)
            assert_bits_equal(p.detach(), hi, f"step {step} param {k}")
            assert_bits_equal(su["master_ulp8"], corr, f"step {step} param {k} correction")
            keys = set(sf) - {"master_param", "rng"}
            assert set(su) - {"master_ulp8", "rng"} == keys, (set(su), keys)
            for key in keys:
                assert_bits_equal(su[key], sf[key], f"step {step} param {k} {key}")
            sf["master_param"].copy_(reference.ulp8_decode(hi, corr))
            assert "master_param" not in su and "master_remainder" not in su
    assert any(int(opt_u.state[p]["master_ulp8"].abs().max()) > 0 for p in ps_u)


@pytest.mark.skipif("native" not in BACKENDS, reason="fastamp._C has no CPU kernel for adamw_q8_")
def test_ulp8_masters_run_on_the_native_kernel_under_auto(monkeypatch):
    ran = []

    def spy(op, backend, impl):
        def kernel(*args, **kwargs):
            ran.append((op, backend))
            return impl(*args, **kwargs)

        return kernel

    spy_kernels(monkeypatch, spy)
    monkeypatch.delenv("FASTAMP_BACKEND", raising=False)
    ps = _params(torch.float16)
    opt = AdamW(ps, lr=1e-3, master_weights="ulp8", state_format="q8", lowbit_min_numel=0, seed=1)
    _run(opt, ps, 1)
    assert ran == [("optim_", "native")]
    assert all(opt.state[p]["master_ulp8"].dtype == torch.int8 for p in ps)


def test_ulp8_bytes_small_tensors_conversions_and_export():
    ps = _params()
    opt = AdamW(ps, lr=1e-3, master_weights="remainder", state_format="q8", lowbit_min_numel=64, seed=1)
    _run(opt, ps, 2)
    exact = [reference.join_master(p.detach(), opt.state[p]["master_remainder"]) for p in ps]
    opt.param_groups[0]["master_weights"] = "ulp8"  # remainder -> ulp8: encoded from the exact master
    opt.param_groups[0]["lr"] = 0.0
    set_grads(ps, [torch.zeros_like(p) for p in ps])
    opt.step()
    ids = opt._rng_ids()
    for p, m in zip(ps, exact):
        st = opt.state[p]
        if p.numel() >= 64:
            # converted from the exact master (to nearest), then one step at lr 0 re-encodes the decoded
            # master with its stochastic correction (counter 2: two steps applied before)
            hi, corr = reference.ulp8_encode(m.contiguous(), p.dtype)
            rand = reference.sr_random16(1, torch.tensor(2), 4 * ids[id(p)], p.numel(), "cpu")
            hi, corr = reference.ulp8_encode(reference.ulp8_decode(hi, corr), p.dtype, rand)
            assert "master_remainder" not in st and st["master_ulp8"].dtype == torch.int8
            assert_bits_equal(p.detach(), hi)
            assert_bits_equal(st["master_ulp8"], corr)
            nbytes = sum(t.numel() * t.element_size() for k, t in st.items() if k not in ("step", "rng"))
            assert nbytes == p.numel() * 3 + 2 * q8.num_blocks(p.numel())  # int8 + two q8 moments
        else:  # below lowbit_min_numel: dense moments, the exact remainder master
            assert "master_ulp8" not in st and st["master_remainder"].dtype == torch.int16
    sd = opt.state_dict(format="fp32")
    for i, p in enumerate(ps):
        st = sd["state"][i]
        assert "master_ulp8" not in st and st["master_param"].dtype == torch.float32
        if p.numel() >= 64:
            assert_bits_equal(st["master_param"], reference.ulp8_decode(p.detach(), opt.state[p]["master_ulp8"]))


@pytest.mark.parametrize(
    "cls, kw, err, match",
    [
        (AdamW, {"master_weights": "ulp8"}, ValueError, "needs state_format='q8'"),
        (AdamW, {"master_weights": "ulp8", "state_format": "q8", "stochastic_rounding": True}, ValueError,
         "does not combine with master_weights='ulp8'"),
        (fastamp.optim.SGD, {"master_weights": "ulp8", "lr": 0.1}, ValueError, "needs state_format='q8'"),
        (fastamp.optim.Lion, {"master_weights": "ulp8"}, ValueError, "needs state_format='q8'"),
        (fastamp.optim.Lion, {"master_weights": "ulp8", "state_format": "q8", "stochastic_rounding": True}, ValueError,
         "does not combine with master_weights='ulp8'"),
        (fastamp.optim.SGD, {"master_weights": "ulp9", "lr": 0.1}, TypeError, "master_weights must be"),
    ],
)  # fmt: skip
def test_ulp8_refusals(cls, kw, err, match):
    with pytest.raises(err, match=match):
        cls(_params(), **kw)
