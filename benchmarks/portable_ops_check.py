"""How often torch's CPU float ops differ from a correctly rounded (or fixed-order) result here.

fastamp's bit-exact claims may only rest on operations whose rounding is the same on every
CPU. IEEE basic operations (+ - * / and sqrt) are correctly rounded in hardware, but torch
does not always use the hardware instruction: its vectorised CPU kernels may call MKL VML or
Sleef (dispatched by CPU vendor and instruction set), may contract ``a*b + c`` into one FMA,
and sum in an order that depends on the vector width and the thread count. This script
measures, on the machine it runs on, the share of random inputs where a torch op differs
from a correctly rounded result, and whether reductions change with threads or ISA.

    python benchmarks/portable_ops_check.py            # ~1 minute on 2 cores
    ATEN_CPU_CAPABILITY=default python benchmarks/portable_ops_check.py   # torch's non-SIMD build

Truth: numpy's float64 ops are the hardware's (``sqrtpd``, ``divpd``: correctly rounded),
and rounding a correctly rounded fp64 sqrt or quotient of fp32 inputs to fp32 is the
correctly rounded fp32 result (53 >= 2*24 + 2, so double rounding is innocuous). The fp64
truth itself is checked with exact integer arithmetic on a sample. For transcendental ops
(exp, log, tanh, pow) the fp64 value rounded to fp32 is correct except within ~2^-29 of an
fp32 midpoint (negligible at these sample sizes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
from fractions import Fraction

import numpy as np
import torch


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _positive_f32(n: int, gen: torch.Generator) -> torch.Tensor:
    """Positive normal fp32 values with uniformly random bit patterns (every binade alike)."""
    bits = torch.randint(0x00800000, 0x7F7FFFFF, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    return bits.view(torch.float32)


def _moderate_f32(n: int, gen: torch.Generator, lo: float, hi: float) -> torch.Tensor:
    return torch.empty(n, dtype=torch.float64).uniform_(lo, hi, generator=gen).float()


def _mismatch(actual: torch.Tensor, truth: np.ndarray) -> tuple[int, int]:
    """(elements that differ, largest difference in ulps of the truth's dtype)."""
    a = actual.numpy()
    diff = a != truth
    both_nan = np.isnan(a) & np.isnan(truth)
    diff &= ~both_nan
    if not diff.any():
        return 0, 0
    ia = a.view(np.int32 if a.dtype == np.float32 else np.int64).astype(np.int64)
    it = truth.view(np.int32 if truth.dtype == np.float32 else np.int64).astype(np.int64)
    return int(diff.sum()), int(np.abs(ia - it)[diff].max())


def _check_sqrt64_exact(x: np.ndarray, y: np.ndarray, k: int = 2000) -> bool:
    """y == correctly rounded sqrt(x) in fp64, proved with integers for the first k elements."""
    for xv, yv in zip(x[:k].tolist(), y[:k].tolist()):
        fx, fy = Fraction(xv), Fraction(yv)
        ulp = Fraction(math.ulp(yv))
        lo, hi = fy - ulp / 2, fy + ulp / 2
        # the exact root lies strictly between the neighbouring midpoints (no exact ties)
        if not (lo * lo < fx < hi * hi):
            return False
    return True


def measure(n: int, seed: int) -> list[tuple[str, int, int, int]]:
    gen = torch.Generator().manual_seed(seed)
    rows: list[tuple[str, int, int, int]] = []

    def row(name, actual, truth):
        d, u = _mismatch(actual, truth)
        rows.append((name, actual.numel(), d, u))

    x32 = _positive_f32(n, gen)
    x64n = x32.double().numpy()
    sqrt_true32 = np.sqrt(x64n).astype(np.float32)
    row("sqrt fp32 (vector)", torch.sqrt(x32), sqrt_true32)
    k = 20_000
    row("sqrt fp32 (0-d tensor, one by one)", torch.stack([x32[i].sqrt() for i in range(k)]), sqrt_true32[:k])
    row("_foreach_sqrt fp32 (torch's foreach AdamW)", torch._foreach_sqrt([x32])[0], sqrt_true32)
    row("sqrt fp32 via fp64 torch sqrt, rounded once", torch.sqrt(x32.double()).float(), sqrt_true32)
    row("pow(x, 0.5) fp32", torch.pow(x32, 0.5), sqrt_true32)
    row("x ** 0.5 fp32 (0-d, one by one)", torch.stack([x32[i] ** 0.5 for i in range(k)]), sqrt_true32[:k])

    x64 = torch.empty(n, dtype=torch.float64).uniform_(1e-300, 1.0, generator=gen) * torch.exp2(
        torch.randint(-500, 500, (n,), generator=gen).double()
    )
    x64 = x64[torch.isfinite(x64) & (x64 > 0)]
    sqrt_true64 = np.sqrt(x64.numpy())
    assert _check_sqrt64_exact(x64.numpy(), sqrt_true64), "numpy's fp64 sqrt is not correctly rounded here"
    row("sqrt fp64 (vector)", torch.sqrt(x64), sqrt_true64)
    row("sqrt fp64 (0-d tensor, one by one)", torch.stack([x64[i].sqrt() for i in range(k)]), sqrt_true64[:k])
    row("pow(x, 0.5) fp64", torch.pow(x64, 0.5), sqrt_true64)

    rs_true = (1.0 / np.sqrt(x64n)).astype(np.float32)
    row("rsqrt fp32", torch.rsqrt(x32), rs_true)
    row("reciprocal fp32", torch.reciprocal(x32), (1.0 / x64n).astype(np.float32))
    row("reciprocal fp64", torch.reciprocal(x64), 1.0 / x64.numpy())
    y32 = _positive_f32(n, gen)
    row("div fp32 (tensor / tensor)", x32 / y32, (x64n / y32.double().numpy()).astype(np.float32))
    s = y32[:1].clone()
    row("div fp32 (tensor / 0-d tensor)", x32 / s.reshape(()), (x64n / float(s)).astype(np.float32))
    row("mul fp32", x32 * y32 * 0.5, ((x64n * y32.double().numpy()).astype(np.float32) * np.float32(0.5)))

    e = _moderate_f32(n, gen, -80, 80)
    row("exp fp32", torch.exp(e), np.exp(e.double().numpy()).astype(np.float32))
    row("tanh fp32", torch.tanh(e / 16), np.tanh((e / 16).double().numpy()).astype(np.float32))
    row("log fp32", torch.log(x32), np.log(x64n).astype(np.float32))
    b = _moderate_f32(n, gen, 0.5, 1.0)
    st = _moderate_f32(n, gen, 1, 10_000).round()
    row(
        "pow(beta, step) fp32 (bias correction)",
        torch.pow(b, st),
        np.power(b.double().numpy(), st.double().numpy()).astype(np.float32),
    )
    b64, st64 = b.double(), st.double()
    # fp64 truth of fp64 pow is not available from numpy at the last bit: compare the two
    # fp64 pows rounded to fp32 instead (what adamw_step_scalars stores).
    row(
        "pow fp64 rounded to fp32",
        torch.pow(b64, st64).float(),
        np.power(b64.numpy(), st64.numpy()).astype(np.float32),
    )

    # Fused multiply-adds: torch's result vs the unfused one-rounding-per-op definition.
    a, c = _moderate_f32(n, gen, -1, 1), _moderate_f32(n, gen, -1, 1)
    d = _moderate_f32(n, gen, 0.01, 1)
    v = np.float32(-0.37)
    an, cn, dn = a.numpy(), c.numpy(), d.numpy()
    q = (cn / dn).astype(np.float32)
    row("addcdiv fp32 vs x + v*(a/b)", torch.addcdiv(a, c, d, value=float(v)), an + v * q)
    row("addcmul fp32 vs x + (v*a)*b", torch.addcmul(a, c, d, value=float(v)), an + (v * cn) * dn)
    row("add(alpha=v) fp32 vs x + v*a", torch.add(a, c, alpha=float(v)), an + v * cn)
    w = np.float32(0.1)
    row("lerp fp32 (w<0.5) vs a + w*(b-a)", torch.lerp(a, c, float(w)), an + w * (cn - an))
    fma_lerp = (an.astype(np.float64) + np.float64(w) * (cn - an).astype(np.float64)).astype(np.float32)
    row("lerp fp32 (w<0.5) vs fma(w, b-a, a)", torch.lerp(a, c, float(w)), fma_lerp)
    return rows


def step_scalars(steps: int) -> list[str]:
    """fastamp's fp32 AdamW step scalars (torch fp64 pow/sqrt) vs the same chain with a correctly rounded pow/sqrt."""
    from decimal import Decimal, getcontext

    from fastamp import reference

    getcontext().prec = 60
    lines = []
    for beta1, beta2 in ((0.9, 0.999), (0.9, 0.95), (0.95, 0.9999), (0.8, 0.99)):
        lr, wd = 1e-3, 0.01
        pow_differs = scal_differs = 0
        for s in range(1, steps + 1):
            got = reference.adamw_step_scalars(lr, torch.tensor(float(s)), beta1, beta2, wd)
            p1, p2 = float(Decimal(beta1) ** s), float(Decimal(beta2) ** s)
            for beta, exact in ((beta1, p1), (beta2, p2)):
                b, st = torch.tensor(beta, dtype=torch.float64), torch.tensor(float(s), dtype=torch.float64)
                pow_differs += float(torch.pow(b, st)) != exact
            bc1, bc2 = 1 - p1, 1 - p2
            bc2_sqrt = float((Decimal(bc2)).sqrt())  # correctly rounded fp64 sqrt
            want = torch.tensor([lr / bc1, bc2_sqrt, 1 - lr * wd, 1.0], dtype=torch.float64).float()
            scal_differs += not torch.equal(got, want)
        lines.append(
            f"  betas ({beta1}, {beta2}), steps 1..{steps}: torch fp64 pow(beta, step) != correctly rounded on "
            f"{pow_differs} of {2 * steps}; fp32 scalars differ on {scal_differs} of {steps}"
        )
    return lines


def _sum_once(x: torch.Tensor, threads: int) -> tuple[str, ...]:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outs = (
            x.sum(),
            torch.linalg.vector_norm(x),
            torch._foreach_norm([x, x[:12345]])[0],
            x.double().square().sum().float(),
        )
    finally:
        torch.set_num_threads(old)
    return tuple(float(o).hex() for o in outs)


def reductions(n: int, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-8, 8, (n,), generator=gen).float())
    exact = math.fsum(x.double().tolist())
    per_threads = {t: _sum_once(x, t) for t in sorted({1, 2, max(1, os.cpu_count() or 1)})}
    names = ("sum fp32", "vector_norm fp32", "_foreach_norm fp32", "sum of squares fp64 -> fp32")
    lines = []
    for i, name in enumerate(names):
        vals = {t: r[i] for t, r in per_threads.items()}
        same = len(set(vals.values())) == 1
        lines.append(f"  {name:<30} {'same for' if same else 'DIFFERS across'} threads {sorted(vals)}: {vals}")
    lines.append(f"  (exact sum: {exact!r}, torch fp32 sum: {float(x.sum())!r})")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2_000_000, help="random inputs per op")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20_000, help="optimizer steps for the step-scalar check")
    ap.add_argument("--no-subprocess", action="store_true", help="skip the ATEN_CPU_CAPABILITY=default run")
    args = ap.parse_args(argv)
    print(f"cpu: {_cpu_name()}  threads: {torch.get_num_threads()}  torch {torch.__version__}")
    print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}  mkl: {torch.backends.mkl.is_available()}")
    print()
    print("| op | inputs | differ from correctly rounded / definition | share | max ulps |")
    print("|---|---:|---:|---:|---:|")
    with np.errstate(over="ignore", invalid="ignore"):  # fp32 overflow of huge quotients: compared as inf
        rows = measure(args.n, args.seed)
    for name, total, d, u in rows:
        print(f"| {name} | {total:,} | {d:,} | {100.0 * d / max(total, 1):.4f}% | {u} |")
    print()
    print("AdamW step scalars (reference.adamw_step_scalars) vs a correctly rounded pow and sqrt:")
    for line in step_scalars(args.steps):
        print(line)
    print()
    print("reductions (bit patterns) by intra-op thread count:")
    for line in reductions(args.n // 2 + 17, args.seed):
        print(line)
    if not args.no_subprocess and os.environ.get("ATEN_CPU_CAPABILITY") is None:
        n = args.n // 2 + 17
        here = _fingerprint(n, args.seed)
        other = _fingerprint_in_subprocess(n, args.seed, "default")
        print()
        print(f"same results with ATEN_CPU_CAPABILITY=default as with {torch.backends.cpu.get_cpu_capability()}?")
        for key in here:
            print(f"  {key:<30} {'same' if here[key] == other.get(key) else 'DIFFERENT'}")


def _fingerprint(n: int, seed: int) -> dict[str, str]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    y = torch.rand(n, generator=gen) + 0.01
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {
            "sum fp32": x.sum(),
            "vector_norm fp32": torch.linalg.vector_norm(x),
            "_foreach_norm fp32": torch._foreach_norm([x])[0],
            "sqrt fp32": torch.sqrt(y),
            "addcdiv fp32": torch.addcdiv(x, x, y, value=-0.37),
            "addcmul fp32": torch.addcmul(x, x, y, value=-0.37),
            "add(alpha) fp32": torch.add(x, y, alpha=-0.37),
            "lerp fp32": torch.lerp(x, y, 0.1),
            "exp fp32": torch.exp(x),
        }
    finally:
        torch.set_num_threads(old)
    return {k: hashlib.sha1(v.numpy().tobytes()).hexdigest() for k, v in out.items()}


def _fingerprint_in_subprocess(n: int, seed: int, capability: str) -> dict[str, str]:
    code = (
        "import json, runpy, sys;"
        f"m = runpy.run_path({__file__!r}, run_name='fp');"
        f"print(json.dumps(m['_fingerprint']({n}, {seed})))"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
