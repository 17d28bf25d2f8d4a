"""Tier 2 on CUDA for the low-bit ops: adamw_bf16_, sgd_, lion_ and unscale_check_stats_ (csrc/cuda).

The optimizer cases run the one optimizer kernel, ``optim_`` (csrc/cuda/optim.cuh), with each
per-rule op's arguments (``reference.to_optim``): the per-rule CUDA kernels are gone.

Every output of the native CUDA kernels is compared with fastamp.reference run on the same
device, bit for bit (NaN compared as NaN whatever its payload; integer counts with
torch.equal), except the sum of squares, which is within ``tolerances.SUMSQ_RTOL`` of the
reference and bit-identical to the plain ``unscale_check_`` kernel. Skipped without a CUDA
device; the kernels are compile-checked in test_cuda_compile.py. Run on a GPU machine after
building with CUDA: ``pytest tests/backends/test_cuda_lowbit.py``.
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
OPS = torch.ops.fastamp


def native_per_rule(op):
    """The native CUDA kernel of ``optim_`` called with the per-rule op ``op``'s arguments (reference.to_optim)."""

    def call(*args):
        OPS.optim_(*registry.coerce("optim_", to_optim(op, args)))

    return call


NATIVE = {op: native_per_rule(op) for op in ("adamw_", "adamw_bf16_", "sgd_", "lion_")}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CHUNK = 65536  # csrc/cuda/launchers.h kChunkSize
SIZES = [1, 3, 4, 5, 8, 1023, CHUNK, CHUNK + 1, 200003]
BF16_MAX = 3.3895313892515355e38


