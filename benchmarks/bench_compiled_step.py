"""Host time of a compiled optimizer step: ``torch.compile(fullgraph=True)`` around ``opt.step()``.

What a user who compiles the step pays per call, beside the eager step, as the param count
grows (issue 21: host overhead; the compiled step is a path users take). Per param count,
in a fresh process with its own inductor cache directory (a cached graph of another run is
never reused: inductor's FX graph cache can hand one run's code to another whose inputs
alias differently), params of ``--numel`` fp32 elements with grads, native CPU, 1 thread:

* ``eager``: ``opt.step()``, median over ``--calls`` calls after two warm-up steps;
* ``compile s``: the first compiled call (trace + compile);
* ``compiled``: the median compiled call after three warm ones (guards, input fetching,
  inductor's wrapper, the kernel ops);
* providers: ``fastamp`` (``fastamp.optim.AdamW``, backend native) and, with ``--torch``,
  torch's ``AdamW(foreach=True)`` compiled the same way, as its tutorials show (without
  ``fullgraph``: torch's step wrapper breaks the graph); its compile takes minutes at
  1,000 params on 2 cores.

The elements are few (64 per param by default), so the times are host time, not bandwidth.
Timing only: every compiled step's bit-identity with eager is asserted by
``tests/api/test_compile_*.py``; here the compiled and eager params are compared after the
same 24 steps: "bit-identical", or the largest absolute difference of any element ("max abs diff").

``python benchmarks/bench_compiled_step.py [--params 250,500,1000,2000] [--torch] [--tag T]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

_WORKER = r"""
import json, statistics, sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
import fastamp
n, numel, calls, provider = {n}, {numel}, {calls}, {provider!r}


def make():
    gen = torch.Generator().manual_seed(n)
    ps = [torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(n)]
    gs = [torch.randn(numel, generator=gen) * 1e-2 for _ in range(n)]
    for p, g in zip(ps, gs):
        p.grad = g
    if provider == "torch":
        opt = torch.optim.AdamW(ps, lr=1e-3, foreach=True)
    else:
        opt = fastamp.optim.AdamW(ps, lr=1e-3, backend="native")
    return ps, opt


def timed(fn, k):
    out = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


ps_e, opt_e = make()
for _ in range(2):
    opt_e.step()
eager = timed(opt_e.step, calls)
ps_c, opt_c = make()
step = torch.compile(opt_c.step, fullgraph=(provider != "torch"))
t0 = time.perf_counter()
step()
compile_s = time.perf_counter() - t0
for _ in range(3):
    step()
compiled = timed(step, calls)
# the compiled optimizer took 1 + 3 + calls steps, the eager one 2 + calls: step the eager one to match
for _ in range(2):
    opt_e.step()
diff = max(float((a - b).abs().max()) for a, b in zip(ps_e, ps_c))
exact = all(torch.equal(a, b) for a, b in zip(ps_e, ps_c))
print(json.dumps({{"eager": eager, "compile_s": compile_s, "compiled": compiled, "diff": diff, "exact": exact}}))
"""


def _run(n: int, numel: int, calls: int, provider: str, timeout_s: int) -> dict:
    code = _WORKER.format(root=ROOT, n=n, numel=numel, calls=calls, provider=provider)
    with tempfile.TemporaryDirectory(prefix="fastamp-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
        try:
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s} s"}
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["(no output)"])[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_report(path: str, info: dict, rows: list[dict], numel: int, calls: int) -> None:
    lines = ["# Compiled optimizer step: host time per call against the eager step", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [
        f"- {numel} fp32 elements per param, 1 thread, medians of {calls} calls; each row its own "
        "process and inductor cache",
        "",
    ]
    lines += common.markdown_table(rows, common.columns_of(rows)).splitlines()
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="250,500,1000,2000", help="param counts, comma-separated")
    parser.add_argument("--numel", type=int, default=64, help="elements per param")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per mode (median)")
    parser.add_argument("--torch", action="store_true", help="also torch's AdamW(foreach=True), compiled (slow)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per worker process")
    parser.add_argument("--out", default=None, help="output directory (default: benchmarks/results)")
    parser.add_argument("--tag", default="cpu", help="suffix of the output file names")
    args = parser.parse_args(argv)
    out_dir = args.out or common.DEFAULT_OUT
    os.makedirs(out_dir, exist_ok=True)
    import torch

    info = common.machine_info(torch.device("cpu"))
    rows = []
    providers = ["fastamp"] + (["torch"] if args.torch else [])
    for n in (int(x) for x in args.params.split(",")):
        for provider in providers:
            common.log(f"{provider}, {n} params: compiling")
            r = _run(n, args.numel, args.calls, provider, args.timeout)
            row = {"params": n, "provider": provider}
            if "error" in r:
                row["error"] = r["error"]
            else:
                eager, compiled = statistics.median(r["eager"]), statistics.median(r["compiled"])
                row.update(
                    {
                        "eager ms": round(eager * 1e3, 3),
                        "eager us per param": round(eager / n * 1e6, 2),
                        "compile s": round(r["compile_s"], 1),
                        "compiled ms": round(compiled * 1e3, 3),
                        "compiled spread ms": f"{min(r['compiled']) * 1e3:.2f}-{max(r['compiled']) * 1e3:.2f}",
                        "compiled us per param": round(compiled / n * 1e6, 2),
                        "compiled / eager": round(compiled / eager, 1),
                        "compiled == eager": "bit-identical" if r["exact"] else f"max abs diff {r['diff']:.3g}",
                    }
                )
            rows.append(row)
    info["load_avg_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    base = os.path.join(out_dir, f"bench_compiled_step-{args.tag}")
    common.write_csv(base + ".csv", rows)
    write_report(base + ".md", info, rows, args.numel, args.calls)
    print(f"wrote {base}.csv and {base}.md")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
