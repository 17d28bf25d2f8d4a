"""Gradient release (issue 23): fastamp.release and step_bucket, without and with a loss scaler and clipping.

Part 1: release vs the ordinary ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``,
bit for bit, for every rule and master kind, with buckets of one param, of everything and in
between; a param that gets no grad every other step; a handle removed mid-training; a checkpoint
resumed; the refusals, each leaving everything as it was; no host sync and no new plan in the
steady state. Part 2 (the two-backward scheme): the same against ``scaler.scale(loss).backward();
scaler.clip_grad_norm_(opt, max_norm); scaler.step(opt); scaler.update()`` and against torch's
clip without a scaler, with injected overflows and binding clips, on every CPU backend.
"""

import contextlib
import copy

import pytest
import torch
from helpers import COMPILE_BACKENDS, assert_bits_equal, assert_same_state, save_load, state_snapshot

import fastamp
from fastamp import reference
from fastamp.optim.engine import base as _base

STEPS = 22  # part 2 and the remove/resume tests: fp16's first scale growth (growth_interval 4) is at step 16
# part 1 (no scaler): both grad patterns (the branch on even steps only) four times each; nothing in it needs a
# long trajectory (it has no scale to grow: one comparison at the end of the run)
PART1_STEPS = 8


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
    for step in range(PART1_STEPS):
        _ordinary(m1, o1, step)
        _released(m2, h2, step)
        _released(m3, h3, step)
    _assert_same(m1, o1, m3, o3, "one group")
    # the branch missed half the steps: its counts lag (AdamW and momentum SGD keep one, Lion none)
    if rule != "lion":
        assert {float(o3.state[p]["step"]) for p in m3.branch.parameters()} == {PART1_STEPS / 2}
        assert float(o3.state[m3.out.weight]["step"]) == PART1_STEPS
    for a, b in zip(m1.parameters(), m2.parameters()):  # two groups: param order differs in state_dict
        assert_bits_equal(b, a, "two groups")
        for key in o1.state[a]:
            assert_bits_equal(torch.as_tensor(o2.state[b][key]), torch.as_tensor(o1.state[a][key]), key)
    h2.remove()
    h3.remove()


