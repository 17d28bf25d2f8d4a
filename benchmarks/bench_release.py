"""Gradient release (issue 23): peak bytes of live grads during a step, and the step time.

A stack of ``--layers`` ``Linear(dim, dim)`` blocks (ReLU between them), bf16 params with int16
remainder masters, ``fastamp.AdamW``, on CPU. Providers:

``ordinary``        ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``
``release-<size>``  ``h = fastamp.release(model, opt, bucket_bytes=<size>)``; ``h.backward(loss)``

and the two-backward scheme (part 2), on the same layers in fp16 with fp32 masters, a
``fastamp.Scaler`` and global clipping (``--max-norm``, binding here):

``ordinary-amp``        ``scaler.scale(loss).backward(); scaler.clip_grad_norm_(opt, max_norm);
                        scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)``
``release-amp-<size>``  ``h = fastamp.release(model, opt, scaler=scaler, max_norm=max_norm,
                        bucket_bytes=<size>)``; ``h.backward(loss)``

(``time_vs_ordinary`` of an amp row is against ``ordinary-amp``.)

Live grads: the bytes of the distinct storages of the params' ``.grad`` tensors, summed over
the model, sampled in a post-accumulate-grad hook of every param that runs before release's
own (the moment a new grad is there and nothing was freed yet: the peaks) and after backward.
It counts ``.grad`` tensors only, not autograd's buffers of grads still in flight (the same in
both paths). The goal of the issue: peak live grads <= the largest bucket (its params' bytes:
a grad is as large as its param here) + 1 MiB.

Before timing, every release provider is checked against ``ordinary`` bit for bit (params, the
optimizer's ``state_dict()`` and the scaler's) over ``--check-steps`` steps. Step time: forward + backward + step, median over
``--steps`` interleaved steps (min and max with it). Writes ``results/bench_release-<device>.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import fastamp  # noqa: E402
from fastamp import _harness  # noqa: E402

MiB = 1 << 20


def _model(layers: int, dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(dim, dim), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks).to(torch.bfloat16)


def _live_grad_bytes(params: list[torch.Tensor]) -> int:
    seen, total = set(), 0
    for p in params:
        g = p.grad
        if g is not None:
            s = g.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


class Run:
    """One provider: its model, optimizer, scaler (amp rows), handle (None: ordinary) and the peak it saw."""

    def __init__(
        self, name: str, bucket_bytes: int | None, layers: int, dim: int, max_norm: float | None = None
    ) -> None:
        self.name, self.bucket_bytes = name, bucket_bytes
        self.amp = max_norm is not None
        self.max_norm = max_norm
        self.model = _model(layers, dim)
        if self.amp:
            self.model.to(torch.float16)
        self.params = list(self.model.parameters())
        masters = True if self.amp else "remainder"
        self.opt = fastamp.AdamW(self.params, lr=1e-3, weight_decay=0.01, master_weights=masters)
        self.scaler = fastamp.Scaler("cpu", init_scale=2.0**12) if self.amp else None
        self.peak = 0
        # registered before release's hooks: they see each new grad before a bucket's step frees any
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._sample)
        self.h = None
        if bucket_bytes is not None:
            self.h = fastamp.release(
                self.model, self.opt, scaler=self.scaler, max_norm=max_norm, bucket_bytes=bucket_bytes
            )

    def _sample(self, _p: torch.Tensor) -> None:
        self.peak = max(self.peak, _live_grad_bytes(self.params))

    def largest_bucket(self) -> int:
        if self.h is None:
            return sum(p.numel() * p.element_size() for p in self.params)
        return max(sum(p.numel() * p.element_size() for p in b) for b in self.h.buckets)

    def step(self, x: torch.Tensor) -> None:
        loss = self.model(x.to(self.params[0].dtype)).float().square().mean()
        if self.h is None and self.amp:
            self.scaler.scale(loss).backward()
            self.peak = max(self.peak, _live_grad_bytes(self.params))
            self.scaler.clip_grad_norm_(self.opt, self.max_norm)
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
        elif self.h is None:
            loss.backward()
            self.peak = max(self.peak, _live_grad_bytes(self.params))
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            self.h.backward(loss)
            self.peak = max(self.peak, _live_grad_bytes(self.params))


def _base_of(runs: list[Run], r: Run) -> Run:
    """The ordinary run a provider is checked and timed against (``ordinary``, or ``ordinary-amp``)."""
    return next(b for b in runs if b.h is None and b.amp == r.amp)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same size (NaNs and -0.0 compare by their bits)."""
    if t.dtype.is_floating_point and t.element_size() in common._INT_OF_SIZE:
        return t.view(common._INT_OF_SIZE[t.element_size()])
    return t


