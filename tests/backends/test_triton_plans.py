"""The Triton optimizer launchers' cached plans (``kernels/_common.optimizer_launches``).

A repeated call with the same params and states reuses its groups and tables (only this
call's grad addresses go to the kernel anew, as a tensor of their own) and skips the
dispatcher; these tests check
that such a call gives the bits of a launch built from scratch and of the reference, and that
a call whose tensors changed in any way a table depends on (a replaced, rebound, resized,
retyped or restrided tensor; grads are new tensors every step, as after a backward) never
runs with a stale table. Under ``TRITON_INTERPRET=1`` on CPU (conftest.py), on a GPU as is. The
launcher is the one optimizer kernel's, ``optim_`` (``kernels/optim.py``), here on the arguments of
the per-rule ops (``fastamp.reference.optim.to_optim`` maps them).
"""

import pytest
import torch

pytest.importorskip("triton")

from helpers import assert_bits_equal, misaligned  # noqa: E402

from fastamp import kernels as fk  # noqa: E402
from fastamp import reference as R  # noqa: E402

DEVICES = [d for d in ("cpu", "cuda") if fk.available(d)[0]]
if not DEVICES:
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

from fastamp.kernels import _common as C  # noqa: E402
from fastamp.kernels import _guards as G  # noqa: E402
from fastamp.kernels import optim as toptim  # noqa: E402

from fastamp.reference.optim import to_optim  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CHUNK, _ = C.chunk_config()
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# sizes of the tensors of a call: a multi-chunk one, an empty one, a 2-D one (index 4)
SIZES = [1, 5, 0, CHUNK + 3, (6, 50), 7]
OPS = ("adamw_", "adamw_bf16_", "sgd_", "lion_")


def _triton_op(op):
    """The Triton ``optim_`` on the arguments of the per-rule op ``op``."""
    return lambda *args: toptim.optim_(*to_optim(op, args))


TRITON = {op: _triton_op(op) for op in OPS}


def _t(shape, dtype, gen, device, scale=1.0):
    shape = shape if isinstance(shape, tuple) else (shape,)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def _state(op, device, seed=0):
    """The persistent lists of a call (param dtypes vary, index 1 is not 16-byte aligned)."""
    gen = torch.Generator().manual_seed(seed)
    pdt = [BF16] * len(SIZES) if op == "adamw_bf16_" else [F32, F16, F32, BF16, F32, BF16]
    params = [_t(s, d, gen, device) for s, d in zip(SIZES, pdt)]
    params[1] = misaligned(params[1])
    st = {"params": params}
    if op == "adamw_":
        st["masters"] = [p.to(F32, copy=True) for p in params]
        st["m"] = [_t(s, F32, gen, device, 0.1) for s in SIZES]
        st["v"] = [_t(s, F32, gen, device, 0.1).abs() for s in SIZES]
        st["vmax"] = [v * 1.5 for v in st["v"]]
    elif op == "adamw_bf16_":
        st["rem"] = [torch.randint(-2000, 2000, p.shape, generator=gen, dtype=torch.int16).to(device) for p in params]
        # bf16 moments (optim_ takes one state format per call)
        st["m"] = [_t(s, BF16, gen, device, 0.1) for s in SIZES]
        st["v"] = [_t(s, BF16, gen, device, 0.1).abs() for s in SIZES]
    else:
        st["m"] = [_t(s, F32, gen, device, 0.1) for s in SIZES]
    return st


def _clone(st):
    return {k: [t.clone() if t.is_contiguous() and t.data_ptr() % 16 == 0 else misaligned(t) for t in v]
            for k, v in st.items()}  # fmt: skip


