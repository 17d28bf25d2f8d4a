"""The generic CPU kernel of ``optim_`` (csrc/cpu/optim.cpp) against ``fastamp.reference.optim_``, bit for bit.

What the shared matrix (test_optim_matrix.py) does not cover: every rule x master format x state
format x param dtype x grad dtype x flag combination the reference accepts, the ones no per-rule
op had included (ulp8 masters under SGD and Lion and with fp32 or bf16 states, bf16 states with an
fp32 master, SR_PARAM without SR_STATE and the reverse, AMSGRAD on q8 states); on every
instruction-set path this machine runs (the ``isa`` fixture), sizes around the vector block, the
q8 block and the chunk, adversarial values (+-0, subnormals, fp16 max, bf16 ties, non-finite
masters and grads); 1 and 2 threads; found_inf 0, 1, inf, NaN; a flush-to-zero calling thread.
Agreement: every tensor the op writes is bit-identical (NaN compared as NaN whatever its payload).
"""

import math
import zlib

import pytest
import torch
from _matrix import edge_grads, edge_masters
from helpers import assert_bits_equal, clone_lists, each_isa, num_threads, run_flushing_denormals

from fastamp import reference
from fastamp.ops import registry
from fastamp.reference import optim as R
from fastamp.reference import q8

if not registry.native_has_kernel("optim_", "cpu"):
    pytest.skip("fastamp._C has no CPU kernel of optim_ (not built)", allow_module_level=True)

OPS = torch.ops.fastamp
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
SHORT = {F32: "f32", F16: "f16", BF16: "bf16"}
CHUNK = 16384  # csrc/cpu/multi_tensor.h kChunkElems
# empty, one, vector tails, around a q8 block, around the chunk, several chunks
SIZES = [0, 1, 7, 31, 33, CHUNK - 1, CHUNK + 1, 2 * CHUNK + 33]
# the param dtypes each master format takes
PARAMS_OF = {"none": (F32, F16, BF16), "fp32": (F32, F16, BF16), "remainder": (BF16,), "ulp8": (F16, BF16)}
MASTER_DTYPE = {"fp32": F32, "remainder": torch.int16, "ulp8": torch.int8}
STATE_DTYPE = {"fp32": F32, "bf16": BF16}
# name: (rule, hyper, flags); lr and weight decay go into the step scalars
VARIANTS = {
    "adamw": ("adamw", (0.9, 0.999, 1e-8), 0),
    "adamw-amsgrad-maximize": ("adamw", (0.3, 0.5, 1e-3), R.AMSGRAD | R.MAXIMIZE),  # the other lerp formula
    "sgd-nesterov-wd": ("sgd", (0.9, 0.0, 1e-2), R.NESTEROV),
    "sgd-dampening-maximize": ("sgd", (0.5, 0.5, 0.0), R.MAXIMIZE),
    "sgd-no-momentum": ("sgd", (0.0, 0.0, 0.3), 0),  # no state at all
    "lion": ("lion", (0.9, 0.99), 0),
    "lion-maximize": ("lion", (0.95, 0.98), R.MAXIMIZE),
}
SR = {"rne": 0, "sr-param": R.SR_PARAM, "sr-state": R.SR_STATE, "sr-both": R.SR_PARAM | R.SR_STATE}


def _seed(*parts) -> int:
    return zlib.crc32("-".join(map(str, parts)).encode()) % 100_000


def _masters32(n, gen, nonfinite):
    m = edge_masters(n, gen)
    if nonfinite and n >= 40:
        m[35:38] = torch.tensor([math.inf, -math.inf, math.nan])
    return m


