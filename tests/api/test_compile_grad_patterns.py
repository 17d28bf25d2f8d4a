"""Compiled optimizer steps whose params have no grad on some steps, and outside writes to their state.

Compiled and eager steps mixed: a compiled step writes params and counts without the host's
records (it marks them stale, see ``FusedOptimizer._forget_compiled_steps``).

Each test runs a compiled optimizer (or the compiled ``clip_grad_norm_`` + ``step`` +
``update`` of fastamp.Scaler) and an eager twin over the same grads and asserts after every
step: params and every state tensor bit-identical (stochastic-rounding ``rng`` counters
included), through real backends (``aot_eager``; inductor, marked slow), compiles counted
with torch's own counter (``CompileCounterWithBackend``). Grad patterns: a shared block with
a grad on every step but one, and two blocks A and B used on some steps (conditionally used
layers, MoE experts, freezing), with overflows injected under amp.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fastamp
from fastamp import reference

BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]  # inductor: 5-30 s per case here
CHEAP_BACKENDS = ["aot_eager", "inductor"]  # one or two graphs

# param blocks: indices of SHAPES; a grad pattern is a set of blocks
SHAPES = [(7, 5), (13,), (3, 4, 2), (1,), (6,), (2, 5)]
BLOCKS = {"shared": (0, 1), "A": (2, 3), "B": (4, 5)}
PATTERNS = {
    "all": ("shared", "A", "B"),
    "A": ("shared", "A"),  # an expert with the shared layers
    "B": ("B",),  # a layer used alone on some steps
    "shared": ("shared",),  # A and B frozen
    "none": (),  # no grad at all
}
# B, then A leave the counts of B and of the others equal again; a compiled "all" then launched
# them together, and B's graph, replayed, moved them apart under it: the old code gave B the
# others' bias correction from step 5 on
SCHEDULE = ["all", "B", "A", "all", "B", "all", "shared", "A", "B", "all", "none", "A", "all", "shared", "B", "all"]
# graphs: one per (grad pattern, cohorts after it): all, B, A, all | shared, A, B, all, none (the
# cohorts settle at step 6: {shared}, {A}, {B}); every graph guards on them and retraces once
GRAPHS = 9
OVERFLOW = {3, 8, 12, 19, 27, 45}  # steps whose grads hold an inf (found_inf = 1: skipped on the device)

CONFIGS = {
    "fp32": (torch.float32, {}),
    "bf16_master": (torch.bfloat16, {"master_weights": True}),
    "bf16_remainder": (torch.bfloat16, {"master_weights": "remainder"}),
    # no master: stochastic rounding, whose rng counters advance per param like the step counts
    "bf16_sr": (torch.bfloat16, {"master_weights": False, "stochastic_rounding": True, "seed": 7}),
}
OPTIMIZERS = {
    "adamw": (fastamp.optim.AdamW, {"lr": 1e-2, "weight_decay": 1e-2}),
    "sgd": (fastamp.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2}),
    # no momentum: no step count at all, only the rng counters (with stochastic rounding)
    "sgd_plain": (fastamp.optim.SGD, {"lr": 1e-2}),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # GRAPHS > the default limit (8): several grad patterns need a graph each (see the README)
    with torch._dynamo.config.patch(recompile_limit=16):
        yield
    torch._dynamo.reset()


def _params(dtype):
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _twins(opt_name, config, **extra):
    dtype, kw = CONFIGS[config]
    cls, okw = OPTIMIZERS[opt_name]
    out = []
    for _ in range(2):
        params = _params(dtype)
        out.append((params, cls(params, **{**okw, **kw, **extra})))
    return out


def _with_grad(pattern):
    return {i for block in PATTERNS[pattern] for i in BLOCKS[block]}


def _grads(i, pattern, scale=1.0, overflow=False):
    """This step's grads (None for the params the pattern leaves out), an inf in the first one on overflow."""
    g = torch.Generator().manual_seed(100 + i)
    used = _with_grad(pattern)
    out = []
    for j, shape in enumerate(SHAPES):
        grad = torch.randn(shape, generator=g) * scale
        if overflow and j == min(used, default=-1):
            grad.view(-1)[0] = math.inf
        out.append(grad if j in used else None)
    return out


def _set_grads(params, grads):
    for p, grad in zip(params, grads):
        p.grad = None if grad is None else grad.to(p.dtype)


