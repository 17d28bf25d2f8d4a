"""The C++ CPU backend (``native`` on cpu) against the reference, bit for bit.

Every instruction-set path the machine supports is tested (``FASTAMP_CPU_ISA`` lowers the
one the kernels pick; ``torch.ops.fastamp.cpu_isa()`` says which runs). Agreement:
found_inf, written grads, update_scale_ and every tensor AdamW writes (the generic ``optim_``) are bit-exact
(NaN compared as NaN, whatever its payload); the sum of squares is within
``tolerances.SUMSQ_RTOL`` of the reference and bit-identical across thread counts and
instruction sets (fixed chunks, fixed 16-lane fp64 layout).
"""

import itertools
import math

import pytest
import tolerances
import torch
from helpers import assert_bits_equal, clone_lists, native_cpu_isas, native_optim, optim_args

from fastamp import functional, reference
from fastamp.ops import registry

if not all(registry.native_has_kernel(op, "cpu") for op in ("unscale_check_", "update_scale_", "optim_")):
    pytest.skip("fastamp._C has no CPU kernels (not built)", allow_module_level=True)

OPS = torch.ops.fastamp
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CHUNK = 16384  # csrc/cpu/multi_tensor.h kChunkElems
ISAS = native_cpu_isas()  # the ``isa`` fixture (tests/backends/conftest.py) runs each
SIZES = [0, 1, 2, 3, 7, 15, 16, 17, 31, 33, 97, 255, 257, 1021, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]
INV_SCALES = [1.0, 2.0**-16, 0.75, 2.0, 0.0, math.inf]


def assert_all_same(actual, expected, what=""):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bits_equal(a, e, f"{what}[{i}]")


def assert_sumsq_close(actual, expected):
    assert actual.dtype == torch.float32 and actual.dim() == 0
    a, e = actual.item(), expected.item()
    if math.isfinite(e):
        assert math.isclose(a, e, rel_tol=tolerances.SUMSQ_RTOL, abs_tol=0.0), (a, e)
    else:
        assert (math.isnan(a) and math.isnan(e)) or a == e, (a, e)


# ---- adversarial data ----

_SPECIAL_F32 = [
    0.0,
    -0.0,
    1e-45,
    -1e-45,
    3e-39,
    1.1754942e-38,
    1.0,
    -1.0,
    65504.0,
    65519.0,
    65520.0,
    -65536.0,
    3.0e38,
    3.3961e38,
    -3.4028235e38,
    1e-20,
    6e-8,
    2.0**-24,
    2.0**-25,
    1.5 * 2.0**-24,
]
_SPECIAL_F16 = [
    0.0,
    -0.0,
    2.0**-24,
    -(2.0**-24),
    3 * 2.0**-24,
    6.1e-5,
    6.1035e-05,
    1.0,
    65504.0,
    -65504.0,
    60000.0,
    32768.0,
    0.33325,
    1e-3,
]
_SPECIAL_BF16 = [0.0, -0.0, 9.2e-41, 1.2e-38, 1.0, -1.0, 3.3895e38, -3.3895e38, 1e30, 65504.0, 1e-30]


def _finite_values(n, dtype, gen):
    """Random values over many magnitudes, with the dtype's edge cases sprinkled in."""
    if n == 0:
        return torch.empty(0, dtype=dtype)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen).float())
    if dtype == torch.float16:
        x = x.clamp(-65504, 65504)
    specials = {torch.float32: _SPECIAL_F32, torch.float16: _SPECIAL_F16, torch.bfloat16: _SPECIAL_BF16}[dtype]
    sp = torch.tensor(specials, dtype=torch.float32)
    k = min(n, 3 * len(specials))
    pos = torch.randperm(n, generator=gen)[:k]
    x[pos] = sp[torch.arange(k) % len(specials)]
    return x.to(dtype)


def _mixed_grads(sizes, gen, specials=()):
    """One grad per size, dtypes cycling through fp32/fp16/bf16; specials: (index, pos, value)."""
    grads = [_finite_values(n, DTYPES[i % 3], gen) for i, n in enumerate(sizes)]
    for i, pos, val in specials:
        grads[i][pos] = val
    return grads


