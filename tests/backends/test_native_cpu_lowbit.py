"""The C++ CPU backend's low-bit ops against the reference, bit for bit.

AdamW as ``adamw_bf16_`` takes it (int16 master remainders, stochastic rounding, fp32/bf16
moments) and SGD as ``sgd_`` (fp32 / remainder / no master, stochastic rounding), both through the
generic ``optim_`` (``helpers.native_optim``), and ``unscale_check_stats_`` run in ``csrc/cpu`` on every instruction-set path the machine supports (``FASTAMP_CPU_ISA`` lowers
the one the kernels pick). Agreement: every tensor written is bit-exact with
``fastamp.reference`` (NaN compared as NaN whatever its payload), counts are equal
integers, absmax is bit-exact; the sum of squares returned by ``unscale_check_stats_`` is
bit-identical to the plain ``unscale_check_`` kernel's (same chunks and lanes) and within
``tolerances.SUMSQ_RTOL`` of the reference.
"""

import itertools
import math

import pytest
import tolerances
import torch
from helpers import assert_bits_equal, bits, clone_lists, native_cpu_isas, native_optim, optim_args

from fastamp import functional, reference
from fastamp.ops import registry

if not all(registry.native_has_kernel(op, "cpu") for op in ("optim_", "unscale_check_stats_")):
    pytest.skip("fastamp._C has no CPU kernels for the low-bit ops (not built)", allow_module_level=True)

OPS = torch.ops.fastamp
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
CHUNK = 16384  # csrc/cpu/multi_tensor.h kChunkElems
SIZES = [0, 1, 7, 16, 17, 33, 257, 2 * CHUNK + 3]  # empty, tails, vector blocks, chunk boundaries
ISAS = native_cpu_isas()  # the ``isa`` fixture (tests/backends/conftest.py) runs each
BF16_MAX = 3.3895313892515355e38


def assert_lists_same(actual, expected, names, what=""):
    for name, a, e in zip(names, actual, expected):
        assert len(a) == len(e), name
        for i, (x, y) in enumerate(zip(a, e)):
            assert_bits_equal(x, y, f"{what} {name}[{i}]")