def _grads(st, seed):
    """New grads for the current params (new tensors every step, as a backward makes them)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    gdt = [F32, BF16, F16, F32, F16, BF16]
    return [_t(tuple(p.shape), gdt[i % len(gdt)], gen, p.device, 3.0) for i, p in enumerate(st["params"])]


def _args(op, st, grads):
    dev = st["params"][0].device
    n = len(st["params"])
    rows = torch.tensor([[1e-2 * (i + 1), 0.75, 0.999, 0.5] for i in range(n)], device=dev)
    found = torch.zeros(1, device=dev)
    rng = torch.tensor([12345, 7], dtype=torch.int64, device=dev)
    p = st["params"]
    if op == "adamw_":
        return (p, grads, st["masters"], st["m"], st["v"], st["vmax"], rows, found, 0.9, 0.999, 1e-8, True, False)
    if op == "adamw_bf16_":
        return (p, grads, st["rem"], st["m"], st["v"], [], rows, found, rng, 3, 0.9, 0.999, 1e-8, False, False)
    if op == "sgd_":
        sgd_rows = torch.tensor([[1e-2, 0.5, float(i % 2)] for i in range(n)], device=dev)
        return (p, grads, [], st["m"], sgd_rows, found, rng, 5, 0.9, 0.1, 0.01, True, False)
    lion_rows = torch.tensor([1e-2, 0.999, 0.5], device=dev)
    return (p, grads, [], st["m"], lion_rows, found, None, 0, 0.9, 0.99, True)


def _assert_same(a, b, what):
    for k in a:
        assert len(a[k]) == len(b[k]), (what, k)
        for i, (x, y) in enumerate(zip(a[k], b[k])):
            assert_bits_equal(x, y, f"{what}: {k}[{i}]")


NATIVE_CHECK = C._plan_grads is not None
CHECKS = [("c", 4), ("c", 1024), ("c-guards", 4), ("python", 4)] if NATIVE_CHECK else [("python", 4), ("python", 1024)]


@pytest.fixture(autouse=True, params=CHECKS, ids=[f"{path}-blocks-of-{b}" for path, b in CHECKS])
def check_path(request, monkeypatch):
    """The plan check reads the persistent lists' addresses, dtypes and element counts in one C loop
    over all of them (``fastamp._C.plan_lists``) and the grads in one C loop (``fastamp._C.dense_ptrs``:
    path "c", where the extension is built), or the persistent lists in blocks (``C._BLOCK``: several
    blocks here, and one) of one C loop each (``fastamp._C.plan_grads``) and a direct call's grads with
    torch's ``TensorGuards`` and Python passes ("c-guards": what runs where the extension lacks
    plan_lists and dense_ptrs, and for a list plan_lists cannot answer), or everything in Python passes
    ("python"; each path is forced here)."""
    path, block = request.param
    monkeypatch.setattr(C, "_BLOCK", block)
    if path != "c":
        monkeypatch.setattr(C, "_dense_ptrs", None)
        monkeypatch.setattr(C, "_plan_lists", None)
    if path == "python":
        monkeypatch.setattr(C, "_plan_grads", None)
        monkeypatch.setattr(C, "_TensorGuards", None)
    return path


@pytest.fixture
def guard_calls(monkeypatch):
    """How many times the launchers ran their full list guards (once per plan built)."""
    calls = []
    real = G.guard_lists

    def counting(*args):
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(G, "guard_lists", counting)
    return calls


def _run(op, st, steps, mutate=None, cached=True, fn=None):
    fn = fn or TRITON[op]
    for k in range(steps):
        if mutate is not None and k == 1:
            mutate(st)
        if not cached:
            C._PLANS.clear()
        fn(*_args(op, st, _grads(st, k)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_a_cached_plan_gives_the_bits_of_a_fresh_launch_and_of_the_reference(op, device, guard_calls):
    C._PLANS.clear()
    cached = _state(op, device)
    fresh, ref = _clone(cached), _clone(cached)
    _run(op, cached, 3)
    assert guard_calls == ["optim_"], "the second and third calls must reuse the first call's plan"
    _run(op, fresh, 3, cached=False)
    assert len(guard_calls) == 4
    _run(op, ref, 3, fn=getattr(R, op))
    _assert_same(cached, fresh, "cached vs fresh")
    _assert_same(cached, ref, "cached vs reference")


class _Recording:
    """The optimizer kernel, run as it is, with each launch's table and grad-address tensor kept."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(table, grad_ptrs, *args, **kwargs):
            self.launches.append((table, grad_ptrs, table.clone(), grad_ptrs.clone()))
            self.kernel[grid](table, grad_ptrs, *args, **kwargs)

        return launch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_a_planned_call_reuses_its_tables_and_passes_only_new_grad_addresses(op, device, monkeypatch):
    C._PLANS.clear()
    rec = _Recording(toptim._optim_kernel)
    monkeypatch.setattr(toptim, "_optim_kernel", rec)
    st = _state(op, device)
    calls = []
    for k in range(3):
        grads = _grads(st, k)
        before = len(rec.launches)
        TRITON[op](*_args(op, st, grads))
        calls.append((rec.launches[before:], [g.data_ptr() for g in grads if g.numel()]))
    first, _ = calls[0]
    assert len(first) >= 2, "the call has two launch groups at least (dtype pairs, one misaligned param)"
    for launches, gptrs in calls[1:]:
        assert len(launches) == len(first)
        # the same table objects (the plan's), not rewritten since the first call
        for (table, _, _, _), (table0, _, bits0, _) in zip(launches, first):
            assert table is table0 and torch.equal(table.cpu(), bits0.cpu())
        # each launch's grad addresses are this call's grads, every grad of the call once
        got = sorted(x for _, g, _, _ in launches for x in g.tolist())
        assert got == sorted(gptrs)
    # an earlier call's grad addresses are never rewritten by a later call
    for launches, _ in calls:
        for _, grad_ptrs, _, bits in launches:
            assert torch.equal(grad_ptrs.cpu(), bits.cpu())


