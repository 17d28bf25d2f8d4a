"""Property tests (hypothesis): every kernel backend agrees with fastamp.reference.

Over random shapes (0 to a few thousand elements, several tensors per launch, non-multiples
of every block size), dtypes and values with special values mixed in (±0, ±inf, NaN,
subnormals, fp16 max, huge values), every backend other than ``torch`` that
:func:`fastamp.backends.available` reports for an op on a device is compared with the
reference. Exact agreement is required except the sum of squares (``SUMSQ_RTOL``) and Triton
on a real GPU (``ADAMW_GPU_RTOL``). Triton under the CPU interpreter is slow: few examples.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tolerances import ADAMW_GPU_RTOL, SUMSQ_RTOL

from fastamp import backends, reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 70000.0, 1e-40, -1e-45, 3e38, -3e38, 2.0**-24]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cases(op):
    out = []
    for dev in DEVICES:
        for b in backends.BACKENDS:
            if b != "torch" and backends.available(b, op, dev)[0]:
                out.append(pytest.param(b, dev, id=f"{b}-{dev}"))
    return out or [
        pytest.param(
            None,
            None,
            id="no-backend",
            marks=pytest.mark.skip(reason=f"no non-reference backend for {op} on {DEVICES}"),
        )
    ]


def _examples(backend, dev, many):
    return many if backend == "native" or dev == "cuda" else 4  # Triton interpreter: few


@st.composite
def tensor_specs(draw, max_n=3000):
    n = draw(st.one_of(st.integers(0, 40), st.integers(41, max_n)))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1e-6, 1e-2, 1.0, 1e3, 6e4]))
    n_special = draw(st.integers(0, min(n, 4)))
    specials = [(draw(st.integers(0, max(n - 1, 0))), draw(st.sampled_from(SPECIALS))) for _ in range(n_special)]
    return n, dtype, seed, magnitude, specials


def _make(spec, dev, dtype=None, finite=False):
    n, dt, seed, magnitude, specials = spec
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * magnitude
    for i, v in specials:
        if not finite or math.isfinite(v):
            x[i] = v
    return x.to(dtype or dt).to(dev)


def _same(a, b, what):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)


INV_SCALES = [1.0, 2.0**-16, 2.0**-7, 0.5, 3.0, 1.0 / 3.0, 0.0, 2.0**10, 1e-30, 2.0**100]


def _check_unscale(backend, dev, specs, inv, write_back, compute_sumsq):
    grads = [_make(s, dev) for s in specs]
    ref_grads = [g.clone() for g in grads]
    found, ref_found = torch.zeros((), device=dev), torch.zeros((), device=dev)
    inv_t = torch.full((), inv, device=dev)
    impl = backends.get_impl("unscale_check_", backend)
    out = impl(grads, found, inv_t, write_back, compute_sumsq)
    ref = reference.unscale_check_(ref_grads, ref_found, inv_t, write_back, compute_sumsq)
    _same(found, ref_found, "found_inf")
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        _same(a, b, f"grad {i}")
    if compute_sumsq:
        if torch.isfinite(ref):
            torch.testing.assert_close(out, ref, rtol=SUMSQ_RTOL, atol=0)
        else:
            assert not torch.isfinite(out) or bool(ref_found)


@pytest.mark.parametrize("backend, dev", _cases("unscale_check_"))
def test_unscale_check_matches_reference(backend, dev):
    @settings(max_examples=_examples(backend, dev, 60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(tensor_specs(), min_size=1, max_size=5), st.sampled_from(INV_SCALES), st.booleans(), st.booleans())
    def prop(specs, inv, write_back, compute_sumsq):
        _check_unscale(backend, dev, specs, inv, write_back, compute_sumsq)

    prop()


SCALES = [0.0, 1e-45, 1.0, 2.0**16, 2.0**127, 3.0e38, 0.75, 65504.0]


@pytest.mark.parametrize("backend, dev", _cases("update_scale_"))
def test_update_scale_matches_reference(backend, dev):
    @settings(max_examples=_examples(backend, dev, 150), deadline=None)
    @given(
        scale=st.sampled_from(SCALES),
        tracker=st.integers(0, 10),
        hyst_tracker=st.integers(0, 4),
        found=st.sampled_from([0.0, 1.0, 2.0, math.nan, -1.0]),
        growth=st.sampled_from([2.0, 1.5, 4.0]),
        backoff=st.sampled_from([0.5, 0.25, 0.9]),
        interval=st.integers(1, 6),
        hysteresis=st.integers(1, 3),
        bounds=st.sampled_from([(0.0, math.inf), (1.0, 2.0**24), (2.0**-10, 2.0**20)]),
    )
    def prop(scale, tracker, hyst_tracker, found, growth, backoff, interval, hysteresis, bounds):
        outs = []
        for impl in (backends.get_impl("update_scale_", backend), reference.update_scale_):
            s = torch.full((), scale, device=dev)
            gt = torch.full((), tracker, dtype=torch.int32, device=dev)
            ht = torch.full((), hyst_tracker, dtype=torch.int32, device=dev)
            impl(s, gt, ht, torch.full((), found, device=dev), growth, backoff, interval, hysteresis, *bounds)
            outs.append((s, gt, ht))
        for a, b, name in zip(outs[0], outs[1], ("scale", "growth_tracker", "hysteresis_tracker")):
            _same(a, b, name)

    prop()


@st.composite
def adamw_cases(draw):
    k = draw(st.integers(1, 3))
    pdtype = draw(st.sampled_from(DTYPES))
    gdtype = draw(st.sampled_from(DTYPES))
    sizes = [draw(st.one_of(st.integers(0, 20), st.integers(21, 2500))) for _ in range(k)]
    return dict(
        pdtype=pdtype,
        gdtype=gdtype,
        master=pdtype != torch.float32 and draw(st.booleans()),
        sizes=sizes,
        seed=draw(st.integers(0, 2**31 - 1)),
        grad_specials=draw(st.booleans()),
        amsgrad=draw(st.booleans()),
        maximize=draw(st.booleans()),
        found=draw(st.sampled_from([None, 0.0, 1.0, math.nan])),
        lr=draw(st.sampled_from([1e-3, 0.1, 0.0])),
        step=draw(st.integers(1, 10_000)),
        wd=draw(st.sampled_from([0.0, 0.01, 0.5])),
        grad_mul=draw(st.sampled_from([None, 2.0**-10, 0.3])),
        betas=draw(st.sampled_from([(0.9, 0.999), (0.5, 0.9), (0.0, 0.0), (0.3, 0.99)])),
        eps=draw(st.sampled_from([1e-8, 0.0, 1e-3])),
    )


def _adamw_lists(c, dev, seed_offset=0):
    g = torch.Generator().manual_seed(c["seed"] + seed_offset)
    params, grads, masters, m, v, vmax = [], [], [], [], [], []
    for n in c["sizes"]:
        p = torch.randn(n, generator=g)
        params.append(p.to(c["pdtype"]).to(dev))
        if c["master"]:
            masters.append((p + torch.randn(n, generator=g) * 1e-4).to(dev))  # a master off the bf16 grid
        gr = torch.randn(n, generator=g) * 10
        if c["grad_specials"] and n:
            gr[torch.randint(0, n, (1,), generator=g)] = math.inf if n % 2 else math.nan
        grads.append(gr.to(c["gdtype"]).to(dev))
        m.append((torch.randn(n, generator=g) * 0.1).to(dev))
        v.append(torch.rand(n, generator=g).to(dev) * 0.01)
        vmax.append(v[-1] * 1.5 if c["amsgrad"] else None)
    return params, grads, masters, m, v, [x for x in vmax if x is not None]


@pytest.mark.parametrize("backend, dev", _cases("adamw_"))
def test_adamw_matches_reference(backend, dev):
    @settings(max_examples=_examples(backend, dev, 50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(adamw_cases())
    def prop(c):
        gm = None if c["grad_mul"] is None else torch.full((), c["grad_mul"], device=dev)
        scalars = reference.adamw_step_scalars(
            c["lr"], torch.full((), float(c["step"]), device=dev), *c["betas"], c["wd"], gm
        )
        found = None if c["found"] is None else torch.full((), c["found"], device=dev)
        a = _adamw_lists(c, dev)
        b = [[t.clone() for t in lst] for lst in a]
        kw = (c["betas"][0], c["betas"][1], c["eps"], c["amsgrad"], c["maximize"])
        backends.get_impl("adamw_", backend)(*a, scalars, found, *kw)
        reference.adamw_(*b, scalars, found, *kw)
        for name, x, y in zip(("params", "grads", "masters", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"), a, b):
            for i, (s, t) in enumerate(zip(x, y)):
                if backend == "triton" and dev == "cuda":
                    torch.testing.assert_close(s.float(), t.float(), rtol=ADAMW_GPU_RTOL, atol=0, equal_nan=True)
                else:
                    _same(s, t, f"{name}[{i}]")

    prop()


@pytest.mark.parametrize("backend, dev", _cases("unscale_check_stats_"))
def test_unscale_check_stats_matches_reference(backend, dev):
    @settings(max_examples=_examples(backend, dev, 40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(tensor_specs(), min_size=1, max_size=4), st.sampled_from(INV_SCALES), st.booleans())
    def prop(specs, inv, write_back):
        outs = []
        for impl in (backends.get_impl("unscale_check_stats_", backend), reference.unscale_check_stats_):
            grads = [_make(s, dev) for s in specs]
            found = torch.zeros((), device=dev)
            counts = torch.zeros((len(grads), 3), dtype=torch.int64, device=dev)
            absmax = torch.zeros(len(grads), device=dev)
            impl(grads, found, torch.full((), inv, device=dev), write_back, False, counts, absmax)
            outs.append((found, counts, absmax, *grads))
        for i, (a, b) in enumerate(zip(*outs)):
            _same(a, b, f"output {i}")

    prop()


@pytest.mark.parametrize("backend, dev", _cases("sgd_"))
def test_sgd_matches_reference(backend, dev):
    @settings(max_examples=_examples(backend, dev, 40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(adamw_cases(), st.sampled_from([0.0, 0.9]), st.sampled_from([0.0, 0.1]), st.booleans())
    def prop(c, momentum, dampening, nesterov):
        nesterov = nesterov and momentum > 0 and dampening == 0
        scalars = reference.sgd_step_scalars(c["lr"], torch.full((), float(c["step"] % 2), device=dev))
        found = None if c["found"] is None else torch.full((), c["found"], device=dev)
        res = []
        for impl in (backends.get_impl("sgd_", backend), reference.sgd_):
            params, grads, masters, m, _v, _vm = _adamw_lists(c, dev)
            impl(
                params,
                grads,
                masters,
                m if momentum else [],
                scalars,
                found,
                None,
                0,
                momentum,
                dampening,
                c["wd"],
                nesterov,
                c["maximize"],
            )
            res.append(params + masters + m)
        for i, (a, b) in enumerate(zip(*res)):
            _same(a, b, f"tensor {i}")

    prop()


@pytest.mark.parametrize("backend, dev", _cases("adamw_bf16_"))
def test_adamw_bf16_matches_reference(backend, dev):
    @settings(max_examples=_examples(backend, dev, 40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(adamw_cases(), st.booleans())
    def prop(c, stochastic):
        c = dict(c, pdtype=torch.bfloat16, master=False)
        gm = None if c["grad_mul"] is None else torch.full((), c["grad_mul"], device=dev)
        scalars = reference.adamw_step_scalars(
            c["lr"], torch.full((), float(c["step"]), device=dev), *c["betas"], c["wd"], gm
        )
        found = None if c["found"] is None else torch.full((), c["found"], device=dev)
        rng = torch.tensor([1234, c["step"]], dtype=torch.int64, device=dev) if stochastic else None
        res = []
        for impl in (backends.get_impl("adamw_bf16_", backend), reference.adamw_bf16_):
            params, grads, _masters, m, v, vmax = _adamw_lists(c, dev)
            rems = [] if stochastic else [reference.split_master(p.float() + 1e-4)[1] for p in params]
            impl(
                params,
                grads,
                rems,
                m,
                v,
                vmax,
                scalars,
                found,
                rng,
                0,
                c["betas"][0],
                c["betas"][1],
                c["eps"],
                c["amsgrad"],
                c["maximize"],
            )
            res.append(params + rems + m + v + vmax)
        for i, (a, b) in enumerate(zip(*res)):
            _same(a, b, f"tensor {i}")

    prop()
