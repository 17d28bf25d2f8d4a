"""The steady-state check of the cached launch plan: each change it must notice, on both of its paths.

A step that reuses its plan (``FusedOptimizer._gather``) checks every param group in one call
of ``fastamp._C.plan_grads`` and ``same_items`` (csrc/plan_check.cpp) where the extension has
them, else in C-level passes in Python (``_GroupPlan.gather``, ``grads_fit``, ``_all_hold``).
Every test here runs on both paths: after two steady steps, one change, and ``_gather`` must
refuse the plan (None: the next step validates and plans from scratch), or keep it and return
the grads themselves. Steps after each change are compared with a fresh plan in
tests/api/test_step_plan.py (run here on the Python path too).
"""

import pytest
import test_step_plan
import torch

import fastamp
from fastamp.optim import SGD, AdamW
from fastamp.optim.engine import plan as _plan

NATIVE = fastamp.backends.available("native", "optim_", "cpu")[0]
PATHS = ["python"] + (["native"] if _plan._plan_grads is not None else [])


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(_plan, "_plan_grads", None)
        monkeypatch.setattr(_plan, "_same_items", None)
    return request.param


def test_the_built_extension_has_the_plan_checks():
    if not NATIVE:
        pytest.skip("fastamp._C is not built")
    assert _plan._plan_grads is not None and _plan._same_items is not None, (
        "fastamp._C has no plan_grads/same_items (csrc/plan_check.cpp): rebuild the extension"
    )


def _steady(cls=AdamW, **kw):
    """Two groups (fp32 2-D, bf16, fp32 1-D), two steps: the plan is in place."""
    g = torch.Generator().manual_seed(0)
    params = [
        torch.randn(4, 3, generator=g).requires_grad_(),
        torch.randn(6, generator=g).bfloat16().requires_grad_(),
        torch.randn(5, generator=g).requires_grad_(),
    ]
    opt = cls([{"params": params[:2]}, {"params": params[2:]}], lr=0.01, backend="torch", **kw)
    for _ in range(2):
        _new_grads(params)
        opt.step()
    _new_grads(params)
    assert opt._plan is not None
    return params, opt


def _new_grads(params):
    for p in params:
        p.grad = torch.randn_like(p)


def _fits(opt):
    got = opt._gather(opt._plan)
    if got is None:
        return False
    want = [[p.grad for p in group["params"]] for group in opt.param_groups]
    assert [list(map(id, g)) for g in got] == [list(map(id, g)) for g in want], "the grads are not the params' grads"
    return True


def test_an_unchanged_step_keeps_the_plan_and_takes_the_grads_themselves(path):
    params, opt = _steady()
    assert _fits(opt)
    opt.step()
    _new_grads(params)
    assert _fits(opt), "new grad tensors of the same kind must keep the plan"


def _replace_param(opt, params):
    opt.param_groups[0]["params"][1] = torch.zeros(6, dtype=torch.bfloat16, requires_grad=True)


def _rebind_storage(opt, params):
    params[0].data = params[0].data.clone()


def _view_as_other_dtype(opt, params):
    params[1].data = params[1].data.view(torch.float16)  # same address, another dtype


def _lose_grad(opt, params):
    params[2].grad = None


def _grad_of_other_dtype(opt, params):
    params[1].grad.data = params[1].grad.data.float()  # .data bypasses the grad setter's dtype check


def _strided_grad(opt, params):
    params[0].grad = torch.randn(3, 4).t()


def _sparse_grad(opt, params):
    params[2].grad = torch.sparse_coo_tensor([[0]], [1.0], (5,))


def _replace_moment(opt, params):
    opt.state[params[1]]["exp_avg"] = opt.state[params[1]]["exp_avg"].clone()


def _replace_master(opt, params):
    opt.state[params[1]]["master_param"] = opt.state[params[1]]["master_param"].clone()  # the last key checked


def _remove_moment(opt, params):
    del opt.state[params[2]]["exp_avg_sq"]


def _replace_step(opt, params):
    opt.state[params[0]]["step"] = opt.state[params[0]]["step"].clone()


def _write_step(opt, params):
    opt.state[params[0]]["step"].zero_()


CHANGES = [
    _replace_param,
    _rebind_storage,
    _view_as_other_dtype,
    _lose_grad,
    _grad_of_other_dtype,
    _strided_grad,
    _sparse_grad,
    _replace_moment,
    _replace_master,
    _remove_moment,
    _replace_step,
    _write_step,
]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__.lstrip("_") for c in CHANGES])
def test_each_change_refuses_the_plan(path, change):
    params, opt = _steady()
    assert _fits(opt)
    change(opt, params)
    assert opt._gather(opt._plan) is None, f"{change.__name__} kept the plan"


def test_a_grad_that_appears_refuses_the_plan(path):
    params, opt = _steady()
    params[1].grad = None
    opt.step()  # plans without it
    _new_grads(params[:1] + params[2:])
    assert _fits(opt)
    params[1].grad = torch.randn_like(params[1])
    assert opt._gather(opt._plan) is None


