"""Tier 1: fastamp.reference (the spec) against torch's own kernels."""

import math
import random

import numpy as np
import pytest
import torch
from tolerances import NORM_RTOL

from fastamp import reference

SPECIALS = [0.0, -0.0, 1e-45, -1e-40, 6e-8, 65504.0, 65520.0, 3.0e38, -1.0, 0.5, math.inf, -math.inf, math.nan]


def _adversarial(n, dtype, seed, with_nonfinite):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 100
    if n:
        specials = [v for v in SPECIALS if with_nonfinite or math.isfinite(v)]
        k = min(n, len(specials))
        idx = torch.randperm(n, generator=g)[:k]
        x[idx] = torch.tensor(specials[:k])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inv_scale", [1.0, 2.0**-16, 0.75, 2.0])
@pytest.mark.parametrize("with_nonfinite", [False, True])
def test_unscale_check_matches_torch(dtype, inv_scale, with_nonfinite):
    sizes = [0, 1, 7, 64, 1031]
    grads = [_adversarial(n, dtype, seed=n, with_nonfinite=with_nonfinite) for n in sizes]
    ours = [g.clone() for g in grads]
    theirs = [g.clone() for g in grads]
    f_ours, f_theirs = torch.zeros(()), torch.zeros(())
    inv = torch.tensor(inv_scale)
    reference.unscale_check_(ours, f_ours, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, f_theirs, inv)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
    created = any(
        (~torch.isfinite(g.float() * inv_scale) | ~torch.isfinite((g.float() * inv_scale).to(dtype))).any()
        for g in grads
    )
    if float(f_theirs) == 1.0:
        assert float(f_ours) == 1.0
    else:
        # torch flags only non-finite inputs; fastamp also flags overflow created by unscaling
        assert float(f_ours) == float(created)


def test_unscale_check_only_and_found_inf_never_reset():
    g = torch.tensor([2.0, 4.0])
    found = torch.tensor(5.0)
    s = reference.unscale_check_([g], found, torch.tensor(0.5), write_back=False, compute_sumsq=True)
    assert torch.equal(g, torch.tensor([2.0, 4.0])) and float(found) == 5.0
    assert float(s) == 1.0 + 4.0


def test_unscale_created_overflow_cases():
    inf_scale0 = torch.tensor(math.inf)  # scale == 0
    g = torch.zeros(3)
    found = torch.zeros(())
    reference.unscale_check_([g], found, inf_scale0)
    assert float(found) == 1.0  # 0 * inf = nan
    h = torch.tensor([60000.0], dtype=torch.float16)
    found = torch.zeros(())
    reference.unscale_check_([h], found, torch.tensor(2.0))
    assert float(found) == 1.0 and torch.isinf(h).all()
    found = torch.zeros(())
    reference.unscale_check_([torch.tensor([60000.0], dtype=torch.float16)], found, torch.tensor(2.0), write_back=False)
    assert float(found) == 0.0  # 120000 is finite in fp32 registers: a fused optimizer may use it


def test_sumsq_matches_clip_grad_norm():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * 1000 for n in (1, 100, 4097)]
    bf = [g.bfloat16() for g in grads]
    for gs in (grads, bf):
        s = reference.unscale_check_(
            [g.clone() for g in gs], torch.zeros(()), torch.tensor(2.0**-10), compute_sumsq=True
        )
        ref = torch.nn.utils.get_total_norm([g.float() * 2.0**-10 for g in gs])
        assert math.isclose(math.sqrt(float(s)), float(ref), rel_tol=NORM_RTOL)


def _random_found_inf(rng):
    r = rng.random()
    if r < 0.7:
        return 0.0
    return rng.choice([1.0, math.nan, 0.5, 2.0, -1.0, math.inf])


@pytest.mark.parametrize(
    "growth,backoff,interval",
    [(2.0, 0.5, 1), (2.0, 0.5, 3), (2.0, 0.5, 2000), (1.7, 0.3, 2), (3.0, 0.999, 5), (2.0, 0.5, 0)],
)
def test_update_scale_bit_exact_with_torch(growth, backoff, interval):
    rng = random.Random(interval * 31 + int(growth * 10))
    for init in (2.0**16, 1.0, 2.0**125, 3.0e-38):
        s_t, s_r = torch.tensor(init), torch.tensor(init)
        g_t = torch.zeros((), dtype=torch.int32)
        g_r = torch.zeros((), dtype=torch.int32)
        h_r = torch.ones((), dtype=torch.int32)
        for _ in range(600):
            f = torch.tensor(_random_found_inf(rng))
            torch._amp_update_scale_(s_t, g_t, f, growth, backoff, interval)
            reference.update_scale_(s_r, g_r, h_r, f, growth, backoff, interval)
            assert torch.equal(s_t, s_r) or (s_t.isnan() and s_r.isnan())
            assert torch.equal(g_t, g_r)
            assert int(h_r) == 1 or int(h_r) == 0


