"""The persistent tables of the native CPU ``adamw_`` (csrc/cpu/adamw_table.h) that optimizer plans reuse.

A table holds a launch's params and states; each run takes new grads. It must give the op's
bits, and decline (NotImplemented, nothing written) whatever it cannot vouch for, so that the
caller's list path (the op itself) runs instead.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastamp
from fastamp import functional
from fastamp.optim import AdamW

NATIVE = fastamp.backends.available("native", "adamw_", "cpu")[0]
pytestmark = pytest.mark.skipif(not NATIVE or functional._TABLE_RUN is None, reason="needs fastamp._C with adamw_table")
HYPER = (0.9, 0.999, 1e-8)


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
    table = functional._adamw_table(ours[0], ours[2], ours[3], ours[4], ours[5], amsgrad)
    assert table is not None
    for step in range(3):
        sc = _scalars(len(ref[0]), rows) * (step + 1)
        grads = [g * (step + 1) for g in ref[1]]
        torch.ops.fastamp.adamw_(ref[0], grads, *ref[2:], sc, torch.zeros(1), *HYPER, amsgrad, maximize)
        got = functional._TABLE_RUN(table, [g.clone() for g in grads], sc, torch.zeros(1), *HYPER, amsgrad, maximize)
        assert got is None
        for a, b in zip(ref, ours):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


def test_found_inf_skips_a_table_run():
    lists = _lists()
    before = _clone(lists)
    table = functional._adamw_table(lists[0], [], lists[3], lists[4], [], False)
    assert functional._TABLE_RUN(table, lists[1], _scalars(5, True), torch.ones(1), *HYPER, False, False) is None
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
    _grad_of_two_dtypes,
    _grad_fp64,
    _grad_missing,
    _grad_requires_grad,
    _grad_not_a_tensor,
]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__.lstrip("_") for c in CHANGES])
def test_a_table_declines_what_it_cannot_vouch_for_and_writes_nothing(change):
    lists = _lists()
    table = functional._adamw_table(lists[0], [], lists[3], lists[4], [], False)
    grads = list(lists[1])
    change(lists, grads)
    before = [[t.clone() for t in lst] for lst in (lists[0], lists[3], lists[4])]
    with torch.enable_grad():
        got = functional._TABLE_RUN(table, grads, _scalars(5, True), torch.zeros(1), *HYPER, False, False)
    assert got is NotImplemented
    for a, b in zip((lists[0], lists[3], lists[4]), before):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_table_declines_under_a_dispatch_mode_and_other_arguments():
    lists = _lists()
    table = functional._adamw_table(lists[0], [], lists[3], lists[4], [], False)
    sc = _scalars(5, True)

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watch():
        assert functional._TABLE_RUN(table, lists[1], sc, None, *HYPER, False, False) is NotImplemented
    assert functional._TABLE_RUN(table, lists[1], sc, None, *HYPER, True, False) is NotImplemented  # amsgrad
    assert functional._TABLE_RUN(table, lists[1], sc[:2], None, *HYPER, False, False) is NotImplemented  # rows
    assert functional._TABLE_RUN(object(), lists[1], sc, None, *HYPER, False, False) is NotImplemented
    assert functional._TABLE_RUN(table, lists[1], sc, None, *HYPER, False, False) is None


def test_a_table_is_refused_for_what_the_op_refuses():
    lists = _lists()
    assert functional._adamw_table(lists[0], [], lists[3][:-1], lists[4], [], False) is None  # lengths
    assert functional._adamw_table(lists[0], [], [m.double() for m in lists[3]], lists[4], [], False) is None
    strided = [torch.randn(2 * p.numel())[::2] for p in lists[0]]
    assert functional._adamw_table(strided, [], lists[3], lists[4], [], False) is None
    assert functional._adamw_table(lists[0], [], lists[3], lists[4], [], False) is not None
    assert functional._adamw_table([], [], [], [], [], False) is None


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
