"""Every optimizer kernel against the reference: RULES x FORMATS x BACKENDS x CASES.

The axes are the tables of ``_matrix.py`` (add a row there); the cases are the tests below,
each run for every (update rule, state format) pair the rule supports on every backend:
native CPU on each instruction set this machine runs, Triton (the interpreter on CPU, the GPU
where there is one) and native CUDA, each skipped with its reason where it cannot run.

Agreement: every tensor the step writes is bit-exact with ``fastamp.reference`` (NaN compared
as NaN whatever its payload) on the native CPU and CUDA kernels and on Triton under the
interpreter; Triton's AdamW on a GPU within ``tolerances.ADAMW_GPU_RTOL`` (its sqrt/division
may not be correctly rounded, see ``_matrix.assert_state_matches``), its SGD bit-exact.

The reference result of a case does not depend on the backend: it is computed once per case,
with the case's start state, and shared by the backends that follow it (``_shared``; the
parameter lists keep a case's backends together).

Cost: the cases are a covering design, not the cross product of the axes (the whole of
tests/backends, slow tests included, runs in CI on 2 cores). test_matches_reference runs, per
backend family, every dtype pair of every (rule, format) with each compiled kernel variant and
every hyperparameter case at least once (``_match_cover``); the other cases run on the formats of
``Format.cover`` with the hyperparameters that use every state list.
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
    FORMATS,
    RULE,
    RULE_FORMATS,
    SHORT,
    assert_state_matches,
    assert_unchanged,
    backend_marks,
    clone_state,
    decode_q8_state,
    encode_q8_states,
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


def _params(combos, runs_on=lambda b, combo: True):
    """(backend, *combo) for every backend that runs the combination, a case's backends next to each
    other (for ``_shared``)."""
    out = []
    for combo_id, combo in combos:
        for b in BACKENDS:
            if runs_on(b, combo):
                out.append(pytest.param(b, *combo, id=f"{b.id}-{combo_id}", marks=backend_marks(b)))
    return out


def _rf_params(extra=((None, ()),), half=None):
    """(backend, rule, format, *extra) for every supported (rule, format) of the cover (``Format.cover``).

    ``half`` (0 or 1): on the interpreted backends (Triton on the CPU, ~100x slower than the others)
    only every other format of ``FORMATS``, from this one: the cases that take a half alternate it,
    so each format meets half of them there and every one of them on the compiled backends.
    """
    combos = []
    for rule, fmt in RULE_FORMATS:
        if not fmt.cover:
            continue
        for eid, e in extra:
            combos.append((f"{rule.name}-{fmt.name}" + (f"-{eid}" if eid is not None else ""), (rule, fmt, *e)))
    if half is None:
        return _params(combos)
    mine = {f.name for i, f in enumerate(FORMATS) if i % 2 == half}
    return _params(combos, lambda b, combo: not b.interpreted or combo[1].name in mine)


@pytest.fixture(autouse=True)
def _kernels_of_the_backend(request, monkeypatch):
    """Native CPU: the instruction-set path under test (``FASTAMP_CPU_ISA`` lowers the one the kernels pick)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    b = params.get("backend")
    if b is not None and b.isa is not None:
        monkeypatch.setenv("FASTAMP_CPU_ISA", b.isa)
        assert torch.ops.fastamp.cpu_isa() == b.isa


_CACHE: dict = {}


def _shared(key, build):
    """``build()`` once per key: what does not depend on the backend (a case's start state and the
    reference's result from it), made by the first backend of the case and reused by the next."""
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


def _reference_case(key, rule, fmt, h, make, steps, **kw):
    """(start state, the reference's snapshots after each of ``steps`` steps from it), built once per key;
    a backend runs on ``clone_state(start)`` (misaligned tensors stay misaligned)."""

    def build():
        start = make()
        return start, _steps(ref_op, rule, fmt, clone_state(start), h, steps, **kw)

    return _shared(key, build)


def _compare_steps(backend, rule, fmt, got, exp, what):
    for k, (g, e) in enumerate(zip(got, exp)):
        assert_state_matches(backend, rule, fmt, g, e, f"{what} step {k}")


# ---- case: multi-step comparison over dtypes and hyperparameters ----------------------------------------