def test_step_bucket_inside_bucket_step_matches_step_with_stochastic_rounding():
    """The engine entry point: the buckets of one step inside ``bucket_step()``, in any order, give step()'s bits.

    Each launch draws from its group's rng counter, which advances once when the block ends; the
    branch gets no grad on odd steps (its step count lags). Outside the block each call is a step
    of its own for the counters: one call per param then draws other bits.
    """
    worlds = [_world("adamw", "bf16-remainder") for _ in range(3)]
    for _, o in worlds:
        for g in o.param_groups:
            g["master_weights"], g["stochastic_rounding"], g["seed"] = None, True, 7
    (m1, o1), (m2, o2), (m3, o3) = worlds
    for step in range(6):
        for m in (m1, m2, m3):
            m(_batch(step), step).backward()
        o1.step()
        params = list(m2.parameters())
        with o2.bucket_step():
            for p in params[::-2] + params[-2::-2]:  # every other param, backwards, then the rest
                o2.step_bucket([p])
        for p in m3.parameters():
            o3.step_bucket([p])
        for o in (o1, o2, o3):
            o.zero_grad(set_to_none=True)
    _assert_same(m1, o1, m2, o2, "stochastic rounding, buckets inside bucket_step()")
    counter = o2.state[m2.out.weight]["rng"]
    assert all(o2.state[p]["rng"] is counter for p in m2.parameters()), "one counter per group"
    assert counter.tolist() == [7, 6] and float(o2.state[m2.branch.weight]["step"]) == 3
    # outside the block: one advance per call that launched (every param of the model, minus the branch's on odd steps)
    assert o3.state[m3.out.weight]["rng"].tolist() == [7, 6 * 9 - 3 * 2]
    assert not torch.equal(m3.out.weight, m1.out.weight)
    with o2.bucket_step():
        with pytest.raises(RuntimeError, match=r"step\(\) inside bucket_step\(\)"):
            o2.step()
        with pytest.raises(RuntimeError, match=r"bucket_step\(\) inside bucket_step\(\)"):
            with o2.bucket_step():
                pass
    assert counter.tolist() == [7, 6], "a block without launches advances nothing"


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
        ("torch optimizer", TypeError, "must be a fastamp fused optimizer.*torch.optim.adamw.AdamW"),
        ("param not in optimizer", ValueError, "param 'l2.bias' .* requires grad but is not in the optimizer"),
        ("param not in model", ValueError, r"param 0 of param group 1 .* is not a param of the model"),
        ("ddp", NotImplementedError, "DistributedDataParallel"),
        ("twice", RuntimeError, "already under gradient release"),
        ("bucket_bytes", ValueError, "bucket_bytes must be an int >= 0"),
    ],
)
def test_release_refuses_before_registering_anything(case, error, match):
    model, opt = _world("adamw", "bf16-remainder")
    _ordinary(model, opt, 0)  # some state to keep unchanged
    kw = {}
    target_model, target_opt = model, opt
    if case == "torch optimizer":
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


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """A gloo process group of one process (CPU), destroyed after the test."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_release_refuses_dtensor_params(gloo_world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))
    model.bias = torch.nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Replicate()]))
    opt = fastamp.AdamW(model.parameters())
    with pytest.raises(NotImplementedError, match="is a DTensor"):
        fastamp.release(model, opt)
    assert _no_hooks(model)


def test_release_refuses_fsdp1_and_a_model_holding_ddp_or_fsdp1(gloo_world_of_one):
    from torch.distributed.fsdp import FullyShardedDataParallel

    ddp = torch.nn.parallel.DistributedDataParallel
    cases = {
        "fsdp1": lambda m: FullyShardedDataParallel(m, device_id=torch.device("cpu")),
        "fsdp1 inside": lambda m: torch.nn.Sequential(FullyShardedDataParallel(m, device_id=torch.device("cpu"))),
        "ddp inside": lambda m: torch.nn.ModuleDict({"body": ddp(m)}),
    }
    for case, wrap in cases.items():
        torch.manual_seed(0)
        model = wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
        opt = fastamp.AdamW(model.parameters())
        where = "the model is" if case == "fsdp1" else "the model's submodule '(0|body)' is"
        what = "FullyShardedDataParallel .FSDP1." if "fsdp1" in case else "wrapped in DistributedDataParallel"
        with pytest.raises(NotImplementedError, match=f"{where} .*{what}.*use the ordinary path"):
            fastamp.release(model, opt)
        assert _no_hooks(model), case
        assert opt.__dict__.get("_release") is None, case


@pytest.mark.parametrize("clip", ["none", "binding"])
def test_ddp_around_the_model_given_as_its_inner_module_is_found_at_backward(clip, gloo_world_of_one):
    """``ddp = DDP(model); release(model, opt)``: DDP's reducer writes its grads back when backward ends.

    One backward (no clip): the step has run on the process's own grads when the written-back grads
    are found; two (the clip): found after the first, with nothing stepped.
    """
    model, opt = _world("adamw", "fp32")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    h = fastamp.release(model, opt, max_norm=CLIPS[clip], bucket_bytes=6000)
    snap = _snapshot(model, opt)
    done = "This step was taken on this process's own grads" if clip == "none" else "Nothing was stepped"
    with pytest.raises(
        RuntimeError, match=f"has a grad again after the released backward.*DistributedDataParallel.*{done}"
    ):
        h.backward(ddp(_batch(0), 0))
    assert all(p.grad is None for p in model.parameters()), "the written-back grads are dropped"
    if clip == "none":
        assert not torch.equal(model.out.weight, snap[0][-2])
    else:
        _unchanged(model, opt, snap, "two backwards: refused after the first")
    h.remove()


def test_release_registers_all_its_hooks_or_none(monkeypatch):
    model, opt = _world("adamw", "bf16-remainder")
    real = torch.Tensor.register_post_accumulate_grad_hook
    calls = []

    def third_fails(self, hook):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("no room for this hook")
        return real(self, hook)

    monkeypatch.setattr(torch.Tensor, "register_post_accumulate_grad_hook", third_fails)
    with pytest.raises(RuntimeError, match="no room for this hook"):
        fastamp.release(model, opt)
    assert len(calls) == 3
    assert _no_hooks(model)
    assert opt.__dict__.get("_release") is None
    monkeypatch.undo()
    fastamp.release(model, opt).remove()


def test_a_frozen_param_held_by_the_optimizer_is_not_stepped_until_unfrozen():
    """As ``opt.step()``: a param with requires_grad=False gets no grad and no step; unfrozen, it is taken in."""
    m1, o1 = _world("adamw", "bf16-remainder")
    m2, o2 = _world("adamw", "bf16-remainder")
    for m in (m1, m2):
        m.l2.requires_grad_(False)
    h = fastamp.release(m2, o2, bucket_bytes=6000)
    assert all(p is not m2.l2.weight and p is not m2.l2.bias for b in h.buckets for p in b)
    assert not m2.l2.weight._post_accumulate_grad_hooks
    for step in range(PART1_STEPS + 4):
        if step == 4:
            for m in (m1, m2):
                m.l2.requires_grad_(True)
        _ordinary(m1, o1, step)
        _released(m2, h, step)
        if step == 3:
            assert "exp_avg" not in o2.state[m2.l2.weight], "frozen: never stepped"
    _assert_same(m1, o1, m2, o2, "unfrozen at step 4")
    assert float(o2.state[m2.l2.weight]["step"]) == PART1_STEPS
    assert any(p is m2.l2.weight for b in h.buckets for p in b)
    h.remove()
    assert _no_hooks(m2)


@pytest.mark.parametrize("config, clip", [("bf16-remainder", "none"), ("fp16-master-scaler", "binding")])
def test_params_added_to_the_optimizer_after_release_are_taken_in(config, clip):
    """Unfreezing a layer with ``opt.add_param_group`` mid-training: stepped, and in the clip's norm, as in the ordinary loop.

    The steady state notices no change (the same buckets); removing a group whose params still require grad is
    refused as release() refuses a model param missing from the optimizer, with nothing run.
    """
    max_norm = CLIPS[clip]
    worlds = []
    for _ in range(2):
        model, _, scaler = _amp_world("adamw", config)
        model.branch.requires_grad_(False)
        opt = RULES["adamw"](
            [p for n, p in model.named_parameters() if not n.startswith("branch")], **_config(config)[1]
        )
        worlds.append((model, opt, scaler))
    (m1, o1, s1), (m2, o2, s2) = worlds
    h = fastamp.release(m2, o2, scaler=s2, max_norm=max_norm, bucket_bytes=6000)
    first = h.buckets
    for step in range(12):
        if step == 5:
            assert h.buckets is first, "nothing changed: nothing re-bucketed"
            for m, o in ((m1, o1), (m2, o2)):
                m.branch.requires_grad_(True)
                o.add_param_group({"params": list(m.branch.parameters())})
        norm = _amp_ordinary(m1, o1, s1, max_norm, step)
        h.backward(_amp_loss(m2, step, s1 is not None))
        assert all(p.grad is None for p in m2.parameters()), f"step {step}: a grad left"
        if norm is not None:
            assert_bits_equal(h.total_norm, norm, f"step {step}: the clip's total norm")
        for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
            assert_bits_equal(b, a, f"step {step}: param {name}")
        _assert_same_scaler(s1, s2, f"step {step}")
    assert h.buckets is not first and any(p is m2.branch.weight for b in h.buckets for p in b)
    assert "exp_avg" in o2.state[m2.branch.weight]
    _assert_same(m1, o1, m2, o2, "a group added at step 5")
    o2.param_groups.pop()
    params, state = [p.detach().clone() for p in m2.parameters()], state_snapshot(o2)
    with pytest.raises(ValueError, match="'branch.weight' .* requires grad but is not in the optimizer.*ran nothing"):
        h.backward(_amp_loss(m2, 12, s1 is not None))
    for p, q in zip(m2.parameters(), params):
        assert_bits_equal(p, q, "refused")
    assert_same_state(state_snapshot(o2), state)
    assert all(p.grad is None for p in m2.parameters())
    m2.branch.requires_grad_(False)  # as the message says: now it may stay out of the optimizer
    h.backward(_amp_loss(m2, 12, s1 is not None))
    assert not any(p is m2.branch.weight for b in h.buckets for p in b)
    h.remove()


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


def _tiny_compiled_world(backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    opt = fastamp.AdamW(model.parameters(), lr=1e-2, master_weights="remainder")
    return model, opt, torch.compile(model, backend=backend)


def _tiny_loss(compiled, step):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
    return compiled(x).float().square().mean()


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_a_compiled_model_with_two_backwards_matches_or_refuses_donated_buffers(backend):
    """torch.compile(model) with max_norm (two backwards, the first with retain_graph=True) on bf16.

    A compiled backward first run under release has no donated buffers: the same bits as the compiled
    ordinary loop (which shares it: one graph for modules of the same code). One first run by an ordinary
    backward has them and cannot run twice: refused with nothing stepped, and the way out the error names
    works. Caches off: a cached backward would decide.
    """
    import torch._functorch.config

    with torch.compiler.config.patch(force_disable_caches=True):
        torch._dynamo.reset()
        m1, o1, c1 = _tiny_compiled_world(backend)
        m2, o2, c2 = _tiny_compiled_world(backend)
        h = fastamp.release(m2, o2, max_norm=1e-3)
        for step in range(3):
            h.backward(_tiny_loss(c2, step))
            assert all(p.grad is None for p in m2.parameters())
            _tiny_loss(c1, step).backward()
            torch.nn.utils.clip_grad_norm_(list(m1.parameters()), 1e-3)
            o1.step()
            o1.zero_grad(set_to_none=True)
        _assert_same(m1, o1, m2, o2, "compiled, compiled first under release")
        h.remove()

        torch._dynamo.reset()
        m3, o3, c3 = _tiny_compiled_world(backend)
        _tiny_loss(c3, 0).backward()  # its backward compiled for one run: donated buffers
        o3.step()
        o3.zero_grad(set_to_none=True)
        h3 = fastamp.release(m3, o3, max_norm=1e-3)
        snap = _snapshot(m3, o3)
        with pytest.raises(RuntimeError, match=r"donated buffers .*donated_buffer = False and .*force_disable_caches"):
            h3.backward(_tiny_loss(c3, 1))
        _unchanged(m3, o3, snap, "refused")
        assert all(p.grad is None for p in m3.parameters())
        with torch._functorch.config.patch(donated_buffer=False):
            torch._dynamo.reset()
            c3 = torch.compile(m3, backend=backend)
            h3.backward(_tiny_loss(c3, 1))
        assert not torch.equal(m3[0].weight, snap[0][0])
        h3.remove()
        torch._dynamo.reset()


@pytest.mark.slow  # ~20 s: dynamo compiles the hooks' graphs piecewise on the first step
def test_compiled_autograd_runs_the_release_hooks_with_the_same_bits():
    """Under compiled autograd the hooks are traced with graph breaks and step_bucket runs eagerly: eager's bits."""
    from torch._dynamo import compiled_autograd

    m1, o1 = _world("adamw", "bf16-remainder")
    m2, o2 = _world("adamw", "bf16-remainder")
    h = fastamp.release(m2, o2, max_norm=1e-3, bucket_bytes=BUCKETS["everything"])  # fewer hook graphs to compile
    torch._dynamo.reset()
    for step in (0, 2):
        m1(_batch(step), step).backward()
        torch.nn.utils.clip_grad_norm_(list(m1.parameters()), 1e-3)
        o1.step()
        o1.zero_grad(set_to_none=True)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            h.backward(m2(_batch(step), step))
    _assert_same(m1, o1, m2, o2, "compiled autograd")
    h.remove()
    torch._dynamo.reset()


