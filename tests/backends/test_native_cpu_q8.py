"""The C++ CPU kernel of AdamW on 8-bit block-scaled moments against the reference, byte for byte.

The generic ``torch.ops.fastamp.optim_`` with ``adamw_q8_``'s arguments (``helpers.native_optim``)
and ``fastamp.reference.adamw_q8_`` run side by side over
several steps on copies of the same state; every tensor the op writes (params, masters, codes,
scales) must be bit-identical (NaN compared as NaN whatever its payload, as elsewhere), on every
instruction-set path the machine supports (``FASTAMP_CPU_ISA``) and 1 and 2 threads.
"""

import math

import pytest
import torch
from helpers import assert_bits_equal, clone_lists, each_isa, native_optim, num_threads, run_flushing_denormals

from fastamp import reference
from fastamp.ops import registry
from fastamp.reference import q8

if not registry.native_has_kernel("optim_", "cpu"):
    pytest.skip("fastamp._C has no CPU kernel of optim_ (not built)", allow_module_level=True)

ADAMW_Q8 = native_optim("adamw_q8_")
CHUNK = 16384  # csrc/cpu/multi_tensor.h kChunkElems
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
BETAS = (0.9, 0.999)
EPS = 1e-8


def _grad(n, gen, dtype, adversarial):
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    if adversarial and n >= 64:
        x[0:32] = 0.0  # a zero block
        x[32] = -0.0
        x[33] = 1e-40  # subnormal
        x[34] = -3e-39
        x[35] = 1e30  # squares to inf: a saturated/non-finite v block
        x[36] = 3e18
        x[40 : 40 + 5] = torch.tensor([1e-45, -1e-45, 2.0**-126, 6e4, -6e4])
    return x.to(dtype)


# ulp8 masters at the edges of reference/ulp8.py: +-0, fp16's 2^-14 and its subnormals (down to
# below 2^-17, where floor(|M| * 2^40) truncates, and below 2^-25, where p = 0), bf16 subnormals
# and masters below them (p = 0, the value in c), powers of two and just below, the largest
# finite 16-bit values and masters that round to inf, inf, NaN
ULP8_EDGES = [0.0, -0.0, 2.0**-14, -(2.0**-14) * (1 - 2.0**-12), 6e-5, -1e-6, 7.7e-6, 1e-7, -1e-8, 1e-40, -3e-39,
              1e-42, 1e-45, 1.0, -2.0, 1 - 2.0**-20, -(4 - 2.0**-19), 65504.0, 65519.0, -65520.0, 70000.0,
              3.3895e38, -3.3896e38, math.inf, -math.inf, math.nan, 0.1, -3.0e-3]  # fmt: skip


def _ulp8_state(p32, pdtype, gen):
    """(param, correction) from masters with ULP8_EDGES at elements 0.. (zero grads there: they
    stay near the edge) and again at 64.., and every third correction any int8, -128 included
    (never written by encode, but state to decode)."""
    n = p32.numel()
    edges = torch.tensor(ULP8_EDGES)
    for at in (0, 64):
        k = max(0, min(len(edges), n - at))
        p32[at : at + k] = edges[:k]
    p, c = reference.ulp8_encode(p32, pdtype)
    c[::3] = torch.randint(-128, 128, (len(c[::3]),), generator=gen, dtype=torch.int8)
    return p, c


def _state(n, shape, pdtype, master, gen):
    p32 = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-8, 8, (n,), generator=gen).float()
    if master == "ulp8":
        p, c = _ulp8_state(p32, pdtype, gen)
        masters = [c]
    elif master == "remainder":
        p, rem = reference.split_master(p32)
        masters = [rem]
    elif master == "fp32":
        p = p32.to(pdtype)
        masters = [p32.clone()]
    else:
        p = p32.to(pdtype)
        masters = []
    nb = q8.num_blocks(n)
    cm = torch.zeros(n, dtype=torch.uint8).reshape(shape)
    cv = torch.zeros(n, dtype=torch.uint8).reshape(shape)
    sm = torch.full((nb,), q8.M_SCALE_MIN, dtype=torch.uint8)
    sv = torch.full((nb,), q8.W_SCALE_MIN, dtype=torch.uint8)
    return p.reshape(shape), [m.reshape(shape) for m in masters], cm, sm, cv, sv