def test_a_strided_grad_keeps_its_plan_strided_or_not(path):
    params, opt = _steady()
    params[0].grad = torch.randn(3, 4).t()
    opt.step()  # plans a contiguous copy of this grad
    for grad in (torch.randn(3, 4).t(), torch.randn(4, 3)):
        _new_grads(params[1:])
        params[0].grad = grad
        got = opt._gather(opt._plan)
        assert got is not None, "a planned-strided grad must keep the plan"
        assert got[0][0].is_contiguous() and torch.equal(got[0][0], grad)  # the copy the kernels read
        assert got[0][1] is params[1].grad
        opt.step()


def test_params_in_a_tuple_are_checked_on_the_python_path(path):
    """The native check takes lists; any other sequence is answered by the Python passes."""
    params, opt = _steady()
    opt.param_groups[1]["params"] = tuple(opt.param_groups[1]["params"])
    assert _fits(opt)


def test_sgd_without_momentum_state(path):
    params, opt = _steady(SGD)  # no state at all: only the grads are checked
    assert _fits(opt)
    _lose_grad(opt, params)
    assert opt._gather(opt._plan) is None


@pytest.mark.parametrize("config", ["adamw", "adamw_remainder_sr_bf16_state", "sgd_momentum"])
def test_python_path_matches_planning_every_step(monkeypatch, config):
    monkeypatch.setattr(_plan, "_plan_grads", None)
    monkeypatch.setattr(_plan, "_same_items", None)
    test_step_plan.test_cached_plan_matches_planning_every_step(config, "torch")


# --- the scaler's first read of the grads (fastamp/scaler/grad_check._plain_grads) -------------
# ``fastamp._C.param_grads`` answers in one C loop what the Python passes answer: each case is
# run on both and must give the same params, positions and grad objects (or None: the per-grad
# path then runs, and raises its own errors).


class _Sub(torch.Tensor):
    pass


def _grad_cases():
    def mk(n=4):
        return [torch.randn(3).requires_grad_() for _ in range(n)]

    def all_grads():
        ps = mk()
        for p in ps:
            p.grad = torch.randn(3)
        return ps

    def some_missing():
        ps = all_grads()
        ps[0].grad = ps[2].grad = None
        return ps

    def none_at_all():
        return mk()

    def fp16_grad():
        ps = all_grads()
        ps[1] = ps[1].detach().half().requires_grad_()
        ps[1].grad = torch.randn(3).half()
        return ps

    def parameter_grad():  # a grad that is an nn.Parameter is not `type(g) is Tensor`
        ps = all_grads()
        ps[2].grad = torch.nn.Parameter(torch.randn(3), requires_grad=False)
        return ps

    def subclass_grad():
        ps = all_grads()
        ps[3].grad = torch.randn(3).as_subclass(_Sub)
        return ps

    def subclass_param():  # the C loop declines: a subclass may override .grad
        ps = all_grads()
        q = torch.randn(3).as_subclass(_Sub).requires_grad_()
        q.grad = torch.randn(3)
        return [*ps, q]

    def nn_parameters():
        ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
        for p in ps:
            p.grad = torch.randn(3)
        return ps

    return [
        all_grads,
        some_missing,
        none_at_all,
        fp16_grad,
        parameter_grad,
        subclass_grad,
        subclass_param,
        nn_parameters,
    ]


class _Holder:
    def __init__(self, params):
        self.param_groups = [{"params": params[:2]}, {"params": params[2:]}]


@pytest.mark.parametrize("case", _grad_cases(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("allow_fp16", [False, True])
def test_param_grads_answers_what_the_python_passes_answer(case, allow_fp16, monkeypatch):
    from fastamp.scaler import grad_check

    if grad_check._PARAM_GRADS is None:
        pytest.skip("fastamp._C is not built")
    holder = _Holder(case())
    native = grad_check._plain_grads(holder, allow_fp16)
    monkeypatch.setattr(grad_check, "_PARAM_GRADS", None)
    python = grad_check._plain_grads(holder, allow_fp16)
    if python is None:
        assert native is None
        return
    assert native is not None
    for a, b in zip(native, python, strict=True):
        if a is None or b is None:
            assert a is b
        else:
            assert len(a) == len(b) and all(x is y for x, y in zip(a, b))


def test_param_grads_declines_what_is_not_a_list_of_plain_tensors():
    from fastamp.scaler import grad_check

    if grad_check._PARAM_GRADS is None:
        pytest.skip("fastamp._C is not built")
    p = torch.randn(2).requires_grad_()
    assert grad_check._PARAM_GRADS((p,)) is NotImplemented
    assert grad_check._PARAM_GRADS([p, 1.0]) is NotImplemented
    assert grad_check._PARAM_GRADS([]) == ([], True, False)
    with pytest.raises(TypeError, match="takes 1 argument"):
        grad_check._PARAM_GRADS([p], [p])
