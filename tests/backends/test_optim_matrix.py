"""Every optimizer kernel against the reference: RULES x FORMATS x BACKENDS x CASES.

The axes are the tables of ``_matrix.py`` (add a row there); the cases are the tests below,
each run for every (update rule, state format) pair the rule supports on every backend:
native CPU on each instruction set this machine runs, Triton (the interpreter on CPU, the GPU
where there is one) and native CUDA, each skipped with its reason where it cannot run.

Agreement: every tensor the step writes is bit-exact with ``fastamp.reference`` (NaN compared
as NaN whatever its payload) on the native CPU and CUDA kernels and on Triton under the
interpreter; Triton's AdamW on a GPU within ``tolerances.ADAMW_GPU_RTOL`` (its sqrt/division
may not be correctly rounded, see ``_matrix.assert_state_matches``), its SGD bit-exact.

The reference result of a case does not depend on the backend: it is computed once per case
and shared by the backends that follow it (``_expected``; the parameter lists keep a case's
backends together).
"""

import math
import zlib

import pytest
import torch
from _matrix import (
    BACKENDS,
    BAD,
    BF16,
    DTYPES,
    F16,
    F32,
    FORMAT,
    RULE,
    RULE_FORMATS,
    SHORT,
    assert_state_matches,
    assert_unchanged,
    backend_marks,
    clone_state,
    family,
    functional_call,
    make_state,
    op_call,
    ref_op,
    run_steps,
)
from helpers import assert_bits_equal, misaligned

# numpy, behind the Triton interpreter, warns on inf*0 and friends; those values are the point here
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _params(combos, slow=lambda c: False):
    """(backend, *combo) for every backend, a case's backends next to each other (for ``_expected``)."""
    out = []
    for combo_id, combo in combos:
        for b in BACKENDS:
            marks = backend_marks(b) + ([pytest.mark.slow] if slow(combo) else [])
            out.append(pytest.param(b, *combo, id=f"{b.id}-{combo_id}", marks=marks))
    return out


def _rf_params(extra=((None, ()),), slow=lambda c: not c[1].cover):
    """(backend, rule, format, *extra) for every supported (rule, format); formats outside the default
    cover (``Format.cover``) are slow."""
    combos = []
    for rule, fmt in RULE_FORMATS:
        for eid, e in extra:
            combos.append((f"{rule.name}-{fmt.name}" + (f"-{eid}" if eid is not None else ""), (rule, fmt, *e)))
    return _params(combos, slow)