def _run_both(state, grads_per_step, sc_per_step, rng_counter0=0, found_inf=None, sr_param=False, sr_codes=False,
              rng_base=3, maximize=False, betas=BETAS, threads=1):  # fmt: skip
    """Run both implementations for every step on copies of ``state`` ([params, masters, cm, sm, cv, sv]); return both."""
    kw = dict(rng_counter0=rng_counter0, found_inf=found_inf, sr_param=sr_param, sr_codes=sr_codes,
              rng_base=rng_base, maximize=maximize, betas=betas, threads=threads)  # fmt: skip
    return _run(ADAMW_Q8, state, grads_per_step, sc_per_step, **kw), _run(
        reference.adamw_q8_, state, grads_per_step, sc_per_step, **kw
    )


def _run(impl, state, grads_per_step, sc_per_step, rng_counter0=0, found_inf=None, sr_param=False, sr_codes=False,
         rng_base=3, maximize=False, betas=BETAS, threads=1):  # fmt: skip
    """One implementation (the native op or the reference) for every step on a copy of ``state``; what it wrote."""
    st = clone_lists(state)
    rng = torch.tensor([11, rng_counter0], dtype=torch.int64)
    for step, (grads, sc) in enumerate(zip(grads_per_step, sc_per_step)):
        rng[1] = rng_counter0 + step
        with num_threads(threads):
            impl(st[0], grads, st[1], st[2], st[3], st[4], st[5], sc, found_inf, rng, rng_base, betas[0],
                 betas[1], EPS, maximize, sr_param, sr_codes)  # fmt: skip
    return st


def _assert_same(nat, ref, what=""):
    names = ("params", "masters", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")
    for name, a, e in zip(names, nat, ref):
        assert len(a) == len(e), name
        for i, (x, y) in enumerate(zip(a, e)):
            assert_bits_equal(x, y, f"{what} {name}[{i}]")


def _lists(tensors_per_param):
    """[[p0, p1..], [m0, m1..], ...] from a list of per-param tuples (p, masters list, cm, sm, cv, sv)."""
    out = [[], [], [], [], [], []]
    for p, masters, cm, sm, cv, sv in tensors_per_param:
        out[0].append(p)
        out[1].extend(masters)
        for k, t in zip(range(2, 6), (cm, sm, cv, sv)):
            out[k].append(t)
    return out


def _scalars(step, lr=1e-3, wd=0.01, rows=None):
    st = torch.tensor(float(step)) if rows is None else torch.arange(step, step + rows, dtype=torch.float32)
    return reference.adamw_step_scalars(lr, st, *BETAS, wd)


SIZES = [1, 31, 32, 33, 32 * 7 + 5, 3 * CHUNK + 17]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(
    "master,pdtype",
    [
        ("none", torch.float32),
        ("none", torch.float16),
        ("none", torch.bfloat16),
        ("fp32", torch.float32),
        ("fp32", torch.float16),
        ("fp32", torch.bfloat16),
        ("remainder", torch.bfloat16),
    ],  # fmt: skip
    ids=lambda x: _SHORT.get(x, x) if isinstance(x, torch.dtype) else x,
)
@pytest.mark.parametrize("sr_codes", [False, True], ids=["rne", "sr"])
def test_matches_reference_over_steps(isa, n, master, pdtype, sr_codes):
    gen = torch.Generator().manual_seed(n * 7 + len(master))
    sr_param = master == "none" and sr_codes  # both on together here; separately below
    steps = 4 if n < CHUNK else 2
    tensors = [_state(n, (n,), pdtype, master, gen), _state(65, (5, 13), pdtype, master, gen)]
    grads = [[_grad(t[0].numel(), gen, torch.float32, True).reshape(t[0].shape) for t in tensors] for _ in range(steps)]
    scs = [_scalars(s + 1) for s in range(steps)]
    nat, ref = _run_both(_lists(tensors), grads, scs, sr_param=sr_param, sr_codes=sr_codes)
    _assert_same(nat, ref, f"{isa}")


@pytest.mark.parametrize("gdtype", DTYPES, ids=lambda d: _SHORT[d])
@pytest.mark.parametrize("sr_param,sr_codes", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("threads", [1, 2])
def test_grad_dtypes_rounding_and_threads(monkeypatch, gdtype, sr_param, sr_codes, threads):
    """On every instruction-set path, against one reference run."""
    gen = torch.Generator().manual_seed(5)
    tensors = [_state(n, (n,), torch.bfloat16, "none", gen) for n in (CHUNK * 2 + 40, 33, 100)]
    grads = [[_grad(t[0].numel(), gen, gdtype, True) for t in tensors] for _ in range(3)]
    scs = [_scalars(s + 1, rows=3) for s in range(3)]  # [n, 4] rows
    kw = dict(sr_param=sr_param, sr_codes=sr_codes, threads=threads, maximize=gdtype == torch.float16)
    ref = _run(reference.adamw_q8_, _lists(tensors), grads, scs, **kw)
    for isa in each_isa(monkeypatch):
        _assert_same(_run(ADAMW_Q8, _lists(tensors), grads, scs, **kw), ref, f"{isa} threads={threads}")


@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float16], ids=lambda d: _SHORT[d])
@pytest.mark.parametrize("sr_param,sr_codes,threads", [(False, False, 1), (True, False, 2), (False, True, 2),
                                                       (True, True, 1)])  # fmt: skip
