"""The reference of ``adamw_q8_``: AdamW on 8-bit block-scaled moments (issue 22).

The defining property: AdamW with exact masters whose moments are replaced by
``decode(encode(.))`` after every step (the same random bits) is, bit for bit, ``adamw_q8_``
with int16 remainders, fp32 masters or fp32 params. Checked here on the reference only; every
backend is checked against ``reference.adamw_q8_`` in tests/backends.
"""

import pytest
import torch

from fastamp import reference
from fastamp.reference import q8

SHAPES = [(1,), (31,), (33,), (4, 16), (5, 37), (2, 3, 64)]


def _bits(x):
    return x.float().contiguous().view(torch.int32)


def _grads(shape, step, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)
    flat = x.reshape(-1)
    if flat.numel() > 8:
        flat[3] = 0.0
        flat[5] = -0.0
        flat[7] = 1e-30  # subnormal once squared
    return x.to(dtype)


def _zeros_q8(shape):
    n = int(torch.Size(shape).numel())
    nb = q8.num_blocks(n)
    z = torch.zeros(shape, dtype=torch.uint8)
    return (
        z.clone(),
        torch.full((nb,), q8.M_SCALE_MIN, dtype=torch.uint8),
        z.clone(),
        torch.full((nb,), q8.W_SCALE_MIN, dtype=torch.uint8),
    )


def _scalars(step, lr=1e-3, wd=0.01, grad_mul=None):
    return reference.adamw_step_scalars(lr, torch.tensor(float(step)), 0.9, 0.999, wd, grad_mul)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("master", ["remainder", "fp32", "fp32-param"])
@pytest.mark.parametrize("sr_codes", [False, True])
def test_equals_adamw_with_requantised_moments(shape, master, sr_codes):
    torch.manual_seed(0)
    p32 = torch.randn(shape)
    if master == "fp32-param":
        p_q8, masters_q8 = p32.clone(), []
        p_ref, master_ref = p32.clone(), []
    else:
        hi, rem = reference.split_master(p32)
        p_q8 = hi.clone()
        masters_q8 = [rem.clone()] if master == "remainder" else [reference.join_master(hi, rem).clone()]
        p_ref, master_ref = hi.clone(), [reference.join_master(hi, rem).clone()]
    cm, sm, cv, sv = _zeros_q8(shape)
    m_ref, v_ref = torch.zeros(shape), torch.zeros(shape)
    rng = torch.tensor([7, 0], dtype=torch.int64)
    n = p32.numel()
    for step in range(1, 9):
        g = _grads(shape, step)
        rng[1] = step - 1
        sc = _scalars(step)
        reference.adamw_q8_([p_q8], [g], masters_q8, [cm], [sm], [cv], [sv], sc, None, rng, 3, 0.9, 0.999, 1e-8,
                            False, False, sr_codes)  # fmt: skip
        reference.adamw_([p_ref], [g], master_ref, [m_ref], [v_ref], [], sc, None, 0.9, 0.999, 1e-8, False, False)
        rm = reference.sr_random16(7, rng[1], 4 * 3 + 1, n, "cpu") if sr_codes else None
        rv = reference.sr_random16(7, rng[1], 4 * 3 + 2, n, "cpu") if sr_codes else None
        c, s = q8.q8_encode_m(m_ref, rm)
        assert torch.equal(c, cm) and torch.equal(s, sm), f"step {step}: m codes"
        m_ref = q8.q8_decode_m(c, s)
        c, s = q8.q8_encode_v(v_ref, rv)
        assert torch.equal(c, cv) and torch.equal(s, sv), f"step {step}: v codes"
        v_ref = q8.q8_decode_v(c, s)
        if master == "remainder":
            assert torch.equal(_bits(reference.join_master(p_q8, masters_q8[0])), _bits(master_ref[0]))
        elif master == "fp32":
            assert torch.equal(_bits(masters_q8[0]), _bits(master_ref[0]))
        else:
            assert torch.equal(_bits(p_q8), _bits(p_ref))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_skip_changes_no_byte_and_nonfinite_grad_makes_nan_block(bad):
    shape = (70,)
    p = torch.randn(shape).bfloat16()
    rem = torch.zeros(shape, dtype=torch.int16)
    cm, sm, cv, sv = _zeros_q8(shape)
    rng = torch.tensor([1, 0], dtype=torch.int64)
    args = lambda g, fi: ([p], [g], [rem], [cm], [sm], [cv], [sv], _scalars(1), fi, rng, 0, 0.9, 0.999, 1e-8,  # noqa: E731
                          False, False, True)  # fmt: skip
    reference.adamw_q8_(*args(_grads(shape, 1), None))
    before = [t.clone() for t in (p, rem, cm, sm, cv, sv)]
    g = _grads(shape, 2)
    g[40] = bad
    reference.adamw_q8_(*args(g, torch.ones(())))
    for a, b in zip(before, (p, rem, cm, sm, cv, sv)):
        assert torch.equal(
            a.view(torch.uint8) if a.dtype != torch.uint8 else a, b.view(torch.uint8) if b.dtype != torch.uint8 else b
        )
    reference.adamw_q8_(*args(g, None))  # no scaler: the bad element's blocks go non-finite
    assert sm[1] == q8.NONFINITE_SCALE and sv[1] == q8.NONFINITE_SCALE
    assert sm[0] != q8.NONFINITE_SCALE and sm[2] != q8.NONFINITE_SCALE
    assert torch.isnan(q8.q8_decode_m(cm, sm)[32:64]).all()


