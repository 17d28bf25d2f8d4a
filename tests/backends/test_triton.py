"""Tier 2: the Triton backend (``fastamp.kernels``) against ``fastamp.reference``.

On a CPU machine the kernels run under ``TRITON_INTERPRET=1`` (set by conftest.py before
anything imports Triton) and must be bit-exact with the reference. On a CUDA machine they
run on the GPU: found_inf, written grads and the scale update stay bit-exact; AdamW is
compared within ``tolerances.ADAMW_GPU_RTOL`` (the kernel asks for correctly rounded
sqrt/division and no FMA contraction, so it is expected to be exact there too). The optimizer
cases run the one optimizer kernel, ``optim_`` (``kernels/optim.py``), on the per-rule ops'
arguments (``fastamp.reference.optim.to_optim`` maps them).
"""

import itertools
import math
import random
import warnings

import pytest
import torch

pytest.importorskip("triton")

from helpers import assert_bits_equal, clone_lists  # noqa: E402
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

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CHUNK, BLOCK = tamp.C.chunk_config()

# numpy, behind the interpreter, warns on inf*0 and friends; those values are the point here
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _triton_op(op):
    """The Triton ``optim_`` on the arguments of the per-rule op ``op`` (the reference's ``to_optim``)."""
    return lambda *args: toptim.optim_(*to_optim(op, args))


def _optim_args(op, args):
    """``optim_``'s arguments (schema types) for the per-rule op ``op``'s ``args``."""
    return registry.coerce("optim_", to_optim(op, args))


def _rand(n, dtype, device, gen, scale=1.0):
    return (torch.randn(n, generator=gen) * scale).to(dtype).to(device)


# Adversarial, finite values per dtype (fp16 max and just below; subnormals; +-0; near overflow).
_SPECIALS = {
    torch.float32: [0.0, -0.0, 1e-45, -1e-40, 1.1754942e-38, 65504.0, 65520.0, 1e38, -3.4e38, 3.4028235e38, 1.0, -2.5],
    torch.float16: [0.0, -0.0, 6e-8, -6.1e-5, 65504.0, -65504.0, 60000.0, 32768.0, 1.0, -0.5, 1e-3],
    torch.bfloat16: [0.0, -0.0, 1e-40, -9.2e-41, 3.38e38, -3.38e38, 1.7e38, 65504.0, 1.0, -0.5],
}
_SIZES = [0, 1, 2, 3, 7, 13, 127, BLOCK - 1, BLOCK, BLOCK + 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]


def _grad_set(device, seed=0, sizes=_SIZES):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.tensor(v, dtype=dt).to(device) for dt, v in _SPECIALS.items()]
    for i, n in enumerate(sizes):
        dt = DTYPES[i % 3]
        grads.append(_rand(n, dt, device, gen, scale=100.0))
    return grads


def _run_unscale(fn, grads, inv_scale, write_back, compute_sumsq, found=0.0):
    grads = [g.clone() for g in grads]
    dev = grads[0].device
    found_inf = torch.full((1,), found, device=dev)
    total = fn(grads, found_inf, torch.tensor([inv_scale], device=dev), write_back, compute_sumsq)
    return grads, found_inf, total


def _check_unscale(grads, inv_scale, write_back, compute_sumsq=True, found=0.0):
    got_g, got_f, got_s = _run_unscale(tamp.unscale_check_, grads, inv_scale, write_back, compute_sumsq, found)
    exp_g, exp_f, exp_s = _run_unscale(R.unscale_check_, grads, inv_scale, write_back, compute_sumsq, found)
    assert_bits_equal(got_f, exp_f, "found_inf")
    for i, (a, e) in enumerate(zip(got_g, exp_g)):
        assert_bits_equal(a, e, f"grad {i} ({a.dtype}, n={a.numel()})")
    assert got_s.shape == () and got_s.dtype == torch.float32 and got_s.device == got_f.device
    if compute_sumsq and torch.isfinite(exp_s):
        torch.testing.assert_close(got_s, exp_s, rtol=SUMSQ_RTOL, atol=0)
    else:
        assert_bits_equal(got_s, exp_s, "sumsq")
    return got_f, got_s


