"""Gradient release without a loss scaler or clipping (issue 23, part 1): fastamp.release and step_bucket.

Release vs the ordinary ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``, bit for
bit, for every rule and master kind, with buckets of one param, of everything and in between; a
param that gets no grad every other step; a handle removed mid-training; a checkpoint resumed; the
refusals, each leaving everything as it was; no host sync and no new plan in the steady state.
"""

import contextlib
import copy

import pytest
import torch
from helpers import assert_bits_equal, save_load

import fastamp
from fastamp import reference
from fastamp.optim import _base

STEPS = 22


class Net(torch.nn.Module):
    """An embedding, a few Linear layers, and a branch used only on even steps (no grad on odd ones)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(40, 12)
        self.l1 = torch.nn.Linear(48, 32)
        self.l2 = torch.nn.Linear(32, 32)
        self.branch = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 6)
        self.to(dtype)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.relu(self.l1(self.emb(x).flatten(1)))
        h = torch.tanh(self.l2(h))
        if step % 2 == 0:
            h = h + self.branch(h)
        return self.out(h).float().square().mean()


RULES = {
    "adamw": lambda params, **kw: fastamp.AdamW(params, lr=1e-2, weight_decay=0.1, **kw),
    "sgd": lambda params, **kw: fastamp.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01, **kw),
    "lion": lambda params, **kw: fastamp.Lion(params, lr=1e-3, weight_decay=0.1, **kw),
}
CONFIGS = {
    "fp32": (torch.float32, {}),
    "bf16-fp32-master": (torch.bfloat16, {"master_weights": True}),
    "bf16-remainder": (torch.bfloat16, {"master_weights": "remainder"}),
}
BUCKETS = {"one-param": 0, "middle": 6000, "everything": 1 << 30}


def _world(rule: str, config: str, groups: bool = False):
    dtype, kw = CONFIGS[config]
    torch.manual_seed(0)
    model = Net(dtype)
    if groups:  # two groups, so that buckets span groups
        params = [
            {"params": [model.emb.weight, model.l1.weight, model.out.bias]},
            {"params": [p for n, p in model.named_parameters() if n not in ("emb.weight", "l1.weight", "out.bias")]},
        ]
    else:
        params = model.parameters()
    return model, RULES[rule](params, **kw)


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 40, (8, 4), generator=g)


def _ordinary(model, opt, step):
    model(_batch(step), step).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _released(model, h, step):
    h.backward(model(_batch(step), step))
    assert all(p.grad is None for p in model.parameters()), "release left a grad"


def _assert_same(m1, o1, m2, o2, what):
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert_bits_equal(b, a, f"{what}: param {name}")
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert s1.keys() == s2.keys(), what
    for k in s1:
        assert s1[k].keys() == s2[k].keys(), (what, k)
        for key in s1[k]:
            assert_bits_equal(torch.as_tensor(s2[k][key]), torch.as_tensor(s1[k][key]), f"{what}: state {k} {key}")


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("rule", RULES)
def test_release_matches_the_ordinary_step_bit_for_bit(rule, config, bucket):
    m1, o1 = _world(rule, config)
    m2, o2 = _world(rule, config, groups=True)
    m3, o3 = _world(rule, config)
    h2 = fastamp.release(m2, o2, bucket_bytes=BUCKETS[bucket])
    h3 = fastamp.release(m3, o3, bucket_bytes=BUCKETS[bucket])
    if bucket == "one-param":
        assert all(len(b) == 1 for b in h3.buckets)
    elif bucket == "everything":
        assert len(h3.buckets) == 1
    else:
        assert 1 < len(h3.buckets) < len(list(m3.parameters()))
    # backward order: the output layer's params are in the first bucket
    assert h3.buckets[0][0] is m3.out.bias
    for step in range(STEPS):
        _ordinary(m1, o1, step)
        _released(m2, h2, step)
        _released(m3, h3, step)
    _assert_same(m1, o1, m3, o3, "one group")
    # the branch missed half the steps: its counts lag (AdamW and momentum SGD keep one, Lion none)
    if rule != "lion":
        assert {float(o3.state[p]["step"]) for p in m3.branch.parameters()} == {STEPS / 2}
        assert float(o3.state[m3.out.weight]["step"]) == STEPS
    for a, b in zip(m1.parameters(), m2.parameters()):  # two groups: param order differs in state_dict
        assert_bits_equal(b, a, "two groups")
        for key in o1.state[a]:
            assert_bits_equal(torch.as_tensor(o2.state[b][key]), torch.as_tensor(o1.state[a][key]), key)
    h2.remove()
    h3.remove()


def test_step_bucket_matches_step_with_stochastic_rounding_when_every_param_steps():
    """The engine entry point keeps each param's SR tensor id and counter: one bucket per param gives step()'s bits."""
    m1, o1 = _world("adamw", "bf16-remainder")
    m2, o2 = _world("adamw", "bf16-remainder")
    for o in (o1, o2):
        for g in o.param_groups:
            g["master_weights"], g["stochastic_rounding"], g["seed"] = None, True, 7
    params2 = list(m2.parameters())
    for step in range(6):
        m1(_batch(step), 0).backward()
        o1.step()
        o1.zero_grad(set_to_none=True)
        m2(_batch(step), 0).backward()
        for p in reversed(params2):
            o2.step_bucket([p])
        o2.zero_grad(set_to_none=True)
    _assert_same(m1, o1, m2, o2, "stochastic rounding")


def test_step_scalar_rows_do_not_depend_on_the_position_of_a_count():
    """A bucket computes a count's AdamW scalars in a shorter vector than step(): the rows must not differ.

    torch's CPU pow gives a vector's SIMD blocks and its tail other fp64 bits (79 of 4,000
    counts differ here without the lane-wise padding of reference._pow).
    """
    counts = torch.arange(1, 4001, dtype=torch.float32)
    whole = reference.adamw_step_scalars(1e-3, counts, 0.9, 0.999, 0.1)
    pows = reference.optim._pow(torch.full((), 0.999, dtype=torch.float64), counts.double())
    for i in range(0, 4000, 13):
        alone = reference.optim._pow(torch.full((), 0.999, dtype=torch.float64), counts[i : i + 1].double())
        assert_bits_equal(alone, pows[i : i + 1], f"pow of count {i + 1}")
        assert_bits_equal(
            reference.adamw_step_scalars(1e-3, counts[i : i + 3], 0.9, 0.999, 0.1), whole[i : i + 3], str(i)
        )


def test_remove_mid_training_then_ordinary_steps_match_a_run_without_release():
    m1, o1 = _world("adamw", "bf16-remainder")
    m2, o2 = _world("adamw", "bf16-remainder")
    h = fastamp.release(m2, o2, bucket_bytes=6000)
    for step in range(STEPS):
        _ordinary(m1, o1, step)
        if step < 9:
            _released(m2, h, step)
        else:
            if step == 9:
                h.remove()
                h.remove()  # idempotent
            _ordinary(m2, o2, step)
    _assert_same(m1, o1, m2, o2, "removed at step 9")
    with pytest.raises(RuntimeError, match="this handle was removed"):
        h.backward(m2(_batch(0), 0))
    h2 = fastamp.release(m2, o2)  # a new handle once the old one is removed
    h2.remove()


def test_a_checkpoint_saved_under_release_resumes_bit_identically():
    m1, o1 = _world("adamw", "bf16-remainder")
    m2, o2 = _world("adamw", "bf16-remainder")
    h = fastamp.release(m2, o2, bucket_bytes=6000)
    for step in range(10):
        _ordinary(m1, o1, step)
        _released(m2, h, step)
    saved = save_load({"model": m2.state_dict(), "opt": o2.state_dict()})
    h.remove()
    m3, o3 = _world("adamw", "bf16-remainder")
    m3.load_state_dict(saved["model"])
    o3.load_state_dict(saved["opt"])
    h3 = fastamp.release(m3, o3, bucket_bytes=6000)
    for step in range(10, STEPS):
        _ordinary(m1, o1, step)
        _released(m3, h3, step)
    _assert_same(m1, o1, m3, o3, "resumed")


def _no_hooks(model):
    return all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


def _snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _unchanged(model, opt, snap, what):
    params, state = snap
    for p, q in zip(model.parameters(), params):
        assert_bits_equal(p, q, what)
    now = opt.state_dict()
    assert now["state"].keys() == state["state"].keys(), what
    for k, st in state["state"].items():
        for key, v in st.items():
            assert_bits_equal(torch.as_tensor(now["state"][k][key]), torch.as_tensor(v), what)


@pytest.mark.parametrize(
    "case, error, match",
    [
        (
            "scaler",
            NotImplementedError,
            "a loss scaler under gradient release is not implemented yet.*use the ordinary path",
        ),
        ("max_norm", NotImplementedError, r"global clipping \(max_norm\) under .*ordinary path"),
        ("torch optimizer", TypeError, "must be a fastamp fused optimizer.*torch.optim.adamw.AdamW"),
        ("param not in optimizer", ValueError, "param 'l2.bias' .* requires grad but is not in the optimizer"),
        ("param not in model", ValueError, r"param 0 of param group 1 .* is not a param of the model"),
        ("ddp", NotImplementedError, "DistributedDataParallel"),
        ("stochastic rounding", NotImplementedError, "param group 0 uses stochastic rounding"),
        ("twice", RuntimeError, "already under gradient release"),
        ("bucket_bytes", ValueError, "bucket_bytes must be an int >= 0"),
    ],
)
def test_release_refuses_before_registering_anything(case, error, match):
    model, opt = _world("adamw", "bf16-remainder")
    _ordinary(model, opt, 0)  # some state to keep unchanged
    kw = {}
    target_model, target_opt = model, opt
    if case == "scaler":
        kw["scaler"] = fastamp.Scaler("cpu")
    elif case == "max_norm":
        kw["max_norm"] = 1.0
    elif case == "torch optimizer":
        target_opt = torch.optim.AdamW(model.parameters())
    elif case == "param not in optimizer":
        target_opt = fastamp.AdamW([p for n, p in model.named_parameters() if n != "l2.bias"])
    elif case == "param not in model":
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]})
    elif case == "ddp":
        # a DDP instance without a process group: only its type matters to the check
        ddp = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
        torch.nn.Module.__init__(ddp)
        ddp.module = model
        target_model = ddp
    elif case == "stochastic rounding":
        target_opt = fastamp.AdamW(model.parameters(), stochastic_rounding=True)
    elif case == "twice":
        first = fastamp.release(model, opt)
    elif case == "bucket_bytes":
        kw["bucket_bytes"] = -1
    if case != "twice":
        assert _no_hooks(model)
    snap = _snapshot(model, opt)
    with pytest.raises(error, match=match):
        fastamp.release(target_model, target_opt, **kw)
    _unchanged(model, opt, snap, case)
    if case == "twice":
        first.remove()
    assert _no_hooks(model)
    if case == "param not in model":
        opt.param_groups.pop()
    _ordinary(model, opt, 1)  # the ordinary path still works


def test_release_refuses_dtensor_params(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(4, 4)
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))
        model.bias = torch.nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Replicate()]))
        opt = fastamp.AdamW(model.parameters())
        with pytest.raises(NotImplementedError, match="is a DTensor"):
            fastamp.release(model, opt)
        assert _no_hooks(model)
    finally:
        dist.destroy_process_group()


def test_backward_refuses_a_grad_already_there_and_changes_nothing():
    """Gradient accumulation: a loss.backward() outside the handle (its hooks are inactive there) keeps its grads."""
    model, opt = _world("sgd", "fp32")
    h = fastamp.release(model, opt, bucket_bytes=6000)
    _released(model, h, 0)
    snap = _snapshot(model, opt)
    model(_batch(1), 1).backward()
    _unchanged(model, opt, snap, "a plain backward steps nothing")
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    assert sum(g is not None for g in grads) == 7  # every param but the branch's two
    with pytest.raises(RuntimeError, match="param 'out.bias' already has a grad when h.backward starts"):
        h.backward(model(_batch(2), 2))
    _unchanged(model, opt, snap, "refused backward")
    for p, g in zip(model.parameters(), grads):
        assert (p.grad is None) == (g is None)
        if g is not None:
            assert_bits_equal(p.grad, g, "grad kept")
    opt.zero_grad(set_to_none=True)
    _released(model, h, 3)  # as the message says: drop the grads, and release goes on
    h.remove()


def test_backward_validates_the_groups_before_backward_runs():
    """A bad hyperparameter is refused before any bucket steps: nothing changes, no grad is left."""
    model, opt = _world("adamw", "bf16-remainder")
    h = fastamp.release(model, opt, bucket_bytes=0)
    _released(model, h, 0)
    snap = _snapshot(model, opt)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0 .in param group 0."):
        h.backward(model(_batch(1), 1))
    assert all(p.grad is None for p in model.parameters())
    opt.param_groups[0]["lr"] = 1e-2
    _unchanged(model, opt, snap, "refused lr")
    _released(model, h, 2)
    h.remove()


_SYNCS = ("item", "__bool__", "__float__", "__int__", "__index__", "cpu", "tolist", "numpy")


@contextlib.contextmanager
def _no_host_sync_or_new_plan(monkeypatch):
    """A host read of a tensor's value or a new launch plan raises (as tests/api/test_compile_scaler.py's guard)."""
    with monkeypatch.context() as m:
        for name in _SYNCS:

            def refuse(self, *args, _name=name, **kwargs):
                raise AssertionError(f"host sync under release: Tensor.{_name}()")

            m.setattr(torch.Tensor, name, refuse)

        def no_plan(*args, **kwargs):
            raise AssertionError("a new launch plan in the steady state")

        m.setattr(_base.FusedOptimizer, "_build_plan", no_plan)
        yield


@pytest.mark.parametrize("rule", RULES)
def test_steady_state_has_no_host_sync_and_keeps_each_buckets_plan(rule, monkeypatch):
    model, opt = _world(rule, "bf16-remainder")
    h = fastamp.release(model, opt, bucket_bytes=6000)
    for step in range(4):  # both grad patterns (with and without the branch), planned twice
        _released(model, h, step)
    # buckets whose grad pattern does not change keep their plans: step with the branch every time
    x = _batch(0)
    h.backward(model(x, 0))
    h.backward(model(x, 0))
    with _no_host_sync_or_new_plan(monkeypatch):
        for _ in range(3):
            loss = model(x, 0)
            h.backward(loss)
    h.remove()


def test_step_bucket_validates_before_any_write():
    model, opt = _world("adamw", "bf16-remainder")
    _ordinary(model, opt, 0)
    model(_batch(1), 0).backward()
    snap = _snapshot(model, opt)
    with pytest.raises(ValueError, match="entry 1 of the bucket .* is not a param of this optimizer"):
        opt.step_bucket([model.out.bias, torch.zeros(3)])
    with pytest.raises(ValueError, match="entry 1 of the bucket appears twice"):
        opt.step_bucket([model.out.bias, model.out.bias])
    _unchanged(model, opt, snap, "refused bucket")
    # a state tensor of the last param of the bucket is bad: nothing of the bucket is written
    opt.state[model.l1.weight]["exp_avg"] = torch.zeros(3)
    snap = _snapshot(model, opt)
    with pytest.raises((TypeError, ValueError, RuntimeError), match="exp_avg"):
        opt.step_bucket([model.out.bias, model.out.weight, model.l1.weight])
    _unchanged(model, opt, snap, "refused bucket")


def test_a_compiled_function_runs_h_backward_eagerly():
    """``h.backward`` is ``torch.compiler.disable``d: a compiled training step gives eager's bits."""
    m1, o1 = _world("adamw", "bf16-remainder")
    m2, o2 = _world("adamw", "bf16-remainder")
    h = fastamp.release(m2, o2)

    @torch.compile(backend="eager")
    def train_step(x):
        h.backward(m2(x, 0))

    for step in range(3):
        _ordinary(m1, o1, 0 if step == 0 else 2 * step)
        train_step(_batch(0 if step == 0 else 2 * step))
    _assert_same(m1, o1, m2, o2, "compiled caller")
    h.remove()
