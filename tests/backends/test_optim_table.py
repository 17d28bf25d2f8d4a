"""The persistent tables of the native CPU ``optim_`` (csrc/cpu/optim_table.h) that optimizer plans reuse.

A table holds a launch's params, masters and states, for any rule and any master and state format;
each run takes new grads (and step scalars, rng, hyperparameters). It must give the op's bits, and
decline (NotImplemented, nothing written) whatever it cannot vouch for, so that the caller's list
path (the op itself) runs instead.
"""

import pytest
import torch
from helpers import assert_bits_equal, clone_lists, optim_args
from test_native_cpu_optim import make_call
from torch.utils._python_dispatch import TorchDispatchMode

import fastamp
from fastamp import functional
from fastamp.optim import AdamW
from fastamp.reference import optim as R

NATIVE = fastamp.backends.available("native", "optim_", "cpu")[0]
pytestmark = pytest.mark.skipif(not NATIVE or functional._TABLE_RUN is None, reason="needs fastamp._C with optim_table")
HYPER = (0.9, 0.999, 1e-8)


def _table(lists, amsgrad=False):
    """The table of adamw_'s lists (params, grads, masters, m, v, vmax) as optim_ takes them."""
    states = [*lists[3], *lists[4], *(lists[5] if amsgrad else [])]
    return functional._optim_table(lists[0], lists[2], states, "adamw", R.AMSGRAD if amsgrad else 0)


def _run(table, grads, sc, found_inf, amsgrad=False, maximize=False, hyper=HYPER, rule="adamw"):
    """The table run of adamw_'s arguments (as optim_ takes them)."""
    flags = (R.AMSGRAD if amsgrad else 0) | (R.MAXIMIZE if maximize else 0)
    return functional._TABLE_RUN(table, grads, sc, found_inf, None, 0, rule, list(hyper), flags)


def _lists(n=5, dtype=torch.float32, master=False, amsgrad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 7, 300, 16384 + 5, 33][:n]
    params = [torch.randn(s, generator=g).to(dtype) for s in sizes]
    grads = [torch.randn(s, generator=g).to(dtype) for s in sizes]
    masters = [p.float() for p in params] if master else []
    m = [torch.randn(s, generator=g) * 0.1 for s in sizes]
    v = [torch.rand(s, generator=g) * 0.1 for s in sizes]
    vmax = [x * 2 for x in v] if amsgrad else []
    return params, grads, masters, m, v, vmax


def _clone(lists):
    return tuple([t.clone() for t in lst] for lst in lists)


def _scalars(n, rows):
    base = torch.tensor([1e-3, 0.99, 0.9999, 0.5])
    if not rows:
        return base
    return base * torch.linspace(0.5, 1.5, n).unsqueeze(1)


@pytest.mark.parametrize("rows", [False, True], ids=["shared", "rows"])
@pytest.mark.parametrize("layout", ["fp32", "bf16_master", "fp16_master_amsgrad", "fp32_maximize"], ids=lambda s: s)
def test_a_table_run_gives_the_op_s_bits(layout, rows):
    dtype = {"fp32": torch.float32, "bf16_master": torch.bfloat16, "fp16_master_amsgrad": torch.float16}.get(
        layout, torch.float32
    )
    master, amsgrad, maximize = "master" in layout, "amsgrad" in layout, "maximize" in layout
    ref = _lists(dtype=dtype, master=master, amsgrad=amsgrad)
    ours = _clone(ref)
    table = _table(ours, amsgrad)
    assert table is not None
    for step in range(3):
        sc = _scalars(len(ref[0]), rows) * (step + 1)
        grads = [g * (step + 1) for g in ref[1]]
        adamw = (ref[0], grads, *ref[2:], sc, torch.zeros(1), *HYPER, amsgrad, maximize)
        torch.ops.fastamp.optim_(*optim_args("adamw_", adamw))
        got = _run(table, [g.clone() for g in grads], sc, torch.zeros(1), amsgrad, maximize)
        assert got is None
        for a, b in zip(ref, ours):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


def test_found_inf_skips_a_table_run():
    lists = _lists()
    before = _clone(lists)
    table = _table(lists)
    assert _run(table, lists[1], _scalars(5, True), torch.ones(1)) is None
    for a, b in zip(lists, before):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _state_rebound(lists, grads):
    lists[3][2].data = lists[3][2].data.clone()  # another storage: the table would update the old one