# ---------------------------------------------------------------- unscale_check_


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("write_back", [True, False])
@pytest.mark.parametrize("inv_scale", [1.0, 2.0**-16, 0.75, 2.0, 0.0, math.inf])
def test_unscale_adversarial_values(device, write_back, inv_scale):
    grads = _grad_set(device)
    found, _ = _check_unscale(grads, inv_scale, write_back)
    # sanity that the case exercises what it is meant to: overflow created by the unscale itself
    if inv_scale == math.inf or (inv_scale == 2.0 and write_back):
        assert found.item() == 1.0
    if inv_scale in (1.0, 2.0**-16, 0.75, 0.0):
        assert found.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_overflow_only_on_store(device):
    """Finite in fp32 after unscaling, inf once rounded to the 16-bit grad dtype: flagged only with write_back."""
    bf16_max = torch.finfo(torch.bfloat16).max
    for dtype, value, inv_scale in ((torch.float16, 60000.0, 2.0), (torch.bfloat16, bf16_max, 1.0 + 2.0**-8)):
        grads = [torch.tensor([1.0, value, -value], dtype=dtype, device=device)]
        found, _ = _check_unscale(grads, inv_scale, True)
        assert found.item() == 1.0
        found, _ = _check_unscale(grads, inv_scale, False)
        assert found.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_unscale_nonfinite_positions(device, dtype, bad):
    gen = torch.Generator().manual_seed(1)
    for n, pos in [(1, 0), (CHUNK + 5, 0), (CHUNK + 5, CHUNK + 4), (BLOCK + 1, BLOCK)]:
        g = _rand(n, dtype, device, gen)
        g[pos] = bad
        others = [_rand(33, dt, device, gen) for dt in DTYPES]
        for write_back in (True, False):
            found, _ = _check_unscale([others[0], g, *others[1:]], 2.0**-8, write_back)
            assert found.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_found_inf_never_reset_and_empty(device):
    grads = [torch.ones(5, device=device), torch.ones(3, dtype=torch.float16, device=device)]
    found, _ = _check_unscale(grads, 0.5, True, found=1.0)
    assert found.item() == 1.0
    found_inf = torch.zeros(1, device=device)
    total = tamp.unscale_check_([], found_inf, torch.ones(1, device=device), True, True)
    assert total.item() == 0.0 and found_inf.item() == 0.0
    total = tamp.unscale_check_([torch.empty(0, device=device)], found_inf, torch.ones(1, device=device), True, True)
    assert total.item() == 0.0 and found_inf.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_many_tiny_tensors_mixed_dtypes(device):
    gen = torch.Generator().manual_seed(2)
    grads = [_rand(1 + (i * 7) % 19, DTYPES[i % 3], device, gen, scale=1000.0) for i in range(200)]
    _check_unscale(grads, 2.0**-10, True)
    grads[151][-1] = math.inf
    found, _ = _check_unscale(grads, 2.0**-10, False)
    assert found.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_non_contiguous_and_sparse(device):
    gen = torch.Generator().manual_seed(3)
    base = _rand(64 * 40, torch.float16, device, gen, scale=50.0).reshape(64, 40)
    strided = base[:, ::3]
    assert not strided.is_contiguous()
    g = strided.clone().t().contiguous().t()  # a fresh transposed (non-contiguous) tensor
    ref = g.clone()
    ref_strided = base.clone()[:, ::3]
    f1, f2 = torch.zeros(1, device=device), torch.zeros(1, device=device)
    inv = torch.tensor([0.125], device=device)
    s1 = tamp.unscale_check_([g, strided], f1, inv, True, True)
    s2 = R.unscale_check_([ref, ref_strided], f2, inv, True, True)
    assert_bits_equal(g, ref, "transposed grad")
    assert_bits_equal(strided, ref_strided, "strided view")
    torch.testing.assert_close(s1, s2, rtol=SUMSQ_RTOL, atol=0)
    idx = torch.tensor([[0, 2, 5]], device=device)
    vals = torch.tensor([1.0, 3e38, 2.0], device=device)
    sp = torch.sparse_coo_tensor(idx, vals, (8,), check_invariants=True).coalesce()
    found = torch.zeros(1, device=device)
    tamp.unscale_check_([sp], found, torch.tensor([4.0], device=device), True, False)
    assert found.item() == 1.0
    assert_bits_equal(sp._values()[[0, 2]], torch.tensor([4.0, 8.0], device=device), "sparse values")


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_matches_torch_kernel(device):
    """found_inf and unscaled values equal torch's where torch defines them (finite inputs, inv_scale <= 1)."""
    gen = torch.Generator().manual_seed(4)
    for bad in (None, 5):
        grads = [_rand(n, torch.float32, device, gen, scale=1e4) for n in (1, 1000, CHUNK + 1)]
        if bad is not None:
            grads[1][bad] = math.nan
        ours = [g.clone() for g in grads]
        f_torch, f_ours = torch.zeros(1, device=device), torch.zeros(1, device=device)
        inv = torch.tensor([2.0**-16], device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, f_torch, inv)
        tamp.unscale_check_(ours, f_ours, inv, True, False)
        assert_bits_equal(f_ours, f_torch, "found_inf vs torch")
        for a, e in zip(ours, grads):
            assert_bits_equal(a, e, "unscaled grad vs torch")


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_sumsq_deterministic(device):
    gen = torch.Generator().manual_seed(5)
    grads = [_rand(n, dt, device, gen, scale=3.0) for n, dt in zip((3 * CHUNK + 7, 2 * CHUNK, 999), DTYPES)]
    results = [_run_unscale(tamp.unscale_check_, grads, 0.5, False, True)[2] for _ in range(2)]
    assert_bits_equal(results[0], results[1], "sum of squares run to run")
    exp = sum(g.double().mul(0.5).square().sum() for g in grads).float()
    torch.testing.assert_close(results[0], exp, rtol=SUMSQ_RTOL, atol=0)


