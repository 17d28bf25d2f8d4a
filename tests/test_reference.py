"""Tier 1: fastamp.reference (the spec) against torch's own kernels."""

import math
import random

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
