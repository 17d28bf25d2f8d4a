"""Tier 2 on CUDA: the native CUDA kernels (csrc/cuda) against fastamp.reference.

AdamW's cases run the one optimizer kernel, ``optim_`` (csrc/cuda/optim.cuh), with ``adamw_``'s
arguments (``reference.to_optim``): the per-rule CUDA kernels are gone. Skipped without a CUDA device. On a GPU machine, build with CUDA first (see
csrc/cuda/bindings.cpp's header note / the project README) and run
``pytest tests/backends/test_cuda.py``. Agreement is bit for bit (NaN compared as NaN, signed zeros
compared by sign) except the sum of squares, which is within ``tolerances.SUMSQ_RTOL``.
"""

import math

import pytest
import torch
from helpers import assert_bits_equal, misaligned
from tolerances import SUMSQ_RTOL

from fastamp import reference
from fastamp.ops import registry
from fastamp.reference.optim import to_optim

pytestmark = pytest.mark.gpu(reason="needs a CUDA device (CUDA kernels are compile-checked in test_cuda_compile.py)")

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CHUNK = 65536
# Sizes around the vector widths (4 and 8), the block, the 64K-element chunk, primes, 2^k +- 1.
SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 31, 127, 255, 257, 1021, 4093, 65535, 65536, 65537, 131071, 131073, 1000003]
SPECIALS = [
    0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-38, 5.960464477539063e-08, 6e-8, 1e-5, 65504.0, -65504.0, 65519.99,
    65520.0, 70000.0, 3.0e38, -3.4028234663852886e38, 1.0, -1.0, 0.5, 3.0,
]  # fmt: skip
NONFINITE = [math.inf, -math.inf, math.nan]


def _ops_native():
    return torch.ops.fastamp


def native_per_rule(op):
    """The native CUDA kernel of ``optim_`` called with the per-rule op ``op``'s arguments (reference.to_optim)."""

    def call(*args):
        torch.ops.fastamp.optim_(*registry.coerce("optim_", to_optim(op, args)))

    return call


def assert_sumsq_close(ours, ref):
    assert ours.dtype == torch.float32 and ours.dim() == 0 and ours.device == ref.device
    torch.testing.assert_close(ours, ref, rtol=SUMSQ_RTOL, atol=0.0, equal_nan=True)


def _finite_specials(dtype):
    vals = torch.tensor(SPECIALS).to(dtype)
    return [v for v, c in zip(SPECIALS, vals.isfinite().tolist()) if c]