# ------------------------------------------------------------------ part 2: the loss scaler and global clipping


class AmpNet(torch.nn.Module):
    """Linear and LayerNorm layers, one weight over two native chunks (25,600 elements), a branch on even steps only."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(40, 12)
        self.l1 = torch.nn.Linear(48, 160)
        self.norm = torch.nn.LayerNorm(160)
        self.l2 = torch.nn.Linear(160, 160)
        self.branch = torch.nn.Linear(160, 160)
        self.out = torch.nn.Linear(160, 6)
        self.to(dtype)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.norm(torch.relu(self.l1(self.emb(x).flatten(1))))
        h = torch.tanh(self.l2(h))
        if step % 2 == 0:
            h = h + self.branch(h)
        return self.out(h).float().square().mean()


# steps whose loss overflows: all grads inf/nan (3, and 11 and 12 in a row), or only fp16 ones (7: scaled by 2^24)
_INF_STEPS = (3, 11, 12)
_BIG_STEP = 7

AMP_CONFIGS = {
    # (param dtype, optimizer options, scaler: None / "on" / "off" (a disabled fastamp.Scaler))
    "fp16-master-scaler": (torch.float16, {"master_weights": True}, "on"),
    "bf16-remainder-scaler": (torch.bfloat16, {"master_weights": "remainder"}, "on"),
    "bf16-remainder": (torch.bfloat16, {"master_weights": "remainder"}, None),
    "bf16-master-disabled-scaler": (torch.bfloat16, {"master_weights": True}, "off"),
}
CLIPS = {"none": None, "binding": 1e-3, "loose": 1e6}
# stochastic rounding in each form, on the param (no master; bf16 moments too), the ulp8 correction and the q8
# codes: every launch of a step draws from its group's rng counter (fastamp.optim.engine.rng)
_SR = {"master_weights": False, "stochastic_rounding": True}
SR_CONFIGS = {
    # AdamW's bf16 forms in one optimizer, a group each (a counter each)
    "bf16-adamw-forms-scaler": (
        torch.bfloat16,
        {
            "groups": (
                (("emb", "l1"), {**_SR, "state_dtype": torch.bfloat16, "seed": 3}),
                (("norm", "l2"), {"master_weights": "remainder", "state_format": "q8"}),
                (("branch", "out"), {**_SR, "state_format": "q8", "seed": 9}),
            )
        },
        "on",
    ),
    "fp16-ulp8-q8-scaler": (torch.float16, {"master_weights": "ulp8", "state_format": "q8", "seed": 5}, "on"),
    "bf16-sr-scaler": (torch.bfloat16, {**_SR, "seed": 3}, "on"),
    "bf16-sr": (torch.bfloat16, {**_SR, "seed": 3}, None),
}


# q8 moments (SGD's momentum, Lion's and AdamW's moments as 8-bit codes) with every master kind under the scaler;
# lowbit_min_numel=0 puts even the biases and the LayerNorm in q8 (one partial block each); the default keeps the
# small tensors unquantised, so that a bucket steps both kinds
Q8_CONFIGS = {
    "bf16-remainder-q8-scaler": (
        torch.bfloat16,
        {"master_weights": "remainder", "state_format": "q8", "lowbit_min_numel": 0, "seed": 2},
        "on",
    ),
    "bf16-sr-q8-scaler": (torch.bfloat16, {**_SR, "state_format": "q8", "seed": 4}, "on"),
    "fp16-master-q8-scaler": (
        torch.float16,
        {"master_weights": True, "state_format": "q8", "lowbit_min_numel": 0, "seed": 2},
        "on",
    ),
    "bf16-remainder-q8": (torch.bfloat16, {"master_weights": "remainder", "state_format": "q8", "seed": 2}, None),
}


# the CUDA runs only: fp16 params with an fp32 LayerNorm in the middle of the list, so that the native CUDA check
# pass's dtype groups (fp32 first) order the partials unlike the list
MIXED_CONFIGS = {
    "fp16-fp32-norm-master-scaler": (torch.float16, {"master_weights": True, "fp32_modules": ("norm",)}, "on"),
}


def _config(config: str):
    for table in (AMP_CONFIGS, SR_CONFIGS, Q8_CONFIGS):
        if config in table:
            return table[config]
    return MIXED_CONFIGS[config]


def _amp_world(rule: str, config: str, backend: str | None = None, device: str = "cpu"):
    dtype, kw, which = _config(config)
    torch.manual_seed(0)
    model = AmpNet(dtype)
    kw = dict(kw)
    for name in kw.pop("fp32_modules", ()):
        getattr(model, name).float()
    model.to(device)
    params = model.parameters()
    if "groups" in kw:  # ((module names, group options), ...)
        named = list(model.named_parameters())
        params = [{"params": [p for n, p in named if n.split(".")[0] in names], **opts} for names, opts in kw["groups"]]
        kw = {}
    opt = RULES[rule](params, **kw)
    scaler = None
    if which is not None:
        scaler = fastamp.Scaler(device, init_scale=2.0**12, growth_interval=4, backend=backend, enabled=which == "on")
    return model, opt, scaler


def _amp_loss(model, step: int, overflow: bool = True) -> torch.Tensor:
    """The loss of ``step``; with ``overflow`` (runs with a scaler: without one an inf would stay in the params) x inf or 2^24."""
    loss = model(_batch(step).to(next(model.parameters()).device), step)
    if not overflow:
        return loss
    if step in _INF_STEPS:
        return loss * float("inf")
    if step == _BIG_STEP:
        return loss * 2.0**24
    return loss


def _amp_ordinary(model, opt, scaler, max_norm, step):
    """The ordinary loop; the norm its clip returns (None without clipping)."""
    loss = _amp_loss(model, step, scaler is not None and scaler.is_enabled())
    norm = None
    if scaler is not None and scaler.is_enabled():
        scaler.scale(loss).backward()
        if max_norm is not None:
            norm = scaler.clip_grad_norm_(opt, max_norm)
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        if max_norm is not None:
            params = [p for g in opt.param_groups for p in g["params"]]
            if scaler is not None:
                norm = scaler.clip_grad_norm_(opt, max_norm)  # disabled: torch's clip
            else:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def _assert_same_scaler(s1, s2, what):
    if s1 is None or not s1.is_enabled():
        return
    assert_bits_equal(s2._scale, s1._scale, f"{what}: scale")
    assert_bits_equal(s2._growth_tracker, s1._growth_tracker, f"{what}: growth tracker")
    assert_bits_equal(s2._hysteresis_tracker, s1._hysteresis_tracker, f"{what}: hysteresis tracker")
    assert_bits_equal(s2.skipped_steps, s1.skipped_steps, f"{what}: skipped steps")
    assert_bits_equal(s2.last_step_skipped_tensor, s1.last_step_skipped_tensor, f"{what}: last step skipped")


def _amp_run(rule, config, clip, bucket, backend=None, steps=STEPS, resume_at=None, device="cpu"):
    """Release vs the ordinary loop, compared after every step; ``resume_at``: the released run is saved there
    (model, optimizer, scaler through torch.save / torch.load) and goes on in new objects loaded from it."""
    max_norm = CLIPS[clip]
    m1, o1, s1 = _amp_world(rule, config, backend, device)
    m2, o2, s2 = _amp_world(rule, config, backend, device)
    h = fastamp.release(m2, o2, scaler=s2, max_norm=max_norm, bucket_bytes=BUCKETS[bucket])
    skipped = 0
    for step in range(steps):
        if step == resume_at:
            saved = save_load(
                {"model": m2.state_dict(), "opt": o2.state_dict(), "scaler": None if s2 is None else s2.state_dict()}
            )
            h.remove()
            m2, o2, s2 = _amp_world(rule, config, backend, device)
            m2.load_state_dict(saved["model"])
            o2.load_state_dict(saved["opt"])
            if s2 is not None:
                s2.load_state_dict(saved["scaler"])
            h = fastamp.release(m2, o2, scaler=s2, max_norm=max_norm, bucket_bytes=BUCKETS[bucket])
        norm = _amp_ordinary(m1, o1, s1, max_norm, step)
        h.backward(_amp_loss(m2, step, s1 is not None and s1.is_enabled()))
        assert all(p.grad is None for p in m2.parameters()), "release left a grad"
        if norm is not None:
            assert_bits_equal(h.total_norm, norm, f"step {step}: the clip's total norm")
        for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
            assert_bits_equal(b, a, f"step {step}: param {name}")
        _assert_same_scaler(s1, s2, f"step {step}")
        if s1 is not None and s1.is_enabled():
            skipped += s1.last_step_skipped
    _assert_same(m1, o1, m2, o2, "the last step")
    if s1 is not None and s1.is_enabled():
        # at least the overflows of _INF_STEPS, and of _BIG_STEP in fp16 (bf16 holds 2^24 times the grads)
        assert skipped == int(s1.skipped_steps) >= (4 if _config(config)[0] == torch.float16 else 3)
        assert int(h.mismatches) == 0
    return m1, o1, s1, m2, o2, s2, h


# every rule, config and clip with middle buckets; the other bucket sizes on AdamW
AMP_CASES = [
    (rule, config, clip, "middle")
    for rule in RULES
    for config in AMP_CONFIGS
    for clip in CLIPS
    if AMP_CONFIGS[config][2] == "on" or clip != "none"  # neither: part 1's test
] + [
    ("adamw", config, clip, bucket)
    for config in ("fp16-master-scaler", "bf16-remainder")
    for clip in ("none", "binding")
    for bucket in ("one-param", "everything")
    if config != "bf16-remainder" or clip != "none"
]


@pytest.mark.parametrize("rule, config, clip, bucket", AMP_CASES)
def test_release_with_a_scaler_or_clip_matches_the_ordinary_loop_bit_for_bit(rule, config, clip, bucket):
    *_, o2, s2, h = _amp_run(rule, config, clip, bucket)
    if clip == "binding":
        assert float(h.total_norm) > 1e-3  # the clip bound
    elif clip == "loose":
        assert float(h.total_norm) < 1e6
    if rule != "lion":  # the branch's counts lag: it has no grad on odd steps (and skipped steps do not count)
        assert float(o2.state[h.model.branch.weight]["step"]) < float(o2.state[h.model.out.weight]["step"])
    h.remove()


SR_CASES = [  # (rule, config, clip, resume_at)
    ("adamw", "bf16-adamw-forms-scaler", "binding", None),
    ("adamw", "fp16-ulp8-q8-scaler", "binding", None),
    ("sgd", "bf16-sr-scaler", "binding", 10),  # a checkpoint saved under release and resumed
    ("lion", "bf16-sr", "none", None),  # one backward: no scaler, no clip
]


@pytest.mark.parametrize("rule, config, clip, resume_at", SR_CASES)
def test_release_with_stochastic_rounding_matches_the_ordinary_loop_bit_for_bit(rule, config, clip, resume_at):
    """Every bucket of a step draws from its group's counter as the step began; it advances once, when the step ends.

    The branch gets no grad on odd steps (per-param counters would lag); overflows are injected (fp16: also the 2^24
    step) and the clip binds; one run goes through a checkpoint.
    """
    *_, o2, s2, h = _amp_run(rule, config, clip, "middle", resume_at=resume_at)
    model = h.model
    assert len(h.buckets) > 2
    users = {name for name, p in model.named_parameters() if "rng" in o2.state[p]}
    assert {"branch.weight", "l2.weight"} <= users  # the branch draws bits
    applied = STEPS - (0 if s2 is None else int(s2.skipped_steps))
    counters = []
    for group in o2.param_groups:
        held = [o2.state[p]["rng"] for p in group["params"] if "rng" in o2.state[p]]
        assert held and all(t is held[0] for t in held), "one counter per group and device"
        assert int(held[0][1]) == applied, "one advance per applied step"
        counters.append(held[0])
    assert len({id(t) for t in counters}) == len(counters)
    if rule != "lion":
        assert float(o2.state[model.branch.weight]["step"]) < float(o2.state[model.out.weight]["step"])
    if resume_at is not None:
        saved = o2.state_dict()["state"]
        assert all(st["rng"] is not o2.state[p]["rng"] for p, st in zip(model.parameters(), saved.values()))
    h.remove()


Q8_CASES = [  # (rule, config, clip): SGD and Lion under the scaler and the binding clip; every rule in one backward
    *[
        (rule, config, "binding")
        for rule in ("sgd", "lion")
        for config in ("bf16-remainder-q8-scaler", "bf16-sr-q8-scaler", "fp16-master-q8-scaler", "fp16-ulp8-q8-scaler")
    ],
    *[(rule, "bf16-remainder-q8", "none") for rule in RULES],
]


@pytest.mark.slow  # ~5 s a case, 11 cases
@pytest.mark.parametrize("rule, config, clip", Q8_CASES)
def test_release_with_q8_moments_matches_the_ordinary_loop_bit_for_bit(rule, config, clip):
    """STEPS steps of q8 state, compared after every step: with the scaler, overflows injected and the clip binding;
    without a scaler and clip (one backward per step), every rule."""
    *_, o2, s2, h = _amp_run(rule, config, clip, "middle")
    model = h.model
    assert len(h.buckets) > 2
    q8 = {name for name, p in model.named_parameters() if any(k.endswith("_q") for k in o2.state[p])}
    assert {"l2.weight", "branch.weight"} <= q8  # the branch's codes too (no grad on odd steps)
    small = "lowbit_min_numel" in _config(config)[1]
    assert ("out.bias" in q8) == small, q8
    if clip == "binding":
        assert float(h.total_norm) > 1e-3  # the clip bound
    if rule != "lion":
        assert float(o2.state[model.branch.weight]["step"]) < float(o2.state[model.out.weight]["step"])
    h.remove()


# Triton (interpreted, ~12 s a case) with the binding clip only: the backend runs the partials, the fold and the
# second backward's check, the same kernel calls whatever the clip; the coefficient (< 1 binding, 1 loose) is
# computed from the folded norm in torch ops and applied by the optimizer's step, which the torch rows cover both ways
@pytest.mark.parametrize(
    "backend, clip", [("torch", "binding"), ("torch", "loose"), ("triton", "binding")], ids=lambda v: v
)
def test_release_with_a_scaler_matches_on_every_cpu_backend(backend, clip):
    """The partials and their fold per backend: the torch reference and Triton (interpreter) fold as their check pass."""
    if backend == "triton":
        pytest.importorskip("triton")
        from fastamp import kernels

        if not kernels.available("cpu")[0]:
            pytest.skip("Triton cannot run on the CPU here (TRITON_INTERPRET is not 1)")
    *_, h = _amp_run("adamw", "fp16-master-scaler", clip, "middle", backend=backend, steps=14)
    h.remove()


# On one CUDA device, every backend (native: csrc/cuda's partials kernel and fold; Triton on the GPU; the torch
# reference) with an fp16 scaler, the injected overflows and the binding clip over STEPS steps; the mixed config
# (an fp32 LayerNorm among fp16 params) folds the native CUDA partials dtype group by dtype group
@pytest.mark.parametrize(
    "backend, config",
    [
        ("native", "fp16-master-scaler"),
        ("native", "fp16-fp32-norm-master-scaler"),
        ("native", "bf16-remainder-scaler"),
        ("triton", "fp16-master-scaler"),
        ("triton", "fp16-fp32-norm-master-scaler"),
        ("torch", "fp16-fp32-norm-master-scaler"),
    ],
    ids=lambda v: v,
)
@pytest.mark.parametrize("device", ["cuda"])
def test_release_with_a_scaler_and_binding_clip_matches_the_ordinary_loop_on_cuda(backend, config, device):
    from fastamp.ops import backends

    ok, why = backends.available(backend, "unscale_check_", device)
    if not ok:
        pytest.skip(f"{backend} on {device}: {why}")
    *_, h = _amp_run("adamw", config, "binding", "middle", backend=backend, device=device)
    assert float(h.total_norm) > 1e-3  # the clip binds
    assert h.total_norm.device.type == "cuda"
    h.remove()


def test_release_with_a_scaler_refuses_a_param_on_a_device_it_does_not_run_on():
    model, _, scaler = _amp_world("adamw", "fp16-master-scaler")
    model.out.bias = torch.nn.Parameter(torch.empty_like(model.out.bias, device="meta"))
    opt = RULES["adamw"](model.parameters(), master_weights=True)
    with pytest.raises(NotImplementedError, match=r"'out.bias' is on meta; .* one CPU or CUDA device"):
        fastamp.release(model, opt, scaler=scaler, max_norm=1.0)
    assert _no_hooks(model)


@pytest.mark.parametrize("device", ["cuda"])
def test_release_refuses_params_on_several_devices(device):
    """One device only: a param moved to the CPU after the model went to CUDA is refused, naming both."""
    model, opt, scaler = _amp_world("adamw", "fp16-master-scaler", device=device)
    model.out.bias.data = model.out.bias.data.cpu()
    with pytest.raises(NotImplementedError, match=r"'out.bias' is on cpu but 'emb.weight' is on cuda:0.*one device"):
        fastamp.release(model, opt, scaler=scaler, max_norm=1.0)
    assert _no_hooks(model)


def test_partials_fold_to_the_check_pass_sum_on_every_backend():
    """unscale_check_partials_ + sumsq_fold in any call order = unscale_check_'s sum of squares, bit for bit."""
    from fastamp import _release, backends

    torch.manual_seed(3)
    grads = [
        torch.randn(n).to(dt) * 3
        for n, dt in (
            (5, torch.float32),
            (40000, torch.float16),
            (16384, torch.bfloat16),
            (0, torch.float32),
            (16385, torch.float32),
            (777, torch.float16),
        )
    ]
    grads.append(torch.randn(30, 20)[:, :7])  # strided
    inv = torch.full((), 0.25)
    names = ["torch", "native"]
    with contextlib.suppress(Exception):
        from fastamp import kernels

        if kernels.available("cpu")[0]:
            names.append("triton")
    for name in names:
        if not backends.available(name, "unscale_check_", "cpu")[0]:
            continue
        found = torch.zeros(())
        want = fastamp.functional.unscale_check_(
            [g.clone() for g in grads], found, inv, write_back=False, compute_sumsq=True, backend=name
        )
        impl = _release._SumsqBackend(name)
        counts = [impl.count(g.numel()) for g in grads]
        offsets = [sum(counts[:i]) for i in range(len(grads))]
        slots = torch.full((sum(counts) + 3,), float("nan"), dtype=torch.float64)
        found2 = torch.zeros(())
        for i in reversed(range(len(grads))):  # one grad per call, in reverse: as hooks run
            g = grads[i]
            impl.partials_([g.contiguous()], found2, inv, slots, [offsets[i]])
        groups: dict = {}
        for i, g in enumerate(grads):
            if g.numel() or name == "torch":
                groups.setdefault(impl.group(impl.key(g)), []).append(i)
        index = [offsets[i] + k for members in groups.values() for i in members for k in range(counts[i])]
        got = impl.fold(slots, torch.tensor(index, dtype=torch.int64), index)
        assert_bits_equal(got, want, f"{name}: folded partials")
        assert_bits_equal(found2, found, f"{name}: found_inf")
        grads[1][3] = float("inf")
        found3 = torch.zeros(())
        impl.partials_([grads[1]], found3, inv, slots, [offsets[1]])
        assert float(found3) == 1.0, name
        grads[1][3] = 0.0


