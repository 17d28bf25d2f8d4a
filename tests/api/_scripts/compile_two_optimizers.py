"""Two fastamp optimizers stepped in one compiled function, in a fresh process (tests/api/test_compile_loops.py).

``python compile_two_optimizers.py PAIR SCALER BACKEND``: PAIR ``adamw_sgd`` (AdamW over fp32
params, SGD with momentum over bf16 params with fp32 masters) or ``adamw_fp32_remainder``
(AdamW over fp32 params, AdamW over bf16 params with ``master_weights="remainder"``);
SCALER ``scaler`` (one fastamp.Scaler drives both: ``step(a); step(b); update()``) or
``none``. The compiled function (``fullgraph=True``) and an eager twin run the same grads for
STEPS steps, overflows injected under the scaler; after every step params, optimizer state
and scale must be bit-identical, and the function must compile once, without graph breaks.
Exits non-zero with the reason otherwise. A fresh process, because what the first compiled
step of a process finds already set up (kernel modules imported, tables filled) decides
whether the bug shows.
"""

from __future__ import annotations

import math
import sys

import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fastamp

STEPS = 12
OVERFLOW = {3, 8}


def _world(pair: str, scaler: bool):
    g = torch.Generator().manual_seed(0)
    fp32 = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((7, 5), (13,))]
    bf16 = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in ((3, 4, 2), (9,))]
    a = fastamp.optim.AdamW(fp32, lr=torch.tensor(1e-2))
    if pair == "adamw_sgd":
        b = fastamp.optim.SGD(bf16, lr=torch.tensor(1e-2), momentum=0.9, master_weights=True)
    else:
        b = fastamp.optim.AdamW(bf16, lr=torch.tensor(1e-2), master_weights="remainder")
    s = fastamp.Scaler("cpu", init_scale=2.0**4, growth_interval=3) if scaler else None
    return fp32 + bf16, (a, b), s


def _step(opts, scaler):
    a, b = opts
    if scaler is None:
        a.step()
        b.step()
    else:
        scaler.step(a)
        scaler.step(b)
        scaler.update()


def _backward(i, params, scaler):
    g = torch.Generator().manual_seed(100 + i)
    scale = 1.0 if scaler is None else float(scaler.scale(torch.ones(())))
    for j, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g) * scale
        if scaler is not None and i in OVERFLOW and j == 0:
            grad.view(-1)[0] = math.inf
        p.grad = grad.to(p.dtype)


def _snapshot(params, opts, scaler):
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
    for k, opt in enumerate(opts):
        for i, p in enumerate(opt.param_groups[0]["params"]):
            for key, v in opt.state.get(p, {}).items():
                out[f"opt{k}.p{i}.{key}"] = v.detach().clone()
    if scaler is not None:
        out["scale"] = scaler._scale.clone()
    return out


def main(pair: str, with_scaler: str, backend: str) -> None:
    use_scaler = with_scaler == "scaler"
    (pc, oc, sc), (pe, oe, se) = _world(pair, use_scaler), _world(pair, use_scaler)
    cc = CompileCounterWithBackend(backend)
    compiled = torch.compile(_step, backend=cc, fullgraph=True)
    for i in range(STEPS):
        for params, opts, scaler, fn in ((pe, oe, se, _step), (pc, oc, sc, compiled)):
            _backward(i, params, scaler)
            fn(opts, scaler)
        a, b = _snapshot(pe, oe, se), _snapshot(pc, oc, sc)
        assert a.keys() == b.keys(), f"step {i}: state keys differ"
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {i}: {k} differs from eager"
    assert cc.frame_count == 1, f"{cc.frame_count} compiles"
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert not breaks, breaks
    if use_scaler:
        assert int(sc.skipped_steps) == len(OVERFLOW)
    print("ok")


if __name__ == "__main__":
    main(*sys.argv[1:])