def test_ulp8_masters(isa, pdtype, sr_param, sr_codes, threads):
    """int8 ulp8 corrections of bf16 / fp16 params: edge masters, any correction byte, the
    correction rounded stochastically (sr_param) or to nearest, fp32 / 16-bit grads per tensor,
    whole, partial and multi-chunk blocks."""
    gen = torch.Generator().manual_seed(12)
    sizes = (CHUNK * 2 + 37, 65, 1)
    tensors = [_state(n, (n,), pdtype, "ulp8", gen) for n in sizes]
    gdtypes = (torch.float32, pdtype, torch.bfloat16)
    grads = [[_grad(n, gen, gd, True) for n, gd in zip(sizes, gdtypes)] for _ in range(3)]
    scs = [_scalars(s + 1, rows=3) for s in range(3)]
    nat, ref = _run_both(_lists(tensors), grads, scs, sr_param=sr_param, sr_codes=sr_codes, threads=threads)
    _assert_same(nat, ref, f"{isa} threads={threads}")
    assert any(int(c.abs().max()) > 0 for c in nat[1])


def test_thread_count_does_not_change_bytes(isa):
    gen = torch.Generator().manual_seed(9)
    tensors = [_state(n, (n,), torch.bfloat16, "remainder", gen) for n in (5 * CHUNK + 3, 1, 64, 2000)]
    grads = [[_grad(t[0].numel(), gen, torch.bfloat16, True) for t in tensors] for _ in range(2)]
    scs = [_scalars(s + 1) for s in range(2)]
    one, ref = _run_both(_lists(tensors), grads, scs, sr_codes=True, threads=1)
    two, _ = _run_both(_lists(tensors), grads, scs, sr_codes=True, threads=2)
    _assert_same(one, ref, "1 thread")
    _assert_same(two, one, "2 threads vs 1")