def _amp_step(opt, step, found_inf):
    # as torch.amp.GradScaler and fastamp.Scaler hand them to a _step_supports_amp_scaling optimizer
    opt.grad_scale, opt.found_inf = torch.tensor(4.0), found_inf
    try:
        step()
    finally:
        del opt.grad_scale, opt.found_inf


def _assert_same(a, b, where):
    (pa, oa), (pb, ob) = a, b
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"{where}: param {i} differs"
        assert oa.state[x].keys() == ob.state[y].keys(), f"{where}: state keys of param {i}"
        for key, t in ob.state[y].items():
            assert torch.equal(oa.state[x][key], t), f"{where}: state {key!r} of param {i} differs"


def _no_graph_breaks():
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def _run_schedule(compiled, eager, step, schedule, amp=True, first=0):
    for i, pattern in enumerate(schedule, first):
        overflow = amp and i in OVERFLOW
        grads = _grads(i, pattern, 4.0 if amp else 1.0, overflow)
        for (params, opt), fn in ((compiled, step), (eager, eager[1].step)):
            _set_grads(params, grads)
            if amp:
                _amp_step(opt, fn, torch.tensor(1.0 if overflow else 0.0))
            else:
                fn()
        _assert_same(compiled, eager, f"step {i} ({pattern})")


# ----------------------------------------------------------------------------- master export, eager and compiled mixed


@pytest.mark.parametrize("backend", CHEAP_BACKENDS)
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_fp32_master_export_after_any_mix_of_eager_and_compiled_steps(opt_name, backend):
    """bf16 params with remainder masters: ``state_dict(master_format="fp32")`` is the exact master after every step.

    One eager step, then compiled ones, eager ones in between: the compiled steps move the
    params' version counters without the host's records, which must neither make the export
    take the param for the master nor make the next eager step re-sync the master (a
    warning, the remainder dropped): that warning is an error here.
    """
    compiled, eager = _twins(opt_name, "bf16_remainder")
    step = torch.compile(compiled[1].step, fullgraph=True, backend=CompileCounterWithBackend(backend))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*written outside the optimizer")  # the re-sync
        for i, (what, pattern) in enumerate(zip("ecccecceccec", ["all", "all", "A", "all"] * 3)):
            overflow = i == 5
            grads = _grads(i, pattern, 4.0, overflow)
            for (params, opt), fn in ((compiled, step if what == "c" else compiled[1].step), (eager, eager[1].step)):
                _set_grads(params, grads)
                _amp_step(opt, fn, torch.tensor(1.0 if overflow else 0.0))
            _assert_same(compiled, eager, f"step {i} ({what})")
            ours, theirs = (opt.state_dict(master_format="fp32")["state"] for _, opt in (compiled, eager))
            assert ours.keys() == theirs.keys()
            for k in theirs:
                p = compiled[0][k]
                exact = reference.join_master(p.detach(), compiled[1].state[p]["master_remainder"])
                assert torch.equal(ours[k]["master_param"], exact), f"step {i} ({what}): param {k}"
                assert torch.equal(theirs[k]["master_param"], exact), f"step {i} ({what}): param {k}"
                assert not torch.equal(exact, p.detach().float()), "a master equal to its param proves nothing"


# ----------------------------------------------------------------------------- the common case


@pytest.mark.parametrize("backend", CHEAP_BACKENDS)
@pytest.mark.parametrize(("opt_name", "config"), [("adamw", "bf16_remainder"), ("sgd", "bf16_sr")])
def test_every_param_every_step_one_graph(opt_name, config, backend):
    """Every param has a grad every step, eager steps and state_dict calls in between: one graph, no recompile.

    An eager step after compiled ones reads the counts (one host read) and plans again; it
    keeps the same cohorts and the same ``step`` tensors, so the compiled step's guards pass.
    """
    compiled, eager = _twins(opt_name, config)
    cc = CompileCounterWithBackend(backend)
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    for i, what in enumerate("ccecsccsecccsc"):
        if what == "s":
            compiled[1].state_dict(master_format="fp32")
            continue
        overflow = i in (3, 10)
        grads = _grads(i, "all", 4.0, overflow)
        for (params, opt), fn in ((compiled, step if what == "c" else compiled[1].step), (eager, eager[1].step)):
            _set_grads(params, grads)
            _amp_step(opt, fn, torch.tensor(1.0 if overflow else 0.0))
        _assert_same(compiled, eager, f"step {i} ({what})")
    assert cc.frame_count == 1
    _no_graph_breaks()
