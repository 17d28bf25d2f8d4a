"""Benchmark the scaler's gradient pass: non-finite check, global norm, unscale (and clip).

Three scenarios, each functionally the same across its providers:

``unscale+clip``  grads end unscaled and clipped to ``max_norm``, the total norm is returned
                  and ``found_inf`` set: torch's ``_amp_foreach_non_finite_check_and_unscale_``
                  (what ``GradScaler.unscale_`` runs) + ``clip_grad_norm_(foreach=True)``, vs
                  fastamp's check+norm pass then one unscale*clip write pass (what
                  ``fastamp.Scaler.clip_grad_norm_`` does for an optimizer without amp support).
``unscale+norm``  grads unscaled, norm returned, no clipping: torch's unscale + ``get_total_norm``,
                  vs fastamp's single check+norm+unscale pass.
``check+norm``    found_inf and the norm only, grads untouched: what a fused fastamp optimizer needs
                  (the unscale and the clip factor are folded into its step). torch has no such
                  path, so it is compared with torch's ``unscale+clip``, which is what a torch user
                  who clips must run.
``check+stats``   ``check+norm`` with per-tensor gradient health statistics written in the same
                  pass (``counts=``, ``absmax=`` of :func:`fastamp.functional.unscale_check_`:
                  non-finite, zeros, fp16 underflow, absmax; issue #8). The same bytes are moved;
                  the summary gives its time over ``check+norm``'s (target: < 1.10).
``unscale+stats`` ``unscale+norm`` with the same statistics (write_back=True), vs ``unscale+norm``.

Run ``python benchmarks/bench_unscale.py --quick`` for a smoke test, without flags for the
full sweep (the issue's targets: 64M elements in 256 tensors, 20,000 tensors of 256).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import Provider  # noqa: E402

from fastamp import functional as F  # noqa: E402
from fastamp import reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIZES_FOR_CHECK = [1, 7, 4099, 65537, 256, 3, 0, 131]
# The passes of each fastamp scenario, stream by stream (common.parse_traffic; s: grad bytes).
FASTAMP_TRAFFIC = {"unscale+clip": "g:r{s} ; g:rw{s}", "unscale+norm": "g:rw{s}", "check+norm": "g:r{s}"}


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, 2.0, foreach=True)
    norms = torch._foreach_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)


# Each implementation: (params, grads, found_inf, inv_scale, max_norm) -> total norm tensor.
def torch_unscale_clip(params, grads, found_inf, inv_scale, max_norm):
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


def torch_unscale_norm(params, grads, found_inf, inv_scale, max_norm):
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    return _total_norm(grads)


def fastamp_unscale_clip(backend: str) -> Callable:
    def run(params, grads, found_inf, inv_scale, max_norm):
        sumsq = F.unscale_check_(grads, found_inf, inv_scale, write_back=False, compute_sumsq=True, backend=backend)
        norm = sumsq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        F.unscale_check_(grads, found_inf, inv_scale * coef, write_back=True, backend=backend)
        return norm

    return run


def fastamp_unscale_norm(backend: str) -> Callable:
    def run(params, grads, found_inf, inv_scale, max_norm):
        return F.unscale_check_(
            grads, found_inf, inv_scale, write_back=True, compute_sumsq=True, backend=backend
        ).sqrt()

    return run


def fastamp_check_norm(backend: str) -> Callable:
    def run(params, grads, found_inf, inv_scale, max_norm):
        return F.unscale_check_(
            grads, found_inf, inv_scale, write_back=False, compute_sumsq=True, backend=backend
        ).sqrt()

    return run


def fastamp_with_stats(backend: str, write_back: bool) -> Callable:
    """check (or unscale) + norm + per-tensor health statistics in one pass; the stats tensors are reused."""
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(params, grads, found_inf, inv_scale, max_norm):
        st = cache.get(len(grads))
        if st is None or st[0].device != found_inf.device:
            st = cache[len(grads)] = (
                torch.zeros(len(grads), 3, dtype=torch.int64, device=found_inf.device),
                torch.zeros(len(grads), dtype=torch.float32, device=found_inf.device),
            )
        run.stats = st
        return F.unscale_check_(
            grads, found_inf, inv_scale, write_back=write_back, compute_sumsq=True, counts=st[0], absmax=st[1],
            backend=backend,
        ).sqrt()  # fmt: skip

    run.stats = None
    return run


def make_stats_check(impl: Callable, write_back: bool, dtype: torch.dtype, device: torch.device) -> Callable[[], str]:
    """Counts and absmax equal fastamp.reference.unscale_check_stats_ on adversarial grads; grads and norm too."""

    def check() -> str:
        gen = torch.Generator().manual_seed(2)
        grads = [(torch.randn(n, generator=gen) * 1024).to(dtype) for n in SIZES_FOR_CHECK]
        for g in grads:
            if g.numel() >= 7:
                g[0], g[1], g[2] = 0.0, -0.0, 2.0**-20  # zeros, and a value that underflows fp16 after unscaling
                g[3] = 2.0**-13 if dtype != torch.float16 else 2.0**-14
        grads[2][5] = float("inf")
        grads[-1][-1] = float("nan")
        grads = [g.to(device) for g in grads]
        inv_scale = torch.full((1,), 1.0 / 1024, device=device)
        want = [g.clone() for g in grads]
        want_fi = torch.zeros(1, device=device)
        want_counts = torch.zeros(len(grads), 3, dtype=torch.int64, device=device)
        want_absmax = torch.zeros(len(grads), device=device)
        want_sumsq = reference.unscale_check_stats_(
            want, want_fi, inv_scale, write_back, True, want_counts, want_absmax
        )  # fmt: skip
        got = [g.clone() for g in grads]
        params = [torch.empty_like(g) for g in got]
        fi = torch.zeros(1, device=device)
        norm = impl(params, got, fi, inv_scale, 0.0)
        counts, absmax = impl.stats
        if not torch.equal(counts, want_counts):
            raise AssertionError(f"counts {counts.tolist()} != reference {want_counts.tolist()}")
        common.assert_close("absmax", absmax, want_absmax)
        common.assert_close("norm", norm.reshape(()), want_sumsq.sqrt().reshape(()))
        for i, (a, b) in enumerate(zip(got, want)):
            if not torch.equal(torch.nan_to_num(a.float(), nan=7.0), torch.nan_to_num(b.float(), nan=7.0)):
                raise AssertionError(f"grad[{i}] differs from the reference (write_back={write_back})")
        if float(fi) != float(want_fi) or float(fi) != 1.0:
            raise AssertionError(f"found_inf {float(fi)}, reference {float(want_fi)}, expected 1")
        return f"counts exact ({int(counts.sum())} counted), absmax, norm, grads and found_inf match the reference"

    return check


def _reference(scenario: str, grads, inv_scale, max_norm):
    """Expected grads, norm and found_inf for a scenario, from fastamp.reference."""
    dev = grads[0].device if grads else torch.device("cpu")
    g = [x.clone() for x in grads]
    fi = torch.zeros(1, device=dev)
    sumsq = reference.unscale_check_(g, fi, inv_scale, write_back=scenario != "check+norm", compute_sumsq=True)
    norm = sumsq.sqrt()
    if scenario == "unscale+clip":
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        g = [(x.float() * coef).to(x.dtype) for x in g]
    return g, norm, fi


def make_check(scenario: str, impl: Callable, dtype: torch.dtype, device: torch.device) -> Callable[[], str]:
    def check() -> str:
        gen = torch.Generator().manual_seed(1)
        base = [(torch.randn(n, generator=gen) * 1024).to(dtype).to(device) for n in SIZES_FOR_CHECK]
        inv_scale = torch.full((1,), 1.0 / 1024, device=device)
        want_g, want_norm, _ = _reference(scenario, base, inv_scale, 0.0)
        max_norm = float(want_norm) * 0.5  # make the clip bite
        want_g, want_norm, want_fi = _reference(scenario, base, inv_scale, max_norm)
        grads = [x.clone() for x in base]
        params = [torch.empty_like(x) for x in grads]
        for p, gr in zip(params, grads):
            p.grad = gr
        fi = torch.zeros(1, device=device)
        norm = impl(params, grads, fi, inv_scale, max_norm)
        # The clipped grads of a low-precision dtype are rounded once by fastamp (g*inv*coef)
        # and twice by the reference and torch (g*inv, then *coef): one ulp of the dtype.
        rtol = {torch.float32: common.CHECK_RTOL, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
        err = 0.0
        for i, (a, b) in enumerate(zip(grads, want_g)):
            err = max(err, common.assert_close(f"grad[{i}]", a, b, rtol=rtol, atol=0.0))
        common.assert_close("norm", norm.reshape(()), want_norm.reshape(()))
        assert float(fi) == float(want_fi) == 0.0, f"found_inf {float(fi)} on finite grads"
        bad = [x.clone() for x in base]
        bad[-1][-1] = float("inf")
        params = [torch.empty_like(x) for x in bad]
        for p, gr in zip(params, bad):
            p.grad = gr
        fi = torch.zeros(1, device=device)
        impl(params, bad, fi, inv_scale, max_norm)
        assert float(fi) == 1.0, f"found_inf {float(fi)} after an inf in the last element"
        return f"max abs grad error {err:.2g}; found_inf ok"

    return check


def make_setup(impl: Callable, n_tensors: int, per: int, dtype: torch.dtype, device: torch.device) -> Callable:
    def setup():
        grads = [(torch.randn(per, device=device)).to(dtype) for _ in range(n_tensors)]
        # Params are never read by these paths (only .grad); empty() reserves address space.
        params = [torch.empty(per, device=device, dtype=dtype) for _ in range(n_tensors)]
        for p, g in zip(params, grads):
            p.grad = g
        found_inf = torch.zeros(1, device=device)
        # Alternating 2 and 1/2 keeps the grads' values stable over repeated calls (exact
        # powers of two); max_norm is large so clipping multiplies by exactly 1.
        scales = [torch.full((1,), 2.0, device=device), torch.full((1,), 0.5, device=device)]
        state = {"i": 0}

        def run():
            state["i"] ^= 1
            return impl(params, grads, found_inf, scales[state["i"]], 1e30)

        return run

    return setup


def make_providers(args, device):
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"--dtypes: unknown dtype {d!r}; expected some of {list(DTYPES)}")

    def build(n_tensors: int, per: int, backends: list[str]) -> list[Provider]:
        out = []
        torch_impls = {"unscale+clip": torch_unscale_clip, "unscale+norm": torch_unscale_norm}
        torch_bytes = {"unscale+clip": 5, "unscale+norm": 3}
        torch_notes = {
            "unscale+clip": "_amp_foreach_non_finite_check_and_unscale_ (read+write) + clip_grad_norm_(foreach=True): "
            "norm (read) and clip multiply (read+write): 5 x grad bytes",
            "unscale+norm": "_amp_foreach_non_finite_check_and_unscale_ (read+write) + get_total_norm(foreach=True) (read): "
            "3 x grad bytes",
        }
        for sc, impl in torch_impls.items():
            out.append(
                Provider(
                    name="torch",
                    scenario=sc,
                    dtype="fp32",
                    bytes_per_elem=torch_bytes[sc] * 4,
                    setup=make_setup(impl, n_tensors, per, torch.float32, device),
                    check=make_check(sc, impl, torch.float32, device),
                    notes=torch_notes[sc],
                    traffic={"unscale+clip": "g:rw4 ; g:r4 ; g:rw4", "unscale+norm": "g:rw4 ; g:r4"}[sc],
                )
            )
        fa = {
            "unscale+clip": (
                fastamp_unscale_clip,
                3,
                "torch",
                "check+norm pass (read) then unscale*clip pass (read+write): 3 x grad bytes",
            ),
            "unscale+norm": (
                fastamp_unscale_norm,
                2,
                "torch",
                "one check+norm+unscale pass (read+write): 2 x grad bytes",
            ),
            "check+norm": (
                fastamp_check_norm,
                1,
                "torch@unscale+clip",
                "one read-only check+norm pass: 1 x grad bytes",
            ),
        }
        stats = {
            "check+stats": (False, 1, "torch@unscale+clip", "check+norm pass with per-tensor stats (read): 1 x grad bytes"),
            "unscale+stats": (True, 2, "torch@unscale+norm", "check+norm+unscale pass with stats (read+write): 2 x grad "
                              "bytes"),
        }  # fmt: skip
        for b in backends:
            for sc, (write_back, nbytes, baseline, note) in stats.items():
                for d in dtypes:
                    dt = DTYPES[d]
                    impl = fastamp_with_stats(b, write_back)
                    out.append(
                        Provider(
                            name=f"fastamp-{b}",
                            scenario=sc,
                            dtype=d,
                            bytes_per_elem=nbytes * dt.itemsize,
                            setup=make_setup(fastamp_with_stats(b, write_back), n_tensors, per, dt, device),
                            check=make_stats_check(impl, write_back, dt, device),
                            baseline=baseline,
                            notes=note
                            + "; the stats (3 int64 + 1 fp32 per tensor) are not counted"
                            + ("; the torch backend is the plain-torch reference" if b == "torch" else ""),
                            traffic=f"g:{'rw' if write_back else 'r'}{dt.itemsize}",
                        )
                    )
            for sc, (factory, nbytes, baseline, note) in fa.items():
                for d in dtypes:
                    dt = DTYPES[d]
                    impl = factory(b)
                    out.append(
                        Provider(
                            name=f"fastamp-{b}",
                            scenario=sc,
                            dtype=d,
                            bytes_per_elem=nbytes * dt.itemsize,
                            setup=make_setup(impl, n_tensors, per, dt, device),
                            check=make_check(sc, impl, dt, device),
                            baseline=baseline,
                            notes=note + ("; the torch backend is the plain-torch reference" if b == "torch" else ""),
                            traffic=FASTAMP_TRAFFIC[sc].format(s=dt.itemsize),
                        )
                    )
        return out

    return build


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--dtypes", default="fp32,bf16", help="grad dtypes of the fastamp rows (fp32,bf16,fp16)")
    args = parser.parse_args(argv)
    device = common.resolve_device(args.device)
    return common.run_benchmark(
        args,
        "bench_unscale",
        "unscale_check_",
        make_providers(args, device),
        "check + norm + unscale (+ clip): fastamp vs torch",
        summarise=_stats_overhead,
    )


def _stats_overhead(rows):
    """Issue #8: the check pass with health statistics vs without, same backend, dtype and size."""
    dts = sorted({r["dtype"] for r in rows if r["scenario"] == "check+stats"})
    pairs = [("check+stats", d, "check+norm", d) for d in dts] + [("unscale+stats", d, "unscale+norm", d) for d in dts]
    return common.ratio_lines(
        rows, pairs, "Gradient statistics overhead (same backend, dtype and size; issue #8 target: ratio < 1.10):"
    )


if __name__ == "__main__":
    main()