@pytest.fixture(autouse=True)
def _kernels_of_the_backend(request, monkeypatch):
    """Native CPU: the instruction-set path under test (``FASTAMP_CPU_ISA`` lowers the one the kernels pick)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    b = params.get("backend")
    if b is not None and b.isa is not None:
        monkeypatch.setenv("FASTAMP_CPU_ISA", b.isa)
        assert torch.ops.fastamp.cpu_isa() == b.isa


_CACHE: dict = {}


def _expected(key, build):
    """``build()`` once per key (the reference's result of a case, the same for every backend)."""
    if key not in _CACHE:
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = build()
    return _CACHE[key]


def _seed(*parts) -> int:
    return zlib.crc32("-".join(map(str, parts)).encode()) % 10_000


def _steps(fn_of_op, rule, fmt, st, h, steps, **kw):
    """Snapshots of ``st`` after each of ``steps`` steps."""
    out = []
    for k in range(steps):
        run_steps(
            fn_of_op, rule, fmt, st, h, 1, first=kw.get("first", 0) + k, **{a: v for a, v in kw.items() if a != "first"}
        )
        out.append(clone_state(st))
    return out


def _compare_steps(backend, rule, fmt, got, exp, what):
    for k, (g, e) in enumerate(zip(got, exp)):
        assert_state_matches(backend, rule, fmt, g, e, f"{what} step {k}")


def _full_state_hyper(rule):
    """The hyperparameters that use every state list of the rule (amsgrad's max, momentum buffers)."""
    return {"adamw": "amsgrad", "sgd": "nesterov-wd-maximize"}[rule.name]


# ---- case: multi-step comparison over dtypes and hyperparameters ----------------------------------------


def _match_combos():
    combos = []
    for rule, fmt in RULE_FORMATS:
        k = 0
        for pdt in fmt.param_dtypes:
            for gdt in DTYPES:
                for i, hyper in enumerate(rule.hypers):
                    cover = i == k % len(rule.hypers)  # the default run: every hyperparameter case once per row
                    cid = f"{rule.name}-{fmt.name}-p{SHORT[pdt]}-g{SHORT[gdt]}-{hyper}"
                    combos.append((cid, (rule, fmt, pdt, gdt, hyper, cover)))
                k += 1
    return combos


# The full cross product (~450 combinations per backend, ~0.2 s each for the reference on CPU and
# longer under the Triton interpreter) is slow; the default run keeps one hyperparameter case per
# (rule, format, param dtype, grad dtype), rotating so that every hyperparameter case runs, over the
# formats of the default cover.
@pytest.mark.parametrize(
    "backend, rule, fmt, pdt, gdt, hyper, cover", _params(_match_combos(), lambda c: not (c[-1] and c[1].cover))
)
def test_matches_reference(backend, rule, fmt, pdt, gdt, hyper, cover):
    h = rule.hypers[hyper]
    sizes = backend.short_sizes()
    seed = _seed(rule.name, fmt.name, pdt, gdt, hyper)

    def build():
        return _steps(
            ref_op, rule, fmt, make_state(rule, fmt, pdt, gdt, h, sizes, seed, backend.device), h, 3, seed=seed
        )

    exp = _expected(("match", rule.name, fmt.name, pdt, gdt, hyper, tuple(sizes), backend.device), build)
    st = make_state(rule, fmt, pdt, gdt, h, sizes, seed, backend.device)
    before = clone_state(st)
    got = _steps(backend.op, rule, fmt, st, h, 3, seed=seed)
    _compare_steps(backend, rule, fmt, got, exp, f"{pdt}/{gdt} {hyper}")
    assert any(not torch.equal(a, b) for a, b in zip(st["params"], before["params"])), "the update must move params"
    if fmt.master == "fp32":
        for p, w in zip(st["params"], st["master"]):
            assert_bits_equal(p, w.to(p.dtype), "param is its master rounded")
    if "momentum_buffers" in st and st["momentum_buffers"]:
        assert not torch.isnan(st["momentum_buffers"][-1]).all(), "the first step replaced the NaN-filled buffers"


# ---- case: non-finite and extreme values in grads, params and state ---------------------------------------


def _plant_adversarial(st, rule):
    g = st["grads"][-1]
    g[:8] = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 3e38, -3e38, math.inf, math.nan]).to(g.dtype)
    st["grads"][1][0] = math.nan
    st["grads"][2][-1] = -math.inf
    for key, pos, vals in zip(rule.state_keys, (100, 200, 300), ([1e-45, -0.0, 3e38, math.inf], [0.0, 1e-45, math.inf],
                                                                  [math.nan, math.inf])):  # fmt: skip
        if st[key]:
            st[key][-1][pos : pos + len(vals)] = torch.tensor(vals).to(st[key][-1].dtype)
    p = st["master"][-1] if st["master"] and st["master"][-1].is_floating_point() else st["params"][-1]
    p[400:404] = torch.tensor([1e-45, -0.0, math.inf, math.nan]).to(p.dtype)


@pytest.mark.parametrize("backend, rule, fmt", _rf_params())
def test_adversarial_values_propagate_like_reference(backend, rule, fmt):
    """Zero, subnormal, huge and non-finite grads, state and params, on every param dtype of the format."""
    h = rule.hypers[_full_state_hyper(rule)]
    sizes = [9, 33, 17, backend.chunk + 3]
    for pdt in fmt.param_dtypes:
        seed = _seed("adv", rule.name, fmt.name, pdt)

        def state(pdt=pdt, seed=seed):
            st = make_state(rule, fmt, pdt, F32, h, sizes, seed, backend.device)
            _plant_adversarial(st, rule)
            return st

        exp = _expected(("adv", rule.name, fmt.name, pdt, backend.chunk, backend.device),
                        lambda: _steps(ref_op, rule, fmt, state(), h, 2, grad_mul=1.0, seed=seed))  # noqa: B023 (called at once)  # fmt: skip
        got = _steps(backend.op, rule, fmt, state(), h, 2, grad_mul=1.0, seed=seed)
        _compare_steps(backend, rule, fmt, got, exp, f"adversarial {pdt}")


# ---- case: sizes, each alone in a call and all in one ---------------------------------------------------


