"""The C++ CPU kernel of SGD and Lion on one q8 state against the reference, byte for byte.

The generic ``torch.ops.fastamp.optim_`` with ``sgd_q8_``'s / ``lion_q8_``'s arguments
(``helpers.native_optim``) and ``fastamp.reference.<op>`` (the rule's dense reference on the
decoded state, encoded again: ``fastamp.reference.one_state_q8``) run side by side over several
steps on copies of the same state. Every tensor the op writes (params, masters, codes, scales)
must be bit-identical (NaN compared as NaN whatever its payload), on every instruction-set path
the machine supports (``FASTAMP_CPU_ISA``), with 1 and 2 threads, for every master kind and
grad dtype, with the codes rounded to nearest or stochastically.
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

CHUNK = 16384  # csrc/cpu/multi_tensor.h kChunkElems
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# a partial block, whole blocks, one element, and tensors over several chunks (the RNG counter
# and the chunk seams)
SIZES = (1, 31, 33, 32 * 7 + 5, 3 * CHUNK + 17)

# op, its hyperparameters (after rng_base), its step scalars at a step
RULES = {
    "sgd": ("sgd_q8_", (0.9, 0.1, 0.01, False, False), lambda step: reference.sgd_step_scalars(0.05, step)),
    "nesterov": ("sgd_q8_", (0.9, 0.0, 0.0, True, True), lambda step: reference.sgd_step_scalars(0.05, step)),
    "lion": ("lion_q8_", (0.9, 0.99, False), lambda step: reference.lion_step_scalars(1e-3, 0.1)),
}


def _grad(n, gen, dtype):
    """Heavy-tailed, with a zero block, +-0, fp32 subnormals and huge values where there is room."""
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    if n >= 64:
        x[0:32] = 0.0
        x[32] = -0.0
        x[33:37] = torch.tensor([1e-40, -3e-39, 1e30, 3e18])
        x[40:45] = torch.tensor([1e-45, -1e-45, 2.0**-126, 6e4, -6e4])
    return x.to(dtype)


def _state(n, pdtype, master, gen):
    """(param, masters list, codes, scales): a state holding codes of every magnitude (m spread over 2^+-16)."""
    p32 = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-8, 8, (n,), generator=gen).float()
    if master == "remainder":
        p, rem = reference.split_master(p32)
        masters = [rem]
    elif master == "fp32":
        p, masters = p32.to(pdtype), [p32.clone()]
    else:
        p, masters = p32.to(pdtype), []
    m = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-16, 16, (n,), generator=gen).float()
    codes, scales = q8.q8_encode_m(m)
    return p, masters, codes, scales


def _lists(tensors):
    out = [[], [], [], []]
    for p, masters, codes, scales in tensors:
        out[0].append(p)
        out[1].extend(masters)
        out[2].append(codes)
        out[3].append(scales)
    return out


def _run(native, rule, state, grads_per_step, found_inf=None, sr_param=False, sr_codes=False, threads=1, rows=False):
    """The native op (``native``) or the reference over the steps on a copy of ``state`` ([params, masters,
    codes, scales]); what it wrote."""
    op, hyper, scalars = RULES[rule]
    impl = native_optim(op) if native else getattr(reference, op)
    st = clone_lists(state)
    n = len(state[0])
    for step, grads in enumerate(grads_per_step):
        count = torch.arange(step, step + n, dtype=torch.float32) if rows else torch.tensor(float(step))
        sc = scalars(count)
        if rows and sc.dim() == 1:
            sc = sc.expand(n, 3).contiguous()
        rng = torch.tensor([11, step], dtype=torch.int64)
        with num_threads(threads):
            impl(st[0], grads, *st[1:], sc, found_inf, rng.clone(), 3, *hyper, sr_param, sr_codes)
    return st


def _run_both(rule, state, grads_per_step, **kw):
    """Both implementations over the steps on copies of ``state``; both results."""
    return _run(True, rule, state, grads_per_step, **kw), _run(False, rule, state, grads_per_step, **kw)


def _assert_same(nat, ref, what=""):
    for name, a, e in zip(("params", "masters", "codes", "scales"), nat, ref):
        assert len(a) == len(e), name
        for i, (x, y) in enumerate(zip(a, e)):
            assert_bits_equal(x, y, f"{what} {name}[{i}]")


MASTERS = [
    ("none", torch.float32),
    ("none", torch.float16),
    ("none", torch.bfloat16),
    ("fp32", torch.float32),
    ("fp32", torch.float16),
    ("fp32", torch.bfloat16),
    ("remainder", torch.bfloat16),
]


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("master,pdtype", MASTERS, ids=lambda x: _SHORT.get(x, x) if isinstance(x, torch.dtype) else x)
@pytest.mark.parametrize("sr_codes", [False, True], ids=["rne", "sr"])
def test_matches_reference_over_steps(monkeypatch, rule, master, pdtype, sr_codes):
    """Every size in one call (partial blocks, several chunks); a bf16 param without a master is also
    rounded stochastically when the codes are. On every instruction-set path (one reference run)."""
    gen = torch.Generator().manual_seed(len(master) * 7 + len(rule))
    tensors = [_state(n, pdtype, master, gen) for n in SIZES]
    grads = [[_grad(n, gen, torch.float32) for n in SIZES] for _ in range(3)]
    sr_param = sr_codes and master == "none" and pdtype == torch.bfloat16
    ref = _run(False, rule, _lists(tensors), grads, sr_param=sr_param, sr_codes=sr_codes)
    for isa in each_isa(monkeypatch):
        nat = _run(True, rule, _lists(tensors), grads, sr_param=sr_param, sr_codes=sr_codes)
        _assert_same(nat, ref, f"{isa} {rule}")
        assert not torch.equal(nat[2][-1], _lists(tensors)[2][-1]), "the step wrote no code"


@pytest.mark.parametrize("rule", ["sgd", "lion"])
@pytest.mark.parametrize("sr_param,sr_codes", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("threads", [1, 2])
def test_grad_dtypes_rounding_rows_and_threads(monkeypatch, rule, sr_param, sr_codes, threads):
    """fp32, fp16 and bf16 grads in one call, step scalars one row per tensor, 1 and 2 threads (every path)."""
    gen = torch.Generator().manual_seed(5)
    sizes = (CHUNK * 2 + 40, 33, 100)
    tensors = [_state(n, torch.bfloat16, "none", gen) for n in sizes]
    gdtypes = (torch.bfloat16, torch.float16, torch.float32)
    grads = [[_grad(n, gen, gd) for n, gd in zip(sizes, gdtypes)] for _ in range(3)]
    kw = dict(sr_param=sr_param, sr_codes=sr_codes, threads=threads, rows=True)
    ref = _run(False, rule, _lists(tensors), grads, **kw)
    for isa in each_isa(monkeypatch):
        _assert_same(_run(True, rule, _lists(tensors), grads, **kw), ref, f"{isa} threads={threads}")


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_every_code_and_scale_byte_decodes_as_the_reference(isa, rule):
    """All 256 codes under scale bytes across the range (0xFF: NaN blocks; below M_SCALE_MIN; the top).

    Zero grads with a decaying master: the new state is the decoded one times the momentum (SGD)
    or beta2 (Lion), so a decode that differs in any bit shows in a code or a param.
    """
    scales = [0, 1, 10, 11, 12, 60, 126, 127, 137, 200, 253, 254, 255]
    codes = torch.arange(256, dtype=torch.uint8).repeat(len(scales))
    sc = torch.tensor(scales, dtype=torch.uint8).repeat_interleave(8)  # 256 codes = 8 blocks per scale byte
    gen = torch.Generator().manual_seed(2)
    n = codes.numel()
    state = [[torch.randn(n, generator=gen)], [], [codes], [sc]]
    nat, ref = _run_both(rule, state, [[torch.zeros(n)], [torch.randn(n, generator=gen) * 1e-3]])
    _assert_same(nat, ref, rule)


@pytest.mark.parametrize("rule", ["sgd", "lion"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_nonfinite_grad_makes_a_nan_block(isa, rule, bad):
    gen = torch.Generator().manual_seed(4)
    tensors = [_state(200, torch.bfloat16, "remainder", gen)]
    g = _grad(200, gen, torch.float32)
    g[70] = bad
    nat, ref = _run_both(rule, _lists(tensors), [[g], [_grad(200, gen, torch.float32)]])
    _assert_same(nat, ref)
    # element 70's block (2) holds a non-finite state after the first step; decoded as NaN, it stays so
    assert int(nat[3][0][2]) == q8.NONFINITE_SCALE


@pytest.mark.parametrize("rule", ["sgd", "lion"])
@pytest.mark.parametrize("found", [1.0, math.nan, math.inf])
def test_found_inf_writes_nothing(isa, rule, found):
    op, hyper, scalars = RULES[rule]
    gen = torch.Generator().manual_seed(6)
    state = _lists([_state(n, torch.bfloat16, "remainder", gen) for n in (100, CHUNK + 5)])
    grads = [_grad(p.numel(), gen, torch.float32) for p in state[0]]
    before = clone_lists(state)
    native_optim(op)(state[0], grads, *state[1:], scalars(torch.tensor(1.0)), torch.tensor([found]),
                     torch.tensor([1, 1]), 0, *hyper, False, True)  # fmt: skip
    _assert_same(state, before, "skipped step")
    nat, ref = _run_both(rule, state, [grads], found_inf=torch.tensor([0.0]), sr_codes=True)
    _assert_same(nat, ref, "found_inf == 0")
    assert not torch.equal(nat[2][1], before[2][1])


def test_thread_float_mode_does_not_change_bytes(isa):
    """Under torch.set_flush_denormal(True) the bytes are the same (the codec needs subnormals), and the
    thread gets its flush-to-zero back."""
    gen = torch.Generator().manual_seed(13)
    tensors = [_state(n, torch.float32, "none", gen) for n in (CHUNK + 70, 40)]
    for _, _, _, scales in tensors:  # tiny states: decode and encode through fp32 subnormals
        scales.fill_(q8.M_SCALE_MIN)
    grads = [_grad(t[0].numel(), gen, torch.float32) * 1e-38 for t in tensors]
    plain, flushed = _lists(tensors), clone_lists(_lists(tensors))
    op, hyper, scalars = RULES["lion"]

    def step(st):
        with num_threads(1):
            native_optim(op)(st[0], grads, *st[1:], scalars(None), None, torch.tensor([5, 2]), 0, *hyper, False, True)

    step(plain)
    run_flushing_denormals(lambda: step(flushed))
    _assert_same(flushed, plain, f"{isa} flush-to-zero thread")


def test_empty_lists_and_empty_tensors(isa):
    for rule in ("sgd", "lion"):
        op, hyper, scalars = RULES[rule]
        native_optim(op)([], [], [], [], [], scalars(torch.tensor(0.0)), None, None, 0, *hyper, False, False)
        gen = torch.Generator().manual_seed(8)
        tensors = [_state(0, torch.float32, "none", gen), _state(40, torch.float32, "none", gen)]
        nat, ref = _run_both(rule, _lists(tensors), [[torch.zeros(0), _grad(40, gen, torch.float32)]])
        _assert_same(nat, ref)


# ---- refusals: a clear error naming the problem, and nothing written ----


def _bad_cases():
    n = 70

    def set_(key, val):
        return lambda a: a.__setitem__(key, val)

    return {
        "codes count": (
            set_("codes", []),
            "{missing}",
        ),
        "scales count": (
            set_("scales", []),
            "{missing}",
        ),
        "codes dtype": (
            set_("codes", [torch.zeros(n, dtype=torch.int8)]),
            r"{states} must be float32 or bfloat16, or uint8 q8 codes and scales \(one state format per call\), got "
            "{states}[0] of Char",
        ),
        "scales dtype int8": (set_("scales", [torch.zeros(3, dtype=torch.int8)]), "{scales}[0] must have dtype Byte"),
        "codes numel": (set_("codes", [torch.zeros(n - 1, dtype=torch.uint8)]), "{codes}[0] has 69 elements"),
        "codes strided": (set_("codes", [torch.zeros(2 * n, dtype=torch.uint8)[::2]]), "{codes}[0] must be contig"),
        "scales length": (set_("scales", [torch.zeros(2, dtype=torch.uint8)]), "{scales}[0] must be 1-D with 3"),
        "scales dtype": (set_("scales", [torch.zeros(3, dtype=torch.int32)]), "{scales}[0] must have dtype Byte"),
        "remainder param": (
            lambda a: a.__setitem__("params", [a["params"][0].float()]),
            "int16 remainder masters need bfloat16 params",
        ),
        "sr without rng": (set_("rng", None), "SR_PARAM / SR_STATE need rng"),
        "grad numel": (set_("grads", [torch.zeros(n + 1)]), "grads[0] has 71 elements"),
        "step_scalars shape": (set_("sc", torch.zeros(4)), "step_scalars must be"),
    }


@pytest.mark.parametrize("rule", ["sgd", "lion"])
@pytest.mark.parametrize("case", list(_bad_cases()))
def test_refusals_name_the_problem_and_change_nothing(rule, case):
    op, hyper, scalars = RULES[rule]
    names = {"sgd": ("momentum_buffer_codes", "momentum_buffer_scales"), "lion": ("exp_avg_codes", "exp_avg_scales")}
    mutate, message = _bad_cases()[case]
    gen = torch.Generator().manual_seed(0)
    p, masters, codes, scales = _state(70, torch.bfloat16, "remainder", gen)
    a = dict(params=[p], grads=[torch.randn(70, generator=gen)], masters=masters, codes=[codes], scales=[scales],
             sc=scalars(torch.tensor(1.0)), rng=torch.tensor([1, 2]))  # fmt: skip
    mutate(a)
    before = [[t.clone() for t in a[k]] for k in ("params", "masters", "codes", "scales")]
    states = {"sgd": "momentum_buffers", "lion": "exp_avgs"}
    # the one state missing: SGD's momentum says it needs one; Lion keeps its exp_avgs
    missing = {
        "sgd": "momentum=0.9 needs one momentum_buffers tensor per param, got 0",
        "lion": r"keeps 1 state\(s\) \(exp_avgs\), 2 list\(s\) of 1 tensors each: 2 state tensors, got 1",
    }[rule]
    message = message.format(codes=names[rule][0], scales=names[rule][1], missing=missing, states=states[rule])
    with pytest.raises(RuntimeError, match="fastamp::optim_: .*" + message.replace("[", r"\[").replace("]", r"\]")):
        native_optim(op)(a["params"], a["grads"], a["masters"], a["codes"], a["scales"], a["sc"], None, a["rng"], 0,
                         *hyper, False, True)  # fmt: skip
    for k, old in zip(("params", "masters", "codes", "scales"), before):
        for x, y in zip(a[k], old):
            assert_bits_equal(x, y, f"{k} after a refused call")


def test_sgd_q8_refuses_zero_momentum():
    """SGD without a momentum keeps no state: q8 lists for it are refused (the codes hold the momentum buffer)."""
    gen = torch.Generator().manual_seed(0)
    p, masters, codes, scales = _state(40, torch.float32, "none", gen)
    with pytest.raises(RuntimeError, match=r"fastamp::optim_: rule 'sgd' with these settings keeps 0 state\(s\)"):
        torch.ops.fastamp.optim_([p], [torch.ones(40)], [], [codes, scales],
                                 reference.sgd_step_scalars(0.1, torch.tensor(0.0)), None, None, 0, "sgd",
                                 [0.0, 0.0, 0.0], 0)  # fmt: skip
