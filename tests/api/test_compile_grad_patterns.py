"""Compiled optimizer steps whose params have no grad on some steps, and outside writes to their state.

A compiled step (fastamp/optim/engine/traced.py) reads every param's ``step`` count at every run
and computes one row of step scalars (bias corrections) per param from its own count, over
the same count vector as the eager step. dynamo traces one graph per grad pattern; the
counts may differ within a launch, so a graph replayed after other patterns moved the
counts apart, or after a count was replaced or written in place, gives each param its own
bias correction without retracing.

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
from helpers import COMPILE_BACKENDS
from tolerances import ADAMW_VS_TORCH_ATOL, ADAMW_VS_TORCH_RTOL
from torch._dynamo.testing import CompileCounterWithBackend

import fastamp
from fastamp import reference

BACKENDS = COMPILE_BACKENDS  # inductor: 2-26 s a case here
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
# graphs: one per grad pattern (all, B, A, shared, none), whatever the counts
GRAPHS = len(set(SCHEDULE))
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
def _fresh_dynamo(fresh_dynamo):
    # several grad patterns need a graph each (see the README); room above GRAPHS, so that a
    # graph too many fails the count assertions rather than the recompile limit
    with torch._dynamo.config.patch(recompile_limit=16):
        yield


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


CASES = [
    ("adamw", "fp32"),
    ("adamw", "bf16_master"),
    ("adamw", "bf16_remainder"),
    ("adamw", "bf16_sr"),
    ("sgd", "fp32"),
    ("sgd", "bf16_remainder"),
    ("sgd", "bf16_sr"),
    ("sgd_plain", "bf16_sr"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("opt_name", "config"), CASES)
def test_grad_patterns_bit_identical_to_eager(opt_name, config, backend):
    """16 steps of changing grad patterns under amp with overflows, run three times: eager's bits after every step.

    One graph per grad pattern: replaying the schedule compiles nothing.
    """
    compiled, eager = _twins(opt_name, config)
    cc = CompileCounterWithBackend(backend)
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    counts = []
    for rep in range(3):
        _run_schedule(compiled, eager, step, SCHEDULE, first=rep * len(SCHEDULE))
        counts.append(cc.frame_count)
    assert counts == [GRAPHS] * 3, counts
    _no_graph_breaks()
    if opt_name != "sgd_plain":  # each param counts its own applied steps (as torch): they moved apart
        expected = [
            sum(j in _with_grad(SCHEDULE[i % len(SCHEDULE)]) and i not in OVERFLOW for i in range(3 * len(SCHEDULE)))
            for j in range(len(SHAPES))
        ]
        assert [float(compiled[1].state[p]["step"]) for p in compiled[0]] == expected


# ----------------------------------------------------------------------------- fastamp.Scaler, compiled


def _clip_step_update(scaler, opt):
    norm = scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    return norm


SCALER_SCHEDULE = ["all", "B", "A", "all", "B", "all", "shared", "A", "B", "all", "A", "all"]
SCALER_OVERFLOW = {3, 7, 8, 10}  # 7, 8: two in a row (hysteresis 2 backs off on the second)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("opt_name", "config"), [("adamw", "bf16_remainder"), ("adamw", "bf16_sr"), ("sgd", "fp32")])
def test_compiled_scaler_path_with_grad_patterns(opt_name, config, backend):
    """The README's compiled clip + step + update (fastamp.Scaler) over changing grad patterns: eager's bits.

    Grads are planted as a scaled backward leaves them (times the current scale, an inf on
    overflow steps); params, state, the returned norm, the scale and its trackers are
    compared after every step, twice over the schedule (the second pass compiles nothing).
    """
    compiled, eager = _twins(opt_name, config)
    scalers = [fastamp.Scaler("cpu", init_scale=2.0**4, growth_interval=3, hysteresis=2) for _ in range(2)]
    cc = CompileCounterWithBackend(backend)
    fn = torch.compile(_clip_step_update, fullgraph=True, backend=cc)
    counts = []
    for rep in range(2):
        for i, pattern in enumerate(SCALER_SCHEDULE):
            grads = _grads(i, pattern, overflow=i in SCALER_OVERFLOW)
            norms = []
            for (params, opt), scaler, f in zip((compiled, eager), scalers, (fn, _clip_step_update)):
                scale = scaler.scale(torch.ones(()))  # the scale a backward of scaler.scale(loss) multiplies by
                _set_grads(params, [None if g is None else g * scale for g in grads])
                norms.append(f(scaler, opt))
            where = f"pass {rep} step {i} ({pattern})"
            _assert_same(compiled, eager, where)
            assert torch.equal(norms[0], norms[1]), where
            for key in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_skipped_steps"):
                assert torch.equal(getattr(scalers[0], key), getattr(scalers[1], key)), f"{where}: {key}"
        counts.append(cc.frame_count)
    assert counts[1] == counts[0], counts
    assert int(scalers[0]._skipped_steps) == len(SCALER_OVERFLOW) * 2
    _no_graph_breaks()


# ----------------------------------------------------------------------------- writes from outside


def _reinit(opt, params, how):
    """Re-initialise the optimizer state of block A as a user resetting a layer does (the writes eager honours)."""
    for j in BLOCKS["A"]:
        p = params[j]
        st = opt.state[p]
        if how == "replace_step":  # a fresh count and fresh moments
            st["step"] = torch.tensor(0.0)
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                if key in st:
                    st[key] = torch.zeros_like(st[key])
        elif how == "in_place":  # the same values, written into the tensors the state holds
            st["step"].zero_()
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                if key in st:
                    st[key].zero_()
        elif how == "new_state_dict":
            opt.state[p] = {}
        elif how == "del_state":
            del opt.state[p]
        elif how == "clear_state":
            st.clear()
        else:
            raise AssertionError(how)


REINIT_AT = 4


def _reinit_run(compiled, eager, step, how, eager_after=False, torch_twin=None, n_steps=10):
    """Steps (all grads, then B left out now and then); block A re-initialised before step REINIT_AT."""
    for i in range(n_steps):
        pattern = "A" if i in (6, 7) else "all"
        if i == REINIT_AT:
            for params, opt in (compiled, eager) + ((torch_twin,) if torch_twin else ()):
                _reinit(opt, params, how)
        grads = _grads(i, pattern)
        fns = ((compiled, compiled[1].step if eager_after and i == REINIT_AT else step), (eager, eager[1].step))
        for (params, _), fn in fns + (((torch_twin, torch_twin[1].step),) if torch_twin else ()):
            _set_grads(params, grads)
            fn()
        _assert_same(compiled, eager, f"step {i} ({how})")
        if torch_twin:
            for j, (x, y) in enumerate(zip(eager[0], torch_twin[0])):
                torch.testing.assert_close(
                    x, y, atol=ADAMW_VS_TORCH_ATOL, rtol=ADAMW_VS_TORCH_RTOL, msg=f"step {i}: {j}"
                )
                assert float(eager[1].state[x]["step"]) == float(torch_twin[1].state[y]["step"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["replace_step", "new_state_dict", "del_state", "clear_state"])
def test_state_reset_between_compiled_steps_as_eager_and_torch(how, backend):
    """A layer's state reset between compiled steps (a new ``step`` tensor, a new or emptied state): as eager, as torch.

    fp32 AdamW: the compiled step is bit-identical to the eager one, which matches
    ``torch.optim.AdamW`` (the reset params restart their bias corrections from step 1).
    The graph reads the new counts and state at run time: no graph beyond one per grad pattern.
    """
    compiled, eager = _twins("adamw", "fp32")
    theirs = _params(torch.float32)
    torch_twin = (theirs, torch.optim.AdamW(theirs, lr=1e-2, weight_decay=1e-2, foreach=False))
    cc = CompileCounterWithBackend(backend)
    _reinit_run(
        compiled, eager, torch.compile(compiled[1].step, fullgraph=True, backend=cc), how, torch_twin=torch_twin
    )
    # one graph per grad pattern: all, A (B left out); a state dict replaced, emptied or removed retraces
    # once more (dynamo guards the state's dicts and keys), a replaced count does not
    assert cc.frame_count == (2 if how == "replace_step" else 3), cc.frame_count
    _no_graph_breaks()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("opt_name", "config"), [("adamw", "bf16_remainder"), ("sgd", "bf16_sr"), ("sgd", "fp32")])
def test_step_replaced_between_compiled_steps(opt_name, config, backend):
    """``state[p]["step"] = torch.tensor(0.)`` with fresh moments: the next compiled step honours it."""
    compiled, eager = _twins(opt_name, config)
    cc = CompileCounterWithBackend(backend)
    _reinit_run(compiled, eager, torch.compile(compiled[1].step, fullgraph=True, backend=cc), "replace_step")
    assert cc.frame_count == 2, cc.frame_count  # as in test_state_reset_between_compiled_steps_as_eager_and_torch
    _no_graph_breaks()


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_written_in_place_then_an_eager_step(backend):
    """An in-place write (``.zero_()``) is seen by the next eager step, and the compiled steps after it
    keep the counts apart."""
    compiled, eager = _twins("adamw", "fp32")
    cc = CompileCounterWithBackend(backend)
    step = torch.compile(compiled[1].step, fullgraph=True, backend=cc)
    _reinit_run(compiled, eager, step, "in_place", eager_after=True)
    assert cc.frame_count == 2, cc.frame_count  # one graph per grad pattern


def test_step_written_in_place_between_compiled_steps():
    compiled, eager = _twins("adamw", "fp32")
    _reinit_run(compiled, eager, torch.compile(compiled[1].step, fullgraph=True, backend="aot_eager"), "in_place")


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

    An eager step after compiled ones reads (validates) the counts once and plans again; it
    keeps the same ``step`` tensors, so the compiled step's guards pass.
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