def test_unscale_bad_input():
    dev = DEVICES[0]
    f, inv = torch.zeros(1, device=dev), torch.ones(1, device=dev)
    # the user-facing checks, through functional
    with pytest.raises(TypeError, match="found_inf must be a torch.float32"):
        functional.unscale_check_([torch.ones(2, device=dev)], f.double(), inv, backend="triton")
    with pytest.raises(ValueError, match="inv_scale must be a 1-element"):
        functional.unscale_check_([torch.ones(2, device=dev)], f, torch.ones(2, device=dev), backend="triton")
    # the launcher's guards (fp64 grads go to the reference through functional)
    with pytest.raises(RuntimeError, match=r"grads\[0\] must be a strided tensor of .*float32"):
        tamp.unscale_check_([torch.ones(2, dtype=torch.float64, device=dev)], f, inv)
    with pytest.raises(RuntimeError, match="fastamp_triton::unscale_check_: found_inf, inv_scale"):
        tamp.unscale_check_([torch.ones(2, device=dev)], f.double(), inv)
    with pytest.raises(RuntimeError, match="fastamp_triton::unscale_check_: found_inf, inv_scale"):
        tamp.unscale_check_([torch.ones(2, device=dev)], f, torch.ones(2, device=dev))
    assert f.item() == 0.0


# ---------------------------------------------------------------- update_scale_