def _family(b) -> int:
    """The index of the backend's (kind, device): the ISAs of the native CPU kernels are one family."""
    return list(dict.fromkeys((x.kind, x.device) for x in BACKENDS)).index((b.kind, b.device))


def _match_cover(rule, fmt, rotation, variants=True):
    """(param dtype, grad dtype, hyperparameter case) triples: every dtype pair of the format with each
    kernel variant (``Rule.kernel_variant``: every compiled kernel), every hyperparameter case at least
    once; ``rotation`` shifts which case meets which pair. Without ``variants`` (the interpreted
    backends: the compiled ones run every pair, and the interpreter runs the same kernel source as
    Triton on a GPU) each param dtype and each grad dtype once and three cases per format, the
    rule's cases spread over its formats."""
    pairs = [(p, g) for p in fmt.param_dtypes for g in DTYPES]
    if not variants:
        # an interpreted backend: each param dtype and each grad dtype at least once, and three
        # hyperparameter cases per format, rotating over the formats so that the rule's cases all run
        n = max(len(fmt.param_dtypes), len(DTYPES))
        pairs = [(fmt.param_dtypes[j % len(fmt.param_dtypes)], DTYPES[(j + rotation) % len(DTYPES)]) for j in range(n)]
        names = list(rule.hypers)
        off = 3 * FORMATS.index(fmt) + rotation
        return [(*pairs[j % len(pairs)], names[(off + j) % len(names)]) for j in range(max(len(pairs), 3))]
    by_variant: dict = {}
    for name, h in rule.hypers.items():
        by_variant.setdefault(rule.kernel_variant(h) if variants else None, []).append(name)
    out = []
    for names in by_variant.values():
        for j in range(max(len(pairs), len(names))):
            out.append((*pairs[j % len(pairs)], names[(j + rotation) % len(names)]))
    return out


def _match_params():
    """A covering design, not the cross product (~450 combinations per backend): per backend family
    (one rotation each, so the families meet different (dtype pair, case) pairs) the cover of every
    (rule, format); the ISAs of the native CPU kernels share theirs, and with it the reference's result.
    The interpreter (~0.1 s a launch) runs each dtype pair once, not once per kernel variant."""
    covers, combos = {}, {}
    families = {_family(b): not b.interpreted for b in BACKENDS}
    for rule, fmt in RULE_FORMATS:
        for fam, variants in sorted(families.items()):
            for pdt, gdt, hyper in _match_cover(rule, fmt, fam, variants):
                cid = f"{rule.name}-{fmt.name}-p{SHORT[pdt]}-g{SHORT[gdt]}-{hyper}"
                combos[cid] = (rule, fmt, pdt, gdt, hyper)
                covers.setdefault(cid, set()).add(fam)
    return _params(combos.items(), lambda b, combo: _family(b) in covers[_match_id(*combo)])


def _match_id(rule, fmt, pdt, gdt, hyper):
    return f"{rule.name}-{fmt.name}-p{SHORT[pdt]}-g{SHORT[gdt]}-{hyper}"


@pytest.mark.parametrize("backend, rule, fmt, pdt, gdt, hyper", _match_params())
def test_matches_reference(backend, rule, fmt, pdt, gdt, hyper):
    """Two steps (the second from the state the kernel wrote; SGD: the first step's buffer := grad)."""
    h = rule.hypers[hyper]
    sizes = backend.short_sizes()
    seed = _seed(rule.name, fmt.name, pdt, gdt, hyper)
    start, exp = _reference_case(
        ("match", rule.name, fmt.name, pdt, gdt, hyper, tuple(sizes), backend.device), rule, fmt, h,
        lambda: make_state(rule, fmt, pdt, gdt, h, sizes, seed, backend.device), 2, seed=seed,
    )  # fmt: skip
    st = clone_state(start)
    got = _steps(backend.op, rule, fmt, st, h, 2, seed=seed)
    _compare_steps(backend, rule, fmt, got, exp, f"{pdt}/{gdt} {hyper}")
    assert any(not torch.equal(a, b) for a, b in zip(st["params"], start["params"])), "the update must move params"
    if fmt.master == "fp32":
        for p, w in zip(st["params"], st["master"]):
            assert_bits_equal(p, w.to(p.dtype), "param is its master rounded")
    if "momentum_buffers" in st and st["momentum_buffers"]:
        assert not torch.isnan(st["momentum_buffers"][-1]).all(), "the first step replaced the NaN-filled buffers"