def _state_values(n, code, gen):
    """Values of one state: m-coded signed (zeros of both signs), v-coded >= 0; over many magnitudes."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 4, (n,), generator=gen).float())
    if code == "v":
        x = x.abs() * 1e-2
    elif n >= 2:
        x[:2] = torch.tensor([0.0, -0.0])
    return x


def make_call(variant, master, fmt, flags_sr, seed, *, specs=None, grad_scale=64.0, nonfinite=True, rows=False):
    """The positional arguments of one optim_ call (for ``reference.optim_`` and ``torch.ops.fastamp.optim_``).

    ``specs``: (numel, param dtype, grad dtype) per tensor; by default every param dtype the master
    takes x every grad dtype, the sizes of SIZES round-robin.
    """
    rule, hyper, flags = VARIANTS[variant]
    flags |= flags_sr
    gen = torch.Generator().manual_seed(seed)
    if specs is None:
        combos = [(p, g) for p in PARAMS_OF[master] for g in (F32, F16, BF16)]
        start = seed % len(SIZES)
        specs = [(SIZES[(start + k) % len(SIZES)], p, g) for k, (p, g) in enumerate(combos)]
        if all(n < CHUNK for n, _, _ in specs):
            specs.append((2 * CHUNK + 33, *combos[0]))
    params, grads, masters = [], [], []
    for n, pdt, gdt in specs:
        m32 = _masters32(n, gen, nonfinite)
        if master == "remainder":
            p, rem = reference.split_master(m32)
            masters.append(rem)
        elif master == "ulp8":
            p, c = reference.ulp8_encode(m32, pdt)
            c[::3] = torch.randint(-128, 128, (len(c[::3]),), generator=gen, dtype=torch.int8)
            masters.append(c)
        else:
            p = m32.to(pdt)
            if master == "fp32":
                masters.append(m32.clone())
        params.append(p)
        g = edge_grads(n, gdt, gen, grad_scale)
        if nonfinite and n >= 64:
            g[50:53] = torch.tensor([math.inf, -math.inf, math.nan]).to(gdt)
        grads.append(g)
    defs = R.RULES[rule].states(hyper, flags)
    states = []
    for d in defs:
        values = [_state_values(n, d.q8_code, gen) for n, _, _ in specs]
        if fmt == "q8":
            encode = q8.q8_encode_v if d.q8_code == "v" else q8.q8_encode_m
            pairs = [encode(v) for v in values]
            states += [c for c, _ in pairs] + [s for _, s in pairs]
        else:
            states += [v.to(STATE_DTYPE[fmt]) for v in values]
    n = len(specs)
    sc = _scalars(rule, hyper, 0, n, rows)
    rng = torch.tensor([0x5EED + seed, 1000 + seed], dtype=torch.int64)
    return [params, grads, masters, states, sc, None, rng if flags & (R.SR_PARAM | R.SR_STATE) else None, 3, rule,
            list(hyper), flags]  # fmt: skip


def _scalars(rule, hyper, step, n, rows, grad_mul=1 / 64):
    gm = torch.tensor(grad_mul)
    if rule == "adamw":
        count = torch.arange(step + 1, step + 1 + n, dtype=F32) if rows else torch.tensor(float(step + 1))
        return reference.adamw_step_scalars(1e-2, count, hyper[0], hyper[1], 0.1, gm)
    if rule == "sgd":
        count = torch.arange(step, step + n) if rows else torch.tensor(step)
        return reference.sgd_step_scalars(0.05, count, gm)
    sc = reference.lion_step_scalars(1e-3 * (step + 1), 0.1, gm)
    return sc.expand(n, 3).contiguous() if rows else sc


def _tensors(args):
    return args[0], args[2], args[3]


def run_one(impl, args, steps=2, threads=1, found_inf=None):
    """``steps`` steps of ``impl`` (the native op or the reference) on copies of ``args``; its written lists."""
    st = clone_lists(_tensors(args))
    rule, hyper, flags = args[8], args[9], args[10]
    n = len(args[0])
    rows = args[4].dim() == 2
    for step in range(steps):
        sc = _scalars(rule, hyper, step, n, rows)
        rng = None if args[6] is None else args[6] + torch.tensor([0, step])
        with num_threads(threads):
            impl(st[0], args[1], st[1], st[2], sc, found_inf, rng, args[7], rule, hyper, flags)
    return st


def run_both(args, steps=2, threads=1, found_inf=None):
    """``steps`` steps of the native kernel and of the reference on copies of ``args``; their written lists."""
    return (run_one(OPS.optim_, args, steps, threads, found_inf),
            run_one(reference.optim_, args, steps, threads, found_inf))  # fmt: skip


def assert_same(got, want, what):
    for name, a, e in zip(("params", "masters", "states"), got, want):
        assert len(a) == len(e), (what, name)
        for i, (x, y) in enumerate(zip(a, e)):
            assert_bits_equal(x, y, f"{what} {name}[{i}] ({x.dtype}, n={x.numel()})")


def _cases():
    out = []
    for variant, (rule, hyper, _) in VARIANTS.items():
        fmts = ("fp32",) if rule == "sgd" and hyper[0] == 0 else ("fp32", "bf16", "q8")
        for master in PARAMS_OF:
            for fmt in fmts:
                out.append(pytest.param(variant, master, fmt, id=f"{variant}-{master}-{fmt}"))
    return out


@pytest.mark.parametrize("variant,master,fmt", _cases())
def test_every_combination_matches_the_reference(monkeypatch, variant, master, fmt):
    """Each rule variant x master x state format, with every param and grad dtype the master takes in
    one call (a kernel per tensor), each of the four SR flag combinations, shared and per-tensor step
    scalars, two steps (SGD's first step, then its buffer); on every instruction-set path."""
    for sr_name, sr in SR.items():
        seed = _seed(variant, master, fmt, sr_name)
        args = make_call(variant, master, fmt, sr, seed, rows=seed % 2 == 1)
        ref = run_one(reference.optim_, args)
        for isa in each_isa(monkeypatch):
            assert_same(run_one(OPS.optim_, args), ref, f"{isa} {variant} {master} {fmt} {sr_name}")


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "q8"])
@pytest.mark.parametrize("variant", ["adamw-amsgrad-maximize", "sgd-nesterov-wd", "lion"])
def test_thread_count_does_not_change_bits(monkeypatch, variant, fmt):
    """Multi-chunk tensors and many tiny ones, 1 and 2 threads: the same bits, the reference's (every path)."""
    gen = torch.Generator().manual_seed(7)
    sizes = [2 * CHUNK + 3, 1, 64, 2000] + torch.randint(0, 70, (300,), generator=gen).tolist()
    specs = [(n, BF16, (F32, F16, BF16)[k % 3]) for k, n in enumerate(sizes)]
    args = make_call(variant, "ulp8", fmt, R.SR_PARAM | R.SR_STATE, 11, specs=specs, rows=True)
    ref = run_one(reference.optim_, args)
    for isa in each_isa(monkeypatch):
        one = run_one(OPS.optim_, args, threads=1)
        two = run_one(OPS.optim_, args, threads=2)
        assert_same(one, ref, f"{isa} 1 thread")
        assert_same(two, one, f"{isa} 2 threads vs 1")