def _run_unscale(grads, inv, write_back, compute_sumsq, found_init=0.0):
    """(native result, reference result), each (grads, found_inf, returned tensor)."""
    out = []
    for fn in (OPS.unscale_check_, reference.unscale_check_):
        gs = [g.clone() for g in grads]
        found = torch.full((1,), found_init)
        ret = fn(gs, found, torch.tensor([inv], dtype=torch.float32), write_back, compute_sumsq)
        out.append((gs, found, ret))
    return out


def _assert_unscale_matches(grads, inv, write_back, compute_sumsq=True, found_init=0.0):
    (g_n, f_n, r_n), (g_r, f_r, r_r) = _run_unscale(grads, inv, write_back, compute_sumsq, found_init)
    assert_all_same(g_n, g_r, f"grads (inv={inv}, write_back={write_back})")
    assert_bits_equal(f_n, f_r, f"found_inf (inv={inv}, write_back={write_back})")
    if compute_sumsq:
        assert_sumsq_close(r_n, r_r)
    else:
        assert r_n.item() == 0.0 and r_n.dtype == torch.float32 and r_n.dim() == 0
    return f_n.item(), r_n


# ---- unscale_check_ ----


@pytest.mark.parametrize("write_back", [True, False])
@pytest.mark.parametrize("inv", INV_SCALES)
def test_unscale_matches_reference(isa, inv, write_back):
    gen = torch.Generator().manual_seed(1)
    grads = _mixed_grads(SIZES, gen)
    _assert_unscale_matches(grads, inv, write_back, compute_sumsq=True)
    _assert_unscale_matches(grads, inv, write_back, compute_sumsq=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_unscale_nonfinite_positions(isa, dtype, value):
    gen = torch.Generator().manual_seed(2)
    for n, where in itertools.product([1, 17, CHUNK + 5], ["first", "last", "middle"]):
        pos = {"first": 0, "last": n - 1, "middle": n // 2}[where]
        others = _mixed_grads([5, 33], gen)
        g = _finite_values(n, dtype, gen).clamp(-1e4, 1e4)
        g[pos] = value
        for wb in (True, False):
            found, _ = _assert_unscale_matches(others[:1] + [g] + others[1:], 2.0**-16, wb)
            assert found == 1.0, (n, where, wb)


def test_unscale_nonfinite_every_lane(isa):
    """One inf/nan (or fp16 overflow on write-back) at every position of the vector blocks and the tail."""
    n = 53
    for dtype, pos in itertools.product(DTYPES, range(n)):
        for value, inv, write_back in ((math.nan, 1.0, False), (math.inf, 0.5, True), (60000.0, 2.0, True)):
            g = torch.full((n,), 0.25, dtype=dtype)
            g[pos] = value
            expect = 1.0 if (value != 60000.0 or dtype == torch.float16) else 0.0
            found, _ = _assert_unscale_matches([g], inv, write_back, compute_sumsq=False)
            assert found == expect, (dtype, pos, value)


def test_unscale_only_element_and_found_inf_never_reset(isa):
    for dtype in DTYPES:
        g = torch.tensor([math.nan], dtype=dtype)
        assert _assert_unscale_matches([g], 1.0, True)[0] == 1.0
        clean = torch.ones(40, dtype=dtype)
        assert _assert_unscale_matches([clean], 0.5, True, found_init=1.0)[0] == 1.0
        assert _assert_unscale_matches([clean], 0.5, True, found_init=0.0)[0] == 0.0
    assert _assert_unscale_matches([], 0.5, True, found_init=0.0)[0] == 0.0


@pytest.mark.parametrize("n", [1, 16, 37])
def test_unscale_overflow_created_by_unscaling(isa, n):
    """Finite scaled grads that unscaling (or rounding back) turns into inf/nan raise found_inf."""
    cases = [
        # (dtype, value, inv_scale, flagged with write_back, flagged check-only)
        (torch.float16, 65504.0, 1.0002, False, False),  # 65517.1 rounds back to 65504
        (torch.float16, 65504.0, 1.0003, True, False),  # 65523.7 rounds to inf in fp16 only
        (torch.float16, 60000.0, 2.0, True, False),
        (torch.bfloat16, 3.3895e38, 1.0001, False, False),
        (torch.bfloat16, 3.3895e38, 1.0022, True, False),  # finite in fp32, inf in bf16
        (torch.float32, 3.0e38, 2.0, True, True),  # inf in fp32
        (torch.float32, 1.0, math.inf, True, True),
        (torch.float16, 0.0, math.inf, True, True),  # 0 * inf = nan
        (torch.bfloat16, 1e-30, 0.0, False, False),
    ]
    for dtype, value, inv, flag_wb, flag_check in cases:
        g = torch.full((n,), value, dtype=dtype)
        assert _assert_unscale_matches([g], inv, True)[0] == float(flag_wb), (dtype, value, inv)
        assert _assert_unscale_matches([g], inv, False)[0] == float(flag_check), (dtype, value, inv)


def test_unscale_subnormal_rounding(isa):
    """Unscaled values landing in the fp16/bf16/fp32 subnormal range, ties included."""
    gen = torch.Generator().manual_seed(3)
    h = torch.arange(0, 2048, dtype=torch.int16).view(torch.float16)  # all fp16 subnormals and small normals
    b = (torch.randint(0, 2**15, (4099,), generator=gen, dtype=torch.int16)).view(torch.bfloat16)
    f = torch.randn(4099, generator=gen) * 1e-36
    for inv in (0.5, 0.75, 2.0**-3, 1.5, 2.0**-16):
        _assert_unscale_matches([h, b, f, -h], inv, True)


def test_unscale_many_tiny_tensors(isa):
    gen = torch.Generator().manual_seed(4)
    sizes = torch.randint(0, 40, (3000,), generator=gen).tolist()
    grads = _mixed_grads(sizes, gen)
    _assert_unscale_matches(grads, 0.75, True)
    found, _ = _assert_unscale_matches(grads, 2.0**-10, False)
    assert found == 0.0
    grads[2711 if sizes[2711] else 2712][0] = math.inf
    assert _assert_unscale_matches(grads, 2.0**-10, True)[0] == 1.0


def test_unscale_sumsq_deterministic_across_threads_and_isas(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    sizes = [CHUNK * 7 + 3, 100_003, 5, 0, 65_537] + torch.randint(1, 3000, (200,), generator=gen).tolist()
    grads = _mixed_grads(sizes, gen)
    old = torch.get_num_threads()
    results = {}
    try:
        for isa_name, threads in itertools.product(ISAS, [1, 2, 3]):
            monkeypatch.setenv("FASTAMP_CPU_ISA", isa_name)
            torch.set_num_threads(threads)
            gs = [g.clone() for g in grads]
            found = torch.zeros(1)
            ret = OPS.unscale_check_(gs, found, torch.tensor([0.75]), True, True)
            results[(isa_name, threads)] = (ret, gs, found)
    finally:
        torch.set_num_threads(old)
    (r0, g0, f0) = next(iter(results.values()))
    for key, (r, g, f) in results.items():
        assert_bits_equal(r, r0, f"sumsq {key}")
        assert_all_same(g, g0, f"grads {key}")
        assert_bits_equal(f, f0, f"found_inf {key}")
    ref_found = torch.zeros(1)
    ref = reference.unscale_check_([g.clone() for g in grads], ref_found, torch.tensor([0.75]), True, True)
    assert_sumsq_close(r0, ref)


def test_unscale_sumsq_wide_range_of_magnitudes(isa):
    """Squares in fp32's subnormal range (1e-40) and near its max stay exact in the fp64 lanes."""
    tiny = torch.full((1000,), 1e-20)
    big = torch.full((3,), 1e19)
    for grads in ([tiny], [big], [tiny, big], [tiny.half(), tiny.bfloat16()]):
        _, r = _assert_unscale_matches(grads, 1.0, False)
        assert r.item() > 0 or grads[0].dtype == torch.float16


def test_unscale_through_functional():
    gen = torch.Generator().manual_seed(6)
    grads = _mixed_grads([100, 3, CHUNK + 1], gen)
    a = [g.clone() for g in grads]
    b = [g.clone() for g in grads]
    fa, fb = torch.zeros(1), torch.zeros(1)
    inv = torch.tensor([2.0**-8])
    ra = functional.unscale_check_(a, fa, inv, write_back=True, compute_sumsq=True, backend="native")
    rb = reference.unscale_check_(b, fb, inv, True, True)
    assert_all_same(a, b, "grads")
    assert_bits_equal(fa, fb, "found_inf")
    assert_sumsq_close(ra, rb)


# ---- update_scale_ ----


def test_update_scale_matches_torch_long_sequences():
    gen = torch.Generator().manual_seed(7)
    for growth_interval, growth, backoff, start in [
        (3, 2.0, 0.5, 65536.0),
        (1, 2.0, 0.5, 2.0**125),
        (7, 1.5, 0.3, 1.0),
        (2000, 2.0, 0.5, 1e-30),
    ]:
        s_t, gt_t = torch.tensor([start]), torch.zeros(1, dtype=torch.int32)
        s_n, gt_n, h_n = torch.tensor([start]), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
        flags = torch.rand(2000, generator=gen)
        for step in range(2000):
            u = flags[step].item()
            f = math.nan if u < 0.02 else (1.0 if u < 0.15 else (float(step) if u < 0.17 else 0.0))
            found = torch.tensor([f])
            torch._amp_update_scale_(s_t, gt_t, found, growth, backoff, growth_interval)
            OPS.update_scale_(s_n, gt_n, h_n, found, growth, backoff, growth_interval, 1, 0.0, math.inf)
            assert_bits_equal(s_n, s_t, f"scale at step {step}")
            assert torch.equal(gt_n, gt_t), step
            assert h_n.item() == (0 if f != 0 else 1)  # NaN != 0 too


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_update_scale_matches_reference_with_hysteresis_and_bounds(hysteresis):
    gen = torch.Generator().manual_seed(8 + hysteresis)
    for growth_interval, growth, backoff, lo, hi in [
        (2, 2.0, 0.5, 1.0, 2.0**20),
        (4, 1.7, 0.3, 0.01, 1e6),
        (1, 2.0, 0.5, 0.0, math.inf),
    ]:
        state_n = [
            torch.tensor([1024.0]),
            torch.zeros(1, dtype=torch.int32),
            torch.full((1,), hysteresis, dtype=torch.int32),
        ]
        state_r = [t.clone() for t in state_n]
        for step in range(600):
            u = torch.rand((), generator=gen).item()
            found = torch.tensor([math.nan if u < 0.03 else (1.0 if u < 0.4 else 0.0)])
            args = (found, growth, backoff, growth_interval, hysteresis, lo, hi)
            OPS.update_scale_(*state_n, *args)
            reference.update_scale_(*state_r, *args)
            for a, b, name in zip(state_n, state_r, ("scale", "growth_tracker", "hysteresis_tracker")):
                assert_bits_equal(a, b, f"{name} at step {step}")


def test_update_scale_through_functional():
    s, gt, h = torch.tensor([8.0]), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    functional.update_scale_(s, gt, h, torch.tensor([1.0]), 2.0, 0.5, 10, backend="native")
    assert s.item() == 4.0 and gt.item() == 0 and h.item() == 0


# ---- AdamW (optim_) ----

ADAM_SIZES = [0, 1, 7, 16, 17, 33, 257, CHUNK + 9]


def _adamw_state(pdt, gdt, master, amsgrad, seed, sizes=ADAM_SIZES, grad_scale=64.0):
    gen = torch.Generator().manual_seed(seed)
    p32 = [torch.randn(n, generator=gen) for n in sizes]
    params = [p.to(pdt) for p in p32]
    grads = [(torch.randn(n, generator=gen) * grad_scale).to(gdt) for n in sizes]
    masters = [p.float() for p in params] if master else []
    m = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
    v = [torch.rand(n, generator=gen) * 0.01 for n in sizes]
    vmax = [t * 1.5 for t in v] if amsgrad else []
    return [params, grads, masters, m, v, vmax]


def test_adamw_many_tiny_tensors_and_thread_counts(monkeypatch):
    gen = torch.Generator().manual_seed(12)
    sizes = torch.randint(0, 50, (2000,), generator=gen).tolist() + [3 * CHUNK + 1]
    base = _adamw_state(torch.bfloat16, torch.bfloat16, True, False, 13, sizes=sizes)
    ss = reference.adamw_step_scalars(1e-2, torch.tensor(3.0), 0.9, 0.999, 0.01, torch.tensor(0.5))
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            st = clone_lists(base)
            native_optim("adamw_")(*st, ss, None, 0.9, 0.999, 1e-8, False, False)
            outs.append(st)
    finally:
        torch.set_num_threads(old)
    ref = clone_lists(base)
    reference.adamw_(*ref, ss, None, 0.9, 0.999, 1e-8, False, False)
    for st in outs:
        for a, b in zip(st, ref):
            assert_all_same(a, b, "state")


# ---- bad inputs ----


def test_unscale_bad_inputs_raise():
    g = [torch.ones(4)]
    cases = [
        ((g, torch.zeros(1, dtype=torch.int32), torch.ones(1)), "found_inf must have dtype Float"),
        ((g, torch.zeros(2), torch.ones(1)), "found_inf must have exactly one element"),
        ((g, torch.zeros(1), torch.ones(1, dtype=torch.float64)), "inv_scale must have dtype Float"),
        (([torch.ones(4, 2)[:, 0]], torch.zeros(1), torch.ones(1)), r"grads\[0\] must be contiguous"),
        (
            ([torch.ones(4), torch.ones(4, dtype=torch.float64)], torch.zeros(1), torch.ones(1)),
            r"grads\[1\] must be float32, float16 or bfloat16, got Double",
        ),
        (([torch.ones(4, dtype=torch.int32)], torch.zeros(1), torch.ones(1)), r"grads\[0\] must be float32"),
    ]
    for (grads, found, inv), msg in cases:
        with pytest.raises(RuntimeError, match="fastamp::unscale_check_: " + msg):
            OPS.unscale_check_(grads, found, inv, True, True)
        assert found.sum().item() == 0


def test_update_scale_bad_inputs_raise():
    s, gt, h, f = torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.zeros(1)
    with pytest.raises(RuntimeError, match="fastamp::update_scale_: growth_tracker must have dtype Int"):
        OPS.update_scale_(s, gt.long(), h, f, 2.0, 0.5, 10, 1, 0.0, math.inf)
    with pytest.raises(RuntimeError, match="fastamp::update_scale_: scale must have exactly one element"):
        OPS.update_scale_(torch.ones(2), gt, h, f, 2.0, 0.5, 10, 1, 0.0, math.inf)


def test_bad_isa_override_raises(monkeypatch):
    monkeypatch.setenv("FASTAMP_CPU_ISA", "sse9")
    with pytest.raises(RuntimeError, match="FASTAMP_CPU_ISA must be one of scalar, avx2, avx512"):
        OPS.unscale_check_([torch.ones(3)], torch.zeros(1), torch.ones(1), True, False)


# ---- torch.library.opcheck ----


def test_opcheck_unscale_check():
    for wb, ss in ((True, True), (False, False)):
        grads = [torch.randn(5), torch.randn(7).half(), torch.randn(3).bfloat16()]
        torch.library.opcheck(OPS.unscale_check_.default, (grads, torch.zeros(1), torch.tensor([0.5]), wb, ss))


def test_opcheck_update_scale():
    args = (
        torch.tensor([4.0]),
        torch.zeros(1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        torch.zeros(1),
        2.0,
        0.5,
        3,
        1,
        0.0,
        math.inf,
    )
    torch.library.opcheck(OPS.update_scale_.default, args)


@pytest.mark.parametrize("found", [None, 0.0, 1.0])
def test_opcheck_adamw(found):
    st = _adamw_state(torch.bfloat16, torch.float16, True, True, seed=16, sizes=[5, 17])
    ss = torch.tensor([1e-3, 0.1, 0.99, 0.5])
    fi = None if found is None else torch.tensor([found])
    torch.library.opcheck(OPS.optim_.default, optim_args("adamw_", (*st, ss, fi, 0.9, 0.999, 1e-8, True, False)))