def _masters_from_bits(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _edge_masters(n, gen):
    """fp32 masters: random over many magnitudes, with exact ties (low 16 bits 0x8000),
    subnormals, values next to bf16's max (some round to inf in bf16), zeros, inf and NaN."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 20, (n,), generator=gen).float())
    if n == 0:
        return x
    bits = x.view(torch.int32)
    tie = torch.rand(n, generator=gen) < 0.25
    bits[tie] = (bits[tie] & ~0xFFFF) | 0x8000  # exact ties, both signs
    specials = _masters_from_bits(
        [0x00008000, 0x80008000, 0x00000001, 0x807FFFFF, 0x00018000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000]
    ).tolist() + [0.0, -0.0, 1e-40, -3e-39, BF16_MAX, -BF16_MAX, math.inf, -math.inf, math.nan]
    k = min(n, len(specials))
    pos = torch.randperm(n, generator=gen)[:k]
    x[pos] = torch.tensor(specials[:k])
    return x


def _bf16_state_from_masters(masters):
    """(bf16 params, int16 remainders) holding exactly the given fp32 masters."""
    params, rems = zip(*(reference.split_master(m) for m in masters)) if masters else ((), ())
    return list(params), list(rems)


# ---- AdamW as adamw_bf16_ takes it (optim_) ----


def _adamw_bf16_state(gdt, rem, mdt, amsgrad, seed, sizes=SIZES, grad_scale=64.0, edge=True):
    gen = torch.Generator().manual_seed(seed)
    masters = [_edge_masters(n, gen) if edge else torch.randn(n, generator=gen) for n in sizes]
    params, rems = _bf16_state_from_masters(masters)
    grads = [(torch.randn(n, generator=gen) * grad_scale).to(gdt) for n in sizes]
    m = [(torch.randn(n, generator=gen) * 0.1).to(mdt) for n in sizes]
    v = [(torch.rand(n, generator=gen) * 0.01).to(mdt) for n in sizes]
    vmax = [(t.float() * 1.5).to(mdt) for t in v] if amsgrad else []
    return [params, grads, rems if rem else [], m, v, vmax]


_ADAM_NAMES = ("params", "grads", "remainders", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")


def test_adamw_bf16_ties_are_split_exactly(isa):
    """decay 0.5 and step_size 0 halve every master exactly (normal range): the results keep
    low 16 bits of 0x8000 (ties), land in the subnormal range, or sit next to bf16's max."""
    gen = torch.Generator().manual_seed(21)
    masters = [_edge_masters(n, gen) * 2 for n in (5, 64, 1000)]
    masters[1].view(torch.int32).copy_((masters[1].view(torch.int32) & ~0xFFFF) | 0x8000)
    params, rems = _bf16_state_from_masters(masters)
    zeros = [torch.zeros_like(m) for m in masters]
    nat = [params, [z.clone() for z in zeros], rems, [z.clone() for z in zeros], [z.clone() for z in zeros], []]
    ref = clone_lists(nat)
    ss = torch.tensor([0.0, 1.0, 0.5, 1.0])
    native_optim("adamw_bf16_")(*nat, ss, None, None, 0, 0.9, 0.999, 1e-8, False, False)
    reference.adamw_bf16_(*ref, ss, None, None, 0, 0.9, 0.999, 1e-8, False, False)
    assert_lists_same(nat, ref, _ADAM_NAMES, "halved")
    ties = (reference.join_master(nat[0][1], nat[2][1]).view(torch.int32) & 0xFFFF) == 0x8000
    assert ties.float().mean() > 0.5  # the case under test really occurs


def test_adamw_bf16_remainder_trajectory_equals_fp32_master(isa):
    """Issue #7: remainder state reproduces adamw_ with fp32 masters bit for bit, step after step."""
    gen = torch.Generator().manual_seed(6)
    sizes = [3, 40, 1000]
    masters = [torch.randn(n, generator=gen) for n in sizes]
    params, rems = _bf16_state_from_masters(masters)
    fp32_state = [[p.clone() for p in params], None, [m.clone() for m in masters], None, None, []]
    rem_state = [params, None, rems, None, None, []]
    for st in (fp32_state, rem_state):
        st[3] = [torch.zeros(n) for n in sizes]
        st[4] = [torch.zeros(n) for n in sizes]
    for step in range(1, 61):
        grads = [(torch.randn(n, generator=gen) * 2.0**-step % 7).bfloat16() for n in sizes]
        ss = reference.adamw_step_scalars(1e-3, torch.tensor(float(step)), 0.9, 0.999, 0.1)
        fp32_state[1] = rem_state[1] = grads
        native_optim("adamw_")(*fp32_state, ss, None, 0.9, 0.999, 1e-8, False, False)
        native_optim("adamw_bf16_")(*rem_state, ss, None, None, 0, 0.9, 0.999, 1e-8, False, False)
        for i in range(len(sizes)):
            assert_bits_equal(
                reference.join_master(rem_state[0][i], rem_state[2][i]), fp32_state[2][i], f"master {step}"
            )
            assert_bits_equal(rem_state[0][i], reference.split_master(fp32_state[2][i])[0], f"param {step}")
            assert_bits_equal(rem_state[3][i], fp32_state[3][i], f"exp_avg {step}")


def test_adamw_bf16_stochastic_rounding_streams(isa):
    """Same (seed, counter, tensor id) gives the same bits; another counter or rng_base others."""
    gdt, mdt = torch.bfloat16, torch.bfloat16
    base = _adamw_bf16_state(gdt, False, mdt, False, seed=7, sizes=[CHUNK + 5], edge=False)
    ss = reference.adamw_step_scalars(1e-2, torch.tensor(1.0), 0.9, 0.999, 0.0)

    def run(counter, rng_base):
        st = clone_lists(base)
        native_optim("adamw_bf16_")(
            *st, ss, None, torch.tensor([99, counter]), rng_base, 0.9, 0.999, 1e-8, False, False
        )
        return st

    a, b, c, d = run(1, 0), run(1, 0), run(2, 0), run(1, 1)
    assert_lists_same(a, b, _ADAM_NAMES, "rerun")
    for other in (c, d):
        for k in (0, 3, 4):
            assert not torch.equal(bits(a[k][0]), bits(other[k][0]))
    # each param is one of the two bf16 neighbours of the fp32 result, rounded up as often as
    # the discarded fraction says (truncation would round up never, nearest-even ~half the time)
    st = clone_lists(base)
    exact = [st[0][0].float()]
    reference.adamw_(
        st[0],
        st[1],
        exact,
        [m.float() for m in st[3]],
        [v.float() for v in st[4]],
        [],
        ss,
        None,
        0.9,
        0.999,
        1e-8,
        False,
        False,
    )
    e = exact[0]
    lo_bits = bits(e) & ~0xFFFF
    lo, hi = lo_bits.view(torch.float32), (lo_bits + 0x10000).view(torch.float32)
    got = a[0][0].float()
    assert bool(((got == lo) | (got == hi)).all())
    frac = ((e - lo) / (hi - lo)).double()
    up = (got == hi).double()
    assert abs(up.mean().item() - frac.mean().item()) < 0.02, (up.mean().item(), frac.mean().item())


# ---- SGD as sgd_ takes it (optim_) ----

_SGD_NAMES = ("params", "grads", "masters", "momentum_buffers")


def _sgd_state(pdt, gdt, kind, momentum, seed, sizes=SIZES):
    gen = torch.Generator().manual_seed(seed)
    masters = [_edge_masters(n, gen) for n in sizes]
    if pdt == torch.bfloat16:
        params, rems = _bf16_state_from_masters(masters)
    else:
        params, rems = [m.to(pdt) for m in masters], []
    ms = {"none": [], "fp32": masters, "remainder": rems}[kind]
    grads = [(torch.randn(n, generator=gen) * 64.0).to(gdt) for n in sizes]
    if sizes and sizes[-1] >= 8:
        grads[-1][:6] = torch.tensor([0.0, -0.0, 1e-45, 3e38, math.inf, math.nan]).to(gdt)
    bufs = [torch.randn(n, generator=gen) for n in sizes] if momentum else []
    return [params, grads, ms, bufs]


def test_sgd_remainder_trajectory_equals_fp32_master(isa):
    gen = torch.Generator().manual_seed(9)
    sizes = [5, 300]
    masters = [torch.randn(n, generator=gen) for n in sizes]
    params, rems = _bf16_state_from_masters(masters)
    a = [[p.clone() for p in params], None, [m.clone() for m in masters], [torch.zeros(n) for n in sizes]]
    b = [params, None, rems, [torch.zeros(n) for n in sizes]]
    for step in range(60):
        grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
        a[1] = b[1] = grads
        ss = reference.sgd_step_scalars(1e-2, torch.tensor(step))
        for st in (a, b):
            native_optim("sgd_")(*st, ss, None, None, 0, 0.9, 0.0, 1e-4, True, False)
        for i in range(len(sizes)):
            assert_bits_equal(reference.join_master(b[0][i], b[2][i]), a[2][i], f"master {step}")
            assert_bits_equal(b[3][i], a[3][i], f"buffer {step}")


def test_sgd_mixed_dtypes_in_one_call(isa):
    """Params and grads of different dtypes in one call (no master), each tensor its own kernel."""
    gen = torch.Generator().manual_seed(11)
    sizes = [33, 17, 100, 9]
    pdts = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]
    gdts = [torch.bfloat16, torch.float16, torch.float32, torch.float32]
    nat = [
        [torch.randn(n, generator=gen).to(d) for n, d in zip(sizes, pdts)],
        [torch.randn(n, generator=gen).to(d) for n, d in zip(sizes, gdts)],
        [],
        [torch.randn(n, generator=gen) for n in sizes],
    ]
    ref = clone_lists(nat)
    ss = reference.sgd_step_scalars(0.05, torch.tensor(4))
    rng = torch.tensor([3, 4])
    native_optim("sgd_")(*nat, ss, torch.zeros(1), rng, 0, 0.9, 0.0, 0.0, False, False)
    reference.sgd_(*ref, ss, torch.zeros(1), rng, 0, 0.9, 0.0, 0.0, False, False)
    assert_lists_same(nat, ref, _SGD_NAMES, "mixed")