# ---- case: non-finite and extreme values in grads, params and state ---------------------------------------


def _plant_adversarial(st, rule, fmt):
    g = st["grads"][-1]
    g[:8] = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 3e38, -3e38, math.inf, math.nan]).to(g.dtype)
    st["grads"][1][0] = math.nan
    st["grads"][2][-1] = -math.inf
    q8 = fmt.state == "q8"
    for key, pos, vals in zip(rule.state_keys, (100, 200, 300), ([1e-45, -0.0, 3e38, math.inf], [0.0, 1e-45, math.inf],
                                                                  [math.nan, math.inf])):  # fmt: skip
        if st[key]:
            values = decode_q8_state(rule, st, key) if q8 else st[key]
            values[-1][pos : pos + len(vals)] = torch.tensor(vals).to(values[-1].dtype)
            if q8:  # planted in the decoded values, encoded again (a non-finite value makes its block NaN)
                st[key] = values
                encode_q8_states(rule, st, (key,))
    p = st["master"][-1] if st["master"] and st["master"][-1].is_floating_point() else st["params"][-1]
    p[400:404] = torch.tensor([1e-45, -0.0, math.inf, math.nan]).to(p.dtype)


@pytest.mark.parametrize("backend, rule, fmt", _rf_params(half=0))
def test_adversarial_values_propagate_like_reference(backend, rule, fmt):
    """Zero, subnormal, huge and non-finite grads, state and params, on every param dtype of the format."""
    h = rule.hypers[rule.full_state]
    sizes = [9, 33, 17, backend.chunk + 3]
    for pdt in fmt.param_dtypes:
        seed = _seed("adv", rule.name, fmt.name, pdt)

        def state(pdt=pdt, seed=seed):
            st = make_state(rule, fmt, pdt, F32, h, sizes, seed, backend.device)
            _plant_adversarial(st, rule, fmt)
            return st

        key = ("adv", rule.name, fmt.name, pdt, backend.chunk, backend.device)
        start, exp = _reference_case(key, rule, fmt, h, state, 2, grad_mul=1.0, seed=seed)
        got = _steps(backend.op, rule, fmt, clone_state(start), h, 2, grad_mul=1.0, seed=seed)
        _compare_steps(backend, rule, fmt, got, exp, f"adversarial {pdt}")


# ---- case: sizes, each alone in a call and all in one ---------------------------------------------------


@pytest.mark.parametrize("backend, rule, fmt", _rf_params(half=1))
def test_sizes_alone_and_together(backend, rule, fmt):
    """Sizes around the vector block and the scalar tail's lengths each alone in a call
    (``Backend.alone_sizes``); then every size, 0 to more than two chunks, in one call, every other
    param and grad misaligned by one element (on Triton: a launch of its own, without the alignment hint)."""
    h = rule.hypers[rule.full_state]
    pdt = fmt.param_dtypes[-1]
    groups = [[n] for n in backend.alone_sizes()] + [backend.sizes()]

    def build():
        cases = []
        for i, group in enumerate(groups):
            seed = _seed("sizes", rule.name, fmt.name, i)
            st = make_state(rule, fmt, pdt, DTYPES[i % 3], h, group, seed, backend.device)
            if len(group) > 1:
                for key in ("params", "grads"):
                    st[key] = [misaligned(t) if j % 2 == 0 else t for j, t in enumerate(st[key])]
            cases.append((st, _steps(ref_op, rule, fmt, clone_state(st), h, 1, seed=seed)))
        return cases

    cases = _shared(("sizes", rule.name, fmt.name, tuple(map(tuple, groups)), backend.device), build)
    for i, (group, (start, exp)) in enumerate(zip(groups, cases)):
        got = _steps(backend.op, rule, fmt, clone_state(start), h, 1, seed=_seed("sizes", rule.name, fmt.name, i))
        _compare_steps(backend, rule, fmt, got, exp, f"sizes {group if len(group) == 1 else 'all'}")