def _state_resized(lists, grads):
    lists[4][1].resize_(3)


def _state_viewed_as_int(lists, grads):
    lists[3][0].data = lists[3][0].data.view(torch.int32)


def _param_rebound(lists, grads):
    lists[0][4].data = torch.zeros(33)


def _grad_too_short(lists, grads):
    grads[2] = grads[2][:-1]


def _grad_strided(lists, grads):
    grads[3] = torch.randn(2 * grads[3].numel())[::2]


def _grad_of_two_dtypes(lists, grads):
    grads[1] = grads[1].bfloat16()


def _grad_fp64(lists, grads):
    grads[:] = [g.double() for g in grads]


def _grad_missing(lists, grads):
    grads.pop()


def _grad_requires_grad(lists, grads):
    grads[0] = grads[0].clone().requires_grad_()


def _grad_not_a_tensor(lists, grads):
    grads[1] = 1.0


CHANGES = [
    _state_rebound,
    _state_resized,
    _state_viewed_as_int,
    _param_rebound,
    _grad_too_short,
    _grad_strided,
    _grad_fp64,
    _grad_missing,
    _grad_requires_grad,
    _grad_not_a_tensor,
]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__.lstrip("_") for c in CHANGES])
def test_a_table_declines_what_it_cannot_vouch_for_and_writes_nothing(change):
    lists = _lists()
    table = _table(lists)
    grads = list(lists[1])
    change(lists, grads)
    before = [[t.clone() for t in lst] for lst in (lists[0], lists[3], lists[4])]
    with torch.enable_grad():
        got = _run(table, grads, _scalars(5, True), torch.zeros(1))
    assert got is NotImplemented
    for a, b in zip((lists[0], lists[3], lists[4]), before):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_table_takes_grads_of_several_dtypes_as_the_op_does():
    """One grad of another dtype: the op takes it (a kernel per tensor), and the table gives the op's bits."""
    lists = _lists()
    ours = _clone(lists)
    table = _table(ours)
    grads = list(lists[1])
    _grad_of_two_dtypes(lists, grads)
    sc = _scalars(5, True)
    torch.ops.fastamp.optim_(*optim_args("adamw_", (lists[0], grads, *lists[2:], sc, None, *HYPER, False, False)))
    assert _run(table, grads, sc, None) is None
    for a, b in zip(lists, ours):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_table_declines_under_a_dispatch_mode_and_other_arguments():
    lists = _lists()
    table = _table(lists)
    sc = _scalars(5, True)

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watch():
        assert _run(table, lists[1], sc, None) is NotImplemented
    assert _run(table, lists[1], sc, None, amsgrad=True) is NotImplemented  # amsgrad
    assert _run(table, lists[1], sc[:2], None) is NotImplemented  # rows
    assert _run(object(), lists[1], sc, None) is NotImplemented
    assert _run(table, lists[1], sc, None, rule="lion", hyper=(0.9, 0.99)) is NotImplemented  # another rule
    assert _run(table, lists[1], sc, None, hyper=(0.9, 0.999)) is NotImplemented  # hyper of another length
    assert _run(table, lists[1], sc, None) is None


def test_a_table_is_refused_for_what_the_op_refuses():
    lists = _lists()
    assert _table([lists[0], None, [], lists[3][:-1], lists[4], []]) is None  # lengths
    assert _table([lists[0], None, [], [m.double() for m in lists[3]], lists[4], []]) is None
    strided = [torch.randn(2 * p.numel())[::2] for p in lists[0]]
    assert _table([strided, None, [], lists[3], lists[4], []]) is None
    assert _table(lists) is not None
    assert _table([[], None, [], [], [], []]) is None
    assert functional._optim_table(lists[0], [], [*lists[3], *lists[4]], "adam", 0) is None  # unknown rule
    assert functional._optim_table(lists[0], [], [*lists[3], *lists[4]], "adamw", R.NESTEROV) is None  # flags


