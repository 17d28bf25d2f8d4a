"""The Scaler's path under ``torch.compile(fullgraph=True)`` and the CUDA-graph preconditions (fastamp/scaler/compiled.py).

A compiled function doing ``clip_grad_norm_`` / ``unscale_`` + ``step`` + ``update`` (or only
``step`` + ``update``) drives one optimizer; an eager twin runs the same calls over the same
grads. Grads are planted as a scaled backward leaves them (times the current scale), with an
inf in one grad on some steps. Asserted bit-identical after every step: params, optimizer
state, the returned norm, the scale, the growth and hysteresis trackers, the skip counters;
and one compile (torch's ``CompileCounterWithBackend``), no graph breaks. Every test that
runs a compiled function runs it through real backends: ``aot_eager`` (AOTAutograd's
functionalization of the kernels' declared mutations) and inductor (code generation; those
cases are marked ``slow``), never a counting backend alone.

On CPU the preconditions of a CUDA-graph capture are proven instead of a capture: after
warm-up the tensors the kernels touch keep their addresses and no step state outlives the
step, and no host sync (``.item()``, ``bool(tensor)``, ``.cpu()`` ...) runs in the path. The
capture itself is a ``gpu`` test.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import COMPILE_BACKENDS, bits, cuda_syncs_raise
from torch._dynamo.testing import CompileCounterWithBackend
from torch.amp.grad_scaler import OptState

import fastamp

STEPS = 20
OVERFLOW = {2, 7, 8, 15}  # steps whose first grad holds an inf (7, 8: two in a row, with hysteresis 2)
SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]
CONFIGS = {
    "fp32": (torch.float32, {}),
    "bf16_master": (torch.bfloat16, {"master_weights": True}),
    "fp16_master": (torch.float16, {"master_weights": True}),
    "bf16_remainder": (torch.bfloat16, {"master_weights": "remainder"}),
    # stochastic rounding without masters: the rng counters advance in the graph, on the device
    "bf16_sr": (torch.bfloat16, {"master_weights": False, "stochastic_rounding": True, "seed": 7}),
}
MAIN_CONFIGS = ["fp32", "bf16_master", "fp16_master", "bf16_remainder"]
OPTIMIZERS = {
    "adamw": (fastamp.optim.AdamW, {"weight_decay": 1e-2}),
    "sgd": (fastamp.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-2}),
    "lion": (fastamp.optim.Lion, {"weight_decay": 1e-2}),
}


def _clip(scaler, opt):
    norm = scaler.clip_grad_norm_(opt, 0.5)
    scaler.step(opt)
    scaler.update()
    return norm


def _unscale(scaler, opt):
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def _step_update(scaler, opt):
    scaler.step(opt)
    scaler.update()


# name -> (the compiled function, what runs eagerly before it on each step)
PATTERNS = {
    "clip": (_clip, None),
    "unscale": (_unscale, None),
    "step": (_step_update, None),
    "eager_clip": (_step_update, lambda s, o: s.clip_grad_norm_(o, 0.5)),
}


# the real backends every compiled function runs through (see the module doc)
BACKENDS = COMPILE_BACKENDS


@pytest.fixture(autouse=True)
def _fresh_dynamo(fresh_dynamo):
    pass


def _world(opt_name, config, device="cpu", lr=1e-2, backend=None):
    dtype, kw = CONFIGS[config]
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in SHAPES]
    cls, okw = OPTIMIZERS[opt_name]
    opt = cls(params, lr=lr, backend=backend, **okw, **kw)
    # a small scale that moves: growth every 3 clean steps, backoff after 2 overflows in a row
    scaler = fastamp.Scaler(device, init_scale=2.0**4, growth_interval=3, hysteresis=2, backend=backend)
    return params, opt, scaler


def _backward(i, params, scaler):
    """The grads a scaled backward would leave (in place after the first step), with an inf on OVERFLOW steps."""
    g = torch.Generator().manual_seed(100 + i)
    scale = scaler.scale(torch.ones((), device=params[0].device))
    for j, p in enumerate(params):
        grad = (torch.randn(p.shape, generator=g).to(p.device) * scale).to(p.dtype)
        if i in OVERFLOW and j == 0:
            grad.view(-1)[0] = math.inf
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.copy_(grad)


def _snapshot(params, opt, scaler, norm=None):
    out = {}
    for i, p in enumerate(params):
        out[f"p{i}"] = p.detach()
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"p{i}.{k}"] = v
    for k in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_skipped_steps", "_last_step_skipped"):
        out[k] = getattr(scaler, k)
    if norm is not None:
        out["norm"] = norm
    return {k: v.detach().clone() for k, v in out.items()}


def _assert_same(a, b, where=""):
    assert a.keys() == b.keys(), where
    for k in a:
        same = a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(bits(a[k]), bits(b[k]))
        assert same, f"{where}: {k} differs: {a[k]} vs {b[k]}"


def _assert_iteration_closed(opt, scaler):
    assert len(scaler._per_optimizer_states) == 0 and not scaler._per_optimizer_clip_scales
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def _no_graph_breaks():
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def _drive(pattern, compiled_world, eager_world, fn, steps=STEPS):
    """``steps`` iterations of both twins; asserts the same state after every one."""
    body, before = PATTERNS[pattern]
    for i in range(steps):
        outs = []
        for (params, opt, scaler), run in ((eager_world, body), (compiled_world, fn)):
            _backward(i, params, scaler)
            if before is not None:
                before(scaler, opt)
            outs.append(_snapshot(params, opt, scaler, run(scaler, opt)))
            _assert_iteration_closed(opt, scaler)
        _assert_same(outs[0], outs[1], f"step {i}")
    assert int(compiled_world[2].skipped_steps) == len([i for i in OVERFLOW if i < steps])


CASES = [("adamw", c, p) for c in MAIN_CONFIGS for p in PATTERNS] + [("sgd", c, "clip") for c in MAIN_CONFIGS]
CASES += [("sgd", "fp32", "unscale"), ("sgd", "bf16_master", "step"), ("sgd", "fp16_master", "eager_clip")]
CASES += [("adamw", "bf16_sr", "clip"), ("sgd", "bf16_sr", "unscale")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("opt_name", "config", "pattern"), CASES)
def test_fullgraph_bit_identical_one_compile(opt_name, config, pattern, backend):
    """fullgraph=True over the scaler's calls: eager's bits at every step, one graph, no recompile, no break."""
    compiled_world, eager_world = _world(opt_name, config), _world(opt_name, config)
    cc = CompileCounterWithBackend(backend)
    fn = torch.compile(PATTERNS[pattern][0], backend=cc, fullgraph=True)
    _drive(pattern, compiled_world, eager_world, fn)
    assert cc.frame_count == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    _no_graph_breaks()


@pytest.mark.parametrize("compiler", BACKENDS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fullgraph_other_backends(backend, compiler):
    """The backend resolved at trace time: the reference (traced as torch ops) and Triton (its ops, interpreted here)."""
    if not fastamp.backends.available(backend, "unscale_check_", "cpu")[0]:
        pytest.skip(f"{backend} unavailable on CPU here")
    compiled_world, eager_world = (_world("adamw", "bf16_master", backend=backend) for _ in range(2))
    cc = CompileCounterWithBackend(compiler)
    fn = torch.compile(_clip, backend=cc, fullgraph=True)
    _drive("clip", compiled_world, eager_world, fn, steps=10)
    assert cc.frame_count == 1
    _no_graph_breaks()


def test_inductor_clip_step_update_bit_identical():
    """Inductor: the device scalars (fp64 reciprocal, fp64 root of the norm, clip coefficient) keep eager's rounding.

    The one inductor case outside ``slow`` (``test_fullgraph_bit_identical_one_compile`` runs every
    case through inductor too), so that ``-m "not slow"`` still generates code once.
    """
    compiled_world, eager_world = _world("adamw", "bf16_master"), _world("adamw", "bf16_master")
    cc = CompileCounterWithBackend("inductor")
    fn = torch.compile(_clip, backend=cc, fullgraph=True)
    _drive("clip", compiled_world, eager_world, fn, steps=12)
    assert cc.frame_count == 1
    _no_graph_breaks()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_only_opt_step_with_the_eager_scaler(backend):
    """``opt.step = torch.compile(opt.step, fullgraph=True)``: the eager scaler hands it grad_scale/found_inf."""
    compiled_world, eager_world = _world("adamw", "bf16_master"), _world("adamw", "bf16_master")
    cc = CompileCounterWithBackend(backend)
    compiled_world[1].step = torch.compile(compiled_world[1].step, backend=cc, fullgraph=True)
    _drive("clip", compiled_world, eager_world, _clip)
    assert cc.frame_count == 1
    _no_graph_breaks()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compiled_autograd", [False, True], ids=["backward_eager", "compiled_autograd"])
def test_whole_training_step_with_the_model_compiled(compiled_autograd, backend):
    """Forward, scaled backward, clip, step and update in one compiled function: eager's bits.

    torch 2.13 cannot put ``loss.backward()`` in a dynamo graph (fullgraph=True fails there,
    "Unsupported Tensor.backward() call"), so the function is compiled without fullgraph:
    the forward and ``scale`` are one graph, the backward runs at a graph break (eagerly, or
    as its own graph under compiled autograd), and clip + step + update are one graph after
    it. The only graph breaks are the backward's; no recompile after the second step.

    The twin runs the scaler's calls eagerly. Under ``aot_eager`` its forward and backward are
    eager too (aot_eager runs eager's ops). Under inductor they are compiled by inductor as
    well, in a function of their own: inductor's forward and backward are not eager's bits
    (fused reductions and epilogues), so the twin takes the same grads from the same
    generated code, and the comparison is of the scaler's path alone.
    """
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    worlds = []
    for m in models:
        opt = fastamp.optim.AdamW(m.parameters(), lr=1e-2)
        worlds.append((m, opt, fastamp.Scaler("cpu", init_scale=2.0**4, growth_interval=3)))

    def train_step(model, opt, scaler, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(opt, 0.5)
        scaler.step(opt)
        scaler.update()
        return loss.detach(), norm

    def forward_backward(model, scaler, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        return loss.detach()

    cc = CompileCounterWithBackend(backend)
    g = torch.Generator().manual_seed(3)
    frames = []
    with torch._dynamo.config.patch(compiled_autograd=compiled_autograd):
        compiled = torch.compile(train_step, backend=cc)
        twin_forward_backward = forward_backward if backend == "aot_eager" else torch.compile(forward_backward)

        def twin_step(model, opt, scaler, x, y):
            loss = twin_forward_backward(model, scaler, x, y)
            norm = scaler.clip_grad_norm_(opt, 0.5)
            scaler.step(opt)
            scaler.update()
            return loss, norm

        for i in range(10):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            if i in (2, 6):
                x[0, 0] = math.inf
            outs = []
            for (m, opt, scaler), fn in zip(worlds, (twin_step, compiled)):
                opt.zero_grad()
                loss, norm = fn(m, opt, scaler, x, y)
                outs.append({"norm": norm, "scale": scaler._scale, **dict(m.named_parameters())})
                outs[-1] = {k: v.detach().clone() for k, v in outs[-1].items()}
            _assert_same(outs[0], outs[1], f"step {i}")
            frames.append(cc.frame_count)
    assert int(worlds[1][2].skipped_steps) == 2
    # the first call creates the scale inside the forward's graph (scale() is lazy), so the
    # second traces that graph again with it; nothing recompiles after that
    assert frames[1:] == [frames[1]] * (len(frames) - 1), frames
    breaks = torch._dynamo.utils.counters["graph_break"]  # the twin's compiled function breaks there too
    assert breaks and all("backward()" in reason for reason in breaks), dict(breaks)
    if compiled_autograd:
        assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] >= 1


# --------------------------------------------------------------------------- refusals and eager fallbacks


def _torch_world(kind):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (8, 5)]
    if kind == "torch_adamw_fused":
        opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    elif kind == "torch_sgd_fused":
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True)
    else:
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    return params, opt, fastamp.Scaler("cpu", init_scale=2.0**4, growth_interval=3, hysteresis=2)


TORCH_KINDS = {
    # kind -> what the fullgraph refusal names
    "torch_sgd": "the optimizer is not amp-aware",
    "torch_adamw_fused": "torch.optim's optimizers graph-break inside their own step",
    "torch_sgd_fused": "torch.optim's optimizers graph-break inside their own step",
}


@pytest.mark.parametrize("kind", list(TORCH_KINDS))
def test_torch_optimizers_refused_under_fullgraph_untouched(kind):
    """fullgraph=True with an ordinary or a torch fused optimizer: a clear error at trace time, nothing changed."""
    params, opt, scaler = _torch_world(kind)
    _backward(0, params, scaler)
    before = _snapshot(params, opt, scaler)
    grads = [p.grad.clone() for p in params]
    fn = torch.compile(_clip, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception) as info:
        fn(scaler, opt)
    message = str(info.value)
    assert TORCH_KINDS[kind] in message
    assert "fastamp.Scaler.clip_grad_norm_() cannot be captured by torch.compile here" in message
    assert "use fastamp.optim.AdamW / SGD" in message or "use an amp-aware optimizer" in message
    _assert_same(before, _snapshot(params, opt, scaler))
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    assert len(scaler._per_optimizer_states) == 0
    _clip(scaler, opt)  # the scaler is intact: the eager calls still work


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(TORCH_KINDS))
def test_torch_optimizers_without_fullgraph_eager_result(kind, backend):
    """Without fullgraph the scaler's calls run eagerly at graph breaks (update is traced): eager's bits, skips kept."""
    compiled_world, eager_world = _torch_world(kind), _torch_world(kind)
    fn = torch.compile(_clip, backend=backend)
    _drive("clip", compiled_world, eager_world, fn, steps=10)
    assert int(compiled_world[2].skipped_steps) == len([i for i in OVERFLOW if i < 10])


def _odd_world(setup):
    """A world with one setting the traced path leaves to eager, after the first scaled backward."""
    params, opt, _ = _world("adamw", "fp32")
    scaler = fastamp.Scaler("cpu", init_scale=2.0**4, track_stats=setup == "track_stats")
    if setup == "tensor_betas":
        opt.param_groups[0]["betas"] = (torch.tensor(0.9), torch.tensor(0.999))
    _backward(0, params, scaler)
    if setup == "strided_grad":
        params[0].grad = params[0].grad.t().contiguous().t()
    return params, opt, scaler


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("setup", "why"),
    [
        ("track_stats", "track_stats=True"),
        ("strided_grad", "a grad the fused check cannot take in a graph"),
        ("inf_norm", "norm_type != 2"),
        ("tensor_betas", "the optimizer has tensor betas"),
    ],
)
def test_untraceable_settings_refused_under_fullgraph(setup, why, backend):
    """fullgraph: refused before anything ran, with the reason. Without: eager at a graph break, eager's result.

    (Tensor betas: the optimizer's own compiled step refuses them with a hard error even
    without fullgraph; the scaler's call checks first and runs eagerly instead.)
    """
    norm_type = math.inf if setup == "inf_norm" else 2.0

    def fn(scaler, opt):
        norm = scaler.clip_grad_norm_(opt, 0.5, norm_type)
        scaler.step(opt)
        scaler.update()
        return norm

    params, opt, scaler = _odd_world(setup)
    before = _snapshot(params, opt, scaler)
    with pytest.raises(Exception) as info:
        torch.compile(fn, backend=backend, fullgraph=True)(scaler, opt)
    assert why in str(info.value)
    _assert_same(before, _snapshot(params, opt, scaler))
    ref_params, ref_opt, ref_scaler = _odd_world(setup)
    fn(ref_scaler, ref_opt)
    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(scaler, opt)
    _assert_same(_snapshot(ref_params, ref_opt, ref_scaler), _snapshot(params, opt, scaler))


def test_process_group_refused_under_fullgraph():
    """A process_group all-reduces the flags outside the graph: refused at trace time (nothing reaches the group)."""
    params, opt, scaler = _world("adamw", "fp32")
    _backward(0, params, scaler)
    scaler._process_group = object()  # never used: the refusal comes first
    before = _snapshot(params, opt, scaler)
    with pytest.raises(Exception, match="a process_group all-reduces the flags outside the graph"):
        torch.compile(_clip, backend="aot_eager", fullgraph=True)(scaler, opt)
    _assert_same(before, _snapshot(params, opt, scaler))


def test_stage_errors_raised_in_the_compiled_function():
    """The state machine's errors are eager's (unscale_ twice: its class and message), and raised before anything ran."""
    params, opt, scaler = _world("adamw", "fp32")
    _backward(0, params, scaler)

    def twice(scaler, opt):
        scaler.unscale_(opt)
        scaler.unscale_(opt)

    grads = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError) as info:
        torch.compile(twice, backend="aot_eager", fullgraph=True)(scaler, opt)
    assert str(info.value) == "unscale_() has already been called on this optimizer since the last update()."
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY


# --------------------------------------------------------------------------- CUDA-graph preconditions (CPU)


def _persistent(params, opt, scaler):
    """Every tensor that lives across steps and that the kernels read or write, by name."""
    out = {}
    for i, p in enumerate(params):
        out[f"p{i}"] = p
        out[f"p{i}.grad"] = p.grad
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"p{i}.{k}"] = v
    for k in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_skipped_steps", "_last_step_skipped"):
        out[k] = getattr(scaler, k)
    for gi, group in enumerate(opt.param_groups):
        if isinstance(group["lr"], torch.Tensor):
            out[f"lr{gi}"] = group["lr"]
    return out


class _KernelArgs(torch.utils._python_dispatch.TorchDispatchMode):
    """The storage addresses of every tensor argument of every op called under it."""

    def __init__(self):
        super().__init__()
        self.ptrs: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                self.ptrs.append(a.untyped_storage().data_ptr())
        return func(*args, **kwargs)


class _GraphInputs:
    """An ``aot_eager`` backend that records the storage addresses of the graph's tensor inputs at every call.

    The inputs of the compiled graph are exactly the tensors from outside the step that it
    reads or writes: what a CUDA-graph capture of it needs at fixed addresses.
    """

    def __init__(self):
        self.ptrs: list[int] = []

    def __call__(self, gm, example_inputs):
        compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args):
            self.ptrs.extend(a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor))
            return compiled(*args)

        return run


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("config", ["bf16_master", "bf16_remainder"])
def test_after_warmup_addresses_fixed_and_no_step_state_kept(config, compiled):
    """What a CUDA-graph replay needs: the same persistent tensors at the same addresses every step.

    After two warm-up steps (state created), each step touches, besides the temporaries made
    inside the step (which a capture allocates from its private pool), only the persistent
    tensors recorded at warm-up, at the addresses recorded then, the same ones every step;
    and nothing made inside a step is held after it (no per-optimizer state, clip scale,
    attribute). Eager: the tensor arguments of every fastamp kernel, seen by a dispatch
    mode. Compiled: the graph's tensor inputs.
    """
    params, opt, scaler = _world("adamw", config, lr=torch.tensor(1e-2))
    inputs = _GraphInputs()
    fn = torch.compile(_clip, backend=inputs, fullgraph=True) if compiled else _clip
    for i in range(2):
        _backward(i, params, scaler)
        fn(scaler, opt)
    tensors = _persistent(params, opt, scaler)
    addresses = {k: t.data_ptr() for k, t in tensors.items()}
    storages = {k: t.untyped_storage().data_ptr() for k, t in tensors.items()}  # the step counts share one
    persistent = set(storages.values())
    touched_per_step = []
    for i in range(2, 8):  # overflow steps (2, 7) included
        _backward(i, params, scaler)
        inputs.ptrs.clear()
        mode = _KernelArgs()
        if compiled:
            fn(scaler, opt)
            touched = inputs.ptrs
            assert set(touched) <= persistent, "the graph reads a tensor made outside it that is not persistent"
        else:
            with mode:
                fn(scaler, opt)
            touched = [p for p in mode.ptrs if p in persistent]
        _assert_iteration_closed(opt, scaler)
        now = _persistent(params, opt, scaler)
        assert now.keys() == tensors.keys()
        assert all(now[k] is tensors[k] for k in now), [k for k in now if now[k] is not tensors[k]]
        assert {k: t.data_ptr() for k, t in now.items()} == addresses
        touched_per_step.append(sorted(set(touched)))
    assert all(t == touched_per_step[0] for t in touched_per_step)
    # every persistent tensor is touched, the same every step; compiled, dynamo holds the params
    # themselves in the graph (as attributes, guarded by identity), not as inputs
    missing = [k for k in storages if storages[k] not in touched_per_step[0]]
    if compiled:
        missing = [k for k in missing if not isinstance(tensors[k], torch.nn.Parameter)]
    assert not missing, missing


_SYNCS = ("item", "__bool__", "__float__", "__int__", "__index__", "cpu", "tolist", "numpy")


@pytest.fixture
def no_host_sync(monkeypatch):
    """Within ``with no_host_sync():`` a host read of a tensor's value raises."""
    import contextlib

    @contextlib.contextmanager
    def guard():
        with monkeypatch.context() as m:
            for name in _SYNCS:

                def refuse(self, *args, _name=name, **kwargs):
                    raise AssertionError(f"host sync in the scaler's path: Tensor.{_name}()")

                m.setattr(torch.Tensor, name, refuse)
            yield

    return guard


def test_the_sync_guard_catches_a_sync(no_host_sync):
    """The guard is real: eager's step with an ordinary optimizer reads found_inf on the host."""
    params, _, scaler = _world("adamw", "fp32")
    opt = torch.optim.SGD(params, lr=1e-2)
    _backward(0, params, scaler)
    with no_host_sync(), pytest.raises(AssertionError, match="host sync in the scaler's path"):
        scaler.step(opt)


@pytest.mark.parametrize("pattern", ["clip", "unscale", "step"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_no_host_sync_in_the_path(pattern, compiled, no_host_sync):
    """After warm-up no step (overflowed or not) reads a tensor on the host, eager or compiled."""
    params, opt, scaler = _world("adamw", "fp16_master", lr=torch.tensor(1e-2))
    body = PATTERNS[pattern][0]
    fn = torch.compile(body, backend="aot_eager", fullgraph=True) if compiled else body
    for i in range(2):
        _backward(i, params, scaler)
        fn(scaler, opt)
    for i in range(2, 5):
        _backward(i, params, scaler)
        with no_host_sync():
            fn(scaler, opt)
    assert int(scaler.skipped_steps) == 1  # step 2 overflowed, and was skipped without a host read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_no_device_sync_on_cuda(compiled):
    """torch's sync debug mode raises on any synchronising CUDA call (kernels' own reads included)."""
    params, opt, scaler = _world("adamw", "bf16_master", "cuda", lr=torch.tensor(1e-2, device="cuda"))
    fn = torch.compile(_clip, backend="aot_eager", fullgraph=True) if compiled else _clip
    for i in range(2):
        _backward(i, params, scaler)
        fn(scaler, opt)
    for i in range(2, 5):
        _backward(i, params, scaler)
        with cuda_syncs_raise():
            fn(scaler, opt)
    assert int(scaler.skipped_steps) == 1


# --------------------------------------------------------------------------- CUDA-graph capture (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", ["fp32", "bf16_master", "fp16_master"])
def test_cuda_graph_capture_of_the_whole_optimizer_path(config):
    """clip + step + update captured with torch.cuda.graph and replayed: eager's bits at every step.

    The function captured is the compiled one (aot_eager: the graph's ops run as they are),
    warmed up on a side stream as torch's docs ask. Before each replay the grads are copied
    into their static buffers (overflows injected the same way); the eager twin runs the
    same calls. The lr is a device tensor (a float lr would be copied from the host).
    """
    dev = "cuda"
    worlds = [_world("adamw", config, dev, lr=torch.tensor(1e-2, device=dev)) for _ in range(2)]
    (params, opt, scaler), eager_world = worlds
    fn = torch.compile(_clip, backend="aot_eager", fullgraph=True)
    warmup = 3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            for (ps, o, s), run in ((eager_world, _clip), (worlds[0], fn)):
                _backward(i, ps, s)
                run(s, o)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm = fn(scaler, opt)  # recorded, not run: the replays below run it
    for i in range(warmup, STEPS):
        _backward(i, params, scaler)
        graph.replay()
        _backward(i, eager_world[0], eager_world[2])
        ref_norm = _clip(eager_world[2], eager_world[1])
        _assert_same(_snapshot(*eager_world, ref_norm), _snapshot(params, opt, scaler, norm), f"step {i}")
    assert int(scaler.skipped_steps) == len(OVERFLOW)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reduce_overhead_mode_gives_the_eager_result():
    """``torch.compile(mode="reduce-overhead", fullgraph=True)``: inductor's CUDA graphs (where it takes
    them: the optimizer state are mutated inputs it may decline to capture) or plain inductor; eager's bits."""
    dev = "cuda"
    worlds = [_world("adamw", "bf16_master", dev, lr=torch.tensor(1e-2, device=dev)) for _ in range(2)]
    fn = torch.compile(_clip, mode="reduce-overhead", fullgraph=True)
    _drive("clip", worlds[0], worlds[1], fn, steps=12)
    _no_graph_breaks()