def test_sr_param_without_master_uses_stream_zero():
    shape = (50,)
    torch.manual_seed(1)
    p0 = torch.randn(shape).bfloat16()
    g = _grads(shape, 1)
    rng = torch.tensor([5, 2], dtype=torch.int64)
    out = {}
    for sr_param in (False, True):
        p = p0.clone()
        cm, sm, cv, sv = _zeros_q8(shape)
        reference.adamw_q8_([p], [g], [], [cm], [sm], [cv], [sv], _scalars(1, lr=1e-2), None, rng, 4, 0.9, 0.999,
                            1e-8, False, sr_param, False)  # fmt: skip
        out[sr_param] = p
    # the same fp32 value, rounded to nearest vs stochastically with stream 4 * 4
    p_ref = p0.clone()
    zeros = torch.zeros(shape)
    reference.adamw_([p_ref], [g], [p0.float()], [zeros.clone()], [zeros.clone()], [], _scalars(1, lr=1e-2), None,
                     0.9, 0.999, 1e-8, False, False)  # fmt: skip
    assert torch.equal(out[False], p_ref)
    full = p0.float()
    reference.adamw_([full], [g], [], [zeros.clone()], [zeros.clone()], [], _scalars(1, lr=1e-2), None, 0.9, 0.999, 1e-8,
                     False, False)  # fmt: skip
    rand = reference.sr_random16(5, torch.tensor(2), 16, 50, "cpu")
    assert torch.equal(out[True], reference.round_bf16_stochastic(full, rand).reshape(shape))


def test_sr_without_rng_is_refused():
    p = torch.zeros(4)
    cm, sm, cv, sv = _zeros_q8((4,))
    with pytest.raises(ValueError, match="need rng"):
        reference.adamw_q8_([p], [p.clone()], [], [cm], [sm], [cv], [sv], _scalars(1), None, None, 0, 0.9, 0.999,
                            1e-8, False, False, True)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sr_param", [False, True])
def test_ulp8_master_is_decode_step_encode(dtype, sr_param):
    """int8 masters: the step runs on ulp8_decode(param, c) and stores ulp8_encode(new master) (stream 0)."""
    shape = (3, 45)
    torch.manual_seed(2)
    m32 = torch.randn(shape)
    p, c = reference.ulp8_encode(m32, dtype)
    p_ref, c_ref = p.clone(), c.clone()
    state = _zeros_q8(shape)
    state_ref = [t.clone() for t in state]
    rng = torch.tensor([9, 0], dtype=torch.int64)
    for step in range(1, 7):
        g = _grads(shape, step)
        rng[1] = step - 1
        sc = _scalars(step, lr=1e-3)
        reference.adamw_q8_([p], [g], [c], *[[t] for t in state], sc, None, rng, 2, 0.9, 0.999, 1e-8, False,
                            sr_param, True)  # fmt: skip
        master = reference.ulp8_decode(p_ref, c_ref).clone()
        reference.adamw_q8_([p_ref.clone()], [g], [master], *[[t] for t in state_ref], sc, None, rng, 2, 0.9, 0.999,
                            1e-8, False, False, True)  # fmt: skip
        rand = reference.sr_random16(9, rng[1], 4 * 2, master.numel(), "cpu") if sr_param else None
        p_ref, c_ref = reference.ulp8_encode(master, dtype, rand)
        for a, b in zip(state, state_ref):
            assert torch.equal(a, b), f"step {step}"
        assert torch.equal(p.view(torch.int16), p_ref.view(torch.int16)) and torch.equal(c, c_ref), f"step {step}"
    assert c.abs().max() > 0