def _bits_to_f32(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def edge_masters(n, gen):
    """fp32 masters (CPU) with the remainder edge cases planted: exact ties (low 16 bits
    0x8000, both signs, odd and even bf16 neighbours), subnormals, values next to bf16 max
    (including the tie between max and inf), zeros of both signs, the largest fp32."""
    m = torch.randn(n, generator=gen)
    specials = _bits_to_f32([
        0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x00008000, 0x80018000, 0x00000001, 0x807FFFFF,
        0x7F7F8000, 0x7F7F7FFF, 0xFF7F8000, 0x7F7FFFFF, 0x7F7F0000, 0x00000000, 0x80000000, 0x3F80FFFF,
    ])  # fmt: skip
    k = min(n, specials.numel())
    if k:
        m[torch.randperm(n, generator=gen)[:k]] = specials[:k]
    return m


def _grads(n, dtype, gen, scale=1.0):
    g = torch.randn(n, generator=gen) * scale
    if n > 2:
        g[torch.randint(0, n, (max(1, n // 97),), generator=gen)] = 0.0
    return g.to(dtype).to(DEV)


def _clone(st):
    return {k: ([t.clone() for t in v] if isinstance(v, list) else v) for k, v in st.items()}


def _compare(ours, ref, keys, what):
    for key in keys:
        for i, (a, b) in enumerate(zip(ours[key], ref[key])):
            assert_bits_equal(a, b, f"{what}: {key}[{i}] (n={a.numel()})")


def test_new_ops_have_cuda_kernels():
    assert registry.NATIVE_LOADED, f"fastamp._C failed to load: {registry.NATIVE_ERROR}"
    for op in ("optim_", "unscale_check_stats_"):
        assert registry.native_has_kernel(op, "cuda"), (
            f"no CUDA kernel for fastamp::{op}; build info {registry.build_info()!r}"
        )


# ---------------------------------------------------------------- adamw_bf16_

ADAM_H = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1)


def _adamw_bf16_state(grad_dtype, use_rem, moment_dtype, amsgrad, seed, sizes=SIZES, misalign=False):
    gen = torch.Generator().manual_seed(seed)
    st = dict(params=[], grads=[], rems=[], ms=[], vs=[], vmaxs=[])
    for i, n in enumerate(sizes):
        p, r = reference.split_master(edge_masters(n, gen))
        g = _grads(n, grad_dtype, gen, scale=3.0)
        m = (torch.randn(n, generator=gen) * 0.1).to(moment_dtype)
        v = (torch.rand(n, generator=gen) * 0.01).to(moment_dtype)
        if misalign and i % 2 == 0:
            p, g = misaligned(p.to(DEV)), misaligned(g)
        st["params"].append(p.to(DEV))
        st["grads"].append(g)
        st["rems"].append(r.to(DEV))
        st["ms"].append(m.to(DEV))
        st["vs"].append(v.to(DEV))
        st["vmaxs"].append((v.float() * 1.5).to(moment_dtype).to(DEV))
    if not use_rem:
        st["rems"] = []
    if not amsgrad:
        st["vmaxs"] = []
    return st


def _adamw_bf16_call(fn, st, scalars, found, rng, rng_base, amsgrad, maximize, h=ADAM_H):
    fn(st["params"], st["grads"], st["rems"], st["ms"], st["vs"], st["vmaxs"], scalars, found, rng, rng_base,
       h["beta1"], h["beta2"], h["eps"], amsgrad, maximize)  # fmt: skip


def _adamw_scalars(step, h=ADAM_H, grad_mul=2.0**-10 * 0.7):
    return reference.adamw_step_scalars(
        torch.tensor(h["lr"], device=DEV), torch.tensor(float(step), device=DEV), h["beta1"], h["beta2"], h["wd"],
        torch.tensor(grad_mul, device=DEV),
    )  # fmt: skip


ADAM_KEYS = ("params", "rems", "ms", "vs", "vmaxs")


def _run_adamw_bf16(st, amsgrad, maximize, found_value, use_rng, steps=3, rng_base=0, h=ADAM_H):
    ours, ref = _clone(st), _clone(st)
    for step in range(1, steps + 1):
        sc = _adamw_scalars(step, h)
        found = None if found_value is None else torch.full((1,), found_value, device=DEV)
        rng = torch.tensor([1234567, step], dtype=torch.int64, device=DEV) if use_rng else None
        _adamw_bf16_call(NATIVE["adamw_bf16_"], ours, sc, found, rng, rng_base, amsgrad, maximize, h)
        _adamw_bf16_call(reference.adamw_bf16_, ref, sc, found, rng, rng_base, amsgrad, maximize, h)
        _compare(ours, ref, ADAM_KEYS, f"adamw_bf16_ step {step}")
    return ours


def test_adamw_bf16_identity_step_keeps_every_master_exactly():
    # lr = 0, wd = 0: the master comes back unchanged, so every edge case (ties, subnormals,
    # the max/inf tie) goes through join -> split in the kernel and must round-trip exactly.
    h = dict(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0)
    st = _adamw_bf16_state(torch.float32, True, torch.float32, False, seed=3, sizes=[16, 17, 1029])
    before = [reference.join_master(p, r) for p, r in zip(st["params"], st["rems"])]
    ours = _run_adamw_bf16(st, False, False, None, False, steps=1, h=h)
    for p, r, m in zip(ours["params"], ours["rems"], before):
        # + 0.0: a zero master may come back with the other sign (-0 - (-0) = +0)
        assert_bits_equal(reference.join_master(p, r) + 0.0, m + 0.0, "master after an identity step")


def test_adamw_bf16_remainder_trajectory_equals_fp32_master_adamw():
    # 2,000 steps: remainder state (bf16 param + int16) vs an fp32 master run of adamw_.
    gen = torch.Generator().manual_seed(6)
    sizes = [1, 5, 1031, CHUNK + 7]
    masters0 = [edge_masters(n, gen).clamp(-100, 100).to(DEV) for n in sizes]
    grads = [_grads(n, torch.bfloat16, gen) for n in sizes]
    split = [reference.split_master(m) for m in masters0]
    rem = dict(params=[p for p, _ in split], grads=grads, rems=[r for _, r in split],
               ms=[torch.zeros_like(m) for m in masters0], vs=[torch.zeros_like(m) for m in masters0], vmaxs=[])  # fmt: skip
    fp_params = [m.bfloat16() for m in masters0]
    fp_masters = [m.clone() for m in masters0]
    fp_ms = [torch.zeros_like(m) for m in masters0]
    fp_vs = [torch.zeros_like(m) for m in masters0]
    for step in range(1, 2001):
        sc = _adamw_scalars(step, grad_mul=1.0)
        if step % 7 == 0:  # new grads now and then, in place, bounded (x -0.5, then x -2)
            for g in grads:
                g.mul_(-0.5 if step % 14 else -2.0)
        _adamw_bf16_call(NATIVE["adamw_bf16_"], rem, sc, None, None, 0, False, False)
        NATIVE["adamw_"](fp_params, grads, fp_masters, fp_ms, fp_vs, [], sc, None, 0.9, 0.999, 1e-8, False, False)
    for i in range(len(sizes)):
        assert_bits_equal(reference.join_master(rem["params"][i], rem["rems"][i]), fp_masters[i], f"master[{i}]")
        assert_bits_equal(rem["ms"][i], fp_ms[i], f"exp_avg[{i}]")
        assert_bits_equal(rem["vs"][i], fp_vs[i], f"exp_avg_sq[{i}]")
        p_ref, _ = reference.split_master(fp_masters[i])
        assert_bits_equal(rem["params"][i], p_ref, f"param[{i}] == split_master(fp32 master)")


# ---------------------------------------------------------------- stochastic rounding


def test_stochastic_rounding_bits_streams_and_reproducibility():
    gen = torch.Generator().manual_seed(7)
    sizes = [3, CHUNK + 5, 1000]
    st = _adamw_bf16_state(torch.float32, False, torch.bfloat16, True, seed=8, sizes=sizes)
    sc = _adamw_scalars(1)
    rng = torch.tensor([-987654321012, 2**40 + 17], dtype=torch.int64, device=DEV)  # only the low 32 bits count
    a, b = _clone(st), _clone(st)
    _adamw_bf16_call(NATIVE["adamw_bf16_"], a, sc, None, rng, 5, True, False)
    _adamw_bf16_call(NATIVE["adamw_bf16_"], b, sc, None, rng, 5, True, False)
    _compare(a, b, ADAM_KEYS, "same rng, same bits")
    ref = _clone(st)
    _adamw_bf16_call(reference.adamw_bf16_, ref, sc, None, rng, 5, True, False)
    _compare(a, ref, ADAM_KEYS, "vs reference (rng with high bits set)")
    # tensor i of a call with rng_base=5 draws what tensor 0 of a call with rng_base=5+i draws
    for i in range(len(sizes)):
        single = {k: ([v[i].clone()] if v else []) for k, v in st.items()}
        _adamw_bf16_call(NATIVE["adamw_bf16_"], single, sc, None, rng, 5 + i, True, False)
        for k in ADAM_KEYS:
            if single[k]:
                assert_bits_equal(single[k][0], a[k][i], f"stream of tensor {i}: {k}")
    # another counter draws other bits
    c = _clone(st)
    _adamw_bf16_call(NATIVE["adamw_bf16_"], c, sc, None, torch.tensor([-987654321012, 18], device=DEV), 5, True, False)
    assert any(not torch.equal(x, y) for x, y in zip(c["params"], a["params"]))
    del gen


def test_stochastic_rounding_is_unbiased():
    # p = 1 (bf16), lr = 1, grad = -2^-9: the fp32 result 1 + 2^-9 lies a quarter of the way
    # from 1 to the next bf16 (1 + 2^-7), so it must round up with probability 1/4.
    n = 1 << 20
    p = torch.ones(n, dtype=torch.bfloat16, device=DEV)
    g = torch.full((n,), -(2.0**-9), device=DEV)
    ref_p = p.clone()
    sc = reference.sgd_step_scalars(1.0, torch.tensor(0.0, device=DEV))
    rng = torch.tensor([42, 3], dtype=torch.int64, device=DEV)
    NATIVE["sgd_"]([p], [g], [], [], sc, None, rng, 0, 0.0, 0.0, 0.0, False, False)
    reference.sgd_([ref_p], [g], [], [], sc, None, rng, 0, 0.0, 0.0, 0.0, False, False)
    assert_bits_equal(p, ref_p, "SR param vs reference")
    assert set(p.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    frac_up = (p.float() > 1.0).double().mean().item()
    sigma = math.sqrt(0.25 * 0.75 / n)
    assert abs(frac_up - 0.25) < 6 * sigma, frac_up


# ---------------------------------------------------------------- sgd_

SGD_CONFIGS = {
    "plain": dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
    "momentum": dict(momentum=0.9, dampening=0.1, weight_decay=1e-2, nesterov=False, maximize=False),
    "nesterov": dict(momentum=0.9, dampening=0.0, weight_decay=5e-4, nesterov=True, maximize=True),
    "wd_only": dict(momentum=0.0, dampening=0.0, weight_decay=0.3, nesterov=False, maximize=True),
}
SGD_COMBOS = [(p, g, k) for p in DTYPES for g in DTYPES for k in ("none", "fp32")] + [
    (torch.bfloat16, g, "remainder") for g in DTYPES
]
SGD_KEYS = ("params", "masters", "bufs")


def _sgd_state(param_dtype, grad_dtype, kind, momentum, seed, sizes=SIZES, misalign=False):
    gen = torch.Generator().manual_seed(seed)
    st = dict(params=[], grads=[], masters=[], bufs=[])
    for i, n in enumerate(sizes):
        m = edge_masters(n, gen) if kind == "remainder" else torch.randn(n, generator=gen)
        if kind == "remainder":
            p, master = reference.split_master(m)
        else:
            p, master = m.to(param_dtype), m
        g = _grads(n, grad_dtype, gen, scale=2.0)
        if misalign and i % 2 == 1:
            g = misaligned(g)
        st["params"].append(misaligned(p.to(DEV)) if misalign and i % 2 == 0 else p.to(DEV))
        st["grads"].append(g)
        st["masters"].append(master.to(DEV))
        st["bufs"].append((torch.randn(n, generator=gen) * 0.1).to(DEV))
    if kind == "none":
        st["masters"] = []
    if momentum == 0.0:
        st["bufs"] = []
    return st


def _sgd_call(fn, st, sc, found, rng, rng_base, h):
    fn(st["params"], st["grads"], st["masters"], st["bufs"], sc, found, rng, rng_base, h["momentum"],
       h["dampening"], h["weight_decay"], h["nesterov"], h["maximize"])  # fmt: skip


def _run_sgd(st, h, found_value, use_rng, steps=3, first_step=0, lr=0.05, grad_mul=0.75):
    ours, ref = _clone(st), _clone(st)
    lr_t, gm = torch.tensor(lr, device=DEV), torch.tensor(grad_mul, device=DEV)
    for k in range(steps):
        sc = reference.sgd_step_scalars(lr_t, torch.tensor(first_step + k, device=DEV), gm)
        found = None if found_value is None else torch.full((1,), found_value, device=DEV)
        rng = torch.tensor([99, 1000 + k], dtype=torch.int64, device=DEV) if use_rng else None
        _sgd_call(NATIVE["sgd_"], ours, sc, found, rng, 2, h)
        _sgd_call(reference.sgd_, ref, sc, found, rng, 2, h)
        _compare(ours, ref, SGD_KEYS, f"sgd_ step {k}")
    return ours


def test_sgd_first_step_flag_comes_from_step_scalars():
    # is_first = 1 sets the buffer to the grad whatever it held (NaN included); 0 uses it.
    h = SGD_CONFIGS["momentum"]
    for first_step in (0, 1):
        st = _sgd_state(torch.float32, torch.float32, "none", 0.9, seed=12, sizes=[5, 300])
        st["bufs"][0][1] = math.nan
        ours = _run_sgd(st, h, None, False, steps=1, first_step=first_step)
        assert ours["bufs"][0][1].isnan().item() == (first_step == 1)


def test_sgd_identity_step_keeps_every_remainder_master_exactly():
    st = _sgd_state(torch.bfloat16, torch.float32, "remainder", 0.0, seed=13, sizes=[16, 1029])
    before = [reference.join_master(p, r) for p, r in zip(st["params"], st["masters"])]
    ours = _run_sgd(st, SGD_CONFIGS["plain"], None, False, steps=1, lr=0.0)
    for p, r, m in zip(ours["params"], ours["masters"], before):
        # + 0.0: a zero master may come back with the other sign (-0 - (-0) = +0)
        assert_bits_equal(reference.join_master(p, r) + 0.0, m + 0.0, "master after an identity step")


def test_sgd_remainder_trajectory_equals_fp32_master():
    gen = torch.Generator().manual_seed(16)
    sizes = [1, 5, 1031, CHUNK + 7]
    masters0 = [edge_masters(n, gen).clamp(-100, 100).to(DEV) for n in sizes]
    grads = [_grads(n, torch.bfloat16, gen) for n in sizes]
    split = [reference.split_master(m) for m in masters0]
    rem = dict(params=[p for p, _ in split], grads=grads, masters=[r for _, r in split],
               bufs=[torch.zeros_like(m) for m in masters0])  # fmt: skip
    fp = dict(params=[m.bfloat16() for m in masters0], grads=grads, masters=[m.clone() for m in masters0],
              bufs=[torch.zeros_like(m) for m in masters0])  # fmt: skip
    h = SGD_CONFIGS["nesterov"]
    lr = torch.tensor(0.01, device=DEV)
    for step in range(2000):
        sc = reference.sgd_step_scalars(lr, torch.tensor(step, device=DEV))
        if step % 7 == 6:
            for g in grads:
                g.mul_(-0.5 if step % 14 == 6 else -2.0)
        _sgd_call(NATIVE["sgd_"], rem, sc, None, None, 0, h)
        _sgd_call(NATIVE["sgd_"], fp, sc, None, None, 0, h)
    for i in range(len(sizes)):
        assert_bits_equal(reference.join_master(rem["params"][i], rem["masters"][i]), fp["masters"][i], f"master[{i}]")
        assert_bits_equal(rem["bufs"][i], fp["bufs"][i], f"momentum_buffer[{i}]")
        assert_bits_equal(rem["params"][i], reference.split_master(fp["masters"][i])[0], f"param[{i}]")


# ---------------------------------------------------------------- unscale_check_stats_

STATS_SPECIALS = [
    0.0, -0.0, 1e-45, -1e-45, 1e-40, 5.960464477539063e-08, 6e-8, 6.1035156e-05, 6.103515625e-05, -6.1e-05,
    1e-5, 65504.0, -65504.0, 65520.0, 70000.0, 3.0e38, -3.4028234663852886e38, 1.0, 0.5,
]  # fmt: skip


def _stats_grads(sizes, dtypes, seed, nonfinite=True):
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for i, n in enumerate(sizes):
        dt = dtypes[i % len(dtypes)]
        x = torch.randn(n, generator=gen) * 10.0 ** float(torch.randint(-7, 4, (1,), generator=gen))
        if n:
            vals = torch.tensor(STATS_SPECIALS)
            vals = vals[vals.to(dt).isfinite()]
            k = min(n, vals.numel())
            x[torch.randperm(n, generator=gen)[:k]] = vals[:k]
            x[torch.randint(0, n, (max(1, n // 50),), generator=gen)] = 0.0
            if nonfinite and i % 3 == 1:
                x[torch.randint(0, n, (3,), generator=gen)] = torch.tensor([math.inf, -math.inf, math.nan])
        grads.append(x.to(dt).to(DEV))
    return grads


def _check_stats(grads, inv, write_back, compute_sumsq=True, found=0.0):
    n = len(grads)
    ours, ref, plain = [g.clone() for g in grads], [g.clone() for g in grads], [g.clone() for g in grads]
    f_o, f_r, f_p = (torch.full((1,), found, device=DEV) for _ in range(3))
    inv_t = torch.tensor([inv], dtype=torch.float32, device=DEV)
    # garbage in the outputs: they are overwritten, not accumulated
    c_o = torch.full((n, 3), -7, dtype=torch.int64, device=DEV)
    a_o = torch.full((n,), math.nan, device=DEV)
    c_r = torch.zeros((n, 3), dtype=torch.int64, device=DEV)
    a_r = torch.zeros((n,), device=DEV)
    s_o = OPS.unscale_check_stats_(ours, f_o, inv_t, write_back, compute_sumsq, c_o, a_o)
    s_r = reference.unscale_check_stats_(ref, f_r, inv_t, write_back, compute_sumsq, c_r, a_r)
    s_p = OPS.unscale_check_(plain, f_p, inv_t, write_back, compute_sumsq)
    assert_bits_equal(c_o, c_r, "counts")
    assert_bits_equal(a_o, a_r, "absmax")
    assert_bits_equal(f_o, f_r, "found_inf")
    for i, (a, b, c) in enumerate(zip(ours, ref, plain)):
        assert_bits_equal(a, b, f"grads[{i}] ({a.dtype}, n={a.numel()})")
        assert_bits_equal(a, c, f"grads[{i}] vs unscale_check_")
    assert_bits_equal(s_o, s_p, "sumsq vs unscale_check_ (same chunk order)")
    if compute_sumsq:
        torch.testing.assert_close(s_o, s_r, rtol=SUMSQ_RTOL, atol=0.0, equal_nan=True)
    else:
        assert s_o.item() == 0.0
    return c_o, a_o, f_o


@pytest.mark.parametrize("inv", [1.0, 2.0**-16, 0.75, 3.0, 0.0, math.inf, 1e-30, 2.0**24])
@pytest.mark.parametrize("write_back", [True, False])
def test_unscale_check_stats_matches_reference(inv, write_back):
    sizes = [0, 1, 2, 7, 9, 255, 1021, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 1000003]
    grads = _stats_grads(sizes, DTYPES, seed=7 + write_back)
    grads[3] = misaligned(grads[3])
    _check_stats(grads, inv, write_back, compute_sumsq=inv != 0.75)


def test_unscale_check_stats_edge_counts():
    # fp16 60000 unscaled by 2 overflows only when written back; 2^-15 underflows, 2^-14 does not;
    # -0 counts as a zero; all-NaN gives absmax 0; an empty tensor gives zeros.
    grads = [
        torch.tensor([60000.0, 1.0, -0.0, 2.0**-16, 2.0**-15, 2.0**-13], dtype=torch.float16, device=DEV),
        torch.full((70000,), math.nan, device=DEV),
        torch.empty(0, dtype=torch.bfloat16, device=DEV),
        torch.tensor([3.0e38, -1e-45, 0.0], device=DEV),
    ]
    for write_back in (True, False):
        c, a, f = _check_stats(grads, 2.0, write_back)
        assert c[0].tolist() == [1 if write_back else 0, 1, 1] and a[0].item() == 120000.0
        assert c[1].tolist() == [70000, 0, 0] and a[1].item() == 0.0
        assert c[2].tolist() == [0, 0, 0] and a[2].item() == 0.0
        assert c[3].tolist() == [1, 1, 1] and f.item() == 1.0


def test_unscale_check_stats_many_tiny_tensors_and_determinism():
    gen = torch.Generator().manual_seed(17)
    sizes = torch.randint(0, 300, (600,), generator=gen).tolist() + [CHUNK * 4 + 3]
    grads = _stats_grads(sizes, DTYPES, seed=18)
    first = _check_stats(grads, 2.0**-10, True)
    again = _check_stats(grads, 2.0**-10, True)
    for x, y in zip(first, again):
        assert_bits_equal(x, y, "run to run")
    _check_stats([], 0.5, True)


def test_unscale_check_stats_through_functional_with_non_contiguous_and_fp64():
    from fastamp import functional

    gens = _stats_grads([33, 1000, 77], DTYPES, seed=19)
    grads = [gens[0], torch.randn(40, 30, device=DEV).t(), gens[1], torch.randn(9, dtype=torch.float64, device=DEV),
             gens[2]]  # fmt: skip
    ref = [g.clone() for g in grads]
    n = len(grads)
    c, a = torch.empty((n, 3), dtype=torch.int64, device=DEV), torch.empty(n, device=DEV)
    c_r, a_r = torch.empty((n, 3), dtype=torch.int64, device=DEV), torch.empty(n, device=DEV)
    f, f_r, inv = torch.zeros(1, device=DEV), torch.zeros(1, device=DEV), torch.tensor([0.25], device=DEV)
    functional.unscale_check_(grads, f, inv, counts=c, absmax=a, backend="native")
    reference.unscale_check_stats_(ref, f_r, inv, True, False, c_r, a_r)
    assert_bits_equal(c, c_r, "counts")
    assert_bits_equal(a, a_r, "absmax")
    for x, y in zip(grads, ref):
        assert_bits_equal(x, y, "grads")


# ---------------------------------------------------------------- lion_
# optim_'s kernel with Lion's rule (csrc/cuda/optim.cuh); the formats, sizes, values and bad inputs are
# in test_optim_matrix.py and test_cuda_optim.py. Here: what only a CUDA launch shows.

LION_H = dict(beta1=0.9, beta2=0.99, maximize=True)
LION_KEYS = ("params", "masters", "exp_avgs")


def _lion_state(param_dtype, grad_dtype, kind, seed, sizes=SIZES, misalign=False):
    st = _sgd_state(param_dtype, grad_dtype, kind, 0.9, seed, sizes, misalign)
    return dict(params=st["params"], grads=st["grads"], masters=st["masters"], exp_avgs=st["bufs"])


def _lion_call(fn, st, sc, found, rng, rng_base, h):
    fn(st["params"], st["grads"], st["masters"], st["exp_avgs"], sc, found, rng, rng_base, h["beta1"], h["beta2"],
       h["maximize"])  # fmt: skip


def _lion_scalars(lr=0.01, weight_decay=0.1, grad_mul=0.5):
    return reference.lion_step_scalars(torch.tensor(lr, device=DEV), weight_decay, torch.tensor(grad_mul, device=DEV))


def test_lion_mixed_dtypes_in_one_call():
    """Every (param, grad) dtype pair in one call, fp32 masters: one launch per pair, each tensor by its own
    pair's kernel, misaligned tensors and a chunk boundary among them; bit-exact with the reference."""
    parts = [
        _lion_state(p, g, "fp32", seed=30 + 3 * i + j, sizes=[5, CHUNK + 3], misalign=True)
        for i, p in enumerate(DTYPES)
        for j, g in enumerate(DTYPES)
    ]
    st = {key: [t for part in parts for t in part[key]] for key in parts[0]}
    ref = _clone(st)
    for k in range(2):
        sc = _lion_scalars(lr=0.01 * (k + 1))
        _lion_call(NATIVE["lion_"], st, sc, None, None, 0, LION_H)
        _lion_call(reference.lion_, ref, sc, None, None, 0, LION_H)
        _compare(st, ref, LION_KEYS, f"lion_ mixed dtypes, step {k}")


def test_lion_captures_in_a_cuda_graph():
    """Under capture the launch table goes into the graph (fill kernels) and the RNG counter is read on the
    device: two replays are two steps with new random bits (bf16 params without masters)."""
    st = _lion_state(torch.bfloat16, torch.float16, "none", seed=27, sizes=[1000, CHUNK + 1])
    ref = _clone(st)
    rng = torch.tensor([7, 0], dtype=torch.int64, device=DEV)
    found = torch.zeros(1, device=DEV)
    sc = _lion_scalars()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rng[1:].add_(1)
        _lion_call(NATIVE["lion_"], st, sc, found, rng, 3, LION_H)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    for k in (1, 2):
        r = torch.tensor([7, k], dtype=torch.int64, device=DEV)
        _lion_call(reference.lion_, ref, sc, found, r, 3, LION_H)
    _compare(st, ref, LION_KEYS, "graph: lion_")
    assert rng[1].item() == 2


# ---------------------------------------------------------------- errors, graphs, opcheck


def test_bad_inputs_raise_clear_errors():
    grads, f, inv = [torch.ones(3, device=DEV)], torch.zeros(1, device=DEV), torch.ones(1, device=DEV)
    with pytest.raises(RuntimeError, match="unscale_check_stats_.*counts must have shape \\[1, 3\\]"):
        OPS.unscale_check_stats_(grads, f, inv, True, False, torch.zeros(3, dtype=torch.int64, device=DEV),
                                 torch.zeros(1, device=DEV))  # fmt: skip
    with pytest.raises(RuntimeError, match="unscale_check_stats_.*counts must be int64"):
        OPS.unscale_check_stats_(grads, f, inv, True, False, torch.zeros(1, 3, dtype=torch.int32, device=DEV),
                                 torch.zeros(1, device=DEV))  # fmt: skip
    with pytest.raises(RuntimeError, match="unscale_check_stats_.*absmax must be float32"):
        OPS.unscale_check_stats_(grads, f, inv, True, False, torch.zeros(1, 3, dtype=torch.int64, device=DEV),
                                 torch.zeros(1, dtype=torch.float16, device=DEV))  # fmt: skip


def test_ops_capture_in_a_cuda_graph():
    # Counter and flags are device values: a captured step replays with new bits and no sync.
    st = _adamw_bf16_state(torch.bfloat16, False, torch.bfloat16, False, seed=22, sizes=[1000, CHUNK + 1])
    sgd_st = _sgd_state(torch.bfloat16, torch.bfloat16, "remainder", 0.9, seed=23, sizes=[1000, 77])
    grads = _stats_grads([1000, CHUNK + 1], DTYPES, seed=24, nonfinite=False)
    st_ref, sgd_ref, g_ref = _clone(st), _clone(sgd_st), [g.clone() for g in grads]
    rng = torch.tensor([5, 0], dtype=torch.int64, device=DEV)
    found, inv = torch.zeros(1, device=DEV), torch.tensor([0.5], device=DEV)
    counts, absmax = torch.empty((2, 3), dtype=torch.int64, device=DEV), torch.empty(2, device=DEV)
    sc = _adamw_scalars(1)
    sc3 = reference.sgd_step_scalars(0.1, torch.tensor(0, device=DEV))
    h = SGD_CONFIGS["nesterov"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on throwaway copies
        OPS.unscale_check_stats_([g.clone() for g in grads], found.clone(), inv, True, True, counts.clone(),
                                 absmax.clone())  # fmt: skip
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        OPS.unscale_check_stats_(grads, found, inv, True, True, counts, absmax)
        rng[1:].add_(1)
        _adamw_bf16_call(NATIVE["adamw_bf16_"], st, sc, found, rng, 0, False, False)
        _sgd_call(NATIVE["sgd_"], sgd_st, sc3, found, None, 0, h)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    f_ref = torch.zeros(1, device=DEV)
    c_ref, a_ref = torch.empty((2, 3), dtype=torch.int64, device=DEV), torch.empty(2, device=DEV)
    for k in (1, 2):
        reference.unscale_check_stats_(g_ref, f_ref, inv, True, True, c_ref, a_ref)
        r = torch.tensor([5, k], dtype=torch.int64, device=DEV)
        _adamw_bf16_call(reference.adamw_bf16_, st_ref, sc, f_ref, r, 0, False, False)
        _sgd_call(reference.sgd_, sgd_ref, sc3, f_ref, None, 0, h)
    assert_bits_equal(counts, c_ref, "graph: counts")
    assert_bits_equal(absmax, a_ref, "graph: absmax")
    _compare(st, st_ref, ADAM_KEYS, "graph: adamw_bf16_")
    _compare(sgd_st, sgd_ref, SGD_KEYS, "graph: sgd_")
    assert rng[1].item() == 2


def test_opcheck():
    f = torch.zeros(1, device=DEV)
    st = _adamw_bf16_state(torch.float16, True, torch.bfloat16, True, seed=25, sizes=[5, 17])
    rng = torch.tensor([1, 2], dtype=torch.int64, device=DEV)
    torch.library.opcheck(
        torch.ops.fastamp.optim_.default,
        registry.coerce("optim_", to_optim("adamw_bf16_", (st["params"], st["grads"], st["rems"], st["ms"], st["vs"],
                                                            st["vmaxs"], _adamw_scalars(1), f, rng, 0, 0.9, 0.999, 1e-8,
                                                            True, False))),
    )  # fmt: skip
    sgd_st = _sgd_state(torch.bfloat16, torch.float32, "none", 0.9, seed=26, sizes=[5, 17])
    torch.library.opcheck(
        torch.ops.fastamp.optim_.default,
        registry.coerce("optim_", to_optim("sgd_", (sgd_st["params"], sgd_st["grads"], sgd_st["masters"], sgd_st["bufs"],
                                                     reference.sgd_step_scalars(0.1, torch.tensor(0, device=DEV)), f,
                                                     rng, 0, 0.9, 0.0, 0.0, True, False))),
    )  # fmt: skip
    lion_st = _lion_state(torch.float16, torch.bfloat16, "fp32", seed=28, sizes=[5, 17])
    torch.library.opcheck(
        torch.ops.fastamp.optim_.default,
        registry.coerce("optim_", to_optim("lion_", (lion_st["params"], lion_st["grads"], lion_st["masters"],
                                                      lion_st["exp_avgs"], _lion_scalars(), f, rng, 0, 0.9, 0.99,
                                                      False))),
    )  # fmt: skip
    grads = [torch.randn(5, device=DEV), torch.randn(9, device=DEV).half()]
    torch.library.opcheck(
        torch.ops.fastamp.unscale_check_stats_.default,
        (grads, f, torch.tensor([0.5], device=DEV), True, True, torch.zeros((2, 3), dtype=torch.int64, device=DEV),
         torch.zeros(2, device=DEV)),
    )  # fmt: skip