def test_thread_float_mode_does_not_change_bytes(isa):
    """The kernel runs with subnormals and round-to-nearest (the reference's fp32), whatever the
    calling thread's mode: under torch.set_flush_denormal(True) the bytes are the same (the grads
    hold subnormals), and the thread gets its flush-to-zero back."""
    gen = torch.Generator().manual_seed(13)
    tensors = [_state(n, (n,), torch.bfloat16, "remainder", gen) for n in (CHUNK + 70, 40)]
    grads = [_grad(t[0].numel(), gen, torch.float32, True) for t in tensors]
    plain, flushed = _lists(tensors), clone_lists(_lists(tensors))

    def step(st):
        with num_threads(1):
            ADAMW_Q8(st[0], grads, st[1], st[2], st[3], st[4], st[5], _scalars(3), None, torch.tensor([5, 2]), 0,
                          *BETAS, EPS, False, False, True)  # fmt: skip

    step(plain)
    run_flushing_denormals(lambda: step(flushed))
    _assert_same(flushed, plain, f"{isa} flush-to-zero thread")


def test_many_small_tensors(isa):
    gen = torch.Generator().manual_seed(3)
    sizes = [1, 2, 31, 32, 33, 63, 64, 65, 255, 256, 257] * 20
    tensors = [_state(n, (n,), torch.bfloat16, "remainder", gen) for n in sizes]
    grads = [[_grad(n, gen, torch.bfloat16, False) for n in sizes] for _ in range(2)]
    scs = [_scalars(s + 1, rows=len(sizes)) for s in range(2)]
    nat, ref = _run_both(_lists(tensors), grads, scs, sr_codes=True, threads=2)
    _assert_same(nat, ref)


@pytest.mark.parametrize("beta1", [0.9, 0.3, 1.0, 0.0])
def test_lerp_branches_and_betas(isa, beta1):
    gen = torch.Generator().manual_seed(1)
    tensors = [_state(300, (300,), torch.float32, "fp32", gen)]
    grads = [[_grad(300, gen, torch.float32, True)] for _ in range(3)]
    scs = [_scalars(s + 1) for s in range(3)]
    nat, ref = _run_both(_lists(tensors), grads, scs, betas=(beta1, 0.5))
    _assert_same(nat, ref)


def test_every_code_and_scale_byte_decodes_as_the_reference(isa):
    """All 256 m codes and 256 w codes under many scale bytes (0xFF: NaN blocks; below S_MIN; the top).

    The codes are the state the op decodes: the param update reads every decoded m and v, and
    the re-encoded codes read them again, so a decode that differs in any bit shows in a param
    (fp32, no master) or a code.
    """
    scales_m = [0, 1, 10, 11, 12, 60, 126, 127, 137, 200, 253, 254, 255]
    scales_w = [0, 5, 74, 75, 76, 100, 126, 138, 190, 191, 220, 254, 255]
    n = 256 * len(scales_m)
    codes = torch.arange(256, dtype=torch.uint8).repeat(len(scales_m))
    # each run of 256 codes spans 8 blocks: one scale byte per run, rotated for v so pairs vary
    sm = torch.tensor(scales_m, dtype=torch.uint8).repeat_interleave(8)
    sv = torch.tensor(scales_w, dtype=torch.uint8).repeat_interleave(8)
    gen = torch.Generator().manual_seed(2)
    for shift in (0, 97):  # the m and v codes of one element differ
        for lr in (1e-3, 0.0):
            p = torch.randn(n, generator=gen)
            state = [[p], [], [codes.clone()], [sm.clone()], [codes.roll(shift).clone()], [sv.roll(3 * 8).clone()]]
            g = [[torch.randn(n, generator=gen) * 1e-3]]
            nat, ref = _run_both(state, g, [_scalars(5, lr=lr)], betas=(0.9, 0.999))
            _assert_same(nat, ref, f"shift {shift} lr {lr}")
            # beta1 = beta2 = 1: the moments pass through unchanged (m + 0 * diff, v * 1 + 0)
            nat, ref = _run_both(state, [[torch.zeros(n)]], [_scalars(5, lr=lr)], betas=(1.0, 1.0))
            _assert_same(nat, ref, f"identity shift {shift} lr {lr}")


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("master,pdtype", [("remainder", torch.bfloat16), ("ulp8", torch.float16)],
                         ids=["remainder", "ulp8-f16"])  # fmt: skip