def test_native_partials_ops_check_their_slots_first_and_pass_opcheck():
    from fastamp.ops import registry

    if not registry.native_has_kernel("unscale_check_partials_", "cpu"):
        pytest.skip("fastamp._C without the release ops")
    grads = [torch.randn(20000), torch.randn(3).half()]
    found, inv = torch.zeros(()), torch.ones(())
    slots = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"offsets\[0\] = 2 leaves no room for the 2 partials of grads\[0\] in 3"):
        torch.ops.fastamp.unscale_check_partials_(grads, found, inv, slots, [2, 0])
    assert float(found) == 0.0 and not slots.any()  # refused before anything was written
    with pytest.raises(RuntimeError, match="index\\[1\\] = 3 is out of range for 3 partials"):
        torch.ops.fastamp.sumsq_fold(slots, torch.tensor([0, 3]))
    torch.library.opcheck(torch.ops.fastamp.unscale_check_partials_, (grads, found, inv, slots, [0, 2]))
    torch.library.opcheck(torch.ops.fastamp.sumsq_fold, (slots, torch.tensor([2, 0, 1])))


def test_release_with_a_scaler_removed_mid_training_then_the_ordinary_loop_continues():
    m1, o1, s1 = _amp_world("adamw", "fp16-master-scaler")
    m2, o2, s2 = _amp_world("adamw", "fp16-master-scaler")
    h = fastamp.release(m2, o2, scaler=s2, max_norm=1e-3, bucket_bytes=6000)
    for step in range(STEPS):
        _amp_ordinary(m1, o1, s1, 1e-3, step)
        if step < 9:
            h.backward(_amp_loss(m2, step))
        else:
            if step == 9:
                h.remove()
            _amp_ordinary(m2, o2, s2, 1e-3, step)
    _assert_same(m1, o1, m2, o2, "removed at step 9")
    _assert_same_scaler(s1, s2, "removed at step 9")