# ---- case: many tiny tensors in one call ---------------------------------------------------------------


@pytest.mark.parametrize("backend, rule, fmt", _rf_params(half=0))
def test_many_tiny_tensors(backend, rule, fmt):
    """Hundreds of tensors of 0 to 50 elements and one of several chunks, in one call."""
    h = rule.hypers[rule.full_state]
    gen = torch.Generator().manual_seed(12)
    # the reference, the comparison (and the Triton interpreter) pay per tensor in Python: 120 on CPU
    # (still over a hundred chunks), more on a GPU
    count = 40 if backend.interpreted else {"cpu": 120, "cuda": 3000}[backend.device]
    sizes = torch.randint(0, 50, (count,), generator=gen).tolist() + [3 * backend.chunk + 1]
    pdt = fmt.param_dtypes[-1]
    kw = dict(first=2, grad_mul=0.5)
    start, exp = _reference_case(
        ("tiny", rule.name, fmt.name, count, backend.chunk, backend.device), rule, fmt, h,
        lambda: make_state(rule, fmt, pdt, BF16, h, sizes, 13, backend.device, edge=False), 1, **kw,
    )  # fmt: skip
    got = _steps(backend.op, rule, fmt, clone_state(start), h, 1, **kw)
    _compare_steps(backend, rule, fmt, got, exp, "many tiny tensors")


# ---- cases: found_inf ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend, rule, fmt", _rf_params(half=1))
def test_found_inf_skips_and_writes_nothing(backend, rule, fmt):
    """found_inf 1, NaN, -2 and inf: every tensor bit-identical, on every param dtype of the format;
    the next applied step is still the first (SGD: buf := grad)."""
    h = rule.hypers[rule.full_state]
    sizes = [5, backend.block + 3, backend.chunk + 1, 130]
    for pdt in fmt.param_dtypes:
        before = make_state(rule, fmt, pdt, F16, h, sizes, 11, backend.device)
        for found in (1.0, math.nan, -2.0, math.inf):
            st = clone_state(before)
            run_steps(backend.op, rule, fmt, st, h, 1, found=found)
            assert_unchanged(st, before, f"skipped step ({pdt}, found_inf {found})")
    seed = _seed("after-skip", rule.name, fmt.name)
    start, exp = _reference_case(("after-skip", rule.name, fmt.name, tuple(sizes), backend.device), rule, fmt, h,
                                 lambda: before, 1, seed=seed)  # fmt: skip
    got = _steps(backend.op, rule, fmt, st, h, 1, seed=seed)
    _compare_steps(backend, rule, fmt, got, exp, "first applied step after a skip")


@pytest.mark.parametrize("backend, rule, fmt", _rf_params(half=0))
def test_found_inf_zero_runs(backend, rule, fmt):
    h = rule.hypers[rule.full_state]
    sizes = [5, backend.block + 3, 2]
    pdt = fmt.param_dtypes[-1]
    seed = _seed("zero", rule.name, fmt.name)
    start, exp = _reference_case(("zero", rule.name, fmt.name, tuple(sizes), backend.device), rule, fmt, h,
                                 lambda: make_state(rule, fmt, pdt, F16, h, sizes, seed, backend.device), 2, found=0.0,
                                 seed=seed)  # fmt: skip
    st = clone_state(start)
    got = _steps(backend.op, rule, fmt, st, h, 2, found=0.0, seed=seed)
    _compare_steps(backend, rule, fmt, got, exp, "found_inf = 0")
    assert not torch.equal(st["params"][1], start["params"][1])


@pytest.mark.parametrize("backend, rule, fmt", _rf_params(half=1))
def test_injected_inf_skips_all(backend, rule, fmt):
    """An inf in one grad among many, found by the backend's unscale_check_, skips the step on the device."""
    h = rule.hypers[rule.full_state]
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
    # every state list and MAXIMIZE (the other rules' full_state cases have both)
    h = rule.hypers["amsgrad-maximize" if rule.name == "adamw" else rule.full_state]
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


@pytest.mark.parametrize("backend, bad", _params([(b.id, (b,)) for b in BAD]))
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