def _trackers(device, scale, growth=0, hyst=1):
    return (
        torch.tensor([scale], dtype=torch.float32, device=device),
        torch.tensor([growth], dtype=torch.int32, device=device),
        torch.tensor([hyst], dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("growth, backoff, interval", [(2.0, 0.5, 3), (1.7, 0.3, 2), (2.0, 0.5, 1)])
def test_update_scale_matches_torch_sequence(device, growth, backoff, interval):
    rng = random.Random(7)
    s, g, h = _trackers(device, 2.0**16)
    ts, tg, _ = _trackers(device, 2.0**16)
    for step in range(150):
        r = rng.random()
        fi = torch.tensor([math.nan if r < 0.03 else (1.0 if r < 0.2 else 0.0)], device=device)
        tamp.update_scale_(s, g, h, fi, growth, backoff, interval)
        torch._amp_update_scale_(ts, tg, fi, growth, backoff, interval)
        assert_bits_equal(s, ts, f"scale at step {step}")
        assert_bits_equal(g, tg, f"growth tracker at step {step}")
    # growth refused when it would overflow fp32, tracker still resets
    s, g, h = _trackers(device, 3e38, growth=interval - 1)
    ts, tg, _ = _trackers(device, 3e38, growth=interval - 1)
    zero = torch.zeros(1, device=device)
    tamp.update_scale_(s, g, h, zero, growth, backoff, interval)
    torch._amp_update_scale_(ts, tg, zero, growth, backoff, interval)
    assert_bits_equal(s, ts, "scale at fp32 overflow")
    assert_bits_equal(g, tg, "tracker at fp32 overflow")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "hysteresis, min_scale, max_scale, interval", [(3, 1.0, 2.0**20, 2), (2, 0.3, 1e300, 4), (1, 0.0, 100.0, 2**40)]
)
def test_update_scale_hysteresis_bounds_match_reference(device, hysteresis, min_scale, max_scale, interval):
    rng = random.Random(hysteresis)
    s, g, h = _trackers(device, 64.0, hyst=hysteresis)
    rs, rg, rh = _trackers(device, 64.0, hyst=hysteresis)
    seen = set()
    for step in range(120):
        # a clean run that reaches max_scale, then bursts of overflows down to min_scale
        burst = step >= 40 and (step - 40) % 40 < 28
        fi = torch.tensor([1.0 if burst or (step >= 40 and rng.random() < 0.1) else 0.0], device=device)
        tamp.update_scale_(s, g, h, fi, 2.0, 0.5, interval, hysteresis, min_scale, max_scale)
        R.update_scale_(rs, rg, rh, fi, 2.0, 0.5, interval, hysteresis, min_scale, max_scale)
        for a, e, what in ((s, rs, "scale"), (g, rg, "growth tracker"), (h, rh, "hysteresis tracker")):
            assert_bits_equal(a, e, f"{what} at step {step}")
        seen.add(s.item())
    if interval == 2:
        assert max(seen) == max_scale and min(seen) == min_scale, "the sequence must reach both bounds"


# ---------------------------------------------------------------- adamw_


def _adamw_state(device, p_dtype, g_dtype, master, amsgrad, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    params, grads = [], []
    for n in sizes:
        p = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen) * 4.0
        if n >= 8:
            p[:4] = torch.tensor([0.0, -0.0, 1e-40, -3e-39])
            g[:4] = torch.tensor([-0.0, 1e-42, 0.0, 65504.0])
        params.append(p.to(p_dtype).to(device))
        grads.append(g.to(g_dtype).to(device))
    masters = [p.float() for p in params] if master else []
    m = [(torch.randn(n, generator=gen) * 0.1).to(device) for n in sizes]
    v = [(torch.rand(n, generator=gen) * 0.01).to(device) for n in sizes]
    vmax = [x * 1.25 for x in v] if amsgrad else []
    return [params, grads, masters, m, v, vmax]


def _adamw_steps(fn, state, device, hyper, found_inf, n_steps=2):
    lr, wd, beta1, beta2, eps, amsgrad, maximize = hyper
    for step in range(1, n_steps + 1):
        scalars = R.adamw_step_scalars(
            lr, torch.tensor(float(step), device=device), beta1, beta2, wd, torch.tensor(0.5, device=device)
        )
        fi = None if found_inf is None else torch.tensor([found_inf], device=device)
        fn(*state, scalars, fi, beta1, beta2, eps, amsgrad, maximize)


def _compare_adamw(got, exp, device):
    names = ("params", "grads", "masters", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")
    for name, la, le in zip(names, got, exp):
        for i, (a, e) in enumerate(zip(la, le)):
            what = f"{name}[{i}] ({a.dtype}, n={a.numel()})"
            if device == "cpu":
                assert_bits_equal(a, e, what)
            else:
                # GPU: correctly rounded sqrt/div are requested but not guaranteed by every
                # Triton; fp32 within ADAMW_GPU_RTOL, 16-bit params within one of their ulps
                rtol = ADAMW_GPU_RTOL if a.dtype == torch.float32 else torch.finfo(a.dtype).eps
                torch.testing.assert_close(a, e, rtol=rtol, atol=1e-30, equal_nan=True, msg=what)


_ADAMW_SIZES = [1, 3, 17, BLOCK + 1, CHUNK + 3]
_DTYPE_PAIRS = list(itertools.product(DTYPES, DTYPES))


@pytest.mark.slow  # ~13 s under the interpreter
@pytest.mark.parametrize("device", DEVICES)
def test_adamw_mixed_dtypes_many_tiny_tensors(device):
    """Hundreds of tensors of every (param, grad) dtype pair in one call: one launch per pair."""
    gen = torch.Generator().manual_seed(12)
    state = [[] for _ in range(6)]
    for i in range(200):
        n = 1 + (i * 5) % 23
        p_dtype, g_dtype = _DTYPE_PAIRS[i % len(_DTYPE_PAIRS)]
        state[0].append(torch.randn(n, generator=gen).to(p_dtype).to(device))
        state[1].append(torch.randn(n, generator=gen).to(g_dtype).to(device))
        state[3].append((torch.randn(n, generator=gen) * 0.1).to(device))
        state[4].append((torch.rand(n, generator=gen) * 0.01).to(device))
        state[5].append(state[4][-1] * 2)
    state[0].append(torch.randn(7, dtype=torch.float64, generator=gen).to(device))
    state[1].append(torch.randn(7, dtype=torch.float64, generator=gen).to(device))
    state[3].append(torch.zeros(7, device=device))
    state[4].append(torch.zeros(7, device=device))
    state[5].append(torch.zeros(7, device=device))
    ref = clone_lists(state)
    hyper = (1e-2, 0.1, 0.9, 0.99, 1e-6, True, True)
    _adamw_steps(_triton_op("adamw_"), state, device, hyper, found_inf=None)
    _adamw_steps(R.adamw_, ref, device, hyper, found_inf=None)
    _compare_adamw(state, ref, device)


# ---------------------------------------------------------------- registration and dispatch


def test_opcheck():
    dev = DEVICES[0]
    grads = [torch.randn(5, device=dev), torch.randn(3, device=dev).half(), torch.randn(4, device=dev).bfloat16()]
    for write_back, sumsq in ((True, True), (False, False)):
        torch.library.opcheck(
            torch.ops.fastamp_triton.unscale_check_.default,
            (
                [g.clone() for g in grads],
                torch.zeros(1, device=dev),
                torch.tensor([0.5], device=dev),
                write_back,
                sumsq,
            ),
        )
    s, g, h = _trackers(dev, 1024.0, growth=1, hyst=2)
    torch.library.opcheck(
        torch.ops.fastamp_triton.update_scale_.default,
        (s, g, h, torch.ones(1, device=dev), 2.0, 0.5, 2, 2, 1.0, 1e6),
    )
    state = _adamw_state(dev, torch.bfloat16, torch.float16, True, True, [3, 6], seed=15)
    scalars = R.adamw_step_scalars(1e-3, torch.tensor(2.0, device=dev), 0.9, 0.999, 0.01)
    torch.library.opcheck(
        torch.ops.fastamp_triton.optim_.default,
        _optim_args("adamw_", (*state, scalars, torch.zeros(1, device=dev), 0.9, 0.999, 1e-8, True, False)),
    )
    # lion_: int16 remainders (bf16 params), and no master with stochastic rounding
    params, grads, _, m, _, _ = _adamw_state(dev, torch.bfloat16, torch.float16, False, False, [3, 6], seed=17)
    scalars = R.lion_step_scalars(1e-3, 0.1, torch.tensor(0.5, device=dev), dev)
    rems = [torch.zeros(p.numel(), dtype=torch.int16, device=dev) for p in params]
    rng = torch.tensor([3, 4], device=dev)
    for masters, found in ((rems, torch.zeros(1, device=dev)), ([], None)):
        torch.library.opcheck(
            torch.ops.fastamp_triton.optim_.default,
            _optim_args("lion_", (params, grads, masters, m, scalars, found, rng, 2, 0.9, 0.99, True)),
        )


def test_reachable_through_functional():
    dev = DEVICES[0]
    assert backends.get_impl("unscale_check_", "triton") is tamp.unscale_check_
    assert backends.get_impl("update_scale_", "triton") is tamp.update_scale_
    assert backends.get_impl("optim_", "triton") is toptim.optim_
    for op in toptim.PER_RULE_OPS:  # optim_ on their arguments; no op of their own
        assert backends.get_impl(op, "triton") is getattr(toptim, op)
        assert not hasattr(torch.ops.fastamp_triton, op)
    grads = _grad_set(dev, seed=16, sizes=[5, BLOCK + 1])
    exp_g, exp_f, exp_s = _run_unscale(R.unscale_check_, grads, 0.25, True, True)
    got = [g.clone() for g in grads]
    found = torch.zeros(1, device=dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        total = functional.unscale_check_(
            got, found, torch.tensor([0.25], device=dev), compute_sumsq=True, backend="triton"
        )
    assert_bits_equal(found, exp_f, "found_inf")
    for a, e in zip(got, exp_g):
        assert_bits_equal(a, e, "grad")
    torch.testing.assert_close(total, exp_s, rtol=SUMSQ_RTOL, atol=0)
    s, g, h = _trackers(dev, 8.0)
    functional.update_scale_(s, g, h, torch.ones(1, device=dev), 2.0, 0.5, 10, backend="triton")
    assert s.item() == 4.0


# ---------------------------------------------------------------- signed zeros


@pytest.mark.parametrize("device", DEVICES)
def test_neg_flips_the_sign_of_zero_in_every_triton(device):
    """``_common.neg`` (``maximize``'s ``g = -g``) gives -0.0 for +0.0 and keeps NaN: Triton 3.2 and 3.6 compute
    unary minus as ``0 - x`` (+0.0 for +0.0), which made three SGD and twelve Lion matrix cases differ from the
    reference under triton 3.6 (the CUDA-build tier runs this file with it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _neg_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tamp.C.neg(tl.load(x_ptr + offs, mask=mask)), mask=mask)

    x = torch.tensor([0.0, -0.0, 1e-45, -3.0, math.inf, -math.inf, math.nan], device=device)
    out = torch.empty_like(x)
    _neg_kernel[(1,)](x, out, x.numel(), BLOCK=8)
    assert_bits_equal(out, x * -1.0)
    assert torch.signbit(out[0]) and not torch.signbit(out[1])
