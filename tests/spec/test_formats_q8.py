"""Tier 1: the 8-bit state formats of issue 22 (q8 moments, ulp8 masters, bytes per param), as properties.

Every oracle here is independent of the code under test: fp64 maths from the format's
definition (``math.frexp``, value tables built from exponent and mantissa), never the
integer formulas of ``fastamp.reference.q8`` / ``ulp8``.
"""

import math

import pytest
import torch
from helpers import assert_bits_equal
from tolerances import SR_MEAN_SIGMAS

from fastamp.reference import q8, sr_random16
from fastamp.reference.layout import master_streams, moment_streams, state_bytes_per_param
from fastamp.reference.q8 import q8_decode_m, q8_decode_v, q8_encode_m, q8_encode_v
from fastamp.reference.ulp8 import ulp8_decode, ulp8_encode

# name -> (encode, decode, mantissa bits, number of magnitude codes, smallest and largest scale byte encode writes)
CODECS = {
    "m": (q8_encode_m, q8_decode_m, 4, 128, 11, 254),
    "v": (q8_encode_v, q8_decode_v, 5, 256, 75, 190),
}


def _rand(n, counter=0, stream=1, seed=1234):
    return sr_random16(seed, torch.tensor(counter), stream, n, "cpu")


def _code_fraction(q, mant_bits):
    """A code magnitude's value as a fraction of the block scale, from its exponent and mantissa fields."""
    e, m = q >> mant_bits, q & ((1 << mant_bits) - 1)
    if e == 0:
        return m / 2**mant_bits * 2.0**-7
    return (1 + m / 2**mant_bits) * 2.0 ** (e - 8)


def _decoded_fp64(which, codes, s):
    """The exact decoded values (fp64), straight from the format's definition."""
    mant = CODECS[which][2]
    scale = 2.0 ** (s - 126)
    out = []
    for c in codes:
        if which == "m":
            val = _code_fraction(c & 0x7F, mant) * scale
            out.append(-val if c & 0x80 else val)
        else:
            out.append((_code_fraction(c, mant) * scale) ** 2)
    return torch.tensor(out, dtype=torch.float64)


def _all_codes_blocks(which):
    """Every code once, in blocks of 31 codes plus the top code (so every block keeps its scale)."""
    ncodes = 256
    top = 0xFF if which == "v" else 0x7F
    codes = []
    for start in range(0, ncodes, 31):
        chunk = list(range(start, min(start + 31, ncodes)))
        codes += chunk + [top] * (32 - len(chunk))
    return torch.tensor(codes, dtype=torch.uint8)


# ---- q8: exactness of decode, round trips --------------------------------------------------------


@pytest.mark.parametrize("which", ["m", "v"])
def test_q8_all_codes_decode_exactly_and_round_trip_across_scales(which):
    encode, decode, _, _, s_lo, s_hi = CODECS[which]
    codes = _all_codes_blocks(which)
    nb = codes.numel() // 32
    for s in range(s_lo, s_hi + 1):
        scales = torch.full((nb,), s, dtype=torch.uint8)
        x = decode(codes, scales)
        want = _decoded_fp64(which, codes.tolist(), s)
        assert torch.equal(x.double(), want), f"scale byte {s}: decode is not exact"
        if which == "m":
            assert torch.equal(torch.signbit(x), (codes & 0x80) != 0)
        for rand in (None, _rand(codes.numel(), counter=s)):
            c2, s2 = encode(x, rand)
            assert_bits_equal(c2, codes, f"codes at scale byte {s}, rand={rand is not None}")
            assert_bits_equal(s2, scales, f"scales at scale byte {s}")


@pytest.mark.parametrize("which", ["m", "v"])
def test_q8_zero_block_is_the_smallest_scale_and_round_trips(which):
    encode, decode, _, _, s_lo, _ = CODECS[which]
    x = torch.tensor([0.0, -0.0] * 16 + [0.0] * 5)
    codes, scales = encode(x)
    assert scales.tolist() == [s_lo, s_lo]
    want = [0x80 * (which == "m" and i % 2 == 1 and i < 32) for i in range(37)]
    assert codes.tolist() == want
    y = decode(codes, scales)
    assert torch.equal(y, torch.zeros(37)) and torch.equal(torch.signbit(y), torch.tensor(want) != 0)