def adversarial(n, dtype, seed, scale=100.0, nonfinite_at=()):
    """Random values with every special finite in ``dtype`` planted, on the device.

    Non-finite values only where asked (fp16 max "and just above" means 65504 and 65520 for
    fp32 grads; for fp16 grads the overflow comes from unscaling, tested separately).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    specials = _finite_specials(dtype)
    if n:
        k = min(n, len(specials))
        x[torch.randperm(n, generator=g)[:k]] = torch.tensor(specials[:k])
    for i, pos in enumerate(nonfinite_at):
        x[pos] = NONFINITE[i % len(NONFINITE)]
    return x.to(dtype).to(DEV)


def plain(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype).to(DEV)


def run_both_unscale(grads, inv, write_back, compute_sumsq, found=0.0):
    ours = [g.clone() for g in grads]
    ref = [g.clone() for g in grads]
    f_ours = torch.full((1,), found, device=DEV)
    f_ref = torch.full((1,), found, device=DEV)
    inv_t = torch.tensor([inv], dtype=torch.float32, device=DEV)
    s_ours = _ops_native().unscale_check_(ours, f_ours, inv_t, write_back, compute_sumsq)
    s_ref = reference.unscale_check_(ref, f_ref, inv_t, write_back, compute_sumsq)
    return ours, ref, f_ours, f_ref, s_ours, s_ref


def check_unscale(grads, inv, write_back=True, compute_sumsq=True, found=0.0):
    ours, ref, f_ours, f_ref, s_ours, s_ref = run_both_unscale(grads, inv, write_back, compute_sumsq, found)
    assert_bits_equal(f_ours, f_ref, "found_inf")
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_bits_equal(a, b, f"grads[{i}] ({a.dtype}, n={a.numel()})")
    if compute_sumsq:
        assert_sumsq_close(s_ours, s_ref)
    else:
        assert s_ours.item() == 0.0
    return f_ours, s_ours


def test_native_cuda_kernels_are_built():
    assert registry.NATIVE_LOADED, f"fastamp._C failed to load: {registry.NATIVE_ERROR}"
    # the per-rule optimizer ops run as optim_ on CUDA (registry.as_optim), the others have C++ kernels
    ops = [op for op in (*registry.NATIVE_OPS, *registry.GENERIC_OPS) if op not in registry.PER_RULE_OPS]
    missing = [op for op in ops if not registry.native_has_kernel(op, "cuda")]
    missing += [op for op in registry.PER_RULE_OPS if (op, "cuda") not in registry.AS_OPTIM]
    assert not missing, (
        f"no CUDA kernel for {missing}; build info {registry.build_info()!r}: rebuild with a CUDA-enabled torch and nvcc"
    )


# ---------------------------------------------------------------- unscale_check_


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inv", [1.0, 2.0**-16, 0.75, 3.0, 2.0, 0.0, math.inf, 1e-30])
@pytest.mark.parametrize("write_back", [True, False])
def test_unscale_adversarial_sizes(dtype, inv, write_back):
    grads = [adversarial(n, dtype, seed=n) for n in SIZES]
    check_unscale(grads, inv, write_back=write_back, compute_sumsq=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 9, 65536, 65537, 1000003])
@pytest.mark.parametrize("where", ["first", "last", "chunk_edge", "all"])
def test_unscale_nonfinite_positions(dtype, n, where):
    pos = {"first": [0], "last": [n - 1], "chunk_edge": [min(n - 1, CHUNK - 1), min(n - 1, CHUNK)], "all": []}[where]
    bad = adversarial(n, dtype, seed=3, nonfinite_at=pos)
    if where == "all":
        bad = torch.full((n,), math.nan, dtype=dtype, device=DEV)
    others = [adversarial(m, dtype, seed=m) for m in (5, 70000)]
    f, _ = check_unscale([others[0], bad, others[1]], 2.0**-8)
    assert f.item() == 1.0


@pytest.mark.parametrize("value", NONFINITE)
def test_unscale_only_element_nonfinite(value):
    for dtype in DTYPES:
        f, _ = check_unscale([torch.tensor([value], dtype=dtype, device=DEV)], 0.5)
        assert f.item() == 1.0


@pytest.mark.parametrize("write_back", [True, False])
def test_unscale_catches_overflow_created_by_unscaling(write_back):
    # fp32: finite scaled value, inf once unscaled by a scale below 1.
    f, _ = check_unscale([torch.tensor([3.0e38, 1.0], device=DEV)], 2.0, write_back=write_back)
    assert f.item() == 1.0
    # fp16 60000 * 2 is finite in fp32 but overflows when written back as fp16.
    f, _ = check_unscale([torch.tensor([60000.0], dtype=torch.float16, device=DEV)], 2.0, write_back=write_back)
    assert f.item() == (1.0 if write_back else 0.0)
    # scale 0 -> inv_scale inf: 0 * inf is NaN.
    f, _ = check_unscale([torch.zeros(3, device=DEV)], math.inf, write_back=write_back)
    assert f.item() == 1.0


def test_unscale_misaligned_matches_and_sumsq_is_alignment_independent():
    for dtype in DTYPES:
        for n in [3, 9, 65537, 300007]:
            g_mis = misaligned(adversarial(n, dtype, seed=n + 1))
            assert g_mis.data_ptr() % 16 != 0
            check_unscale([g_mis], 0.375)
            # sum of squares: same bits whichever load path (vector or scalar) ran
            g = plain(n, dtype, seed=n)
            _, s_aligned = check_unscale([g], 0.375)
            _, s_mis = check_unscale([misaligned(g)], 0.375)
            assert_bits_equal(s_aligned, s_mis, f"sumsq aligned vs misaligned ({dtype}, {n})")


def test_unscale_many_tiny_tensors_mixed_dtypes():
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 300, (3000,), generator=gen).tolist()
    grads = [adversarial(n, DTYPES[i % 3], seed=i, scale=10.0) for i, n in enumerate(sizes)]
    f, s = check_unscale(grads, 2.0**-10)
    assert f.item() == 0.0 and s.item() > 0.0
    # one non-finite value in the last element of the last non-empty tensor of one dtype
    last = max(i for i, n in enumerate(sizes) if n > 0 and i % 3 == 2)
    grads[last][-1] = math.inf
    f, _ = check_unscale(grads, 2.0**-10)
    assert f.item() == 1.0
    # check-only pass: nothing written
    before = [g.clone() for g in grads]
    check_unscale(grads, 2.0**-10, write_back=False)
    f = torch.zeros(1, device=DEV)
    _ops_native().unscale_check_(grads, f, torch.tensor([0.5], device=DEV), False, True)
    for a, b in zip(grads, before):
        assert_bits_equal(a, b, "write_back=False must leave grads untouched")
    assert f.item() == 1.0


def test_unscale_found_inf_is_never_reset_and_sumsq_zero_when_not_asked():
    grads = [adversarial(100, torch.float32, seed=1)]
    f, s = check_unscale(grads, 0.5, compute_sumsq=False, found=1.0)
    assert f.item() == 1.0 and s.item() == 0.0
    f, s = check_unscale([], 0.5, compute_sumsq=True)
    assert f.item() == 0.0 and s.item() == 0.0
    f, s = check_unscale([torch.empty(0, device=DEV)], 0.5, compute_sumsq=True)
    assert f.item() == 0.0 and s.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_unscale_matches_torch_amp_kernel(dtype, nonfinite):
    # Power-of-two inv_scale at most 1 (a scale >= 1): where torch defines the result.
    grads = [adversarial(n, dtype, seed=n, nonfinite_at=[n // 2] if nonfinite and n else []) for n in SIZES]
    ours = [g.clone() for g in grads]
    theirs = [g.clone() for g in grads]
    f_ours, f_theirs = torch.zeros(1, device=DEV), torch.zeros(1, device=DEV)
    inv = torch.tensor([2.0**-12], device=DEV)
    _ops_native().unscale_check_(ours, f_ours, inv, True, False)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, f_theirs, inv)
    assert_bits_equal(f_ours, f_theirs, "found_inf vs torch")
    for a, b in zip(ours, theirs):
        assert_bits_equal(a, b, "grads vs torch")


def test_unscale_sumsq_is_deterministic():
    grads = [plain(n, dt, seed=n) for n in (3_000_001, 65537, 17) for dt in DTYPES]
    inv = torch.tensor([2.0**-7], device=DEV)
    results = []
    for _ in range(3):
        f = torch.zeros(1, device=DEV)
        results.append(_ops_native().unscale_check_(grads, f, inv, False, True))
    assert math.isfinite(results[0].item()) and results[0].item() > 0
    for r in results[1:]:
        assert_bits_equal(r, results[0], "sumsq run to run")


def test_unscale_runs_on_the_current_stream():
    grads = [adversarial(1_000_003, torch.float16, seed=5), adversarial(77, torch.bfloat16, seed=6)]
    ours = [g.clone() for g in grads]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        f = torch.zeros(1, device=DEV)
        inv = torch.tensor([0.25], device=DEV)
        s = _ops_native().unscale_check_(ours, f, inv, True, True)
    torch.cuda.current_stream().wait_stream(side)
    ref = [g.clone() for g in grads]
    f_ref = torch.zeros(1, device=DEV)
    s_ref = reference.unscale_check_(ref, f_ref, torch.tensor([0.25], device=DEV), True, True)
    for a, b in zip(ours, ref):
        assert_bits_equal(a, b, "side stream")
    assert_bits_equal(f, f_ref, "found_inf side stream")
    assert_sumsq_close(s, s_ref)


def test_unscale_more_than_2_pow_31_elements():
    n = 2**31 + 1029
    need = n * 2 * 2 + (1 << 30)  # the fp16 grad, a bool mask and headroom
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free on the GPU, {free / 2**30:.1f} GiB available")
    g = torch.full((n,), 2.0, dtype=torch.float16, device=DEV)
    g[-1] = 4.0
    f = torch.zeros(1, device=DEV)
    s = _ops_native().unscale_check_([g], f, torch.tensor([0.5], device=DEV), True, True)
    assert f.item() == 0.0
    assert s.item() == float(torch.tensor(n + 3, dtype=torch.float64).float())
    assert g[-1].item() == 2.0 and g[0].item() == 1.0 and g[2**31].item() == 1.0
    assert int((g == 1.0).sum()) == n - 1
    g[2**31 + 5] = math.inf
    _ops_native().unscale_check_([g], f, torch.tensor([1.0], device=DEV), False, False)
    assert f.item() == 1.0
    del g


# ---------------------------------------------------------------- update_scale_


@pytest.mark.parametrize("growth_interval", [1, 3, 2000])
@pytest.mark.parametrize("factors", [(2.0, 0.5), (1.7, 0.3)])
@pytest.mark.parametrize("init_scale", [2.0**16, 3.0e38, 1e-30])
def test_update_scale_matches_torch(growth_interval, factors, init_scale):
    growth, backoff = factors
    gen = torch.Generator().manual_seed(growth_interval)
    choices = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, math.nan, 0.5, -2.0, math.inf])
    flags = choices[torch.randint(0, len(choices), (1500,), generator=gen)].to(DEV)
    s_ours = torch.full((1,), init_scale, device=DEV)
    s_torch = s_ours.clone()
    gt_ours = torch.zeros(1, dtype=torch.int32, device=DEV)
    gt_torch = gt_ours.clone()
    hy = torch.ones(1, dtype=torch.int32, device=DEV)
    hist_ours, hist_torch = [], []
    for i in range(flags.numel()):
        f = flags[i : i + 1]
        _ops_native().update_scale_(s_ours, gt_ours, hy, f, growth, backoff, growth_interval, 1, 0.0, math.inf)
        torch._amp_update_scale_(s_torch, gt_torch, f, growth, backoff, growth_interval)
        hist_ours.append(torch.cat([s_ours.view(torch.int32), gt_ours]))
        hist_torch.append(torch.cat([s_torch.view(torch.int32), gt_torch]))
    assert torch.equal(torch.stack(hist_ours), torch.stack(hist_torch))


@pytest.mark.parametrize("hysteresis", [1, 2, 4])
@pytest.mark.parametrize("bounds", [(0.0, math.inf), (1.0, 2.0**24)])
def test_update_scale_matches_reference_with_options(hysteresis, bounds):
    lo, hi = bounds
    gen = torch.Generator().manual_seed(hysteresis)
    # bursts of overflow so hysteresis and the floor are exercised
    flags = (torch.rand(2000, generator=gen) < 0.35).float()
    flags[500:560] = 1.0
    flags[700] = math.nan
    flags = flags.to(DEV)
    state_ours = [
        torch.full((1,), 2.0**20, device=DEV),
        torch.zeros(1, dtype=torch.int32, device=DEV),
        torch.full((1,), hysteresis, dtype=torch.int32, device=DEV),
    ]
    state_ref = [t.clone() for t in state_ours]
    hist_ours, hist_ref = [], []
    for i in range(flags.numel()):
        f = flags[i : i + 1]
        _ops_native().update_scale_(*state_ours, f, 2.0, 0.5, 5, hysteresis, lo, hi)
        reference.update_scale_(*state_ref, f, 2.0, 0.5, 5, hysteresis, lo, hi)
        hist_ours.append(torch.cat([state_ours[0].view(torch.int32), state_ours[1], state_ours[2]]))
        hist_ref.append(torch.cat([state_ref[0].view(torch.int32), state_ref[1], state_ref[2]]))
    assert torch.equal(torch.stack(hist_ours), torch.stack(hist_ref))


# ---------------------------------------------------------------- adamw_

ADAMW_SIZES = [1, 3, 4, 5, 8, 1023, 65536, 65537, 200003]
HYPER = {
    "ordinary": dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=0.1),
    "magnifying": dict(lr=1.0, betas=(0.1, 0.25), eps=1e-6, wd=0.5),
}


def _adamw_state(param_dtype, grad_dtype, use_master, amsgrad, seed, sizes, misalign=False):
    gen = torch.Generator().manual_seed(seed)
    params, grads, masters, ms, vs, vmaxs = [], [], [], [], [], []
    for i, n in enumerate(sizes):
        master = torch.randn(n, generator=gen)
        p = master.to(param_dtype).to(DEV)
        g = adversarial(n, grad_dtype, seed=seed * 1000 + i, scale=3.0)
        m = (torch.randn(n, generator=gen) * 0.1).to(DEV)
        v = (torch.rand(n, generator=gen) * 0.01).to(DEV)
        if misalign and i % 2 == 0:
            p, g = misaligned(p), misaligned(g)
        params.append(p)
        grads.append(g)
        masters.append(master.to(DEV))
        ms.append(m)
        vs.append(v)
        vmaxs.append(v * 1.5 if amsgrad else v.clone())
    return dict(params=params, grads=grads, masters=masters if use_master else [], ms=ms, vs=vs, vmaxs=vmaxs)


def _clone_state(st):
    return {k: [t.clone() for t in v] for k, v in st.items()}


def _adamw_call(fn, st, scalars, found_inf, h, amsgrad, maximize):
    fn(
        st["params"], st["grads"], st["masters"], st["ms"], st["vs"], st["vmaxs"], scalars, found_inf,
        h["betas"][0], h["betas"][1], h["eps"], amsgrad, maximize,
    )  # fmt: skip


def _compare_states(ours, ref, what):
    for key in ("params", "masters", "ms", "vs", "vmaxs"):
        for i, (a, b) in enumerate(zip(ours[key], ref[key])):
            assert_bits_equal(a, b, f"{what}: {key}[{i}]")


def _run_adamw_steps(st, h, amsgrad, maximize, found_value, steps=3, grad_mul=2.0**-10 * 0.7):
    ours, ref = _clone_state(st), _clone_state(st)
    lr = torch.tensor(h["lr"], device=DEV)
    gm = torch.tensor(grad_mul, device=DEV)
    for step in range(1, steps + 1):
        scalars = reference.adamw_step_scalars(
            lr, torch.tensor(float(step), device=DEV), h["betas"][0], h["betas"][1], h["wd"], gm
        )
        found = None if found_value is None else torch.full((1,), found_value, device=DEV)
        _adamw_call(native_per_rule("adamw_"), ours, scalars, found, h, amsgrad, maximize)
        _adamw_call(reference.adamw_, ref, scalars, found, h, amsgrad, maximize)
        _compare_states(ours, ref, f"step {step}")
    return ours


ADAMW_COMBOS = [(p, g, m) for p in DTYPES for g in DTYPES for m in ([False] if p == torch.float32 else [True, False])]


def test_adamw_many_tensors_mixed_dtypes_misaligned_one_call():
    gen = torch.Generator().manual_seed(7)
    sizes = [int(n) for n in torch.randint(1, 200, (400,), generator=gen)] + [65537, 3, 200003]
    parts = [_adamw_state(DTYPES[i % 3], DTYPES[(i // 3) % 3], True, True, 10 + i, [n], misalign=i % 2 == 0)
             for i, n in enumerate(sizes)]  # fmt: skip
    st = {k: [t for part in parts for t in part[k]] for k in parts[0]}
    for amsgrad in (False, True):
        _run_adamw_steps(st, HYPER["ordinary"], amsgrad, False, 0.0)


def test_adamw_fp16_bf16_master_trajectory_equals_fp32_run():
    # Grads exactly representable in the param dtype: the master run equals the fp32-param run.
    for dtype in (torch.float16, torch.bfloat16):
        gen = torch.Generator().manual_seed(11)
        sizes = [1, 4, 1027, 65537]
        master0 = [torch.randn(n, generator=gen).to(DEV) for n in sizes]
        grads = [(torch.randn(n, generator=gen)).to(dtype).to(DEV) for n in sizes]
        lo = {
            "params": [m.to(dtype) for m in master0], "grads": grads, "masters": [m.clone() for m in master0],
            "ms": [torch.zeros_like(m) for m in master0], "vs": [torch.zeros_like(m) for m in master0], "vmaxs": [],
        }  # fmt: skip
        hi = {
            "params": [m.clone() for m in master0], "grads": [g.float() for g in grads], "masters": [],
            "ms": [torch.zeros_like(m) for m in master0], "vs": [torch.zeros_like(m) for m in master0], "vmaxs": [],
        }  # fmt: skip
        h = HYPER["ordinary"]
        lr, gm = torch.tensor(h["lr"], device=DEV), torch.tensor(1.0, device=DEV)
        for step in range(1, 51):
            sc = reference.adamw_step_scalars(lr, torch.tensor(float(step), device=DEV), 0.9, 0.999, h["wd"], gm)
            _adamw_call(native_per_rule("adamw_"), lo, sc, None, h, False, False)
            _adamw_call(native_per_rule("adamw_"), hi, sc, None, h, False, False)
        for a, b, p in zip(lo["masters"], hi["params"], lo["params"]):
            assert_bits_equal(a, b, f"{dtype} master vs fp32 run")
            assert_bits_equal(p, a.to(dtype), f"{dtype} param == master rounded")


# ---------------------------------------------------------------- errors, graphs, opcheck


def test_bad_inputs_raise_clear_errors():
    ops = _ops_native()
    f = torch.zeros(1, device=DEV)
    inv = torch.ones(1, device=DEV)
    with pytest.raises(RuntimeError, match="unscale_check_.*grads\\[1\\].*cpu"):
        ops.unscale_check_([torch.ones(3, device=DEV), torch.ones(3)], f, inv, True, False)
    with pytest.raises(RuntimeError, match="unscale_check_.*grads\\[0\\].*float32, float16 or bfloat16"):
        ops.unscale_check_([torch.ones(3, dtype=torch.float64, device=DEV)], f, inv, True, False)
    with pytest.raises(RuntimeError, match="unscale_check_.*contiguous"):
        ops.unscale_check_([torch.ones(4, 4, device=DEV).t()], f, inv, True, False)
    with pytest.raises(RuntimeError, match="unscale_check_.*inv_scale"):
        ops.unscale_check_([torch.ones(3, device=DEV)], f, torch.ones(2, device=DEV), True, False)
    with pytest.raises(RuntimeError, match="update_scale_.*growth_tracker.*Int"):
        ops.update_scale_(torch.ones(1, device=DEV), torch.zeros(1, device=DEV), torch.ones(1, dtype=torch.int32,
                          device=DEV), f, 2.0, 0.5, 10, 1, 0.0, math.inf)  # fmt: skip


def test_ops_capture_in_a_cuda_graph():
    # No host sync and torch-allocated temporaries: the whole scaler + optimizer step can be captured.
    grads = [adversarial(n, dt, seed=n) for n in (1000, 65537) for dt in DTYPES]
    st = _adamw_state(torch.bfloat16, torch.bfloat16, True, False, seed=5, sizes=[1000, 65537])
    st_ref = _clone_state(st)
    g_ref = [g.clone() for g in grads]
    found, inv = torch.zeros(1, device=DEV), torch.tensor([0.5], device=DEV)
    scale = torch.tensor([2.0], device=DEV)
    gt, hy = torch.zeros(1, dtype=torch.int32, device=DEV), torch.ones(1, dtype=torch.int32, device=DEV)
    sc = reference.adamw_step_scalars(1e-3, torch.tensor(1.0, device=DEV), 0.9, 0.999, 0.01, inv)
    h = HYPER["ordinary"]
    ops = _ops_native()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph on throwaway copies
        ops.unscale_check_([g.clone() for g in grads], found.clone(), inv, True, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total = ops.unscale_check_(grads, found, inv, True, True)
        _adamw_call(native_per_rule("adamw_"), st, sc, found, h, False, False)
        ops.update_scale_(scale, gt, hy, found, 2.0, 0.5, 2000, 1, 0.0, math.inf)
    graph.replay()
    torch.cuda.synchronize()
    f_ref = torch.zeros(1, device=DEV)
    total_ref = reference.unscale_check_(g_ref, f_ref, inv, True, True)
    _adamw_call(reference.adamw_, st_ref, sc, f_ref, h, False, False)
    for a, b in zip(grads, g_ref):
        assert_bits_equal(a, b, "graph: grads")
    assert_sumsq_close(total, total_ref)
    _compare_states(st, st_ref, "graph: adamw")
    assert scale.item() == 2.0 and gt.item() == 1


def test_opcheck():
    f = torch.zeros(1, device=DEV)
    inv = torch.tensor([0.5], device=DEV)
    grads = [torch.randn(5, device=DEV), torch.randn(9, device=DEV).half()]
    torch.library.opcheck(torch.ops.fastamp.unscale_check_.default, (grads, f, inv, True, True))
    torch.library.opcheck(
        torch.ops.fastamp.update_scale_.default,
        (torch.ones(1, device=DEV), torch.zeros(1, dtype=torch.int32, device=DEV),
         torch.ones(1, dtype=torch.int32, device=DEV), f, 2.0, 0.5, 3, 1, 0.0, math.inf),
    )  # fmt: skip
    st = _adamw_state(torch.float16, torch.bfloat16, True, True, seed=6, sizes=[5, 17])
    sc = torch.tensor([1e-3, 0.5, 0.999, 1.0], device=DEV)
    torch.library.opcheck(
        torch.ops.fastamp.optim_.default,
        registry.coerce("optim_", to_optim("adamw_", (st["params"], st["grads"], st["masters"], st["ms"], st["vs"],
                                                       st["vmaxs"], sc, f, 0.9, 0.999, 1e-8, True, False))),
    )  # fmt: skip