def test_nonfinite_grad_makes_nan_blocks(isa, bad, master, pdtype):
    gen = torch.Generator().manual_seed(4)
    tensors = [_state(200, (200,), pdtype, master, gen)]
    g = _grad(200, gen, torch.float32, False)
    g[70] = bad
    nat, ref = _run_both(_lists(tensors), [[g], [_grad(200, gen, torch.float32, False)]], [_scalars(1), _scalars(2)])
    _assert_same(nat, ref)
    assert nat[3][0][2] == q8.NONFINITE_SCALE and nat[5][0][2] == q8.NONFINITE_SCALE


@pytest.mark.parametrize("found", [1.0, math.nan, math.inf])
def test_found_inf_writes_nothing(isa, found):
    gen = torch.Generator().manual_seed(6)
    tensors = [_state(n, (n,), torch.bfloat16, "remainder", gen) for n in (100, CHUNK + 5)]
    state = _lists(tensors)
    # one real step first, so the state is not all default bytes
    grads = [_grad(t[0].numel(), gen, torch.float32, True) for t in tensors]
    ADAMW_Q8(state[0], grads, state[1], state[2], state[3], state[4], state[5], _scalars(1), None,
                  torch.tensor([1, 0]), 0, *BETAS, EPS, False, False, True)  # fmt: skip
    before = clone_lists(state)
    ADAMW_Q8(state[0], grads, state[1], state[2], state[3], state[4], state[5], _scalars(2),
                  torch.tensor([found]), torch.tensor([1, 1]), 0, *BETAS, EPS, False, False, True)  # fmt: skip
    _assert_same(state, before, "skipped step")
    # found_inf == 0 runs the step
    nat, ref = _run_both(state, [grads], [_scalars(2)], found_inf=torch.tensor([0.0]), sr_codes=True)
    _assert_same(nat, ref)


def test_empty_lists_and_empty_tensors(isa):
    ADAMW_Q8([], [], [], [], [], [], [], _scalars(1), None, None, 0, *BETAS, EPS, False, False, False)
    gen = torch.Generator().manual_seed(8)
    tensors = [_state(0, (0,), torch.float32, "none", gen), _state(40, (40,), torch.float32, "none", gen)]
    grads = [[torch.zeros(0), _grad(40, gen, torch.float32, False)]]
    nat, ref = _run_both(_lists(tensors), grads, [_scalars(1)])
    _assert_same(nat, ref)


# ---- refusals: a clear error naming the problem, and nothing written ----


def _good(n=70):
    gen = torch.Generator().manual_seed(0)
    p, masters, cm, sm, cv, sv = _state(n, (n,), torch.bfloat16, "remainder", gen)
    return dict(
        params=[p], grads=[torch.randn(n, generator=gen)], masters=masters, cm=[cm], sm=[sm], cv=[cv], sv=[sv],
        sc=_scalars(1), found_inf=None, rng=torch.tensor([1, 2]), sr_param=False, sr_codes=True,
    )  # fmt: skip


def _call(a):
    ADAMW_Q8(a["params"], a["grads"], a["masters"], a["cm"], a["sm"], a["cv"], a["sv"], a["sc"], a["found_inf"],
                  a["rng"], 0, *BETAS, EPS, False, a["sr_param"], a["sr_codes"])  # fmt: skip