def test_update_scale_tracker_above_interval_never_grows():
    """torch's == test: an interval lowered below the tracker means no growth (until wrap)."""
    s = torch.tensor(8.0)
    g = torch.tensor(10, dtype=torch.int32)
    h = torch.ones((), dtype=torch.int32)
    for _ in range(20):
        reference.update_scale_(s, g, h, torch.zeros(()), 2.0, 0.5, 5)
    assert float(s) == 8.0 and int(g) == 30


# ---- sqrt: correctly rounded on every CPU ----


def _is_correctly_rounded_sqrt(x: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Per element: is the fp32 ``r`` the correctly rounded sqrt of the positive fp32 ``x``?

    Exact, whatever the machine: ``r`` is correct iff ``lo**2 < x < hi**2`` for the midpoints
    ``lo``, ``hi`` between ``r`` and its fp32 neighbours. Those midpoints have 25 significant
    bits, so their squares (at most 50 bits) and ``x`` are exact in fp64 and only IEEE
    multiplications and comparisons are used (no sqrt). No fp32 square root is a midpoint.
    """
    x64, r32 = x.astype(np.float64), r.astype(np.float32)
    lo = (r32.astype(np.float64) + np.nextafter(r32, np.float32(0)).astype(np.float64)) / 2
    hi = (r32.astype(np.float64) + np.nextafter(r32, np.float32(np.inf)).astype(np.float64)) / 2
    return (lo * lo < x64) & (x64 < hi * hi)


def _midpoints_with_nearly_representable_squares() -> np.ndarray:
    """Odd 25-bit ``M`` whose square is within 2**12 of the fp32 grid it is rounded to.

    ``m = M * 2**q`` is an fp32 rounding midpoint; the fp32 value ``x`` nearest ``m * m``
    has a square root within a few fp64 ulps of ``m``: the inputs where a rounding error in
    the fp64 root could matter. ``M * M`` has 49-50 bits and fp32 keeps 24, so the grid of
    ``x`` is ``2**25`` (``M < 2**24.5``) or ``2**26``; ``M * M = c (mod grid)`` with a small
    ``c`` (``c = 1 (mod 8)``, as for every odd square) is solved by Hensel lifting.
    """
    found = set()
    for c in range(-(2**12) + 1, 2**12, 8):
        for bits in (25, 26):
            r = 1  # r*r = c (mod 8); lift to r*r = c (mod 2**bits)
            for i in range(3, bits):
                if (r * r - c) % 2 ** (i + 1):
                    r += 2 ** (i - 1)
            for root in (r, -r, r + 2 ** (bits - 1), -r + 2 ** (bits - 1)):
                big_m = root % 2**bits
                if 2**24 <= big_m < 2**25 and (big_m * big_m >= 2**49) == (bits == 26):
                    found.add(big_m)
    return np.array(sorted(found), dtype=np.float64)


_HARD_MIDPOINTS = _midpoints_with_nearly_representable_squares()


def _hard_sqrt_inputs(n: int, seed: int) -> np.ndarray:
    """Random positive fp32 (every binade, subnormals too), and for rounding midpoints m the
    fp32 values nearest m*m (and their neighbours): the roots closest to a rounding boundary."""
    rng = np.random.default_rng(seed)
    random_bits = rng.integers(1, 0x7F800000, n, dtype=np.int64).astype(np.uint32).view(np.float32)
    hard = _HARD_MIDPOINTS
    odd = np.concatenate([rng.integers(2**23, 2**24, n, dtype=np.int64) * 2 + 1, np.repeat(hard, 64)])
    m = np.ldexp(odd.astype(np.float64), rng.integers(-98, 39, odd.size))
    near = (m * m).astype(np.float32)  # m*m is exact in fp64 (<= 50 bits)
    near = near[np.isfinite(near) & (near > 0)]
    around = [near, np.nextafter(near, np.float32(0)), np.nextafter(near, np.float32(np.inf))]
    return np.concatenate([random_bits, *around])


def test_sqrt_rn_is_correctly_rounded():
    x = _hard_sqrt_inputs(200_000, seed=0)
    got = reference.sqrt_rn(torch.from_numpy(x))
    assert got.dtype == torch.float32
    ok = _is_correctly_rounded_sqrt(x, got.numpy())
    assert ok.all(), f"{int((~ok).sum())} of {x.size} not correctly rounded, e.g. x={x[~ok][:3].tolist()}"
    specials = torch.tensor([0.0, -0.0, math.inf, -1.0, -math.inf, math.nan])
    out = reference.sqrt_rn(specials)
    assert torch.equal(out[:3], torch.tensor([0.0, -0.0, math.inf])) and bool(out[:3].signbit()[1])
    assert out[3:].isnan().all()
    for dtype in (torch.float16, torch.bfloat16):
        low = torch.from_numpy(x[:5000]).to(dtype)
        low = low[torch.isfinite(low) & (low > 0)]
        want = torch.from_numpy(np.sqrt(low.double().numpy())).to(dtype)  # hardware fp64 sqrt, one rounding
        assert torch.equal(reference.sqrt_rn(low), want), dtype


@pytest.mark.parametrize("push", [-1, 0, 1])
def test_sqrt_in_fp64_rounded_once_needs_only_a_faithful_fp64_sqrt(push):
    """Why ``sqrt_rn`` is exact on every CPU: its fp64 root may be off by one fp64 ulp (torch's
    is on ~1.3% of inputs on an AMD EPYC) and the rounding to fp32 is still correct, because no
    fp32 square root lies within 2 fp64 ulps of an fp32 rounding midpoint."""
    x = _hard_sqrt_inputs(200_000, seed=1)
    root = np.sqrt(x.astype(np.float64))
    if push:
        root = np.nextafter(root, np.inf if push > 0 else 0.0)
    ok = _is_correctly_rounded_sqrt(x, root.astype(np.float32))
    assert ok.all(), f"{int((~ok).sum())} of {x.size} wrong with the fp64 root pushed {push:+d} ulp"
    # the check itself can fail: fp32 sqrt one fp32 ulp off is caught
    wrong = np.nextafter(root.astype(np.float32), np.float32(np.inf))
    assert not _is_correctly_rounded_sqrt(x, wrong).any()
    # and the inputs are the hard ones: some roots lie within 4 fp64 ulps of a midpoint
    far = np.sqrt(x.astype(np.float64))
    for _ in range(4):
        far = np.nextafter(far, np.inf)
    assert not _is_correctly_rounded_sqrt(x, far.astype(np.float32)).all()


# ---- the reference does not depend on the instruction set torch dispatches to ----


def _finite_bits(n: int, gen: torch.Generator, lo_exp: int, hi_exp: int) -> torch.Tensor:
    """Random finite fp32 built from integer bit fields (no torch float maths, so the same data
    whatever instruction set torch runs): random sign and mantissa, exponents lo_exp..hi_exp."""
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64) << 31
    exp = torch.randint(lo_exp + 127, hi_exp + 128, (n,), generator=gen, dtype=torch.int64) << 23
    mant = torch.randint(0, 2**23, (n,), generator=gen, dtype=torch.int64)
    bits = sign | exp | mant
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def _reference_results() -> list[torch.Tensor]:
    """Every per-element output of the reference ops on adversarial data (the sums of squares,
    a torch reduction, are left out: they are only specified within SUMSQ_RTOL)."""
    gen = torch.Generator().manual_seed(0)
    sizes = (1, 31, 1000, 4099)
    out = []
    grads = [_finite_bits(n, gen, -30, 20) for n in sizes]
    grads[2][7], grads[3][5] = math.inf, 1e-45
    for dtype, inv in ((torch.float32, 0.75), (torch.bfloat16, 2.0**-7), (torch.float16, 3.0)):
        gs = [g.to(dtype) for g in grads]
        found = torch.zeros(())
        counts, absmax = torch.zeros(len(gs), 3, dtype=torch.int64), torch.zeros(len(gs))
        reference.unscale_check_stats_(gs, found, torch.tensor(inv), True, False, counts, absmax)
        out += [*gs, found, counts, absmax]
    s, gt, ht = torch.tensor(3.0e4), torch.zeros((), dtype=torch.int32), torch.full((), 2, dtype=torch.int32)
    for i in range(40):
        reference.update_scale_(s, gt, ht, torch.tensor(float(i % 7 == 3)), 1.7, 0.3, 3, 2, 1e-3, 1e6)
        out.append(s.clone())
    # step scalars given as fp32 numbers: adamw_step_scalars (torch's fp64 pow) is not under test
    scalars = torch.tensor([3.7e-2, 0.0447, 1 - 1e-3 * 0.01, 2.0**-10])
    for beta1, amsgrad in ((0.9, True), (0.3, False)):
        params = [_finite_bits(n, gen, -8, 3) for n in sizes]
        p_lowp = [params[0], params[1].bfloat16(), params[2].half(), params[3].bfloat16()]
        masters = [p.float() for p in p_lowp]
        ms = [_finite_bits(n, gen, -12, 0) for n in sizes]
        vs = [_finite_bits(n, gen, -24, 0).abs() for n in sizes]
        vmax = [v * 1.5 for v in vs]
        gs = [_finite_bits(n, gen, -6, 14) for n in sizes]
        for _ in range(3):
            reference.adamw_(p_lowp, gs, masters, ms, vs, vmax, scalars, None, beta1, 0.999, 1e-8, amsgrad, not amsgrad)
        out += [*p_lowp, *masters, *ms, *vs, *vmax]
        bf = [p.bfloat16() for p in params]
        _, rems = zip(*(reference.split_master(p) for p in params))
        rems = list(rems)
        bm = [m.bfloat16() for m in ms]
        bv = [v.bfloat16() for v in vs]
        rng = torch.tensor([1234, 5])
        reference.adamw_bf16_(bf, gs, rems, ms, vs, vmax, scalars, None, None, 0, beta1, 0.99, 1e-6, amsgrad, False)
        reference.adamw_bf16_(bf, gs, [], bm, bv, [], scalars, torch.zeros(()), rng, 3, beta1, 0.99, 0.0, False, True)
        out += [*bf, *rems, *bm, *bv]
        bufs = [m.clone() for m in ms]
        sgd_scalars = torch.tensor([0.05, 2.0**-4, 0.0])
        reference.sgd_(params, gs, [], bufs, sgd_scalars, None, rng, 0, 0.9, 0.1, 0.01, amsgrad, not amsgrad)
        reference.sgd_(bf, gs, rems, [], sgd_scalars, None, None, 0, 0.0, 0.0, 0.0, False, False)
        out += [*params, *bufs, *bf, *rems]
    return out


def _digest(tensors: list[torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        t = t.contiguous()
        if t.is_floating_point():
            t = torch.where(t.isnan(), torch.full_like(t, math.nan), t)  # NaN payloads are not specified
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.slow  # reruns the reference in fresh processes under torch's other CPU builds
def test_reference_is_the_same_whatever_instruction_set_torch_uses():
    """torch picks its CPU kernels by instruction set (ATEN_CPU_CAPABILITY); some of them
    (add with alpha, addcmul, addcdiv, lerp, exp, reductions) round differently on AVX2 than on
    the baseline build. The reference must not use those: rerun in torch's baseline (and AVX2)
    build, its every per-element result must be bit-identical to this process's."""
    import os
    import subprocess
    import sys

    here = _digest(_reference_results())
    current = torch.backends.cpu.get_cpu_capability().lower()
    others = [c for c in ("default", "avx2") if c != current and not (c == "avx2" and current == "default")]
    if not others:
        pytest.skip(f"torch runs its baseline kernels here ({current}): nothing to compare with")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = "import test_reference as t; print(t._digest(t._reference_results()))"
    for capability in others:
        # tests/ (tolerances.py) on the path, as pytest's pythonpath setting gives this process.
        pythonpath = os.pathsep.join(p for p in (os.path.dirname(tests_dir), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, PYTHONPATH=pythonpath)
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=tests_dir, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip().splitlines()[-1] == here, f"reference differs with ATEN_CPU_CAPABILITY={capability}"


# ---- per-tensor step scalars: row i of an [n, k] tensor is tensor i's ----


def _optim_case(op: str, n: int, seed: int):
    """A launch of ``n`` tensors of op ``op`` (reference arguments) with one count per tensor."""
    g = torch.Generator().manual_seed(seed)
    sizes = [1 + 37 * i for i in range(n)]
    counts = torch.tensor([1.0, 2.0, 7.0, 1000.0, 3.0][:n])
    params = [torch.randn(s, generator=g).bfloat16() for s in sizes]
    grads = [torch.randn(s, generator=g).bfloat16() for s in sizes]
    if op == "sgd_":
        bufs = [torch.randn(s, generator=g) for s in sizes]
        scalars = reference.sgd_step_scalars(0.1, counts - 1, torch.tensor(0.5))
        return params, grads, [p.float() for p in params], [bufs], scalars, (None, None, 0, 0.9, 0.1, 0.01, True, False)
    m = [torch.randn(s, generator=g) for s in sizes]
    v = [torch.rand(s, generator=g) for s in sizes]
    scalars = reference.adamw_step_scalars(1e-3, counts, 0.9, 0.999, 0.01, torch.tensor(0.25))
    if op == "adamw_":
        return params, grads, [p.float() for p in params], [m, v, []], scalars, (None, 0.9, 0.999, 1e-8, False, False)
    rem = [torch.zeros(s, dtype=torch.int16) for s in sizes]
    return params, grads, rem, [m, v, []], scalars, (None, None, 0, 0.9, 0.999, 1e-8, False, False)


@pytest.mark.parametrize("op", ["adamw_", "adamw_bf16_", "sgd_"])
def test_per_tensor_step_scalars_are_each_tensors_own(op):
    """``step_scalars`` of shape [n, k]: the launch equals n launches of one tensor, each with its row."""
    n = 5
    params, grads, masters, states, scalars, rest = _optim_case(op, n, seed=3)
    k = 3 if op == "sgd_" else 4
    assert scalars.shape == (n, k) and scalars.dtype == torch.float32
    fn = getattr(reference, op)
    each = [[t.clone() for t in ts] for ts in (params, masters, *states)]
    fn(params, grads, masters, *states, scalars, *rest)
    for i in range(n):
        sl = [[ts[i]] if ts else [] for ts in each]
        fn(sl[0], [grads[i]], sl[1], *sl[2:], scalars[i].clone(), *rest)
        assert torch.equal(each[0][i].view(torch.int16), params[i].view(torch.int16)), f"tensor {i}"
        for got, want in zip(each[2:], states):
            if want:
                assert torch.equal(got[i], want[i]), f"tensor {i}"
    # rows differ, so the shared form would not have given this
    assert not torch.equal(scalars[0], scalars[-1])


@pytest.mark.parametrize("fn", ["adamw", "sgd"])
def test_step_scalars_of_a_count_vector_are_the_0dim_ones(fn):
    """Row i of the vector form is bit-identical to the 0-dim form at count i, for every count.

    The counts are many (so torch's vectorised fp64 loops run, not only their scalar tails)
    and cover the early steps, where ``1 - beta**count`` amplifies any rounding difference.
    """
    counts = torch.cat([torch.arange(0.0, 3000.0), torch.tensor([123456.0, 2.0**24 - 1, 2.0**24])])
    if fn == "adamw":
        vec = reference.adamw_step_scalars(3e-4, counts.clamp(min=1), 0.9, 0.999, 0.1, torch.tensor(2.0**-16))
    else:
        vec = reference.sgd_step_scalars(0.1, counts, torch.tensor(0.5))
    for i, c in enumerate(counts):
        if fn == "adamw":
            one = reference.adamw_step_scalars(3e-4, c.clamp(min=1), 0.9, 0.999, 0.1, torch.tensor(2.0**-16))
        else:
            one = reference.sgd_step_scalars(0.1, c, torch.tensor(0.5))
        assert torch.equal(vec[i], one), (fn, float(c))


@pytest.mark.parametrize("shape", [(3, 4), (1, 4), (5,), (3,), (8,), (2, 4, 1)])
def test_step_scalars_of_the_wrong_shape_are_refused(shape):
    p = [torch.zeros(3), torch.zeros(4)]
    with pytest.raises(ValueError, match=r"expected \[4\] or \[2, 4\]"):
        reference.adamw_(
            p,
            p,
            [],
            [torch.zeros(3), torch.zeros(4)],
            [torch.zeros(3), torch.zeros(4)],
            [],
            torch.zeros(shape),
            None,
            0.9,
            0.999,
            1e-8,
            False,
            False,
        )
