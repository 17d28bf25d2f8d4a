"""Hyperparameters whose per-step fp32 scalars overflow are refused before anything changes.

``fastamp.optim.AdamW`` rounds ``[lr / (1 - beta1**count), sqrt(1 - beta2**count),
1 - lr * weight_decay, grad_mul]`` (fp64) to fp32 once per step
(:func:`fastamp.reference.adamw_step_scalars`). An lr inside fp32's range can still make the
step size inf (``lr=1e38``: ``1e38 / 0.1``), and the step then wrote inf into the params;
torch.optim.AdamW raises "value cannot be converted to type float without overflow" there,
after its weight decay already changed the params. Here such a value is refused wherever it
enters (construction, ``add_param_group``, ``load_state_dict``, a group edited between eager
or compiled steps, a new tensor lr put into a group) with params, grads and state
bit-identical. SGD's step scalars cannot overflow for any accepted value (checked below).
Where a tensor lr's value is not read (written in place after it was checked: a host read per
step, a sync on a device; any tensor lr inside a compiled step) the tests say what happens.
"""

import math
import re

import pytest
import torch
from helpers import bits, cuda_syncs_raise, requires_cuda
from torch._dynamo.testing import CompileCounter

import fastamp
from fastamp import reference
from fastamp.optim import SGD, AdamW

FP32_MAX = float(torch.finfo(torch.float32).max)
# fp64 values from here on round to fp32 inf (halfway to 2**128; ties-to-even goes up)
FP32_OVERFLOW = 2.0**128 - 2.0**103
BACKENDS = [b for b in ("native", "torch") if fastamp.backends.available(b, "optim_", "cpu")[0]]
STEP_SIZE = "step size lr / \\(1 - beta1\\)"
DECAY = "decay factor 1 - lr \\* weight_decay"


def _params():
    g = torch.Generator().manual_seed(3)
    bf = [torch.nn.Parameter(torch.randn(n, generator=g).bfloat16()) for n in (7, 33)]
    return bf + [torch.nn.Parameter(torch.randn(5, generator=g))]


def _set_grads(params, i):
    g = torch.Generator().manual_seed(100 + i)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _world(cls, backend, lr=1e-3, **kw):
    """bf16 params with fp32 masters in group 0, an fp32 param in group 1 (a tensor lr of its own), after two
    real steps."""
    params = _params()
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    if isinstance(lr, torch.Tensor):
        groups[1]["lr"] = lr.clone()
    opt = cls(groups, lr=lr, backend=backend, **kw)
    for i in range(2):
        _set_grads(params, i)
        opt.step()
    _set_grads(params, 2)
    return params, opt


def _snapshot(opt, params):
    out = {f"p{i}": bits(p) for i, p in enumerate(params)}
    out.update({f"g{i}": bits(p.grad) for i, p in enumerate(params)})
    for i, p in enumerate(params):
        for k, v in opt.state[p].items():
            out[f"s{i}.{k}"] = bits(v)
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} changed"


def _refusal(err):
    """The type name and message of what a step raised. dynamo (torch 2.13) hands an error of a traced step
    on as InternalTorchDynamoError("ValueError: ...") without a cause; issue 20 tracks that separately."""
    if isinstance(err, torch._dynamo.exc.InternalTorchDynamoError):
        name, _, message = str(err).partition(": ")
        return name, message
    return type(err).__name__, str(err)


# ---- construction, add_param_group, load_state_dict ----------------------------------------

REFUSED_AT_CONSTRUCTION = [
    (dict(lr=1e38), STEP_SIZE),  # 1e38 / (1 - 0.9) = 1e39
    (dict(lr=torch.tensor(1e38)), STEP_SIZE),  # a tensor lr's value is read where it is given
    (dict(lr=1e27, betas=(1 - 2.0**-40, 0.999)), STEP_SIZE),  # 1e27 * 2**40 ~ 1.1e39
    (dict(lr=1e20, weight_decay=1e20), DECAY),  # 1 - 1e40
]


@pytest.mark.parametrize("kw, message", REFUSED_AT_CONSTRUCTION, ids=["lr", "tensor-lr", "beta1", "weight_decay"])
def test_adamw_refuses_overflowing_step_scalars_where_they_enter(kw, message):
    p, q = _params()[:2]
    with pytest.raises(ValueError, match=f"AdamW: .*{message} = .* overflows float32"):
        AdamW([p], **kw)

    params, opt = _world(AdamW, None)
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match=f"{message}.*\\(in param group 2\\)"):
        opt.add_param_group({"params": [q], **kw})
    assert len(opt.param_groups) == 2

    saved = opt.state_dict()
    saved["param_groups"][1].update(kw)
    with pytest.raises(ValueError, match=f"{message}.*\\(in loaded param group 1\\)"):
        opt.load_state_dict(saved)
    _assert_same(before, _snapshot(opt, params))
    assert opt.param_groups[1]["lr"] == 1e-3