@pytest.mark.parametrize("backend, rule, fmt", _rf_params())
def test_sizes_alone_and_together(backend, rule, fmt):
    """0, 1, primes, around the vector block: each alone in a call (one step); then every size up to
    more than two chunks in one call (two steps), every other param and grad misaligned by one element."""
    h = rule.hypers[_full_state_hyper(rule)]
    pdt = fmt.param_dtypes[-1]
    sizes = backend.sizes()
    groups = [([n], 1) for n in sizes if n <= 33 or abs(n - backend.block) <= 1] + [(sizes, 2)]
    for i, (group, steps) in enumerate(groups):
        gdt = DTYPES[i % 3]
        seed = _seed("sizes", rule.name, fmt.name, i)

        def state(group=group, gdt=gdt, seed=seed):
            st = make_state(rule, fmt, pdt, gdt, h, group, seed, backend.device)
            if len(group) > 1:
                for key in ("params", "grads"):
                    st[key] = [misaligned(t) if j % 2 == 0 else t for j, t in enumerate(st[key])]
            return st

        key = ("sizes", rule.name, fmt.name, i, tuple(group), backend.device)
        exp = _expected(key, lambda: _steps(ref_op, rule, fmt, state(), h, steps, seed=seed))  # noqa: B023 (called at once)
        got = _steps(backend.op, rule, fmt, state(), h, steps, seed=seed)
        _compare_steps(backend, rule, fmt, got, exp, f"sizes {group if len(group) == 1 else 'all'}")


# ---- case: many tiny tensors in one call ---------------------------------------------------------------


@pytest.mark.parametrize("backend, rule, fmt", _rf_params())
def test_many_tiny_tensors(backend, rule, fmt):
    """Hundreds of tensors of 0 to 50 elements and one of several chunks, in one call."""
    h = rule.hypers[_full_state_hyper(rule)]
    gen = torch.Generator().manual_seed(12)
    # the reference (and the Triton interpreter) pays per tensor in Python: 600 on CPU, more on a GPU
    count = {"cpu": 300, "cuda": 3000}[backend.device] if backend.id != "triton-cpu" else 40
    sizes = torch.randint(0, 50, (count,), generator=gen).tolist() + [3 * backend.chunk + 1]
    pdt = fmt.param_dtypes[-1]

    def state():
        return make_state(rule, fmt, pdt, BF16, h, sizes, 13, backend.device, edge=False)

    kw = dict(first=2, grad_mul=0.5)
    exp = _expected(("tiny", rule.name, fmt.name, count, backend.chunk, backend.device),
                    lambda: _steps(ref_op, rule, fmt, state(), h, 1, **kw))  # fmt: skip
    got = _steps(backend.op, rule, fmt, state(), h, 1, **kw)
    _compare_steps(backend, rule, fmt, got, exp, "many tiny tensors")


# ---- cases: found_inf ----------------------------------------------------------------------------------

_FOUND = [(f"found{v}", (v,)) for v in (1.0, math.nan, -2.0, math.inf)]


# -2 and inf take the same "non-zero" branch as 1 and NaN: slow, like the formats outside the cover
@pytest.mark.parametrize(
    "backend, rule, fmt, found", _rf_params(_FOUND, slow=lambda c: not c[1].cover or c[2] in (-2.0, math.inf))
)
def test_found_inf_skips_and_writes_nothing(backend, rule, fmt, found):
    """found_inf non-zero (NaN included): every tensor bit-identical, on every param dtype of the format;
    the next applied step is still the first (SGD: buf := grad)."""
    h = rule.hypers[_full_state_hyper(rule)]
    sizes = [5, backend.block + 3, backend.chunk + 1, 130]
    for pdt in fmt.param_dtypes:
        st = make_state(rule, fmt, pdt, F16, h, sizes, 11, backend.device)
        before = clone_state(st)
        run_steps(backend.op, rule, fmt, st, h, 1, found=found)
        assert_unchanged(st, before, f"skipped step ({pdt})")
    seed = _seed("after-skip", rule.name, fmt.name)
    exp = _expected(("after-skip", rule.name, fmt.name, tuple(sizes), backend.device),
                    lambda: _steps(ref_op, rule, fmt, clone_state(before), h, 1, seed=seed))  # fmt: skip
    got = _steps(backend.op, rule, fmt, st, h, 1, seed=seed)
    _compare_steps(backend, rule, fmt, got, exp, "first applied step after a skip")