# ---- unscale_check_stats_ ----

_SPECIAL = [
    0.0,
    -0.0,
    1e-45,
    1e-40,
    -3e-39,
    2.0**-24,
    2.0**-14,
    -(2.0**-14) * 0.99,
    6e-5,
    1.0,
    65504.0,
    60000.0,
    3.0e38,
    -BF16_MAX,
    math.inf,
    -math.inf,
    math.nan,
]


def _stats_grads(sizes, gen):
    grads = []
    for i, n in enumerate(sizes):
        dt = DTYPES[i % 3]
        x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 20, (n,), generator=gen).float())
        if n:
            x[torch.rand(n, generator=gen) < 0.1] = 0.0
            k = min(n, len(_SPECIAL))
            x[torch.randperm(n, generator=gen)[:k]] = torch.tensor(_SPECIAL[:k])
            if dt == torch.float16:
                x = torch.where(x.abs() > 65504, x.sign() * 65504, x)
                x[0] = math.inf if n % 2 else x[0]
        grads.append(x.to(dt))
    return grads


def _run_stats(grads, inv, write_back, threads=None):
    out = []
    for fn in (OPS.unscale_check_stats_, reference.unscale_check_stats_):
        gs = [g.clone() for g in grads]
        found = torch.zeros(1)
        counts = torch.full((len(grads), 3), -7, dtype=torch.int64)  # overwritten, never added to
        absmax = torch.full((len(grads),), -1.0)
        ret = fn(gs, found, torch.tensor([inv]), write_back, True, counts, absmax)
        out.append((gs, found, counts, absmax, ret))
    return out