def test_the_limit_is_where_fp32_rounding_overflows():
    """Accepted up to the last lr (weight_decay) whose fp32 scalar is finite, refused from the first that rounds
    to inf; the ground truth is reference.adamw_step_scalars itself at a first step (count 1)."""
    one = torch.ones(())
    # beta1 = 0.5: lr / (1 - beta1) = 2 * lr exactly, so the limit is FP32_OVERFLOW / 2 exactly
    last, first = math.nextafter(FP32_OVERFLOW / 2, 0.0), FP32_OVERFLOW / 2
    assert torch.isfinite(reference.adamw_step_scalars(last, one, 0.5, 0.999, 0.0)).all()
    assert torch.isinf(reference.adamw_step_scalars(first, one, 0.5, 0.999, 0.0)[0])
    p = torch.nn.Parameter(torch.ones(3))
    AdamW([p], lr=last, betas=(0.5, 0.999), weight_decay=0.0)
    with pytest.raises(ValueError, match=STEP_SIZE):
        AdamW([p], lr=first, betas=(0.5, 0.999), weight_decay=0.0)
    # lr = 2, beta1 = 0: 1 - 2 * weight_decay, the 1 below half an fp64 ulp
    assert torch.isfinite(reference.adamw_step_scalars(2.0, one, 0.0, 0.999, last)).all()
    assert torch.isinf(reference.adamw_step_scalars(2.0, one, 0.0, 0.999, first)[2])
    AdamW([p], lr=2.0, betas=(0.0, 0.999), weight_decay=last)
    with pytest.raises(ValueError, match=DECAY):
        AdamW([p], lr=2.0, betas=(0.0, 0.999), weight_decay=first)
    # a later step has a larger bias correction: checking the first step's covers every count
    s = reference.adamw_step_scalars(last, torch.tensor(1000.0), 0.5, 0.999, 0.0)
    assert torch.isfinite(s).all()


def test_sgd_step_scalars_are_finite_for_every_accepted_value():
    """SGD has no bias correction: its scalars (lr, grad_mul, is_first) and kernel constants (momentum,
    1 - dampening, weight_decay, in fp32) are finite for every value its range checks accept."""
    p = torch.nn.Parameter(torch.ones(3))
    SGD([p], lr=FP32_MAX, momentum=FP32_MAX, dampening=FP32_MAX, weight_decay=FP32_MAX)
    assert torch.isfinite(reference.sgd_step_scalars(FP32_MAX, torch.zeros(()))).all()
    constants = torch.tensor([FP32_MAX, 1.0 - FP32_MAX, FP32_MAX], dtype=torch.float64).float()
    assert torch.isfinite(constants).all()
    with pytest.raises(ValueError, match="Invalid learning rate"):
        SGD([p], lr=math.nextafter(FP32_MAX, math.inf))


# ---- a group edited between steps ---------------------------------------------------------


def _float_lr(opt):
    opt.param_groups[1]["lr"] = 1e38


def _weight_decay(opt):
    opt.param_groups[1]["lr"] = 1e20
    opt.param_groups[1]["weight_decay"] = 1e20


def _beta1(opt):
    opt.param_groups[1]["lr"] = 1e27
    opt.param_groups[1]["betas"] = (1 - 2.0**-40, 0.999)


def _tensor_lr_replaced(opt):
    opt.param_groups[1]["lr"] = torch.tensor(1e38)


EDITS = {
    "float lr": (_float_lr, STEP_SIZE),
    "weight_decay": (_weight_decay, DECAY),
    "beta1": (_beta1, STEP_SIZE),
    "tensor lr replaced": (_tensor_lr_replaced, STEP_SIZE),
}