def test_a_checkpoint_with_the_scaler_saved_under_release_resumes_bit_identically():
    m1, o1, s1 = _amp_world("sgd", "fp16-master-scaler")
    m2, o2, s2 = _amp_world("sgd", "fp16-master-scaler")
    h = fastamp.release(m2, o2, scaler=s2, max_norm=1e-3, bucket_bytes=6000)
    for step in range(10):
        _amp_ordinary(m1, o1, s1, 1e-3, step)
        h.backward(_amp_loss(m2, step))
    saved = save_load({"model": m2.state_dict(), "opt": o2.state_dict(), "scaler": s2.state_dict()})
    h.remove()
    m3, o3, s3 = _amp_world("sgd", "fp16-master-scaler")
    m3.load_state_dict(saved["model"])
    o3.load_state_dict(saved["opt"])
    s3.load_state_dict(saved["scaler"])
    h3 = fastamp.release(m3, o3, scaler=s3, max_norm=1e-3, bucket_bytes=6000)
    for step in range(10, STEPS):
        _amp_ordinary(m1, o1, s1, 1e-3, step)
        h3.backward(_amp_loss(m3, step))
    _assert_same(m1, o1, m3, o3, "resumed")
    _assert_same_scaler(s1, s3, "resumed")


def test_an_overflow_only_in_the_second_backward_skips_that_bucket_and_is_counted():
    """A non-deterministic backward: the first pass saw finite grads, the second an inf in one layer's grads."""
    model, opt, scaler = _amp_world("adamw", "fp16-master-scaler")
    h = fastamp.release(model, opt, scaler=scaler, max_norm=1.0, bucket_bytes=0)
    h.backward(_amp_loss(model, 0))
    calls = []

    def poison_second(grad):
        calls.append(1)
        return grad.clone().fill_(float("inf")) if len(calls) == 2 else grad

    handle = model.out.weight.register_hook(poison_second)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scale = scaler.get_scale()
    h.backward(_amp_loss(model, 2))
    handle.remove()
    assert len(calls) == 2
    assert int(h.mismatches) == 1
    assert_bits_equal(model.out.weight, before["out.weight"], "the poisoned bucket is not stepped")
    assert not torch.equal(model.l1.weight, before["l1.weight"]), "the other buckets stepped"
    assert scaler.get_scale() == scale / 2 and scaler.last_step_skipped  # counted as an overflow: backoff
    h.backward(_amp_loss(model, 4))
    assert int(h.mismatches) == 1
    h.remove()