@pytest.mark.parametrize("found", [1.0, math.inf, -math.inf, math.nan, -0.0, 0.0])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "q8"])
def test_found_inf_writes_nothing(isa, found, fmt):
    """A non-zero (or NaN) found_inf leaves every tensor bit-identical; 0 (of either sign) runs the step."""
    for variant in ("adamw-amsgrad-maximize", "sgd-dampening-maximize", "lion"):
        args = make_call(variant, "remainder" if fmt != "fp32" else "fp32", fmt, R.SR_PARAM | R.SR_STATE,
                         _seed(variant, fmt, found))  # fmt: skip
        fi = torch.tensor([found])
        before = clone_lists(_tensors(args))
        nat, ref = run_both(args, steps=1, found_inf=fi)
        assert_same(nat, ref, f"{isa} {variant} found_inf={found}")
        if found != 0:
            assert_same(nat, before, f"{isa} {variant} found_inf={found}: nothing written")
        else:
            assert not all(torch.equal(a, b) for a, b in zip(nat[0], before[0]))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "q8"])
def test_nonfinite_grads_without_found_inf(isa, fmt):
    """inf / NaN grads and masters with no found_inf: the reference's NaNs and infs, bit for bit (q8: NaN blocks)."""
    for variant in ("adamw", "sgd-nesterov-wd", "lion-maximize"):
        specs = [(200, BF16, F32), (40, F16, F16), (CHUNK + 70, BF16, BF16)]
        args = make_call(variant, "ulp8", fmt, R.SR_STATE, _seed("nonfinite", variant, fmt), specs=specs)
        nat, ref = run_both(args)
        assert_same(nat, ref, f"{isa} {variant} {fmt}")
        if fmt == "q8":
            assert int(nat[2][len(specs)][1]) == q8.NONFINITE_SCALE  # the block of grads 50..52


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "q8"])
def test_flush_to_zero_thread_does_not_change_bits(isa, fmt):
    """The kernels compute in the default float mode (subnormals, round to nearest), whatever the calling
    thread's (torch.set_flush_denormal(True)): subnormal params, grads and updates give the reference's
    bits, and the thread gets its flush-to-zero back."""
    specs = [(CHUNK + 70, F32, F32), (40, BF16, F32), (33, F16, F16)]
    for variant in ("adamw", "sgd-nesterov-wd", "lion"):
        args = make_call(variant, "none", fmt, R.SR_STATE, _seed("ftz", variant, fmt), specs=specs, nonfinite=False,
                         grad_scale=1e-36)  # fmt: skip
        for p in args[0]:
            p.mul_(2.0**-120)
        sc = args[4].clone()
        if args[8] != "sgd":
            sc[0] *= 2.0**-120  # step_size / lr: the update itself subnormal
        ref, plain, flushed = (clone_lists(_tensors(args)) for _ in range(3))

        def step(st, impl=OPS.optim_, sc=sc, args=args):
            with num_threads(1):
                impl(st[0], args[1], st[1], st[2], sc, None, args[6], args[7], *args[8:])

        step(ref, reference.optim_)
        step(plain)
        run_flushing_denormals(lambda st=flushed, step=step: step(st))
        assert_same(plain, ref, f"{isa} {variant} {fmt}")
        assert_same(flushed, plain, f"{isa} {variant} {fmt} flush-to-zero thread")
        tiny = [((x != 0) & (x.abs() < 1.1754944e-38)).any() for x in plain[0][0].float().split(1024)]
        assert any(map(bool, tiny)), f"{variant} {fmt}: no subnormal param to tell the float modes apart"