@pytest.mark.parametrize("backend, rule, fmt", _rf_params())
def test_found_inf_zero_runs(backend, rule, fmt):
    h = rule.hypers[_full_state_hyper(rule)]
    sizes = [5, backend.block + 3, 2]
    pdt = fmt.param_dtypes[-1]
    seed = _seed("zero", rule.name, fmt.name)
    exp = _expected(("zero", rule.name, fmt.name, tuple(sizes), backend.device),
                    lambda: _steps(ref_op, rule, fmt, make_state(rule, fmt, pdt, F16, h, sizes, seed, backend.device),
                                   h, 2, found=0.0, seed=seed))  # fmt: skip
    st = make_state(rule, fmt, pdt, F16, h, sizes, seed, backend.device)
    before = clone_state(st)
    got = _steps(backend.op, rule, fmt, st, h, 2, found=0.0, seed=seed)
    _compare_steps(backend, rule, fmt, got, exp, "found_inf = 0")
    assert not torch.equal(st["params"][1], before["params"][1])


@pytest.mark.parametrize("backend, rule, fmt", _rf_params())
def test_injected_inf_skips_all(backend, rule, fmt):
    """An inf in one grad among many, found by the backend's unscale_check_, skips the step on the device."""
    h = rule.hypers[_full_state_hyper(rule)]
    st = make_state(rule, fmt, fmt.param_dtypes[-1], BF16, h, [4, 9, 300, 2], 13, backend.device)
    st["grads"][2][150] = math.inf
    before = clone_state(st)
    found = torch.zeros(1, device=backend.device)
    inv = torch.tensor([2.0**-4], device=backend.device)
    backend.op("unscale_check_")(st["grads"], found, inv, False, False)
    assert found.item() == 1.0
    scalars = rule.step_scalars(h, 0, None, backend.device)
    rng = torch.tensor([1, 2], device=backend.device)
    op, args = op_call(rule, fmt, st, scalars, found, rng, 0, h)
    backend.op(op)(*args)
    assert_unchanged(st, before, "skipped step")


# ---- case: through fastamp.functional ------------------------------------------------------------------


@pytest.mark.parametrize("backend, rule, fmt", _rf_params())
def test_through_functional(backend, rule, fmt):
    h = rule.hypers[{"adamw": "amsgrad-maximize", "sgd": "nesterov-wd-maximize"}[rule.name]]
    pdt = fmt.param_dtypes[-1]
    sizes = [7, backend.block + 2, 100]
    dev = backend.device
    st = make_state(rule, fmt, pdt, F16, h, sizes, 14, dev)
    ref = clone_state(st)
    scalars = rule.step_scalars(h, 4, torch.tensor(2.0**-12, device=dev), dev)
    rng = torch.tensor([5, 6], device=dev)
    functional_call(backend, rule, fmt, st, scalars, torch.zeros(1, device=dev), rng, 4, h)
    op, args = op_call(rule, fmt, ref, scalars, torch.zeros(1, device=dev), rng, 4, h)
    ref_op(op)(*args)
    assert_state_matches(backend, rule, fmt, st, ref, "functional")


# ---- case: bad inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend, bad", _params([(b.id, (b,)) for b in BAD], slow=lambda c: False))
def test_bad_inputs_refused_and_change_nothing(backend, bad):
    """The kernel refuses (with its message where the row gives one) and so does fastamp.functional; nothing changes."""
    if bad.only and family(backend) not in bad.only:
        pytest.skip(f"{bad.id}: a valid input for the {family(backend)} kernels (Bad.only)")
    rule, fmt = RULE[bad.rule], FORMAT[bad.fmt]
    h = rule.hypers[bad.hyper or "amsgrad"]
    dev = backend.device
    st = make_state(rule, fmt, bad.pdt, bad.gdt, h, [5, 9], 15, dev, edge=False)
    over = bad.mutate(st, dev) or {}
    before = clone_state(st)
    scalars = over.get("scalars", rule.step_scalars(h, 0, None, dev))
    found = over.get("found_inf", None)
    rng = over.get("rng", torch.tensor([1, 2], device=dev))
    op, args = op_call(rule, fmt, st, scalars, found, rng, 0, h)
    msg = getattr(bad, family(backend) if family(backend) != "cpu" else "cpu")
    with pytest.raises(RuntimeError, match=f"{backend.prefix}{op}: .*{msg}"):
        backend.op(op)(*args)
    assert_unchanged(st, before, "a refused call")
    if bad.functional is not None:
        exc, fmsg = bad.functional
        with pytest.raises(exc, match=fmsg):
            functional_call(backend, rule, fmt, st, scalars, found, rng, 0, h)
        assert_unchanged(st, before, "a call refused by fastamp.functional")