def test_steady_state_with_a_scaler_and_clip_has_no_host_sync(monkeypatch):
    model, opt, scaler = _amp_world("adamw", "fp16-master-scaler")
    h = fastamp.release(model, opt, scaler=scaler, max_norm=1e-3, bucket_bytes=6000)
    x = _batch(0)
    for _ in range(3):
        h.backward(model(x, 0))
    with _no_host_sync_or_new_plan(monkeypatch):
        for _ in range(3):
            h.backward(model(x, 0))
    h.remove()


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("torch scaler", TypeError, r"scaler must be a fastamp.Scaler, got torch.amp.grad_scaler.GradScaler"),
        ("track_stats", NotImplementedError, "track_stats=True.*use a scaler without track_stats"),
        ("negative max_norm", ValueError, r"max_norm must be >= 0 \(inf: never clip\), got -1.0"),
        ("nan max_norm", ValueError, "max_norm must be >= 0 .*got nan"),
        ("bool max_norm", TypeError, "max_norm must be a real number or None, got bool"),
        ("norm_type", NotImplementedError, "norm_type must be 2, got 1.0.*use the ordinary path"),
    ],
)
def test_release_refuses_a_bad_scaler_or_clip_before_registering_anything(case, error, match):
    model, opt, _ = _amp_world("adamw", "fp16-master-scaler")
    _ordinary(model, opt, 0)
    kw = {}
    if case == "torch scaler":
        kw["scaler"] = torch.amp.GradScaler("cpu")
    elif case == "track_stats":
        kw["scaler"] = fastamp.Scaler("cpu", track_stats=True)
    elif case == "negative max_norm":
        kw["max_norm"] = -1.0
    elif case == "nan max_norm":
        kw["max_norm"] = float("nan")
    elif case == "bool max_norm":
        kw["max_norm"] = True
    elif case == "norm_type":
        kw.update(max_norm=1.0, norm_type=1.0)
    snap = _snapshot(model, opt)
    with pytest.raises(error, match=match):
        fastamp.release(model, opt, **kw)
    _unchanged(model, opt, snap, case)
    assert _no_hooks(model)
    assert opt.__dict__.get("_release") is None