def test_q8_amsgrad_encodes_max_exp_avg_sq_with_the_v_code(isa):
    """AMSGRAD on q8 states: max_exp_avg_sq is a third v-coded state (stream 4 * id + 3 under SR_STATE)."""
    args = make_call("adamw-amsgrad-maximize", "remainder", "q8", R.SR_STATE, 5,
                     specs=[(CHUNK + 33, BF16, BF16), (64, BF16, F32)])  # fmt: skip
    assert len(args[3]) == 3 * 2 * 2
    nat, ref = run_both(args, steps=3)
    assert_same(nat, ref, isa)
    # the kernel read the third state: a run with its codes zeroed gives other params
    other = clone_lists(_tensors(args))
    other[2][8].zero_()  # max_exp_avg_sq_codes[0]
    OPS.optim_(other[0], args[1], other[1], other[2], args[4], None, args[6], args[7], *args[8:])
    once = clone_lists(_tensors(args))
    OPS.optim_(once[0], args[1], once[1], once[2], args[4], None, args[6], args[7], *args[8:])
    assert not torch.equal(once[0][0], other[0][0])


def test_empty_lists_and_all_empty_tensors(isa):
    for variant in VARIANTS:
        rule, hyper, flags = VARIANTS[variant]
        OPS.optim_([], [], [], [], _scalars(rule, hyper, 0, 0, False), None, None, 0, rule, list(hyper), flags)
        args = make_call(variant, "fp32", "fp32", 0, 1, specs=[(0, F32, F32), (0, BF16, F16)])
        nat, ref = run_both(args, steps=1)
        assert_same(nat, ref, variant)


# ---- refusals: a clear error naming the problem, and nothing written ----


def _good():
    return make_call("adamw-amsgrad-maximize", "ulp8", "q8", R.SR_STATE, 0, specs=[(70, BF16, F32), (9, F16, F16)])


