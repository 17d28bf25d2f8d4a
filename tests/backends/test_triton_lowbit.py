"""Tier 2: the Triton kernels for low-bit master state and gradient health against the reference.

``adamw_bf16_`` (int16 master remainders, counter-based stochastic rounding, fp32/bf16
moments), ``sgd_`` (fp32 masters / remainders / none + stochastic rounding) and
``unscale_check_stats_``. Under ``TRITON_INTERPRET=1`` every output is compared bit for bit
with ``fastamp.reference`` (params, remainders, moments including stochastically rounded
bf16 moments, momentum buffers, counts, absmax, found_inf). On a GPU ``sgd_`` and the
statistics stay bit-exact (multiplies, adds and integer operations only); ``adamw_bf16_``
is compared like ``adamw_`` in test_triton.py (its sqrt/division are requested correctly
rounded, ``tolerances.ADAMW_GPU_RTOL`` otherwise), remainders through the joined master.
The statistical unbiasedness of stochastic rounding is tested with the optimizers, not here.
The optimizer cases run the one optimizer kernel, ``optim_`` (``kernels/optim.py``), on the
per-rule ops' arguments (``fastamp.reference.optim.to_optim`` maps them).
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from helpers import assert_bits_equal, canonical_bits, clone_lists  # noqa: E402
from tolerances import ADAMW_GPU_RTOL, SUMSQ_RTOL  # noqa: E402

from fastamp import backends, functional  # noqa: E402
from fastamp import kernels as fk  # noqa: E402
from fastamp import reference as R  # noqa: E402

DEVICES = [d for d in ("cpu", "cuda") if fk.available(d)[0]]
if not DEVICES:
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

from fastamp.kernels import amp as tamp  # noqa: E402
from fastamp.kernels import optim as toptim  # noqa: E402

from fastamp.ops import registry  # noqa: E402
from fastamp.reference.optim import to_optim  # noqa: E402

CHUNK, BLOCK = tamp.C.chunk_config()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = [1, 3, 17, BLOCK + 1, CHUNK + 3]

# numpy, behind the interpreter, warns on inf*0 and friends; those values are the point here
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _triton_op(op):
    """The Triton ``optim_`` on the arguments of the per-rule op ``op`` (the reference's ``to_optim``)."""
    return lambda *args: toptim.optim_(*to_optim(op, args))


def _optim_args(op, args):
    """``optim_``'s arguments (schema types) for the per-rule op ``op``'s ``args``."""
    return registry.coerce("optim_", to_optim(op, args))


_ADAMW = _triton_op("adamw_")
_ADAMW_BF16 = _triton_op("adamw_bf16_")
_SGD = _triton_op("sgd_")


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 tensor with the given uint32 bit patterns (held in int64)."""
    bits = bits & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


_HI = [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x3F80, 0xBF80, 0x4B00, 0x7F7F, 0xFF7F, 0x7F7E, 0x3A00]
_LO = [0x0000, 0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0001]


def _adversarial_masters(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 masters whose bits hit the split's edge cases: exact ties (low half 0x8000), +-0,
    subnormals, the smallest normal, values whose nearest bf16 is past bf16 max, and random."""
    hi = torch.tensor(_HI)[torch.randint(len(_HI), (n,), generator=gen)]
    lo = torch.randint(0, 1 << 16, (n,), generator=gen)
    special = torch.rand(n, generator=gen) < 0.6
    lo = torch.where(special, torch.tensor(_LO)[torch.randint(len(_LO), (n,), generator=gen)], lo)
    m = _from_bits((hi << 16) | lo)
    # one exact tie of each sign, for certain
    if n >= 2:
        m[:2] = _from_bits(torch.tensor([0x3F808000, 0xBF818000]))
    return m


def _bf16_state(device, sizes, seed, rem, m_dtype, g_dtype, amsgrad, adversarial=False):
    gen = torch.Generator().manual_seed(seed)
    masters = []
    for n in sizes:
        m = _adversarial_masters(n, gen) if adversarial else torch.randn(n, generator=gen)
        masters.append(m)
    grads = [(torch.randn(n, generator=gen) * 3.0).to(g_dtype) for n in sizes]
    if rem:
        split = [R.split_master(m) for m in masters]
        params, rems = [p for p, _ in split], [r for _, r in split]
    else:
        params, rems = [m.bfloat16() for m in masters], []
    exp_avgs = [(torch.randn(n, generator=gen) * 0.1).to(m_dtype) for n in sizes]
    exp_avg_sqs = [(torch.rand(n, generator=gen) * 0.01).to(m_dtype) for n in sizes]
    vmax = [(v.float() * 1.5).to(m_dtype) for v in exp_avg_sqs] if amsgrad else []
    state = [params, grads, rems, exp_avgs, exp_avg_sqs, vmax]
    return [[t.to(device) for t in lst] for lst in state]


def _compare_bf16_adamw(got, exp, device):
    names = ("params", "grads", "remainders", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")
    if device == "cpu":
        for name, la, le in zip(names, got, exp):
            for i, (a, e) in enumerate(zip(la, le)):
                assert_bits_equal(a, e, f"{name}[{i}] ({a.dtype}, n={a.numel()})")
        return
    # GPU: correctly rounded sqrt/div are requested but not guaranteed by every Triton
    for name, la, le in zip(names, got, exp):
        for i, (a, e) in enumerate(zip(la, le)):
            what = f"{name}[{i}]"
            if name == "remainders":
                a, e = R.join_master(got[0][i], a), R.join_master(exp[0][i], e)
                rtol = ADAMW_GPU_RTOL
            else:
                rtol = ADAMW_GPU_RTOL if a.dtype == torch.float32 else torch.finfo(torch.bfloat16).eps
            if a.dtype == torch.bfloat16 and name != "params":
                rtol = 2 * rtol  # a stochastically rounded moment may land on the other neighbour
            torch.testing.assert_close(a.float(), e.float(), rtol=rtol, atol=1e-30, equal_nan=True, msg=what)


def _adamw_bf16_steps(fn, state, device, hyper, found_inf, rng_seed, rng_base, n_steps=2):
    lr, wd, beta1, beta2, eps, amsgrad, maximize = hyper
    for step in range(1, n_steps + 1):
        scalars = R.adamw_step_scalars(
            lr, torch.tensor(float(step), device=device), beta1, beta2, wd, torch.tensor(0.5, device=device)
        )
        fi = None if found_inf is None else torch.tensor([found_inf], device=device)
        rng = None if rng_seed is None else torch.tensor([rng_seed, 1000 + step], device=device)
        fn(*state, scalars, fi, rng, rng_base, beta1, beta2, eps, amsgrad, maximize)


# ---------------------------------------------------------------- adamw_bf16_


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_bf16_remainder_equals_fp32_master(device):
    """Adversarial masters (ties, subnormals, near bf16 max, +-0, inf, NaN) through many steps:
    the remainder path keeps exactly the fp32-master path's master; its param differs from
    ``master.bfloat16()`` only at exact ties, by one ulp away from zero."""
    gen = torch.Generator().manual_seed(21)
    sizes = [2, 9, BLOCK + 5]
    masters = [_adversarial_masters(n, gen) for n in sizes]
    masters[1][2:5] = torch.tensor([math.inf, -math.inf, math.nan])
    params_rem, rems = map(list, zip(*(R.split_master(m) for m in masters)))
    for m, p, r in zip(masters, params_rem, rems):
        assert_bits_equal(R.join_master(p, r), m, "reference split/join round trip")
    to = lambda lst: [t.to(device) for t in lst]  # noqa: E731
    masters, params_rem, rems = to(masters), to(params_rem), to(rems)
    params_fp32 = [m.bfloat16() for m in masters]
    zeros = lambda: [torch.zeros(n, device=device) for n in sizes]  # noqa: E731
    originals = [m.clone() for m in masters]
    fp32_state = [params_fp32, None, masters, zeros(), zeros(), []]
    rem_state = [params_rem, None, rems, zeros(), zeros(), []]
    for step in range(1, 9):
        # step 1 has zero grads and no decay: the update is the identity, so the split of every
        # adversarial master must survive a kernel round trip bit for bit
        wd = 0.0 if step == 1 else 0.1
        grads = [(torch.randn(n, generator=gen) * (step > 1)).to(device) for n in sizes]
        scalars = R.adamw_step_scalars(1e-3, torch.tensor(float(step), device=device), 0.9, 0.999, wd)
        fp32_state[1] = rem_state[1] = grads
        _ADAMW(*fp32_state, scalars, None, 0.9, 0.999, 1e-8, False, False)
        _ADAMW_BF16(*rem_state, scalars, None, None, 0, 0.9, 0.999, 1e-8, False, False)
        for i in range(len(sizes)):
            joined = R.join_master(rem_state[0][i], rem_state[2][i])
            assert_bits_equal(joined, fp32_state[2][i], f"master {i} at step {step}")
            assert_bits_equal(rem_state[3][i], fp32_state[3][i], f"exp_avg {i} at step {step}")
            p_rem, p_fp32 = rem_state[0][i].float(), fp32_state[0][i].float()
            tie = (canonical_bits(fp32_state[2][i]) & 0xFFFF) == 0x8000
            differs = (canonical_bits(p_rem.bfloat16()) != canonical_bits(p_fp32.bfloat16())) & ~torch.isnan(p_rem)
            assert not (differs & ~tie).any(), f"param {i} differs away from a tie at step {step}"
            assert (p_rem[differs].abs() > p_fp32[differs].abs()).all(), "ties round away from zero"
        if step == 1:
            for i in range(len(sizes)):
                joined = R.join_master(rem_state[0][i], rem_state[2][i])
                assert_bits_equal(joined, originals[i], f"master {i} after an identity update")
            ties = sum(int(((canonical_bits(m) & 0xFFFF) == 0x8000).sum()) for m in fp32_state[2])
            assert ties >= 3, "the adversarial set must contain exact ties"


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_bf16_stochastic_bits_and_streams(device):
    """Stochastic rounding draws from (seed, counter, rng_base + index in the call, element):
    a tensor gives the same bits whatever else is in the call and however the call is grouped,
    and a different counter gives different bits."""
    hyper = (1e-2, 0.0, 0.9, 0.999, 1e-8, False, False)
    sizes = [13, BLOCK + 7, 300]
    state = _bf16_state(device, sizes, 31, False, torch.bfloat16, torch.float16, False)
    state[1][1] = state[1][1].float()  # a second grad dtype: two launch groups
    initial = clone_lists(state)
    alone = [[lst[2]] if lst else [] for lst in clone_lists(state)]
    ref = clone_lists(state)
    _adamw_bf16_steps(_ADAMW_BF16, state, device, hyper, None, 77, 10, n_steps=1)
    _adamw_bf16_steps(R.adamw_bf16_, ref, device, hyper, None, 77, 10, n_steps=1)
    _compare_bf16_adamw(state, ref, device)
    _adamw_bf16_steps(_ADAMW_BF16, alone, device, hyper, None, 77, 12, n_steps=1)
    for j in (0, 3, 4):
        assert_bits_equal(alone[j][0], state[j][2], f"list {j}: tensor 2 alone with rng_base 12")
    other = [[lst[2]] if lst else [] for lst in initial]
    rng = torch.tensor([77, 999], device=device)
    scalars = R.adamw_step_scalars(1e-2, torch.tensor(1.0, device=device), 0.9, 0.999, 0.0)
    _ADAMW_BF16(*other, scalars, None, rng, 12, 0.9, 0.999, 1e-8, False, False)
    for j in (0, 3, 4):
        assert not torch.equal(other[j][0].view(torch.int16), alone[j][0].view(torch.int16)), "counter must matter"


# ---------------------------------------------------------------- sgd_


def _sgd_state(device, p_dtype, g_dtype, kind, momentum, sizes, seed, adversarial=False):
    gen = torch.Generator().manual_seed(seed)
    masters = [_adversarial_masters(n, gen) if adversarial else torch.randn(n, generator=gen) for n in sizes]
    grads = [(torch.randn(n, generator=gen) * 2.0).to(g_dtype) for n in sizes]
    if kind == "remainder":
        split = [R.split_master(m) for m in masters]
        params, ms = [p for p, _ in split], [r for _, r in split]
    elif kind == "fp32":
        params, ms = [m.to(p_dtype) for m in masters], masters
    else:
        params, ms = [m.to(p_dtype) for m in masters], []
    # the first step must ignore whatever the buffers hold: fill them with NaN there
    bufs = [torch.randn(n, generator=gen) for n in sizes] if momentum else []
    state = [params, grads, ms, bufs]
    return [[t.to(device) for t in lst] for lst in state]


def _sgd_steps(fn, state, device, hyper, found_inf, rng_seed, first_step=0, n_steps=2):
    momentum, dampening, wd, nesterov, maximize = hyper
    for k in range(n_steps):
        step = torch.tensor(first_step + k, device=device)
        scalars = R.sgd_step_scalars(0.05, step, torch.tensor(0.25, device=device))
        fi = None if found_inf is None else torch.tensor([found_inf], device=device)
        rng = None if rng_seed is None else torch.tensor([rng_seed, first_step + k], device=device)
        fn(*state, scalars, fi, rng, 3, momentum, dampening, wd, nesterov, maximize)


def _compare_exact(got, exp, names):
    for name, la, le in zip(names, got, exp):
        for i, (a, e) in enumerate(zip(la, le)):
            assert_bits_equal(a, e, f"{name}[{i}] ({a.dtype}, n={a.numel()})")


_SGD_NAMES = ("params", "grads", "masters", "momentum_buffers")


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_many_tiny_tensors_mixed_dtypes(device):
    gen = torch.Generator().manual_seed(61)
    params, grads, bufs = [], [], []
    for i in range(54):
        n = 1 + (i * 7) % 19
        params.append(torch.randn(n, generator=gen).to(DTYPES[i % 3]).to(device))
        grads.append(torch.randn(n, generator=gen).to(DTYPES[(i // 3) % 3]).to(device))
        bufs.append(torch.randn(n, generator=gen).to(device))
    params.append(torch.randn(6, dtype=torch.float64, generator=gen).to(device))
    grads.append(torch.randn(6, dtype=torch.float64, generator=gen).to(device))
    bufs.append(torch.zeros(6, device=device))
    params.append(torch.empty(0, dtype=torch.bfloat16, device=device))
    grads.append(torch.empty(0, device=device))
    bufs.append(torch.empty(0, device=device))
    state = [params, grads, [], bufs]
    ref = clone_lists(state)
    hyper = (0.8, 0.1, 1e-3, False, True)
    _sgd_steps(_SGD, state, device, hyper, None, 5, first_step=3)
    _sgd_steps(R.sgd_, ref, device, hyper, None, 5, first_step=3)
    _compare_exact(state, ref, _SGD_NAMES)


# ---------------------------------------------------------------- unscale_check_stats_


_SPECIALS = {
    torch.float32: [0.0, -0.0, 1e-45, -1e-40, 1.1754942e-38, 6.1e-5, -6.2e-5, 65504.0, 3.4028235e38, 1.0, math.nan],
    torch.float16: [0.0, -0.0, 6e-8, -6.1e-5, 6.2e-5, 65504.0, -65504.0, 60000.0, 1.0, 1e-3, -math.inf],
    torch.bfloat16: [0.0, -0.0, 1e-40, -9.2e-41, 3.38e38, -3.38e38, 6.1e-5, 65504.0, 1.0, math.inf],
}
_STATS_SIZES = [0, 1, 7, BLOCK - 1, BLOCK + 1, CHUNK, 2 * CHUNK + 3]


def _stats_grads(device, seed, with_nonfinite=True):
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for dt, v in _SPECIALS.items():
        vals = v if with_nonfinite else [x for x in v if math.isfinite(x)]
        grads.append(torch.tensor(vals, dtype=dt))
    for i, n in enumerate(_STATS_SIZES):
        dt = DTYPES[i % 3]
        g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 8)
        g[torch.rand(n, generator=gen) < 0.05] = 0.0
        if not with_nonfinite:
            g = g.clamp(-60000.0, 60000.0)
        grads.append(g.to(dt))
    return [g.to(device) for g in grads]


def _run_stats(fn, grads, inv_scale, write_back, sumsq, found=0.0):
    grads = [g.clone() for g in grads]
    dev = grads[0].device
    n = len(grads)
    found_inf = torch.full((1,), found, device=dev)
    counts = torch.full((n, 3), -5, dtype=torch.int64, device=dev)  # garbage: must be overwritten
    absmax = torch.full((n,), -1.0, device=dev)
    total = fn(grads, found_inf, torch.tensor([inv_scale], device=dev), write_back, sumsq, counts, absmax)
    return grads, found_inf, total, counts, absmax


def _check_stats(grads, inv_scale, write_back, sumsq=True, found=0.0):
    got = _run_stats(tamp.unscale_check_stats_, grads, inv_scale, write_back, sumsq, found)
    exp = _run_stats(R.unscale_check_stats_, grads, inv_scale, write_back, sumsq, found)
    for i, (a, e) in enumerate(zip(got[0], exp[0])):
        assert_bits_equal(a, e, f"grad {i}")
    assert_bits_equal(got[1], exp[1], "found_inf")
    assert_bits_equal(got[3], exp[3], "counts")
    assert_bits_equal(got[4], exp[4], "absmax")
    if sumsq and torch.isfinite(exp[2]):
        torch.testing.assert_close(got[2], exp[2], rtol=SUMSQ_RTOL, atol=0)
    else:
        assert_bits_equal(got[2], exp[2], "sumsq")
    return got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("write_back", [True, False])
@pytest.mark.parametrize("inv_scale", [1.0, 2.0**-16, 0.75, 4.0, 0.0, math.inf])
def test_stats_adversarial_values(device, write_back, inv_scale):
    grads = _stats_grads(device, seed=int(inv_scale * 7) % 13 if math.isfinite(inv_scale) else 3)
    got = _check_stats(grads, inv_scale, write_back)
    counts = got[3]
    # the case exercises every counter
    assert counts[:, 0].sum() > 0
    if inv_scale not in (0.0, math.inf):
        assert counts[:, 1].sum() > 0 and counts[:, 2].sum() > 0
    assert (counts[3] == 0).all() and got[4][3] == 0, "an empty tensor has zero statistics"


@pytest.mark.parametrize("device", DEVICES)
def test_stats_finite_grads_and_found_inf_kept(device):
    grads = _stats_grads(device, seed=8, with_nonfinite=False)
    got = _check_stats(grads, 2.0**-4, True)
    assert got[1].item() == 0.0 and int(got[3][:, 0].sum()) == 0
    got = _check_stats(grads, 2.0**-4, False, found=1.0)
    assert got[1].item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_stats_deterministic_and_many_tiny_tensors(device):
    gen = torch.Generator().manual_seed(9)
    grads = [(torch.randn(1 + (i * 5) % 23, generator=gen) * 1e-3).to(DTYPES[i % 3]).to(device) for i in range(60)]
    grads[37][0] = math.nan
    grads[50] = torch.empty(0, dtype=torch.float16, device=device)
    first = _check_stats(grads, 2.0**-6, False)
    second = _run_stats(tamp.unscale_check_stats_, grads, 2.0**-6, False, True)
    for a, b, what in zip(first[1:], second[1:], ("found_inf", "sumsq", "counts", "absmax")):
        assert_bits_equal(a, b, f"{what} run to run")
    assert int(first[3][37, 0]) == 1 and int(first[3][:, 0].sum()) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_stats_more_chunks_than_one_reduce_block(device, monkeypatch):
    """A tensor with more chunks than the per-tensor reduction handles per iteration (made small here)."""
    monkeypatch.setattr(tamp, "_STATS_RBLOCK", 2)
    n_chunks = 5
    gen = torch.Generator().manual_seed(11)
    g = (torch.randn(n_chunks * CHUNK - 3, generator=gen) * 1e-3).half()
    g[::997] = 0.0
    g[-2] = math.inf
    got = _check_stats([torch.ones(2, device=device), g.to(device)], 0.5, False, sumsq=False)
    assert int(got[3][1, 0]) == 1 and int(got[3][1, 1]) >= n_chunks * CHUNK // 997


@pytest.mark.parametrize("device", DEVICES)
def test_stats_unscale_part_equals_unscale_check(device):
    """The statistics op writes the same grads, found_inf and sum of squares as unscale_check_."""
    grads = _stats_grads(device, seed=10)
    a = _run_stats(tamp.unscale_check_stats_, grads, 0.5, True, True)
    b = [g.clone() for g in grads]
    f = torch.zeros(1, device=device)
    s = tamp.unscale_check_(b, f, torch.tensor([0.5], device=device), True, True)
    for x, y in zip(a[0], b):
        assert_bits_equal(x, y, "grad")
    assert_bits_equal(a[1], f, "found_inf")
    assert_bits_equal(a[2], s, "sumsq")


def test_stats_bad_input():
    dev = DEVICES[0]
    g = [torch.ones(3, device=dev), torch.ones(2, device=dev)]
    f, inv = torch.zeros(1, device=dev), torch.ones(1, device=dev)
    bad_counts = (torch.zeros(3, 3, dtype=torch.int64, device=dev), torch.zeros(2, device=dev))
    bad_absmax = (torch.zeros(2, 3, dtype=torch.int64, device=dev), torch.zeros(2, dtype=torch.float64, device=dev))
    for (counts, absmax), msg, guard in (
        (bad_counts, r"counts must be an int64 \[2, 3\]", "counts"),
        (bad_absmax, r"absmax must be an fp32 \[2\]", "absmax"),
    ):
        with pytest.raises(ValueError, match=msg):
            functional.unscale_check_(g, f, inv, counts=counts, absmax=absmax, backend="triton")
        with pytest.raises(RuntimeError, match=f"fastamp_triton::unscale_check_stats_: {guard}"):
            tamp.unscale_check_stats_(g, f, inv, True, False, counts, absmax)
    assert all(torch.equal(x, torch.ones_like(x)) for x in g)


# ---------------------------------------------------------------- bad input, registration, dispatch


def test_opcheck():
    dev = DEVICES[0]
    state = _bf16_state(dev, [3, 6], 81, True, torch.bfloat16, torch.float16, True)
    scalars = R.adamw_step_scalars(1e-3, torch.tensor(2.0, device=dev), 0.9, 0.999, 0.01)
    rng = torch.tensor([3, 4], device=dev)
    torch.library.opcheck(
        torch.ops.fastamp_triton.optim_.default,
        _optim_args(
            "adamw_bf16_", (*state, scalars, torch.zeros(1, device=dev), rng, 2, 0.9, 0.999, 1e-8, True, False)
        ),
    )
    sgd_state = _sgd_state(dev, torch.bfloat16, torch.float32, "none", 0.9, [3, 6], 82)
    torch.library.opcheck(
        torch.ops.fastamp_triton.optim_.default,
        _optim_args(
            "sgd_",
            (
                *sgd_state,
                R.sgd_step_scalars(0.1, torch.tensor(1, device=dev)),
                None,
                rng,
                0,
                0.9,
                0.1,
                0.01,
                True,
                False,
            ),
        ),
    )
    grads = [torch.randn(5, device=dev), torch.randn(3, device=dev).half(), torch.randn(4, device=dev).bfloat16()]
    torch.library.opcheck(
        torch.ops.fastamp_triton.unscale_check_stats_.default,
        (
            grads,
            torch.zeros(1, device=dev),
            torch.tensor([0.5], device=dev),
            True,
            True,
            torch.zeros(3, 3, dtype=torch.int64, device=dev),
            torch.zeros(3, device=dev),
        ),
    )


def test_reachable_through_functional():
    dev = DEVICES[0]
    assert backends.get_impl("optim_", "triton") is toptim.optim_
    assert backends.get_impl("adamw_bf16_", "triton") is toptim.adamw_bf16_
    assert backends.get_impl("sgd_", "triton") is toptim.sgd_
    assert backends.get_impl("unscale_check_stats_", "triton") is tamp.unscale_check_stats_
    # non-contiguous and sparse grads go through functional's copies / values
    grads = _stats_grads(dev, seed=93)[:6]
    base = (torch.randn(40, 30) * 1e-4).half().to(dev)
    grads.append(base[:, ::3])
    sp = torch.sparse_coo_tensor(
        torch.tensor([[0, 2, 5]]), torch.tensor([1.0, 0.0, 3e-6]), (8,), check_invariants=True
    ).coalesce()
    grads.append(sp.to(dev))
    ref_grads = [g.clone() for g in grads]
    n = len(grads)
    results = []
    for gs, backend in ((grads, "triton"), (ref_grads, "torch")):
        found = torch.zeros(1, device=dev)
        counts = torch.full((n, 3), -1, dtype=torch.int64, device=dev)
        absmax = torch.full((n,), -1.0, device=dev)
        total = functional.unscale_check_(
            gs,
            found,
            torch.tensor([0.5], device=dev),
            compute_sumsq=True,
            counts=counts,
            absmax=absmax,
            backend=backend,
        )
        results.append((found, total, counts, absmax))
    (f1, s1, c1, a1), (f2, s2, c2, a2) = results
    assert_bits_equal(f1, f2, "found_inf")
    assert_bits_equal(c1, c2, "counts")
    assert_bits_equal(a1, a2, "absmax")
    torch.testing.assert_close(s1, s2, rtol=SUMSQ_RTOL, atol=0, equal_nan=True)
    for a, e in zip(grads, ref_grads):
        a, e = (a._values(), e._values()) if a.is_sparse else (a, e)
        assert_bits_equal(a, e, "grad")
    assert int(c1[-1, 1]) == 1 and int(c1[-1, 2]) == 1, "sparse values: one zero, one fp16 underflow"