def test_a_leftover_scaler_call_of_the_ordinary_loop_is_refused_at_once_and_changes_nothing():
    """A loop ported from ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` that kept a scaler call.

    Each call on the released optimizer raises before touching anything; a leftover ``update()`` raises
    naming h.backward; the next h.backward goes on. An iteration stuck outside release (``scaler.step`` with no
    grads records no inf check, and ``update()`` then refuses to end it) is ended by the way the refusal names.
    """
    model, opt, scaler = _amp_world("adamw", "fp16-master-scaler")
    h = fastamp.release(model, opt, scaler=scaler, max_norm=1.0)
    h.backward(_amp_loss(model, 0))
    snap = _snapshot(model, opt)
    scale, tracker = scaler._scale.clone(), scaler._growth_tracker.clone()
    for name, call in (
        ("step", lambda: scaler.step(opt)),
        ("step", torch.compile(lambda: scaler.step(opt), backend="eager")),  # the traced entry leaves it to eager
        ("unscale_", lambda: scaler.unscale_(opt)),
        ("clip_grad_norm_", lambda: scaler.clip_grad_norm_(opt, 1.0)),
    ):
        with pytest.raises(
            RuntimeError, match=rf"Scaler.{name}: the optimizer is under gradient release.*drop scaler\.{name}"
        ):
            call()
    assert not scaler._per_optimizer_states, "nothing recorded for the iteration"
    with pytest.raises(
        AssertionError, match=r"No inf checks were recorded prior to update\. .*h.backward of fastamp.release"
    ):
        scaler.update()
    _unchanged(model, opt, snap, "refused")
    assert_bits_equal(scaler._scale, scale, "scale")
    assert_bits_equal(scaler._growth_tracker, tracker, "growth tracker")
    h.backward(_amp_loss(model, 2))
    assert not torch.equal(model.out.weight, snap[0][-2]), "h.backward goes on"

    h.remove()
    scaler.step(opt)  # the ordinary path with no grads: no inf check recorded, and update() refuses to end it
    with pytest.raises(AssertionError, match=r"No inf checks were recorded prior to update\.$"):
        scaler.update()
    h = fastamp.release(model, opt, scaler=scaler, max_norm=1.0)
    with pytest.raises(
        RuntimeError, match=r"call scaler.update\(new_scale=scaler.get_scale\(\)\), which keeps the scale"
    ):
        h.backward(_amp_loss(model, 4))
    scale = scaler.get_scale()
    scaler.update(new_scale=scaler.get_scale())
    assert scaler.get_scale() == scale
    snap = _snapshot(model, opt)
    h.backward(_amp_loss(model, 4))
    assert not torch.equal(model.out.weight, snap[0][-2])
    h.remove()


def test_backward_with_a_scaler_refuses_a_scaler_already_used_this_iteration():
    model, opt, scaler = _amp_world("adamw", "fp16-master-scaler")
    h = fastamp.release(model, opt, scaler=scaler, max_norm=1.0)
    h.backward(_amp_loss(model, 0))
    snap = _snapshot(model, opt)
    state = scaler._per_optimizer_states[id(opt)]  # as after scaler.unscale_(opt), which records its check
    state["stage"] = fastamp.OptState.UNSCALED
    state["found_inf_per_device"] = {torch.device("cpu"): torch.zeros(())}
    with pytest.raises(RuntimeError, match=r"already unscaled, clipped or stepped .* call scaler.update\(\) first"):
        h.backward(_amp_loss(model, 2))
    _unchanged(model, opt, snap, "refused")
    assert all(p.grad is None for p in model.parameters())
    scaler._per_optimizer_states.clear()
    with pytest.raises(TypeError, match=r"takes only retain_graph .*\['create_graph'\]"):
        h.backward(_amp_loss(model, 2), create_graph=True)
    _unchanged(model, opt, snap, "refused")
    h.backward(_amp_loss(model, 2))
    h.remove()
