"""Each param's own ``step`` count in one launch, eager and compiled, with outside writes to the counts.

A fused launch takes one row of step scalars per param (``[n, k]``), computed on the device
from the params' own counts (fastamp/optim/engine/base.py ``_execute``, _traced.py): the counts of
one launch may differ (params skipped by some steps, a count written in place or replaced),
and neither the eager step nor the compiled one reads them on the host to step.

The oracle is one optimizer per param (a launch of one tensor, one count: nothing to mix up),
stepped eagerly with the same grads and the same writes: the many-param optimizer, eager and
compiled (``aot_eager``; inductor, marked slow), must match it bit for bit after every step,
state included; fp32 AdamW also matches ``torch.optim.AdamW`` given the same writes. 20 params,
so that the count vector is longer than a CPU vector register of fp64 (the scalars' ``pow``
takes torch's vectorised loop for some rows, its scalar loop for others).
"""

from __future__ import annotations

import pytest
import torch
from tolerances import ADAMW_VS_TORCH_ATOL, ADAMW_VS_TORCH_RTOL
from torch._dynamo.testing import CompileCounterWithBackend

import fastamp
from fastamp.optim import SGD, AdamW

BACKENDS = [b for b in ("native", "torch") if fastamp.backends.available(b, "optim_", "cpu")[0]]

N = 20
SHAPES = [(1 + i % 5, 2 + i % 3) if i % 2 else (3 + i,) for i in range(N)]
SKIPPED = {1: {5, 6}, 2: {5}, 5: {0, 11, 12}, 8: {17}}  # step -> params without a grad
N_STEPS = 12


def _write(step, states):
    """The outside writes before ``step``: ``states[j]`` is param j's state (the same writes on every optimizer)."""
    if step == 3:
        states[4]["step"].zero_()  # a layer re-initialised (its count only)
        states[9]["step"].zero_()
    if step == 5:
        states[7]["step"].fill_(11.0)
    if step == 7:
        states[13]["step"] += 3
        states[4]["step"].fill_(0.0)
    if step == 9:
        states[19]["step"] = torch.tensor(2.0)  # replaced


CONFIGS = {
    "adamw_fp32": (AdamW, torch.float32, dict(lr=1e-2, weight_decay=1e-2)),
    "adamw_bf16_remainder": (AdamW, torch.bfloat16, dict(lr=1e-2, master_weights="remainder")),
    "adamw_bf16_sr": (AdamW, torch.bfloat16, dict(lr=1e-2, master_weights=False, stochastic_rounding=True, seed=3)),
    "sgd_fp32": (SGD, torch.float32, dict(lr=1e-2, momentum=0.9, dampening=0.3, weight_decay=1e-2)),
    "sgd_bf16_remainder": (SGD, torch.bfloat16, dict(lr=1e-2, momentum=0.9, master_weights="remainder")),
}


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(step, dtype):
    g = torch.Generator().manual_seed(50 + step)
    grads = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    return [None if j in SKIPPED.get(step, ()) else grad for j, grad in enumerate(grads)]


def _singles(cls, dtype, kw, backend):
    """One optimizer per param (not for stochastic rounding: its random streams are numbered per param
    within an optimizer, so a single's param draws other bits than in the many-param optimizer)."""
    params = _params(dtype)
    return params, [cls([p], backend=backend, **kw) for p in params]


def _assert_same_state(where, params, states, ref_params, ref_states):
    for j, (p, q) in enumerate(zip(params, ref_params)):
        assert torch.equal(p, q), f"{where}: param {j}"
        assert states[j].keys() == ref_states[j].keys(), f"{where}: state keys of param {j}"
        for key, t in ref_states[j].items():
            assert torch.equal(states[j][key], t), f"{where}: state {key!r} of param {j}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", [c for c in CONFIGS if not c.endswith("_sr")])
def test_eager_launch_with_own_counts_matches_one_optimizer_per_param(config, backend):
    """Counts apart in one launch (skipped params, ``.zero_()``, ``.fill_()``, ``+=``, a replaced count):
    bit-identical to one optimizer per param after every step."""
    cls, dtype, kw = CONFIGS[config]
    params = _params(dtype)
    opt = cls(params, backend=backend, **kw)
    singles, single_opts = _singles(cls, dtype, kw, backend)
    for step in range(N_STEPS):
        if step > 0:
            _write(step, [opt.state[p] for p in params])
            _write(step, [o.state[p] for p, o in zip(singles, single_opts)])
        for ps, grads in ((params, _grads(step, dtype)), (singles, _grads(step, dtype))):
            for p, g in zip(ps, grads):
                p.grad = g
        opt.step()
        for o in single_opts:
            o.step()
        _assert_same_state(
            f"step {step}",
            params,
            [opt.state[p] for p in params],
            singles,
            [o.state[p] for p, o in zip(singles, single_opts)],
        )
    counts = [float(opt.state[p]["step"]) for p in params]
    assert len(set(counts)) >= 5, counts  # the counts of the launch really differ


def _three(cls, dtype, kw, backend):
    return [(ps, cls(ps, backend=backend, **kw)) for ps in (_params(dtype) for _ in range(3))]


# Compiled, with the first available backend (native where built): under the torch backend the
# graph traces the reference's per-tensor Python (and its counter-based RNG) for 20 params, which
# took 150 s for one config under aot_eager and was still compiling after 10 min under inductor; the
# compiled path (the glue around the kernels: stacking the counts, the slices, the increments) is
# the same whichever backend's kernels it calls, and the eager test above runs every backend.
# Inductor compiles one graph per grad pattern: one config per optimizer (about 30 s and 15 s here).
_INDUCTOR_CONFIGS = {"adamw_bf16_sr", "sgd_bf16_remainder"}
_CASES = [
    (config, cb, BACKENDS[0])
    for config in sorted(CONFIGS)
    for cb in ("aot_eager", "inductor")
    if cb == "aot_eager" or config in _INDUCTOR_CONFIGS
]