def _new_lists(st):
    for k in st:
        st[k] = list(st[k])


def _replace_one(st):
    key = "m"
    st["_old"] = [st[key][3]]
    st["_old_bits"] = [st[key][3].clone()]
    st[key][3] = st[key][3].clone()  # the same list object, a new tensor at a new address


def _rebind_larger(st):
    for lst in (v for k, v in st.items() if not k.startswith("_")):
        lst[0].data = torch.cat([lst[0].data, lst[0].data[:1].neg(), lst[0].data[:1]])


def _shrink_in_place(st):
    # `.data = view` keeps the address and the version counter: only the element count changes
    for lst in (v for k, v in st.items() if not k.startswith("_")):
        lst[3].data = lst[3].data[:100]


def _retype_in_place(st):
    # fp16 <-> bf16 at the same address, element count and layout (adamw_, sgd_, lion_ params)
    p = st["params"][1]
    p.data = p.data.view(BF16 if p.dtype == F16 else F16)


MUTATIONS = {
    "new-lists": _new_lists,
    "replaced": _replace_one,
    "rebound-larger": _rebind_larger,
    "shrunk-same-address": _shrink_in_place,
    "retyped-same-address": _retype_in_place,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_changed_tensor_never_reuses_a_stale_table(op, device, mutation, guard_calls):
    if mutation == "retyped-same-address" and op == "adamw_bf16_":
        pytest.skip("adamw_bf16_ takes bf16 params only")
    C._PLANS.clear()
    cached = _state(op, device)
    ref = _clone(cached)
    _run(op, cached, 3, mutate=MUTATIONS[mutation])
    _run(op, ref, 3, mutate=MUTATIONS[mutation], fn=getattr(R, op))
    for old, bits in zip(cached.pop("_old", []), cached.pop("_old_bits", [])):
        assert_bits_equal(old, bits, "a tensor replaced in its list must not be written")
    ref.pop("_old", None), ref.pop("_old_bits", None)
    _assert_same(cached, ref, f"{mutation}: cached vs reference")
    # a new plan where something a table depends on changed, none where only the lists did
    assert len(guard_calls) == (1 if mutation == "new-lists" else 2), guard_calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_a_tensor_restrided_in_place_is_refused_after_a_cached_call(op, device):
    C._PLANS.clear()
    st = _state(op, device)
    _run(op, st, 2)
    for lst in st.values():
        lst[4].transpose_(0, 1)  # same address, element count and dtype; no longer contiguous
    before = {k: [t.clone() for t in v] for k, v in st.items()}
    with pytest.raises(RuntimeError, match="contiguous"):
        TRITON[op](*_args(op, st, [g.t() if g.dim() == 2 else g for g in _grads(st, 5)]))
    _assert_same(st, before, "a refused call writes nothing")


@pytest.mark.parametrize("device", DEVICES)
def test_a_repeated_call_under_a_dispatch_mode_goes_through_the_dispatcher(device):
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    C._PLANS.clear()
    st = _state("adamw_", device)
    _run("adamw_", st, 2)
    with Log():
        TRITON["adamw_"](*_args("adamw_", st, _grads(st, 2)))
    assert any("fastamp_triton.optim_" in s for s in seen), seen


@pytest.mark.parametrize("device", DEVICES)
def test_only_a_call_that_fits_a_plan_skips_the_dispatcher(device, monkeypatch):
    calls = []
    real = toptim._optim_op

    def counting(*args):
        calls.append(len(args[0]))
        return real(*args)

    monkeypatch.setattr(toptim, "_optim_op", counting)
    C._PLANS.clear()
    st = _state("adamw_", device)
    _run("adamw_", st, 3)
    assert len(calls) == 1, "the first call builds the plan through torch.ops, the next two skip it"
    st["m"][3] = st["m"][3].clone()  # a new address
    _run("adamw_", st, 1)
    assert len(calls) == 2, "a call that does not fit its plan goes through torch.ops"


@pytest.mark.parametrize("device", DEVICES)
def test_a_tensor_subclass_goes_through_the_dispatcher(device):
    seen = []

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return super().__torch_function__(func, types, args, kwargs or {})

    C._PLANS.clear()
    st = _state("adamw_", device)
    _run("adamw_", st, 2)
    st["m"][0] = st["m"][0].as_subclass(Sub)  # the same memory: the plan's values still fit
    seen.clear()
    TRITON["adamw_"](*_args("adamw_", st, _grads(st, 2)))
    assert any("fastamp_triton.optim_" in s for s in seen), seen


@pytest.mark.parametrize("device", DEVICES)
def test_a_lazily_negated_grad_goes_through_the_dispatcher(device, monkeypatch):
    """A grad that is a negated view (``torch._neg_view``: the negation is a bit on the tensor, not in
    memory) fits a cached plan by address and size, but a direct call would read its raw memory (the
    interpreter materialises the view; a GPU kernel would not): the check declines it, the call goes
    through ``torch.ops`` (which materialises it), and the result equals the plain grads'."""
    C._PLANS.clear()
    st = _state("adamw_", device)
    twin, control = _clone(st), _clone(st)
    through_ops = []
    op = toptim._optim_op
    monkeypatch.setattr(toptim, "_optim_op", lambda *a: (through_ops.append(1), op(*a)))
    _run("adamw_", twin, 3)  # plain grads throughout
    _run("adamw_", control, 2)
    through_ops.clear()
    TRITON["adamw_"](*_args("adamw_", control, _grads(control, 2)))
    assert through_ops == [], "a plain repeated call should take the direct path"
    _run("adamw_", st, 2)  # the cached plan is now st's
    through_ops.clear()
    neg_grads = [torch._neg_view(g.neg()) for g in _grads(st, 2)]  # the same values, lazily negated
    assert all(n.is_neg() for n in neg_grads)
    TRITON["adamw_"](*_args("adamw_", st, neg_grads))
    assert through_ops == [1], "a negated view must go through torch.ops"
    for key in st:
        for a, b in zip(st[key], twin[key]):
            assert_bits_equal(a, b, key)


def test_the_built_extension_has_the_c_pass(check_path):
    from fastamp import backends

    if not backends.available("native", "adamw_", "cpu")[0]:
        pytest.skip("fastamp._C is not built")
    assert NATIVE_CHECK, "fastamp._C has no plan_grads (csrc/plan_check.cpp): rebuild the extension"


def test_the_c_pass_with_element_counts_answers_as_the_python_passes(check_path):
    """``plan_grads(..., numels)`` (the launch plans' form): True where the block fits (no grad list
    made), False for another element count or a tensor no longer contiguous (the Python passes then
    find the call does not fit), NotImplemented for numels that are not a list, an error naming the
    problem for lists of different lengths."""
    if not NATIVE_CHECK or check_path != "c":
        pytest.skip("fastamp._C has no plan_grads" if not NATIVE_CHECK else "the C function is tested on the c path")
    block = [torch.zeros(4, 3), torch.zeros(6).requires_grad_(), torch.zeros(2, 2)]
    block[1].grad = torch.ones(6)

    def ask(tensors, numels):
        ptrs = [t.data_ptr() for t in tensors]
        dtypes = [t.dtype for t in tensors]
        kinds = [None if t.grad is None else t.grad.dtype for t in tensors]
        return C._plan_grads(tensors, tensors, ptrs, dtypes, kinds, b"\x01" * len(tensors), numels)

    assert ask(block, [12, 6, 4]) is True
    assert ask(block, [12, 6, 5]) is False
    restrided = block[:2] + [block[2].t()]  # same address, count and dtype; not contiguous
    assert ask(restrided, [12, 6, 4]) is False
    assert ask(block, (12, 6, 4)) is NotImplemented
    with pytest.raises(ValueError, match="differ in length"):
        ask(block, [12, 6])
    ptrs = [t.data_ptr() for t in block]
    got = C._plan_grads(block, block, ptrs, [t.dtype for t in block], [None, torch.float32, None], b"\x01" * 3)
    assert type(got) is list and got[1] is block[1].grad, "the 6-argument form still gives the grads"


def test_the_c_pass_over_every_list_answers_as_the_python_passes(check_path):
    """``plan_lists(lists, ptrs, numels, dtypes)`` reads the lists as one sequence: True where every tensor
    has its planned address, dtype and element count and is contiguous (a ``.grad`` does not matter);
    False for any difference, in any list, or another count of tensors; NotImplemented for a subclass or
    a list of another type (the Python passes then decide); an error naming the problem for buffers of
    another length."""
    from array import array

    if check_path != "c":
        pytest.skip("the C function is tested on the c path")
    assert C._plan_lists is not None, "fastamp._C has no plan_lists (csrc/plan_check.cpp): rebuild the extension"
    params = [torch.zeros(4, 3), torch.zeros(6).requires_grad_()]
    params[1].grad = torch.ones(6)
    states = [torch.zeros(4, 3), torch.zeros(6, dtype=torch.bfloat16)]
    lists = [params, states]
    flat = params + states

    planned = (array("q", [t.data_ptr() for t in flat]), array("q", [t.numel() for t in flat]), [t.dtype for t in flat])

    def ask(lists, plan=planned):
        return C._plan_lists(lists, *plan)

    assert ask(lists) is True
    assert ask([params + states[:1], states[1:]]) is True, "the lists are one sequence"
    assert ask(lists, (planned[0], array("q", [12, 6, 12, 7]), planned[2])) is False, "another element count"
    assert ask([params, [states[0], torch.zeros(6, dtype=torch.bfloat16)]]) is False, "another address"
    assert ask([params, [states[0], states[1].view(torch.float16)]]) is False, "another dtype"
    assert ask([params, [states[0].t(), states[1]]]) is False, "not contiguous"
    assert ask([params, states[:1]]) is False and ask([params, states + states[:1]]) is False, "another count"
    assert ask([params, tuple(states)]) is NotImplemented
    params[1].data = torch.zeros(6)  # `.data = x` moves no version counter: the address tells
    assert ask(lists) is False

    class Sub(torch.Tensor):
        pass

    sub = torch.zeros(3).as_subclass(Sub)
    assert ask([[sub]], (array("q", [sub.data_ptr()]), array("q", [3]), [sub.dtype])) is NotImplemented
    with pytest.raises(ValueError, match="int64 buffers as long as dtypes"):
        C._plan_lists(lists, array("q", [0]), array("q", [0] * 4), [t.dtype for t in flat])


@pytest.fixture
def c_pass_calls(monkeypatch, check_path):
    """The calls of the C passes over the persistent lists (plan_lists: all of them; plan_grads: a block)
    and what each answered (True, or a list of grads: they fit)."""
    if check_path == "python":
        pytest.skip("the C pass of the plan check (fastamp._C.plan_lists / plan_grads) is not in use")
    answers = []

    def spy(real):
        def spying(*args):
            got = real(*args)
            answers.append(got is True or type(got) is list)
            return got

        return spying

    monkeypatch.setattr(C, "_plan_grads", spy(C._plan_grads))
    if C._plan_lists is not None:
        monkeypatch.setattr(C, "_plan_lists", spy(C._plan_lists))
    return answers


@pytest.mark.parametrize("device", DEVICES)
def test_a_repeated_call_reads_the_persistent_lists_in_the_c_pass(device, monkeypatch, c_pass_calls, check_path):
    """A repeated plain call is answered by the C pass, fitting: one call over every list (plan_lists,
    path "c") or one per block (plan_grads); the persistent lists are then known to be plain tensors (no
    type pass over them) and no Python pass of their addresses runs; nor of the grads' addresses where
    ``fastamp._C.dense_ptrs`` reads the grads."""
    C._PLANS.clear()
    st = _state("adamw_", device)
    _run("adamw_", st, 2)
    (plan,) = C._PLANS.values()
    c_pass_calls.clear()
    answers = []
    real = C._Plan.grad_ptrs
    monkeypatch.setattr(C._Plan, "grad_ptrs", lambda self, *a: answers.append(real(self, *a)) or answers[-1])
    address_passes = []
    monkeypatch.setattr(C, "_data_ptr", lambda t: address_passes.append(1) or t.data_ptr())
    _run("adamw_", st, 1)
    n_persistent = sum(len(v) for k, v in st.items())  # params, masters, moments, max moments
    assert len(plan.blocks) == -(-n_persistent // C._BLOCK)
    assert c_pass_calls == ([True] if check_path == "c" else [True] * len(plan.blocks)), c_pass_calls
    assert answers[0] is not None and answers[0][1] is True
    if check_path == "c":
        assert address_passes == [], "the grads' addresses are read in C"
    else:
        assert len(address_passes) == len(st["params"]), "only the grads' addresses are read in Python"


@pytest.mark.parametrize("device", DEVICES)
def test_a_grad_on_a_planned_tensor_changes_nothing_but_the_pass(device, guard_calls, c_pass_calls, check_path):
    """A param that gains a ``.grad`` after planning (as in an optimizer's step) keeps the plan and the
    reference's bits. plan_lists (path "c") reads no ``.grad``: it answers True. plan_grads also
    compares each planned tensor's own ``.grad`` (it reads it anyway) and answers False for that block;
    the Python passes then find the call fits."""
    C._PLANS.clear()
    st = _state("adamw_", device)
    ref = _clone(st)

    def give_grads(st):
        for p in st["params"]:
            p.grad = torch.zeros_like(p)

    _run("adamw_", st, 3, mutate=give_grads)
    _run("adamw_", ref, 3, fn=R.adamw_)
    if check_path == "c":
        assert c_pass_calls and all(c_pass_calls), "plan_lists does not read .grad"
    else:
        assert False in c_pass_calls, "the C pass must notice the new .grad"
    assert guard_calls == ["optim_"], "the plan must be kept"
    for p in st["params"]:
        p.grad = None
    _assert_same(st, ref, "cached vs reference")


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_leaf_tensor_is_read_by_the_python_passes_without_a_warning(device, capfd, c_pass_calls, guard_calls):
    """Reading the ``.grad`` of a non-leaf tensor that requires grad warns (in C++, to stderr): a block
    holding one is left to the Python passes, which give the same answers."""
    C._PLANS.clear()
    st = _state("adamw_", device)
    ref = _clone(st)
    leaf = torch.zeros_like(st["m"][0], requires_grad=True)
    nonleaf = leaf + 0  # requires grad, not a leaf
    with torch.no_grad():
        nonleaf.copy_(st["m"][0])
    st["m"][0] = nonleaf
    with torch.no_grad():
        _run("adamw_", st, 3)
    _run("adamw_", ref, 3, fn=R.adamw_)
    assert guard_calls == ["optim_"]
    assert "not a leaf" not in capfd.readouterr().err
    with torch.no_grad():
        st["m"][0] = st["m"][0].detach()
    _assert_same(st, ref, "cached vs reference")


@pytest.fixture
def guard_checks(monkeypatch, check_path):
    """What each grads' guard (``TensorGuards``) of a direct call answered."""
    if check_path != "c-guards" or C._TensorGuards is None:
        pytest.skip("the grads' guards are not in use")
    answers = []
    real = C._guard_of

    class Spy:
        def __init__(self, guard):
            self.guard = guard

        def check(self, *grads):
            answers.append(self.guard.check(*grads))
            return answers[-1]

    monkeypatch.setattr(C, "_guard_of", lambda block: (lambda g: None if g is None else Spy(g))(real(block)))
    return answers


class _Sub(torch.Tensor):
    pass


GRAD_CHANGES = {
    "other-dtype": lambda g: g.to(F16 if g.dtype != F16 else F32),
    "strided": lambda g: g.t().contiguous().t(),  # the same shape, column-major: not contiguous
    "negated-view": lambda g: torch._neg_view(g.neg()),
    "requires-grad": lambda g: g.detach().requires_grad_(),
    "subclass": lambda g: g.as_subclass(_Sub),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", list(GRAD_CHANGES))
def test_a_grad_unlike_the_guarded_ones_is_read_by_the_python_passes(device, change, guard_checks, monkeypatch):
    """From the third call on, a direct call's grads are answered by their guards; a grad unlike the
    guarded ones (dtype, strides, a negated view, requires_grad, a subclass) fails its guard and the
    Python passes decide, as without guards: the bits are those of a fresh launch, and a call that
    does not fit the plan or holds a subclass goes through the dispatcher."""
    C._PLANS.clear()
    st = _state("adamw_", device)
    fresh = _clone(st)
    through_ops = []
    op = toptim._optim_op
    monkeypatch.setattr(toptim, "_optim_op", lambda *a: (through_ops.append(1), op(*a)))
    _run("adamw_", st, 3)
    assert guard_checks and all(guard_checks), "the third call's grads must be answered by their guards"
    guard_checks.clear()
    through_ops.clear()
    grads = _grads(st, 3)
    grads[4] = GRAD_CHANGES[change](grads[4])  # the 2-D one
    with torch.no_grad():
        TRITON["adamw_"](*_args("adamw_", st, grads))
    assert False in guard_checks, "the changed grad must fail its guard"
    assert through_ops == ([] if change == "requires-grad" else [1]), through_ops
    _run("adamw_", fresh, 3, cached=False)
    C._PLANS.clear()
    with torch.no_grad():
        TRITON["adamw_"](*_args("adamw_", fresh, grads))
    _assert_same(st, fresh, f"{change}: cached vs fresh")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_strided_grads_are_read_from_copies_that_outlive_the_launch(op, device):
    """A call with non-contiguous grads launches on contiguous copies of them; the copies must stay
    alive until the kernels are launched (freed earlier, their memory went to the next allocations:
    every such call read garbage under the interpreter)."""
    C._PLANS.clear()
    st = _state(op, device)
    ref = _clone(st)
    for k in range(2):
        grads = [g.t().contiguous().t() if g.dim() == 2 else g.repeat_interleave(2)[::2] for g in _grads(st, k)]
        assert not any(g.is_contiguous() for g in grads if g.numel() > 1)
        TRITON[op](*_args(op, st, grads))
        getattr(R, op)(*_args(op, ref, grads))
    _assert_same(st, ref, "strided grads vs reference")


GRAD_CASES = {
    **GRAD_CHANGES,
    "plain": lambda g: g,
    "misaligned": lambda g: misaligned(g.flatten()).view(g.shape),
    "sparse": lambda g: g.to_sparse(),
    "one-element-short": lambda g: g.flatten()[:-1],
    "parameter": lambda g: torch.nn.Parameter(g, requires_grad=False),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", list(GRAD_CASES))
def test_the_c_read_of_the_grads_answers_what_the_python_passes_answer(device, change, check_path, monkeypatch):
    """``fastamp._C.dense_ptrs`` (path "c") gives a repeated call's grad addresses, or None, exactly
    where the guards and Python passes would: the same plan and lists are checked both ways."""
    if check_path != "c":
        pytest.skip("fastamp._C.dense_ptrs is not in use")
    C._PLANS.clear()
    st = _state("adamw_", device)
    _run("adamw_", st, 2)
    seen = []
    real = C._Plan.grad_ptrs
    monkeypatch.setattr(C._Plan, "grad_ptrs", lambda self, *a: seen.append((self, a)) or real(self, *a))
    _run("adamw_", st, 1)
    monkeypatch.setattr(C._Plan, "grad_ptrs", real)
    plan, (persistent, _, device_, direct) = seen[-1]
    grads = _grads(st, 3)
    grads[4] = GRAD_CASES[change](grads[4])  # the 2-D one

    def answer(got):  # the addresses as a list (dense_ptrs gives an array('q'), the passes a list)
        return None if got is None else (list(got[0]), got[1])

    native = answer(plan.grad_ptrs(persistent, grads, device_, direct))
    monkeypatch.setattr(C, "_dense_ptrs", None)
    python = answer(plan.grad_ptrs(persistent, grads, device_, direct))
    assert native == python
    if change in ("plain", "requires-grad", "parameter"):
        assert native is not None and native[0] == [g.data_ptr() for g in grads]