def _bad_cases():
    n = 70

    def set_(key, val):
        return lambda a: a.__setitem__(key, val)

    return {
        "grads count": (set_("grads", []), "got 1 params but 0 grads"),
        "codes count": (
            set_("cm", []),
            r"keeps 2 state\(s\) \(exp_avgs, exp_avg_sqs\), 2 list\(s\) of 1 tensors each: 4 state tensors, got 3",
        ),
        "scales count": (
            set_("sv", []),
            r"keeps 2 state\(s\) \(exp_avgs, exp_avg_sqs\), 2 list\(s\) of 1 tensors each: 4 state tensors, got 3",
        ),
        "masters count": (
            lambda a: a["masters"].append(a["masters"][0].clone()),
            "remainders must be empty or have one",
        ),
        "param dtype": (
            lambda a: a.__setitem__("params", [a["params"][0].to(torch.int32)]),
            "params must be float32, float16 or bfloat16, got params[0] of Int",
        ),
        "grad dtype": (set_("grads", [torch.zeros(n, dtype=torch.float64)]), "grads[0] must be float32"),
        "grad numel": (set_("grads", [torch.zeros(n + 1)]), "grads[0] has 71 elements"),
        "grad strided": (set_("grads", [torch.zeros(2 * n)[::2]]), "grads[0] must be contiguous"),
        "codes dtype": (
            set_("cm", [torch.zeros(n, dtype=torch.int8)]),
            r"moments must be float32 or bfloat16, or uint8 q8 codes and scales \(one state format per call\), got "
            "exp_avgs[0] of Char",
        ),
        "sq codes dtype": (set_("cv", [torch.zeros(n, dtype=torch.int8)]), "exp_avg_sq_codes[0] must have dtype Byte"),
        "codes strided": (
            set_("cv", [torch.zeros(2 * n, dtype=torch.uint8)[::2]]),
            "exp_avg_sq_codes[0] must be contig",
        ),
        "codes numel": (set_("cm", [torch.zeros(n - 1, dtype=torch.uint8)]), "exp_avg_codes[0] has 69 elements"),
        "scales length": (
            set_("sm", [torch.zeros(2, dtype=torch.uint8)]),
            "exp_avg_scales[0] must be 1-D with 3 scale",
        ),
        "scales 2-D": (set_("sv", [torch.zeros(3, 1, dtype=torch.uint8)]), "exp_avg_sq_scales[0] must be 1-D with 3"),
        "scales dtype": (set_("sm", [torch.zeros(3, dtype=torch.int32)]), "exp_avg_scales[0] must have dtype Byte"),
        "master dtype": (set_("masters", [torch.zeros(n, dtype=torch.float16)]), "masters must be float32"),
        "ulp8 param": (
            lambda a: (
                a.__setitem__("params", [a["params"][0].float()]),
                a.__setitem__("masters", [torch.zeros(n, dtype=torch.int8)]),
            ),
            r"int8 \(ulp8\) masters need bfloat16 or float16 params",
        ),
        "remainder param": (
            lambda a: a.__setitem__("params", [a["params"][0].float()]),
            "int16 remainders need bfloat16 params, but params[0] is Float",
        ),
        "sr without rng": (set_("rng", None), "SR_PARAM / SR_STATE need rng"),
        "sr_param without rng": (
            lambda a: (a.__setitem__("rng", None), a.__setitem__("sr_codes", False), a.__setitem__("sr_param", True)),
            "SR_PARAM / SR_STATE need rng",
        ),
        "rng dtype": (set_("rng", torch.tensor([1.0, 2.0])), "rng must be a contiguous int64 tensor"),
        "step_scalars shape": (set_("sc", torch.zeros(3)), "step_scalars must be a contiguous float32"),
        "found_inf dtype": (set_("found_inf", torch.zeros(1, dtype=torch.float64)), "found_inf must be a 1-element"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_refusals_name_the_problem_and_change_nothing(case):
    mutate, message = _bad_cases()[case]
    a = _good()
    mutate(a)
    before = [[t.clone() for t in a[k]] for k in ("params", "masters", "cm", "sm", "cv", "sv")]
    with pytest.raises(RuntimeError, match="fastamp::optim_: .*" + message.replace("[", r"\[").replace("]", r"\]")):
        _call(a)
    after = [a[k] for k in ("params", "masters", "cm", "sm", "cv", "sv")]
    _assert_same(after, before, case)


def test_good_call_is_accepted():
    _call(_good())