def _adversarial_values(n, seed, which):
    """fp32 values spanning the whole fp32 range with specials: ±0, fp32 subnormals, fp16 max, huge."""
    g = torch.Generator().manual_seed(seed)
    logmag = torch.rand(n, generator=g, dtype=torch.float64) * 260 - 150
    x = (2.0**logmag) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    # every other block with a narrow spread (the usual case), the others over the whole range
    nb = n // 32 + 1
    narrow = torch.randn(nb * 32, generator=g, dtype=torch.float64) * (
        2.0 ** torch.randint(-40, 40, (nb,), generator=g)
    ).double().repeat_interleave(32)
    x = torch.where(torch.arange(n) % 64 < 32, x, narrow[:n])
    specials = [0.0, -0.0, 1e-45, -3e-39, 1.1754942e-38, 65504.0, 1.0, -0.5, 3.0e38, -3.4028235e38]
    k = min(n, len(specials))
    x[torch.randperm(n, generator=g)[:k]] = torch.tensor(specials[:k], dtype=torch.float64)
    x = x.float()
    return x.abs() if which == "v" else x


@pytest.mark.parametrize("which", ["m", "v"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_q8_encode_of_decode_is_idempotent(which, stochastic):
    encode, decode, *_ = CODECS[which]
    x = _adversarial_values(32 * 211 + 13, seed=7, which=which)
    c1, s1 = encode(x, _rand(x.numel(), 1) if stochastic else None)
    y = decode(c1, s1)
    for rand in (None, _rand(x.numel(), 2)):
        c2, s2 = encode(y, rand)
        assert_bits_equal(c2, c1, "codes")
        assert_bits_equal(s2, s1, "scales")


# ---- q8: rounding -----------------------------------------------------------------------------------


def _oracle_nearest(which, x, block=32):
    """Round-to-nearest-even code magnitudes from fp64 maths: the block scale from frexp of the absmax,
    the nearest of all codes (ties to the even code; one step past the top saturates), the w floor."""
    _, _, mant, ncodes, s_min, _ = CODECS[which]
    t = x.double().abs()
    if which == "v":
        t = t.sqrt()  # correctly rounded to fp32 below, as the spec's sqrt_rn
        t = t.float().double()
    n = t.numel()
    grid = torch.tensor([_code_fraction(q, mant) for q in range(ncodes)] + [1.0], dtype=torch.float64)
    out = []
    for b in range(0, n, block):
        blk = t[b : b + block]
        amax = float(blk.max())
        s = max(math.frexp(amax)[1] + 126 if amax > 0 else 0, s_min)
        frac = blk / 2.0 ** (s - 126)
        dist = (frac[:, None] - grid[None, :]).abs()
        best = dist.min(dim=1, keepdim=True).values
        tied = dist == best
        odd = torch.arange(ncodes + 1) % 2 == 1
        choice = torch.where(tied & ~odd, 1, 0).argmax(dim=1)
        choice = torch.where(tied.sum(dim=1) == 1, tied.int().argmax(dim=1), choice)
        choice = torch.clamp(choice, max=ncodes - 1)
        if which == "v":
            choice = torch.where((blk > 0) & (choice == 0), 1, choice)
        out.append(choice)
    return torch.cat(out)


def _rounding_cases(which, seed):
    """Random blocks plus exact midpoints between neighbouring codes (ties) and values near the top."""
    _, _, mant, ncodes, *_ = CODECS[which]
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(24):
        anchor = 2.0 ** float(torch.randint(-60, 60, (), generator=g))  # v = anchor^2 stays finite
        fr = torch.rand(31, generator=g, dtype=torch.float64) * 2.0 ** -torch.randint(0, 12, (31,), generator=g)
        rows.append(torch.cat([torch.tensor([anchor * 0.75]), fr * anchor]))
    fracs = [_code_fraction(q, mant) for q in range(ncodes)] + [1.0]
    mids = torch.tensor([(a + b) / 2 for a, b in zip(fracs[:-1], fracs[1:])], dtype=torch.float64)
    for i in range(0, mids.numel(), 31):
        chunk = mids[i : i + 31]
        rows.append(torch.cat([torch.tensor([0.75]), chunk, torch.full((31 - chunk.numel(),), 0.3)]))
    subn = torch.tensor([2.0**-149 * k for k in range(1, 32)], dtype=torch.float64)
    rows.append(torch.cat([torch.tensor([2.0**-120]), subn]))
    x = torch.cat(rows)
    if which == "v":
        return (x * x).float()  # v whose roots are (near) the w midpoints
    x = torch.where(torch.arange(x.numel()) % 3 == 0, -x, x)
    return x.float()


@pytest.mark.parametrize("which", ["m", "v"])
def test_q8_nearest_is_correctly_rounded(which):
    encode, *_ = CODECS[which]
    x = _rounding_cases(which, seed=3)
    codes, _ = encode(x)
    mag = codes.to(torch.int64) & (0x7F if which == "m" else 0xFF)
    want = _oracle_nearest(which, x)
    assert torch.equal(mag, want), (mag != want).nonzero()[:5].flatten().tolist()
    if which == "m":
        assert torch.equal((codes & 0x80) != 0, torch.signbit(x))


@pytest.mark.parametrize("which", ["m", "v"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_q8_other_block_sizes_for_the_ablation(which, stochastic):
    """``block=64`` (benchmarks/ablation_q8.py): one scale per 64 elements, the largest of its two
    32-blocks' scales, and the same codes as block 32 wherever those agree; RNE codes are correctly
    rounded against the 64-block scale and decode exactly; ``block=32`` is the default, bit for bit."""
    encode, decode, *_ = CODECS[which]
    x = _rounding_cases(which, seed=5)
    x = torch.cat([x, x[:45]])  # a partial last block of each size
    n = x.numel()
    rand = _rand(n, 3) if stochastic else None
    c32, s32 = encode(x, rand)
    c_def, s_def = encode(x, rand, block=32)
    assert_bits_equal(c_def, c32, "block=32 codes")
    assert_bits_equal(s_def, s32, "block=32 scales")
    c64, s64 = encode(x, rand, block=64)
    assert s64.shape == (-(-n // 64),) and q8.num_blocks(n, block=64) == s64.numel()
    pairs = torch.nn.functional.pad(s32, (0, s32.numel() % 2)).view(-1, 2)
    assert_bits_equal(s64, pairs.amax(dim=1), "block-64 scale = the larger of its two 32-block scales")
    same = (pairs[:, 0] == pairs[:, 1]).repeat_interleave(64)[:n]
    assert same.any() and (~same).any()
    assert torch.equal(c64[same], c32[same])
    assert not torch.equal(c64[~same], c32[~same])  # the smaller half is coded on the coarser grid
    y = decode(c64, s64, block=64)
    per_elem = s64.to(torch.int64).repeat_interleave(64)[:n].tolist()
    want = torch.cat([_decoded_fp64(which, [c], s) for c, s in zip(c64.tolist(), per_elem)])
    assert torch.equal(y.double(), want)
    if not stochastic:
        mag = c64.to(torch.int64) & (0x7F if which == "m" else 0xFF)
        assert torch.equal(mag, _oracle_nearest(which, x, block=64))
    c2, s2 = encode(y, None, block=64)
    assert_bits_equal(c2, c64, "block-64 encode of decode")
    assert_bits_equal(s2, s64, "block-64 scales of decode")


def test_q8_bad_block_is_refused():
    x, codes = torch.zeros(100), torch.zeros(100, dtype=torch.uint8)
    for bad in (0, -32):
        with pytest.raises(ValueError, match="block must be >= 1"):
            q8_encode_m(x, block=bad)
    for bad in (32.0, True, "32"):
        with pytest.raises(TypeError, match="block must be an int"):
            q8_encode_v(x, block=bad)
    with pytest.raises(TypeError, match="block must be an int"):
        q8.num_blocks(100, block=None)
    with pytest.raises(ValueError, match="100 codes need 2 scale bytes"):
        q8_decode_v(codes, torch.zeros(4, dtype=torch.uint8), block=64)  # block-32 scales read as block 64
    with pytest.raises(ValueError, match="block must be >= 1"):
        q8_decode_m(codes, torch.zeros(4, dtype=torch.uint8), block=0)


@pytest.mark.parametrize("which", ["m", "v"])
def test_q8_stochastic_rounding_is_unbiased_and_picks_a_neighbour(which):
    """Each of 62 values is encoded 4,096 times with different random bits (one call, replicated blocks).

    Mean of the decoded values (w for v) minus the value, in code steps: within SR_MEAN_SIGMAS
    standard errors (a draw lies in [-1, 1] step: sd <= 1/2) plus the spec's truncation bias of
    at most 2^-16 step; every draw is one of the two codes around the value.
    """
    encode, decode, mant, ncodes, *_ = CODECS[which]
    g = torch.Generator().manual_seed(11)
    reps = 4096
    blocks = []
    for anchor in (1.0, 2.0**-30):
        vals = torch.rand(31, generator=g, dtype=torch.float64) * 2.0 ** -torch.randint(0, 9, (31,), generator=g)
        blocks.append(torch.cat([torch.tensor([0.96875]), vals]) * anchor)
    base = torch.cat(blocks).float()
    x = (base * base if which == "v" else base).repeat(reps)
    codes, scales = encode(x, _rand(x.numel(), counter=5, stream=2))
    y = decode(codes, scales).double().view(reps, -1)
    t = base.double()
    if which == "v":
        y = y.sqrt()
    # the two codes around each value, and the step between them
    s = torch.tensor([math.frexp(float(t[b : b + 32].max()))[1] + 126 for b in range(0, t.numel(), 32)])
    scale = (2.0 ** (s - 126)).double().repeat_interleave(32)
    grid = torch.tensor([_code_fraction(q, mant) for q in range(ncodes)], dtype=torch.float64)
    frac = t / scale
    lo_idx = torch.searchsorted(grid, frac, right=True) - 1
    lo = grid[lo_idx] * scale
    hi = grid[torch.clamp(lo_idx + 1, max=ncodes - 1)] * scale
    exact = lo == t
    assert bool(((y == lo) | (y == hi)).all())
    step = torch.where(exact, torch.ones_like(t), hi - lo)
    err = ((y.mean(dim=0) - t) / step)[~exact]
    bound = SR_MEAN_SIGMAS * 0.5 / math.sqrt(reps) + 2.0**-16
    assert float(err.abs().max()) <= bound, float(err.abs().max())
    assert bool((y == lo).any(dim=0)[~exact].all() and (y == hi).any(dim=0)[~exact].all())
    assert bool((y == t).all(dim=0)[exact].all())


def test_q8_stochastic_rounding_tracks_an_ema_that_nearest_stalls():
    """v = 0.999 v + 0.001 g^2 with g^2 = 1 from v = 4, 2,000 steps through q8 (decode, update, encode).

    Exact: 1 + 3 * 0.999^2000 = 1.4056. Each step moves v by about 0.003, below half a code step
    near v = 4 (w = 2 on a scale of 4: steps of 1/16 in w, about 1/4 in v), so round-to-nearest
    never leaves its start (measured 3.876); stochastic rounding follows the decay (measured 1.394).
    """
    n, steps = 1024, 2000
    exact = 1 + 3 * 0.999**steps
    for mode in ("nearest", "stochastic"):
        codes, scales = q8_encode_v(torch.full((n,), 4.0))
        for t in range(steps):
            v = q8_decode_v(codes, scales) * 0.999 + 0.001
            codes, scales = q8_encode_v(v, _rand(n, counter=t, stream=2) if mode == "stochastic" else None)
        mean = float(q8_decode_v(codes, scales).double().mean())
        if mode == "nearest":
            assert mean > 3.8
        else:
            assert abs(mean / exact - 1) < 0.03, mean


@pytest.mark.parametrize("stochastic", [False, True])
def test_q8_nonzero_v_never_decodes_to_zero(stochastic):
    tiny = [1e-45, 2.0**-149 * 3, 1e-40, 1.1754942e-38, 1e-30, 1e-20]
    x = torch.tensor(([3.0e38] + tiny * 5)[:32] + ([1e-10] + tiny * 6)[:32] + tiny + [0.0, -0.0])
    codes, scales = q8_encode_v(x, _rand(x.numel()) if stochastic else None)
    v = q8_decode_v(codes, scales)
    assert bool((v[x > 0] > 0).all()) and bool((v[x == 0] == 0).all())
    assert bool(torch.isfinite(v).all())
    assert float(v[x > 0].min()) >= 2.0**-126  # no decoded v is subnormal


# ---- q8: blocks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["m", "v"])
@pytest.mark.parametrize("n", [0, 1, 31, 33, 70, 97])
def test_q8_partial_blocks_and_shapes(which, n):
    encode, decode, *_ = CODECS[which]
    x = _adversarial_values(max(n, 1), seed=n, which=which)[:n].reshape(-1, 1) if n else torch.zeros(0, 1)
    codes, scales = encode(x)
    assert codes.shape == x.shape and codes.dtype == torch.uint8
    assert scales.shape == ((n + 31) // 32,) and scales.dtype == torch.uint8
    padded = torch.cat([x.reshape(-1), torch.zeros((-n) % 32)])
    c_pad, s_pad = encode(padded)
    assert_bits_equal(codes.reshape(-1), c_pad[:n], "a partial block codes as if padded with zeros")
    assert_bits_equal(scales, s_pad, "scales")
    assert decode(codes, scales).shape == x.shape


@pytest.mark.parametrize("which", ["m", "v"])
@pytest.mark.parametrize("n", [33, 4097])
def test_q8_codecs_give_the_same_bits_under_inductor(which, n, fresh_dynamo):
    """The codecs run inside compiled optimizer steps (SGD / Lion q8 moments): inductor must not change a bit.

    torch 2.13's CPU inductor left a last partial block unwritten with the flat per-element
    scale form the codecs had (see ``fastamp.reference.q8._blocks``); nearest and stochastic.
    """
    encode, decode, *_ = CODECS[which]
    x = _adversarial_values(n, seed=n, which=which)
    rand = _rand(n)
    enc_c, dec_c = torch.compile(encode, backend="inductor"), torch.compile(decode, backend="inductor")
    for r in (None, rand):
        codes, scales = encode(x, r)
        c2, s2 = enc_c(x, r)
        assert_bits_equal(c2, codes, "codes")
        assert_bits_equal(s2, scales, "scales")
        assert_bits_equal(dec_c(codes, scales), decode(codes, scales), "decoded")


@pytest.mark.parametrize("which", ["m", "v"])
def test_q8_non_contiguous_input_codes_in_row_major_order(which):
    encode, decode, *_ = CODECS[which]
    x = _adversarial_values(48 * 40, seed=9, which=which).reshape(48, 40).t()[:, ::2]
    rand = _rand(x.numel())
    codes, scales = encode(x, rand)
    c2, s2 = encode(x.contiguous(), rand)
    assert_bits_equal(codes, c2, "codes")
    assert_bits_equal(scales, s2, "scales")
    assert codes.shape == x.shape and decode(codes, scales).shape == x.shape


@pytest.mark.parametrize(
    "which,bad", [(w, b) for w in ("m", "v") for b in (math.nan, math.inf, -math.inf)] + [("v", -1.0)]
)
def test_q8_nonfinite_block_is_0xff_and_decodes_to_nan(which, bad):
    encode, decode, *_ = CODECS[which]
    x = torch.linspace(0.1, 2.0, 80)
    x[40] = bad
    rand = _rand(80)
    codes, scales = encode(x, rand)
    assert scales[1] == 0xFF and bool((codes[32:64] == 0).all())
    y = decode(codes, scales)
    assert bool(torch.isnan(y[32:64]).all())
    assert bool(torch.isfinite(y[:32]).all() and torch.isfinite(y[64:]).all())
    others = torch.cat([x[:32], x[64:]])
    c_o, s_o = encode(others, torch.cat([rand[:32], rand[64:]]))
    assert_bits_equal(torch.cat([codes[:32], codes[64:]]), c_o, "other blocks are untouched")
    assert_bits_equal(torch.cat([scales[:1], scales[2:]]), s_o, "other blocks' scales")


def test_q8_signed_zero_and_tiny_negative_m():
    x = torch.tensor([1.0, -0.0, 0.0, -1e-30, 1e-30, -(2.0**-11), -(2.0**-11) * 1.5] + [0.5] * 25)
    codes, scales = q8_encode_m(x)
    assert codes[:5].tolist() == [0x70, 0x80, 0x00, 0x80, 0x00]
    y = q8_decode_m(codes, scales)
    assert torch.equal(torch.signbit(y[:5]), torch.tensor([False, True, False, True, False]))
    # the scale is 2 (absmax 1.0), the smallest step 2^-10: 2^-11 is a tie, to the even code 0
    # (-0.0); 1.5 times it rounds up to the smallest code
    assert codes[5] == 0x80 and codes[6] == 0x81


# ---- q8: determinism ---------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["m", "v"])
def test_q8_same_bits_for_same_seed_and_any_split_at_multiples_of_32(which):
    encode, *_ = CODECS[which]
    n = 3 * 16384 + 4096 + 45
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    x = x * x if which == "v" else x
    rand = sr_random16(99, torch.tensor(17), 4 * 3 + (1 if which == "m" else 2), n, "cpu")
    c_full, s_full = encode(x, rand)
    c_again, s_again = encode(x.clone(), rand.clone())
    assert torch.equal(c_full, c_again) and torch.equal(s_full, s_again)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        c_one, s_one = encode(x, rand)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(c_full, c_one) and torch.equal(s_full, s_one)  # integer maths: any thread count
    c_other, _ = encode(x, sr_random16(99, torch.tensor(18), 13, n, "cpu"))
    assert not torch.equal(c_full, c_other)  # the bits do depend on the step counter
    for bounds in ([0, 16384, 32768, 49152, n], [0, 4096, 8192, 20480, 45056, n], [0, 32, 16384 + 32, n]):
        parts = [encode(x[a:b], rand[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        assert torch.equal(torch.cat([p[0] for p in parts]), c_full), bounds
        assert torch.equal(torch.cat([p[1] for p in parts]), s_full), bounds


def test_q8_bad_input_is_refused():
    with pytest.raises(TypeError, match="fp32"):
        q8_encode_m(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="rand16 has 3 elements"):
        q8_encode_v(torch.zeros(4), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="rand16 must be an integer"):
        q8_encode_m(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="need 2 scale bytes"):
        q8_decode_m(torch.zeros(33, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="codes must be uint8"):
        q8_decode_v(torch.zeros(3, dtype=torch.int8), torch.zeros(1, dtype=torch.uint8))


# ---- ulp8 --------------------------------------------------------------------------------------------

DTYPES16 = {torch.bfloat16: (8, -133, 127), torch.float16: (11, -24, 15)}  # significand bits, min ulp exp, max exp


def _ulp16(m, dtype):
    """The spacing of ``dtype`` values in the binade of each |m| (fp64, from frexp)."""
    p, min_ulp, _ = DTYPES16[dtype]
    out = []
    for v in m.double().abs().tolist():
        e = math.frexp(v)[1] - 1 if v > 0 else -1000
        out.append(2.0 ** max(e - (p - 1), min_ulp))
    return torch.tensor(out, dtype=torch.float64)


def _ulp32(x):
    out = []
    for v in x.double().abs().tolist():
        e = math.frexp(v)[1] - 1 if v > 0 else -1000
        out.append(2.0 ** max(e - 23, -149))
    return torch.tensor(out, dtype=torch.float64)


def _masters(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-149, 127) if dtype == torch.bfloat16 else (-30, 15.99)
    mag = 2.0 ** (torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    x = (mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()).float()
    # exact midpoints (ties) and values next to powers of two, where the spacing halves
    p = torch.randn(64, generator=g).to(dtype).float()
    ulp = _ulp16(p, dtype).float()
    edges = [1.0 - 2.0**-12, 1.0 - 2.0**-10, 2.0**-14 - 2.0**-26, 2.0**-14, 2.0**-126 - 2.0**-140, 1e-40, 6e-8]
    return torch.cat([x, p + ulp / 2, p - ulp / 3, torch.tensor(edges), -torch.tensor(edges)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stochastic", [False, True])
def test_ulp8_param_is_nearest_and_error_within_bound(dtype, stochastic):
    m = _masters(dtype, 20000, seed=1)
    p, c = ulp8_encode(m, dtype, _rand(m.numel(), stream=0) if stochastic else None)
    assert_bits_equal(p, m.to(dtype), "the param is the master rounded to nearest even")
    assert int(c.to(torch.int64).abs().max()) <= 127
    est = ulp8_decode(p, c).double()
    u = _ulp16(m, dtype)
    steps = 1.0 if stochastic else 0.5
    r32 = 0 if dtype == torch.bfloat16 else _ulp32(est) / 2
    trunc = torch.where(m.abs() < 2.0**-17, 2.0**-40, 0.0) if dtype == torch.float16 else 0
    bound = u * steps / 127 / 2 + u * 2.0**-17 + r32 + trunc
    err = (est - m.double()).abs()
    assert bool((err <= bound).all()), (err / bound).max()
    # the correction is worth having: at least 60x better than the param alone, on average
    assert float(err.sum()) * 60 < float((p.double() - m.double()).abs().sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ulp8_every_correction_round_trips_under_nearest(dtype):
    g = torch.Generator().manual_seed(4)
    p = torch.cat([torch.randn(40, generator=g) * 2.0 ** torch.randint(-20, 14, (40,), generator=g)]).to(dtype)
    p = torch.cat([p, torch.tensor([1.0, -2.0, 2.0**-14, 2.0**-13, -(2.0**-20), 0.5, 3e-7], dtype=dtype)])
    c = torch.arange(-127, 128, dtype=torch.int8)
    pp, cc = p.repeat_interleave(c.numel()), c.repeat(p.numel())
    # c = ±127 is half a ulp: ties go to the even param, so they round-trip only on an even param
    even = (pp.view(torch.int16) & 1) == 0
    keep = (cc.abs() < 127) | even
    pp, cc = pp[keep], cc[keep]
    m = ulp8_decode(pp, cc)
    p2, c2 = ulp8_encode(m, dtype)
    assert_bits_equal(p2, pp, "param")
    assert_bits_equal(c2, cc, "correction")
    # stochastic: the decoded value sits within a small fraction of a correction step from c (the
    # decode rounds c * 2^15 / 127 to an integer D unit: 127 * 0.5 / 2^15 < 0.002 step; fp16 then
    # rounds D / 8 to fp32: 127 * 4.5 / 2^15 < 0.0175), so re-encoding gives c or, with at most
    # that probability, its neighbour
    p3, c3 = ulp8_encode(m, dtype, _rand(m.numel(), stream=0))
    assert_bits_equal(p3, pp, "param")
    diff = (c3.to(torch.int64) - cc.to(torch.int64)).abs()
    assert int(diff.max()) <= 1 and float(diff.float().mean()) < (0.002 if dtype == torch.bfloat16 else 0.0175)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ulp8_stochastic_correction_is_unbiased(dtype):
    """Mean correction over 4,096 draws vs 254 (M - p) / ulp16 in fp64: within SR_MEAN_SIGMAS standard errors."""
    reps = 4096
    m = _masters(dtype, 200, seed=2)
    m = m[m.to(dtype).isfinite() & (m.abs() >= 2.0**-17)]
    p, c = ulp8_encode(m.repeat(reps), dtype, _rand(m.numel() * reps, stream=0))
    mean = c.double().view(reps, -1).mean(dim=0)
    exact = 254 * (m.double() - m.to(dtype).double()) / _ulp16(m, dtype)
    assert float((mean - exact).abs().max()) <= SR_MEAN_SIGMAS * 0.5 / math.sqrt(reps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ulp8_tiny_updates_accumulate_with_sr_and_stall_with_nearest(dtype):
    """1,000 updates of 1/8 of a correction step each (1/2032 of an ulp) on 2,048 masters near 1.

    Stochastic: the mean movement is the exact total (1000/2032 ulp) within 3%. Nearest: nothing
    moves (each update is below half a correction step), and the 16-bit param alone (no master)
    does not move either.
    """
    n, steps = 2048, 1000
    base = 1.0 + torch.arange(n, dtype=torch.float32) * 2.0**-9 % 0.25
    base = ulp8_decode(*ulp8_encode(base, dtype))  # a state the format holds
    u = _ulp16(base, dtype).float()
    delta = u / 254 / 8
    results = {}
    for mode in ("nearest", "stochastic"):
        p, c = ulp8_encode(base, dtype)
        for t in range(steps):
            m = ulp8_decode(p, c) + delta
            p, c = ulp8_encode(m, dtype, _rand(n, counter=t, stream=0) if mode == "stochastic" else None)
        results[mode] = (ulp8_decode(p, c).double() - base.double()) / u.double()
    expected = steps / 254 / 8
    assert float(results["nearest"].abs().max()) == 0.0
    assert abs(float(results["stochastic"].mean()) / expected - 1) < 0.03
    plain = base.to(dtype)
    for _ in range(10):
        plain = (plain.float() + delta).to(dtype)
    assert torch.equal(plain, base.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ulp8_edges(dtype):
    big = 3.3e38 if dtype == torch.bfloat16 else 65504.0
    overflow = 3.4e38 if dtype == torch.bfloat16 else 65520.0
    m = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, big, -big, overflow, -overflow, 1e-45, -1e-45])
    p, c = ulp8_encode(m, dtype)
    est = ulp8_decode(p, c)
    assert c[:5].tolist() == [0, 0, 0, 0, 0] and c[7:9].tolist() == [0, 0]
    assert_bits_equal(p, m.to(dtype), "param")
    assert_bits_equal(est[:5], m[:5], "±0, ±inf and NaN decode to themselves")
    assert est[7] == math.inf and est[8] == -math.inf  # rounds to inf: the master is lost, as the param is
    assert bool((est[5:7].double() - m[5:7].double()).abs().le(_ulp16(m[5:7], dtype) / 500).all())
    # below the smallest 16-bit value the param is ±0 and the correction holds the value (bf16: its
    # nearest of 254 steps of 2^-133; fp16: 2^-24 / 254 is far above 1e-45, so it reads 0)
    assert torch.equal(torch.signbit(est[9:]), torch.tensor([False, True]))


def test_ulp8_same_bits_for_same_seed_and_any_split():
    n = 3 * 16384 + 4096 + 45
    m = torch.randn(n, generator=torch.Generator().manual_seed(5))
    rand = sr_random16(3, torch.tensor(9), 4 * 2, n, "cpu")
    p, c = ulp8_encode(m, torch.bfloat16, rand)
    p2, c2 = ulp8_encode(m.clone(), torch.bfloat16, rand.clone())
    assert torch.equal(p.view(torch.int16), p2.view(torch.int16)) and torch.equal(c, c2)
    parts = [ulp8_encode(m[a:b], torch.bfloat16, rand[a:b]) for a, b in ((0, 16384), (16384, 20480), (20480, n))]
    assert torch.equal(torch.cat([q[1] for q in parts]), c)


def test_ulp8_bad_input_is_refused():
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        ulp8_encode(torch.zeros(3), torch.float32)
    with pytest.raises(TypeError, match="fp32 master"):
        ulp8_encode(torch.zeros(3, dtype=torch.float64), torch.bfloat16)
    with pytest.raises(ValueError, match="int8 of the param's shape"):
        ulp8_decode(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int8))


# ---- bytes per param ---------------------------------------------------------------------------------


def test_bytes_per_param_match_the_design_table():
    # memory-formats.md §1: bf16 params and grads, large tensors
    assert state_bytes_per_param("remainder", "q8") == 8.0625
    assert state_bytes_per_param("ulp8", "q8") == 7.0625
    assert state_bytes_per_param("none", "q8") == 6.0625
    assert state_bytes_per_param("fp32", "fp32", param_bytes=2) == 16
    assert state_bytes_per_param("remainder", "fp32") == 14
    assert state_bytes_per_param("none", "fp32") == 12
    assert state_bytes_per_param("ulp8", "q8", n_moments=1) == 6.03125  # SGD momentum
    assert state_bytes_per_param("remainder", "q8", n_moments=1) == 7.03125
    assert state_bytes_per_param("none", "q8", n_moments=1) == 5.03125


def test_bytes_per_param_of_partial_blocks_and_streams():
    assert [(s.key, s.dtype, s.numel) for s in moment_streams("q8", "exp_avg", 33)] == [
        ("exp_avg_q", torch.uint8, 33),
        ("exp_avg_scale", torch.uint8, 2),
    ]
    assert [(s.key, s.dtype, s.numel) for s in master_streams("ulp8", 5)] == [("master_ulp8", torch.int8, 5)]
    assert state_bytes_per_param("ulp8", "q8", numel=33) == 2 + 2 + 1 + 2 * (33 + 2) / 33
    # the table is what encode allocates
    codes, scales = q8_encode_m(torch.ones(33))
    assert codes.numel() == 33 and scales.numel() == 2
    with pytest.raises(ValueError, match="moment format"):
        moment_streams("q4", "exp_avg", 8)
    with pytest.raises(ValueError, match="master format"):
        master_streams("fp8", 8)