def _assert_stats_match(grads, inv, write_back):
    (g_n, f_n, c_n, a_n, r_n), (g_r, f_r, c_r, a_r, r_r) = _run_stats(grads, inv, write_back)
    what = f"inv={inv} write_back={write_back}"
    for i, (x, y) in enumerate(zip(g_n, g_r)):
        assert_bits_equal(x, y, f"{what} grads[{i}]")
    assert_bits_equal(f_n, f_r, f"{what} found_inf")
    assert_bits_equal(c_n, c_r, f"{what} counts")
    assert_bits_equal(a_n, a_r, f"{what} absmax")
    plain = [g.clone() for g in grads]
    r_plain = OPS.unscale_check_(plain, torch.zeros(1), torch.tensor([inv]), write_back, True)
    assert_bits_equal(r_n, r_plain, f"{what} sumsq vs unscale_check_")
    e = r_r.item()
    if math.isfinite(e):
        assert math.isclose(r_n.item(), e, rel_tol=tolerances.SUMSQ_RTOL), (r_n.item(), e)
    return c_n, a_n


@pytest.mark.parametrize("write_back", [False, True])
@pytest.mark.parametrize("inv", [1.0, 2.0**-16, 0.75, 2.0, 0.0, math.inf, 2.0**20])
def test_stats_match_reference_every_isa(isa, inv, write_back):
    gen = torch.Generator().manual_seed(12)
    sizes = [0, 1, 2, 15, 16, 17, 31, 33, 97, 257, 1021, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]
    counts, _ = _assert_stats_match(_stats_grads(sizes, gen), inv, write_back)
    assert counts[0].tolist() == [0, 0, 0]
    if inv == 2.0**-16:
        assert (counts[:, 2] > 0).sum() > 5  # underflows really occur


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stats_every_16bit_value(isa, dtype):
    """All 65,536 values of the dtype: every threshold of the AVX-512 16-bit stats path is met from both sides."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    shuffled = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(17))]
    for inv in (1.0, 0.75, 1 / 3, 2.0**-16, 3e-5, 1e-30, 2.0**-140, 7.0, 2.0**20, 1e30, 0.0, -0.5):
        for write_back in (False, True):
            _assert_stats_match([every, shuffled, shuffled[:4099]], inv, write_back)


def test_stats_every_lane(isa):
    """Each category at every position of the vector blocks and the tail."""
    n = 53
    for dtype, pos in itertools.product(DTYPES, range(n)):
        for value, inv, write_back in (
            (math.nan, 1.0, False),
            (60000.0, 2.0, True),
            (1e-6, 1.0, False),
            (0.0, 1.0, True),
            (-(2.0**15), 0.5, False),
        ):
            g = torch.full((n,), 0.25, dtype=dtype)
            g[pos] = value
            _assert_stats_match([g], inv, write_back)


def test_stats_many_tiny_tensors_and_threads(monkeypatch):
    gen = torch.Generator().manual_seed(13)
    sizes = torch.randint(0, 40, (2000,), generator=gen).tolist() + [5 * CHUNK + 7]
    grads = _stats_grads(sizes, gen)
    _assert_stats_match(grads, 0.75, True)
    old = torch.get_num_threads()
    results = []
    try:
        for isa_name, threads in itertools.product(ISAS, (1, 2)):
            monkeypatch.setenv("FASTAMP_CPU_ISA", isa_name)
            torch.set_num_threads(threads)
            results.append(_run_stats(grads, 2.0**-8, False)[0])
    finally:
        torch.set_num_threads(old)
    for _gs, _f, c, a, r in results[1:]:
        assert_bits_equal(c, results[0][2], "counts")
        assert_bits_equal(a, results[0][3], "absmax")
        assert_bits_equal(r, results[0][4], "sumsq")


# ---- through fastamp.functional ----


def test_stats_functional_native_matches_reference():
    """unscale_check_ with counts/absmax through fastamp.functional (the optimizer ops: test_optim_matrix.py)."""
    gen = torch.Generator().manual_seed(16)
    grads = _stats_grads([100, 3, 0, CHUNK + 1], gen)
    grads.append(torch.randn(6, 4, generator=gen).t())  # strided: functional copies it
    outs = []
    for backend in ("native", "torch"):
        gs = [g.clone() for g in grads]
        found, counts, absmax = torch.zeros(1), torch.empty(len(gs), 3, dtype=torch.int64), torch.empty(len(gs))
        functional.unscale_check_(
            gs,
            found,
            torch.tensor([2.0**-8]),
            write_back=True,
            compute_sumsq=True,
            counts=counts,
            absmax=absmax,
            backend=backend,
        )
        outs.append((gs, found, counts, absmax))
    for a, b in zip(outs[0][0], outs[1][0]):
        assert_bits_equal(a, b, "grads")
    for a, b, name in zip(outs[0][1:], outs[1][1:], ("found_inf", "counts", "absmax")):
        assert_bits_equal(a, b, name)


# ---- bad inputs ----


def test_stats_bad_inputs_raise():
    g = [torch.ones(4), torch.ones(3).half()]
    ok_c, ok_a = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2)
    cases = [
        (dict(counts=torch.zeros(2, 3, dtype=torch.int32)), "counts must have dtype Long"),
        (dict(counts=torch.zeros(3, 3, dtype=torch.int64)), r"counts must have shape \[2, 3\] .*got \[3, 3\]"),
        (dict(counts=torch.zeros(3, 2, dtype=torch.int64).t()), "counts must be contiguous"),
        (dict(absmax=torch.zeros(2, dtype=torch.float64)), "absmax must have dtype Float"),
        (dict(absmax=torch.zeros(1)), r"absmax must have shape \[2\] .*got \[1\]"),
        (dict(found=torch.zeros(1, dtype=torch.int32)), "found_inf must have dtype Float"),
        (
            dict(grads=[torch.ones(4), torch.ones(3, dtype=torch.float64)]),
            r"grads\[1\] must be float32, float16 or bfloat16",
        ),
        (dict(grads=[torch.ones(4, 2)[:, 0], g[1]]), r"grads\[0\] must be contiguous"),
    ]
    for over, msg in cases:
        a = dict(grads=[t.clone() for t in g], found=torch.zeros(1), counts=ok_c.clone(), absmax=ok_a.clone())
        a.update(over)
        with pytest.raises(RuntimeError, match="fastamp::unscale_check_stats_: " + msg):
            OPS.unscale_check_stats_(a["grads"], a["found"], torch.tensor([0.5]), True, True, a["counts"], a["absmax"])
        assert a["found"].sum().item() == 0


# ---- torch.library.opcheck ----


@pytest.mark.parametrize("found", [None, 0.0, 1.0])
def test_opcheck_adamw_bf16(found):
    for rem, mdt in ((True, torch.float32), (False, torch.bfloat16)):
        st = _adamw_bf16_state(torch.float16, rem, mdt, True, seed=19, sizes=[5, 17], edge=False)
        ss = torch.tensor([1e-3, 0.1, 0.99, 0.5])
        fi = None if found is None else torch.tensor([found])
        args = (*st, ss, fi, torch.tensor([1, 2]), 0, 0.9, 0.999, 1e-8, True, False)
        torch.library.opcheck(OPS.optim_.default, optim_args("adamw_bf16_", args))


@pytest.mark.parametrize("found", [None, 1.0])
def test_opcheck_sgd(found):
    for pdt, kind, use_rng in (
        (torch.bfloat16, "remainder", False),
        (torch.bfloat16, "none", True),
        (torch.float16, "fp32", False),
    ):
        st = _sgd_state(pdt, torch.float32, kind, 0.9, seed=20, sizes=[5, 17])
        fi = None if found is None else torch.tensor([found])
        rng = torch.tensor([1, 2]) if use_rng else None
        args = (*st, torch.tensor([0.1, 1.0, 0.0]), fi, rng, 0, 0.9, 0.0, 0.01, True, False)
        torch.library.opcheck(OPS.optim_.default, optim_args("sgd_", args))


def test_opcheck_unscale_check_stats():
    for wb in (True, False):
        grads = [torch.randn(5), torch.randn(7).half(), torch.randn(3).bfloat16()]
        args = (
            grads,
            torch.zeros(1),
            torch.tensor([0.5]),
            wb,
            True,
            torch.zeros(3, 3, dtype=torch.int64),
            torch.zeros(3),
        )
        torch.library.opcheck(OPS.unscale_check_stats_.default, args)