@pytest.mark.parametrize("by", ["opt.step", "fastamp.Scaler", "torch GradScaler"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_between_steps_is_refused_and_changes_nothing(edit, backend, by):
    """The refused step leaves params, grads and state bit-identical; with the edit undone, the run goes on
    bit-identical to a twin that never saw it (not even a step count or an rng counter moved)."""
    change, message = EDITS[edit]
    lr = torch.tensor(1e-3) if "tensor" in edit else 1e-3
    params, opt = _world(AdamW, backend, lr=lr)
    twin_params, twin = _world(AdamW, backend, lr=lr.clone() if isinstance(lr, torch.Tensor) else lr)
    group = dict(opt.param_groups[1])
    scaler = {"opt.step": None, "fastamp.Scaler": fastamp.Scaler("cpu"), "torch GradScaler": None}[by]
    if by == "torch GradScaler":
        scaler = torch.amp.GradScaler("cpu")

    def step(o):
        if scaler is None:
            return o.step()
        scaler.scale(torch.ones(()))  # the scaler's state exists; the grads stand for scaled ones
        return scaler.step(o)

    change(opt)
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match=f"AdamW: .*{message}.*overflows float32.*\\(in param group 1\\)"):
        step(opt)
    _assert_same(before, _snapshot(opt, params))
    if by == "torch GradScaler":
        for name in ("grad_scale", "found_inf"):  # torch's scaler leaves them set when the step raises
            delattr(opt, name)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")

    for key in ("betas", "weight_decay"):
        opt.param_groups[1][key] = group[key]
    if isinstance(lr, torch.Tensor):
        opt.param_groups[1]["lr"] = group["lr"]
        group["lr"].fill_(1e-3)
    else:
        opt.param_groups[1]["lr"] = 1e-3
    if scaler is not None:
        scaler.update()
        scaler.scale(torch.ones(()))
        scaler = None  # the twin stepped without one: go on without
    for i in range(3, 6):
        step(opt)
        step(twin)
        _set_grads(params, i)
        _set_grads(twin_params, i)
    _assert_same(_snapshot(opt, params), _snapshot(twin, twin_params))


def test_a_tensor_lr_is_read_once_per_tensor_not_at_every_step(monkeypatch):
    """A checked tensor lr is not read again at steps (on a device every read would be a sync); a new tensor
    in a group, or a change of the settings its check depends on (beta1, weight_decay), is read once."""
    lr = torch.tensor(1e-3)
    params, opt = _world(AdamW, None, lr=lr)
    reads = []
    read = torch.Tensor.__float__

    def counting(t):
        reads.append(t)
        return read(t)

    monkeypatch.setattr(torch.Tensor, "__float__", counting)
    for i in range(3):
        opt.step()
        _set_grads(params, 3 + i)
    assert reads == []
    opt.param_groups[0]["weight_decay"] = 0.02
    opt.step()
    opt.step()
    assert len(reads) == 1 and reads[0] is lr
    new = opt.param_groups[1]["lr"] = torch.tensor(2e-3)
    opt.step()
    opt.step()
    assert len(reads) == 2 and reads[1] is new


@pytest.mark.parametrize("cls", [AdamW, SGD])
def test_a_torch_scheduler_writing_a_float_lr_is_refused_at_the_next_step(cls):
    """torch's schedulers write a float lr into the group: the next step checks it, changing nothing."""
    kw = dict(momentum=0.9) if cls is SGD else {}
    params, opt = _world(cls, None, lr=1.0, **kw)
    # AdamW: lr 1e38, a step size of 1e39; SGD: lr 1e45, beyond fp32
    factor = 1e38 if cls is AdamW else 1e45
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 1 else factor)
    scheduler.step()
    before = _snapshot(opt, params)
    with pytest.raises(ValueError, match=f"AdamW: .*{STEP_SIZE}" if cls is AdamW else "Invalid learning rate"):
        opt.step()
    _assert_same(before, _snapshot(opt, params))


def test_a_tensor_lr_written_in_place_is_not_read():
    """What happens when a scheduler fills a tensor lr in place with a value whose step size overflows: its
    value is not read at steps (a host read per step; a sync on a device), so the step is not refused and
    writes inf into the params, as torch.optim.AdamW(fused=True) does with the same tensor lr."""
    params, opt = _world(AdamW, None, lr=torch.tensor(1.0))
    theirs = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    torch_opt = torch.optim.AdamW(theirs, lr=torch.tensor(1.0), fused=True)
    for o, ps in ((opt, params), (torch_opt, theirs)):
        for p in ps:
            p.grad = torch.ones_like(p)
        scheduler = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 if s < 1 else 1e38)
        scheduler.step()  # fills the tensor lr in place: 1e38, a step size of up to 1e39
        o.step()
        assert not all(torch.isfinite(p).all() for p in ps)


# ---- compiled steps -------------------------------------------------------------------------