def same_bits(a: object, b: object) -> bool:
    """Whether two params, state dicts (nested dicts / lists / tensors / numbers) hold the same bits."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a == b


def same_run(params_a: list, opt_a, params_b: list, opt_b, scaler_a=None, scaler_b=None) -> bool:
    """Params, the optimizer's whole state_dict and the scaler's state, bit for bit."""
    ok = same_bits(list(params_a), list(params_b)) and same_bits(opt_a.state_dict(), opt_b.state_dict())
    if scaler_a is not None or scaler_b is not None:
        ok = ok and scaler_a is not None and scaler_b is not None and scaler_a.state_dict() == scaler_b.state_dict()
    return ok


def _check(runs: list[Run], steps: int, dim: int) -> dict[str, str]:
    out = {}
    for i in range(steps):
        x = torch.randn(8, dim, generator=torch.Generator().manual_seed(i))
        for r in runs:
            r.step(x)
    for r in runs:
        base = _base_of(runs, r)
        if base is r:
            out[r.name] = "reference"
            continue
        ok = same_run(base.params, base.opt, r.params, r.opt, base.scaler, r.scaler)
        out[r.name] = "ok" if ok else "DIFFERS"
    return out


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--buckets-mib", default="32,4,0", help="release bucket sizes in MiB (0: a bucket per param)")
    parser.add_argument(
        "--amp-buckets-mib", default="32,0", help="bucket sizes of the scaler + clip rows ('': none of them)"
    )
    parser.add_argument("--max-norm", type=float, default=1e-3, help="the clip of the amp rows (binding)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per provider (interleaved)")
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="smoke sizes: 24 layers of 64")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.steps, args.check_steps = 64, 2, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    sizes = [float(s) for s in args.buckets_mib.split(",")]
    runs = [Run("ordinary", None, args.layers, args.dim)]
    runs += [Run(f"release-{s:g}MiB", int(s * MiB), args.layers, args.dim) for s in sizes]
    amp_sizes = [float(s) for s in args.amp_buckets_mib.split(",") if s]
    if amp_sizes:
        runs.append(Run("ordinary-amp", None, args.layers, args.dim, args.max_norm))
        runs += [Run(f"release-amp-{s:g}MiB", int(s * MiB), args.layers, args.dim, args.max_norm) for s in amp_sizes]
    checks = _check(runs, args.check_steps, args.dim)
    for r in runs:
        r.peak = 0
    times: dict[str, list[float]] = {r.name: [] for r in runs}
    for i in range(args.steps):
        x = torch.randn(8, args.dim, generator=torch.Generator().manual_seed(100 + i))
        for r in runs:
            t0 = time.perf_counter()
            r.step(x)
            times[r.name].append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in runs[0].params)
    rows = []
    for r in runs:
        base_ms = statistics.median(times[_base_of(runs, r).name]) * 1e3
        ms = statistics.median(times[r.name]) * 1e3
        largest = r.largest_bucket()
        rows.append(
            {
                "provider": r.name,
                "check": checks[r.name],
                "params": n_params,
                "buckets": 1 if r.h is None else len(r.h.buckets),
                "largest_bucket_mib": round(largest / MiB, 3),
                "peak_live_grads_mib": round(r.peak / MiB, 3),
                "goal_mib": "" if r.h is None else round(largest / MiB + 1, 3),
                "meets_goal": "" if r.h is None else r.peak <= largest + MiB,
                "step_ms": round(ms, 2),
                "step_ms_min": round(min(times[r.name]) * 1e3, 2),
                "step_ms_max": round(max(times[r.name]) * 1e3, 2),
                "time_vs_ordinary": round(ms / base_ms, 3),
            }
        )
    for r in runs:
        if r.h is not None:
            r.h.remove()
    out_dir = args.out or common.DEFAULT_OUT
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"bench_release-{args.tag or device.type + ('-quick' if args.quick else '')}")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    info = _harness.machine_info(device)
    lines = [
        "# bench_release: peak live grads and step time, gradient release vs the ordinary step",
        "",
        *common.header_lines(info),
        "",
        f"{args.layers} x Linear({args.dim}, {args.dim}) + ReLU, bf16 params, master_weights='remainder', "
        f"fastamp.AdamW; batch 8; {args.steps} timed steps (interleaved), {args.check_steps} checked bit for bit.",
        f"amp rows: the same layers in fp16, master_weights=True, fastamp.Scaler(init_scale=2**12), clip max_norm="
        f"{args.max_norm:g} (binding); time_vs_ordinary against ordinary-amp.",
        "Live grads = bytes of the params' `.grad` storages, sampled as each grad is accumulated and after backward.",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "---|" * len(rows[0]),
    ]
    lines += ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    common.log(f"wrote {stem}.csv and .md")
    for row in rows:
        common.log(str(row))
    return rows


if __name__ == "__main__":
    rows = main()
    sys.exit(0 if all(r["check"] in ("ok", "reference") for r in rows) else 1)