def _set(i, value):
    return lambda a: a.__setitem__(i, value)


def _put_state(k, make):
    def mutate(a):
        a[3][k] = make(a[3][k])

    return mutate


BAD = {
    "unknown rule": (_set(8, "adam"), "unknown rule 'adam'; expected one of adamw, sgd, lion"),
    "hyper length": (_set(9, [0.9, 0.999]), "rule 'adamw' takes 3 hyperparameters, got 2"),
    "flags of another rule": (_set(10, R.NESTEROV), "flags 4 are not a combination of rule 'adamw'"),
    "grads count": (lambda a: a[1].pop(), "got 2 params but 1 grads"),
    "states count": (
        lambda a: a[3].extend(a[3][:2]),
        r"keeps 3 state\(s\) \(exp_avgs, exp_avg_sqs, max_exp_avg_sqs\), 2 list\(s\) of 2 tensors each: 12 state "
        r"tensors, got 14",
    ),
    "max_exp_avg_sqs missing": (lambda a: a[3].pop(), "amsgrad needs one max_exp_avg_sqs tensor per param, got 1"),
    "states dtype": (
        _put_state(0, lambda t: t.to(torch.int8)),
        "moments must be float32 or bfloat16, or uint8 q8 codes",
    ),
    "codes numel": (_put_state(5, lambda t: t[:-1].clone()), r"exp_avg_sq_codes\[1\] has 8 elements"),
    "codes dtype": (_put_state(8, lambda t: t.to(torch.int8)), r"max_exp_avg_sq_codes\[0\] must have dtype Byte"),
    "scales length": (_put_state(3, lambda t: t[:0].clone()), r"exp_avg_scales\[1\] must be 1-D with 1 scale byte"),
    "state strided": (
        _put_state(1, lambda t: torch.zeros(18, dtype=torch.uint8)[::2]),
        r"exp_avg_codes\[1\] must be contiguous",
    ),
    "ulp8 fp32 param": (
        lambda a: a[0].__setitem__(1, a[0][1].float()),
        r"int8 \(ulp8\) masters need bfloat16 or float16 params, but params\[1\]",
    ),
    "masters dtype": (lambda a: a.__setitem__(2, [m.to(F16) for m in a[2]]), "masters must be float32"),
    "grad fp64": (lambda a: a[1].__setitem__(0, a[1][0].double()), r"grads\[0\] must be float32, float16 or bfloat16"),
    "sr without rng": (_set(6, None), "SR_PARAM / SR_STATE need rng"),
    "step_scalars": (_set(4, torch.zeros(3)), r"step_scalars must be a contiguous float32 tensor of shape \[4\]"),
    "found_inf": (_set(5, torch.zeros(2)), "found_inf must be a 1-element float32 tensor"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_refusals_name_the_problem_and_change_nothing(case):
    mutate, message = BAD[case]
    a = _good()
    mutate(a)
    before = clone_lists(_tensors(a))
    with pytest.raises(RuntimeError, match="fastamp::optim_: .*" + message):
        OPS.optim_(*a)
    assert_same(_tensors(a), before, case)


def test_sgd_without_momentum_takes_no_states():
    a = make_call("sgd-no-momentum", "none", "fp32", 0, 0, specs=[(9, F32, F32)])
    a[3] = [torch.zeros(9)]
    with pytest.raises(RuntimeError, match=r"rule 'sgd' with these settings keeps 0 state\(s\)"):
        OPS.optim_(*a)


@pytest.mark.parametrize("found", [None, 1.0])
def test_opcheck(found):
    for variant, master, fmt in (("adamw-amsgrad-maximize", "ulp8", "q8"), ("sgd-nesterov-wd", "remainder", "bf16"),
                                 ("lion", "fp32", "fp32")):  # fmt: skip
        a = make_call(variant, master, fmt, R.SR_PARAM | R.SR_STATE, 2, specs=[(5, BF16, F32), (17, BF16, F16)])
        a[5] = None if found is None else torch.tensor([found])
        torch.library.opcheck(OPS.optim_.default, tuple(a))