COMPILED_EDITS = {
    "adamw lr 1e38": (AdamW, 1e38, STEP_SIZE),
    "adamw lr inf": (AdamW, math.inf, "Invalid learning rate"),
    "sgd lr -1": (SGD, -1.0, "Invalid learning rate"),
    "sgd lr nan": (SGD, math.nan, "Invalid learning rate"),
}


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("dynamic", [False, True], ids=["lr-specialised", "lr-a-graph-input"])
@pytest.mark.parametrize("compiler", ["counter", "aot_eager", "inductor"])
@pytest.mark.parametrize("edit", list(COMPILED_EDITS))
def test_a_compiled_step_refuses_an_edited_float_lr(edit, compiler, dynamic):
    """``torch.compile(opt.step, fullgraph=True)``, the lr changed every step, then set out of range.

    A float lr that dynamo specialises retraces at every change, and the trace-time validation
    refuses; one it makes a graph input (``dynamic=True``; the default after a first change
    where floats are unspecialised) does not retrace, so the step scalars' range is a guard in
    the graph (``_checks.float_lr_in_range``): in-range lrs run the one graph, an out-of-range
    one retraces and is refused. Params and state bit-identical; the run then goes on as eager.
    """
    cls, bad, message = COMPILED_EDITS[edit]
    kw = dict(momentum=0.9) if cls is SGD else {}
    params, opt = _world(cls, None, **kw)
    twin_params, twin = _world(cls, None, **kw)
    counter = CompileCounter()
    step = torch.compile(
        opt.step, fullgraph=True, backend=counter if compiler == "counter" else compiler, dynamic=dynamic
    )
    for i, lr in enumerate((1e-3, 2e-3, 3e-3)):
        for o in (opt, twin):
            o.param_groups[1]["lr"] = lr
        step()
        twin.step()
        _set_grads(params, 3 + i)
        _set_grads(twin_params, 3 + i)
    if dynamic and compiler == "counter":
        # the lr is a graph input here (not yet with aot_eager/inductor on torch 2.13: issue 20, item 5),
        # and the guard costs no recompile while it stays in range
        assert counter.frame_count == 1

    opt.param_groups[1]["lr"] = bad
    before = _snapshot(opt, params)
    with pytest.raises(Exception) as excinfo:
        step()
    name, text = _refusal(excinfo.value)
    assert name == "ValueError" and re.search(message, text), repr(excinfo.value)
    _assert_same(before, _snapshot(opt, params))

    opt.param_groups[1]["lr"] = 4e-3
    twin.param_groups[1]["lr"] = 4e-3
    step()
    twin.step()
    _assert_same(_snapshot(opt, params), _snapshot(twin, twin_params))


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("how", ["written in place", "replaced"])
def test_a_compiled_step_reads_a_tensor_lr_only_when_traced(how):
    """What happens with a tensor lr under torch.compile: its value is checked when the step is traced, but
    the graph never reads it on the host and dynamo does not retrace for a new tensor of the same kind, so
    neither a value written in place nor a tensor put in its place later is checked; here one whose step size
    overflows writes inf into the params, as torch.optim.AdamW(fused=True) does. (Eager refuses the replaced
    one at its next step.)"""
    lr = torch.tensor(1e-3)
    params, opt = _world(AdamW, None, lr=lr)
    step = torch.compile(opt.step, fullgraph=True, backend="aot_eager")
    step()
    if how == "written in place":
        lr.fill_(3e38)  # the 4th step: 3e38 / (1 - 0.9**4) ~ 8.7e38
    else:
        opt.param_groups[0]["lr"] = torch.tensor(3e38)
    step()
    assert not all(torch.isfinite(p).all() for p in params)
    if how == "replaced":
        opt.param_groups[0]["lr"] = torch.tensor(3e38)
        with pytest.raises(ValueError, match=STEP_SIZE):
            opt.step()


@requires_cuda
def test_device_tensor_lr_is_checked_where_it_is_set_not_at_steps():
    """A CUDA tensor lr: its value is read where it enters (construction, add_param_group, load_state_dict,
    the first step after it was put into a group: one sync each), not at every step, where the read would be
    a host sync per step. A value written in place later (a scheduler, DeviceLR's schedule function) whose
    step size overflows is not refused, and no step syncs: the step writes inf into the params, as
    torch.optim.AdamW(fused=True) does with the same tensor lr."""
    dev = "cuda"
    p = torch.nn.Parameter(torch.randn(8, device=dev))
    with pytest.raises(ValueError, match=STEP_SIZE):
        AdamW([p], lr=torch.tensor(1e38, device=dev))
    opt = AdamW([p], lr=torch.tensor(1e-3, device=dev))
    with pytest.raises(ValueError, match=STEP_SIZE):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, device=dev))], "lr": 1e38})
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = torch.tensor(1e38, device=dev)
    with pytest.raises(ValueError, match=STEP_SIZE):
        opt.load_state_dict(saved)
    p.grad = torch.ones_like(p)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0]["lr"] = torch.tensor(1e38, device=dev)  # a new tensor: read once at the next step
    with pytest.raises(ValueError, match=STEP_SIZE):
        opt.step()
    assert torch.equal(p, before)
    opt.param_groups[0]["lr"] = torch.tensor(1e-3, device=dev)
    opt.step()  # read once (a sync), then not again

    theirs = torch.nn.Parameter(p.detach().clone())
    torch_opt = torch.optim.AdamW([theirs], lr=torch.tensor(1e-3, device=dev), fused=True)
    for o, q in ((opt, p), (torch_opt, theirs)):
        q.grad = torch.ones_like(q)
        o.param_groups[0]["lr"].fill_(1e38)
        with cuda_syncs_raise():
            o.step()
    assert not torch.isfinite(p).all() and not torch.isfinite(theirs).all()