@pytest.mark.parametrize(
    "variant,fmt",
    [(v, f) for v in ("adamw-amsgrad-maximize", "sgd-nesterov-wd", "lion") for f in ("fp32", "bf16", "q8")]
    + [("sgd-no-momentum", "fp32")],
)
@pytest.mark.parametrize("master", ["none", "fp32", "remainder", "ulp8"])
def test_every_rule_and_format_through_a_table_gives_the_op_s_bits(variant, master, fmt):
    """Three steps of the op and of a table of the same tensors (SR flags, per-tensor step scalars, mixed
    param and grad dtypes, several chunks): the same bits after each."""
    specs = [(n, p, g) for n, (p, g) in zip((40, 16385, 1, 7), [(p, g) for p in (torch.bfloat16, torch.float16)
                                                                for g in (torch.float32, torch.bfloat16)])]  # fmt: skip
    if master == "remainder":
        specs = [(n, torch.bfloat16, g) for n, _, g in specs]
    args = make_call(variant, master, fmt, R.SR_PARAM | R.SR_STATE, 9, specs=specs, rows=True)
    ref = clone_lists((args[0], args[2], args[3]))
    ours = clone_lists((args[0], args[2], args[3]))
    rule, hyper, flags = args[8], args[9], args[10]
    table = functional._optim_table(ours[0], ours[1], ours[2], rule, flags)
    assert table is not None
    for step in range(3):
        grads = [g * (step + 1) for g in args[1]]
        sc = args[4] * (1 + 0.25 * step)
        rng = args[6] + torch.tensor([0, step])
        torch.ops.fastamp.optim_(ref[0], grads, ref[1], ref[2], sc, torch.zeros(1), rng, 4, rule, hyper, flags)
        got = functional._TABLE_RUN(table, [g.clone() for g in grads], sc, torch.zeros(1), rng, 4, rule, hyper, flags)
        assert got is None
        for a, b in zip(ref, ours):
            for x, y in zip(a, b):
                assert_bits_equal(y, x, f"{variant} {master} {fmt} step {step}")


def test_a_table_declines_another_number_of_states():
    """SGD's momentum zero where the table's was not (or the reverse), AMSGRAD off where it was on."""
    args = make_call("sgd-nesterov-wd", "fp32", "fp32", 0, 1, specs=[(9, torch.float32, torch.float32)])
    table = functional._optim_table(args[0], args[2], args[3], "sgd", args[10])
    sc = args[4]
    assert functional._TABLE_RUN(table, args[1], sc, None, None, 0, "sgd", [0.0, 0.0, 0.1], 0) is NotImplemented
    assert functional._TABLE_RUN(table, args[1], sc, None, None, 0, "sgd", [0.9, 0.0, 0.1], 0) is None
    plain = make_call("sgd-no-momentum", "fp32", "fp32", 0, 1, specs=[(9, torch.float32, torch.float32)])
    table = functional._optim_table(plain[0], plain[2], plain[3], "sgd", 0)
    assert functional._TABLE_RUN(table, plain[1], sc, None, None, 0, "sgd", [0.9, 0.0, 0.1], 0) is NotImplemented
    assert functional._TABLE_RUN(table, plain[1], sc, None, None, 0, "sgd", [0.0, 0.0, 0.1], 0) is None
    lists = _lists(amsgrad=True)
    table = _table(lists, amsgrad=True)
    assert _run(table, lists[1], _scalars(5, True), None, amsgrad=False) is NotImplemented
    assert _run(table, lists[1], _scalars(5, True), None, amsgrad=True) is None


def _train(backend_tables: bool, monkeypatch, change=None, steps=4):
    if not backend_tables:
        monkeypatch.setattr(functional, "_TABLE_RUN", None)
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=g).requires_grad_() for s in (3, 300, 40)]
    params.append(torch.randn(50, generator=g).bfloat16().requires_grad_())
    opt = AdamW(params, lr=1e-2, backend="native", amsgrad=True)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        if change is not None and step == 2:
            change(opt, params)
        opt.step()
    tables = [run.table for gp in opt._plan.groups for b in gp.buckets for run in b.runs.values()]
    monkeypatch.undo()
    return params, opt, tables


def _rebind_moment(opt, params):
    st = opt.state[params[1]]
    st["exp_avg"].data = st["exp_avg"].data.clone()


@pytest.mark.parametrize("change", [None, _rebind_moment], ids=["steady", "moment_rebound"])
def test_an_optimizer_step_through_its_tables_gives_the_list_path_s_bits(monkeypatch, change):
    with_tables, opt_a, tables = _train(True, monkeypatch, change)
    without, opt_b, none = _train(False, monkeypatch, change)
    assert all(t is not None and t is not False for t in tables), tables
    assert all(t is False for t in none)
    for p, q in zip(with_tables, without):
        assert torch.equal(p, q)
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), key