@pytest.mark.parametrize(
    "config, compile_backend, backend",
    [pytest.param(*c, marks=pytest.mark.slow) if c[1] == "inductor" else c for c in _CASES],
)
def test_compiled_steps_honour_in_place_writes_to_counts(config, compile_backend, backend):
    """Writes in place (and a replaced count) between compiled steps: the compiled step is bit-identical to
    the eager one after every step (``rng`` counters included), one graph per grad pattern, and (without
    stochastic rounding, whose streams are numbered per optimizer) to one optimizer per param."""
    cls, dtype, kw = CONFIGS[config]
    (cp, copt), (ep, eopt), _ = _three(cls, dtype, kw, backend)
    singles, single_opts = _singles(cls, dtype, kw, backend)
    cc = CompileCounterWithBackend(compile_backend)
    torch._dynamo.reset()
    step_fn = torch.compile(copt.step, fullgraph=True, backend=cc)
    try:
        for step in range(N_STEPS):
            if step > 0:
                for ps, o in ((cp, copt), (ep, eopt)):
                    _write(step, [o.state[p] for p in ps])
                _write(step, [o.state[p] for p, o in zip(singles, single_opts)])
            for ps in (cp, ep, singles):
                for p, g in zip(ps, _grads(step, dtype)):
                    p.grad = g
            step_fn()
            eopt.step()
            for o in single_opts:
                o.step()
            where = f"step {step}"
            for j, (x, y) in enumerate(zip(cp, ep)):
                assert torch.equal(x, y), f"{where}: param {j}, compiled vs eager"
                for key, t in eopt.state[y].items():
                    assert torch.equal(copt.state[x][key], t), f"{where}: state {key!r} of param {j}, compiled vs eager"
            if not config.endswith("_sr"):
                _assert_same_state(
                    where, cp, [copt.state[p] for p in cp], singles, [o.state[p] for p, o in zip(singles, single_opts)]
                )
        # grad patterns: all, and the four of SKIPPED (one pattern per step that skips); no graph for a write
        assert cc.frame_count == 1 + len(SKIPPED), cc.frame_count
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp32_adamw_with_writes_to_counts_matches_torch(compiled):
    """The same writes to ``torch.optim.AdamW``'s counts: params within the AdamW budget, counts equal."""
    ours = _params(torch.float32)
    theirs = _params(torch.float32)
    opt = AdamW(ours, lr=1e-2, weight_decay=1e-2)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=1e-2, foreach=False)
    torch._dynamo.reset()
    step_fn = torch.compile(opt.step, fullgraph=True, backend="aot_eager") if compiled else opt.step
    try:
        for step in range(N_STEPS):
            if step > 0:
                _write(step, [opt.state[p] for p in ours])
                _write(step, [ref.state[p] for p in theirs])
            for ps in (ours, theirs):
                for p, g in zip(ps, _grads(step, torch.float32)):
                    p.grad = g
            step_fn()
            ref.step()
            for j, (p, q) in enumerate(zip(ours, theirs)):
                torch.testing.assert_close(
                    p, q, atol=ADAMW_VS_TORCH_ATOL, rtol=ADAMW_VS_TORCH_RTOL, msg=f"step {step}: param {j}"
                )
                if ref.state.get(q):
                    assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]), f"step {step}: count {j}"
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sgd_count_zeroed_in_place_restarts_the_momentum(compiled, backend):
    """SGD: ``state[p]["step"].zero_()`` makes the next applied step the first (``is_first``): the momentum
    buffer becomes that step's grad (dampening not applied), for that param only, as a fresh state would."""
    params = _params(torch.float32)
    opt = SGD(params, lr=1e-2, momentum=0.9, dampening=0.5, backend=backend)
    torch._dynamo.reset()
    step_fn = torch.compile(opt.step, fullgraph=True, backend="aot_eager") if compiled else opt.step
    try:
        for step in range(4):
            grads = _grads(step, torch.float32)
            for p, g in zip(params, grads):
                p.grad = g
            if step == 3:
                opt.state[params[6]]["step"].zero_()
            step_fn()
        assert torch.equal(opt.state[params[6]]["momentum_buffer"], grads[6]), "the zeroed count is not a first step"
        for j in (5, 7):  # the others: momentum * buf + (1 - dampening) * grad, not the grad
            assert not torch.equal(opt.state[params[j]]["momentum_buffer"], grads[j]), j
        assert [float(opt.state[p]["step"]) for p in params[5:8]] == [2.0, 1.0, 4.0]
    finally:
        torch._dynamo.reset()


_SYNCS = ("item", "__bool__", "__float__", "__int__", "__index__", "cpu", "tolist", "numpy")


@pytest.mark.parametrize("config", ["adamw_fp32", "sgd_bf16_remainder", "adamw_bf16_sr"])
def test_eager_steps_with_counts_apart_read_nothing_on_the_host(config, monkeypatch):
    """After the first steps, grad patterns that move the counts apart and back re-plan without a host read."""
    cls, dtype, kw = CONFIGS[config]
    params = _params(dtype)
    opt = cls(params, **kw)
    for step in range(N_STEPS):
        for p, g in zip(params, _grads(step, dtype)):
            p.grad = g
        with monkeypatch.context() as m:
            if step > 0:
                for name in _SYNCS:

                    def refuse(self, *args, _name=name, **kwargs):
                        raise AssertionError(f"host read in the step: Tensor.{_name}()")

                    m.setattr(torch.Tensor, name, refuse)
            opt.step()
    assert len({float(opt.state[p]["step"]) for p in params}) > 1
