"""Training-state bytes per parameter, measured from allocated tensors (issue 22's M1).

For each optimizer configuration: build the params (N tensors of M elements, or the small GPT of
the convergence study), give them grads, run one optimizer step (state is allocated lazily), then
add up the bytes of the distinct storages of the params, their grads and everything the optimizer
holds (``optimizer.state`` and the tensors in the optimizer's own attributes; tensor subclasses such
as torchao's ``OptimState8bit`` are opened with ``__tensor_flatten__``), divided by the number of
param elements. Rows:

- torch: ``AdamW(fused=True)`` on fp32 params (what torch's AMP keeps too: autocast leaves the
  params fp32) and on bf16 params (pure bf16: moments in bf16, no master);
- fastamp: every AdamW / Lion / SGD storage configuration that exists today;
- torchao ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8`` and bitsandbytes ``AdamW8bit`` on bf16 params, when
  they import (they are not fastamp dependencies: install them beside the pinned torch, e.g.
  ``pip install torch==2.13.0 torchao==0.18.0 bitsandbytes==0.50.2``);
- *computed*, not measured: FlashOptim 0.1.4 (its allocation code, databricks/flashoptim
  ``flashoptim/optimizers.py`` at 8b2d966: int8 codes + one fp16 scale per 32 elements per moment,
  an int8 (24-bit master) or int16 (32-bit) error-correction tensor; its quantised states exist only on
  CUDA), and fastamp's ulp8 + q8 under gradient release (no grads held) from
  ``fastamp/reference/layout.py``. The q8 / ulp8 configs themselves are measured.

Every fastamp row is checked against ``reference/layout.py``'s prediction for the same tensors
(``expected``; the bench fails if a measured fastamp row is off by more than 0.01 B/param). The
last table projects the training state of a 7-billion-parameter model from the measured bytes per
param at the large shape: a projection (params + grads + optimizer state; no activations, no
allocator overhead), not a measurement of a 7B model.

    python benchmarks/bench_memory.py                       # 256 x 262,144 bf16 + the small GPT
    python benchmarks/bench_memory.py --shape 64x4099 --no-gpt --quick
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_release  # noqa: E402

import fastamp  # noqa: E402
from fastamp._harness import machine_info, markdown_table, write_csv  # noqa: E402
from fastamp.reference import layout  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TOLERANCE = 0.01  # B/param between a measured fastamp row and layout.py (issue 22: "must match ±0.01")
PROJECTION_PARAMS = 7e9
# issue 23: params + optimizer state + peak live grads under gradient release, B/param
RELEASE_GOALS = {"ulp8 + q8": 5.1, "SR + q8": 4.1}
MiB = 1 << 20
SCALE = 2.0**12  # init_scale of the fp16 + Scaler rows (the release model's loss does not overflow at it)
PEAK_MARGIN = MiB  # bench_release's goal: peak live grads <= the largest bucket + 1 MiB

# FlashOptim 0.1.4's per-tensor allocation (computed): the codes are int8 [numel] per moment and
# the scales fp16 [ceil(numel / 32)] per moment (`quantize`, group_size=32); `error_bits` is int8
# for master_weight_bits=24 and int16 for 32 on bf16 params (`_ensure_state_initialized`).
FLASHOPTIM_GROUP = 32


def _flashoptim_bytes(numel: int, err_bytes: int, grad_bytes: int) -> int:
    moments = 2 * (numel + 2 * math.ceil(numel / FLASHOPTIM_GROUP))
    return 2 * numel + grad_bytes * numel + err_bytes * numel + moments


def _tensors_in(obj: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    if depth > 6:
        return
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors_in(v, out, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _tensors_in(v, out, depth + 1)


def _storages(t: torch.Tensor, seen: dict) -> None:
    """Record the distinct storages behind ``t``, opening wrapper subclasses (torchao's quantised states)."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            _storages(getattr(t, name), seen)
        return
    s = t.untyped_storage()
    if s.nbytes() and s.data_ptr():
        seen[(s.device.type, s.data_ptr())] = s.nbytes()


def measured_bytes(params: list[torch.Tensor], opt: torch.optim.Optimizer, others: list[Any] = ()) -> tuple[int, int]:
    """Bytes of the distinct storages of ``params``, their grads and the optimizer's tensors; and the param elements.

    ``others``: objects (a scaler, a release handle) whose attributes' tensors count too.
    """
    tensors: list[torch.Tensor] = []
    for obj in others:
        if obj is not None:
            _tensors_in(dict(vars(obj)), tensors)
    for p in params:
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
    _tensors_in(list(opt.state.values()), tensors)
    _tensors_in({k: v for k, v in vars(opt).items() if k not in ("state", "param_groups")}, tensors)
    seen: dict = {}
    for t in tensors:
        _storages(t, seen)
    return sum(seen.values()), sum(p.numel() for p in params)


# name -> (param dtype, optimizer factory or None, layout prediction or None, note)
Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def _fastamp(cls, **kw) -> Factory:
    return lambda ps: cls(ps, lr=1e-3, **kw)


def _torchao(name: str) -> Factory | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.optim as ao
    except Exception:  # noqa: BLE001 (any import failure: the row is reported as not installed)
        return None
    cls = getattr(ao, name, None)
    return None if cls is None else (lambda ps: cls(ps, lr=1e-3, bf16_stochastic_round=True))


def _bnb() -> Factory | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes as bnb
    except Exception:  # noqa: BLE001
        return None
    return lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)


def _expected(master: str, moments: str, n_moments: int) -> Callable[[list[int]], float]:
    """layout.py's bytes for tensors of these element counts (bf16 params and grads), per param."""

    def f(numels: list[int], grad_bytes: int = 2) -> float:
        total = sum(
            layout.state_bytes_per_param(master, moments, n_moments=n_moments, numel=n, grad_bytes=grad_bytes) * n
            for n in numels
        )
        return total / sum(numels)

    return f


def _expected_bf16_moments(master: str, n_moments: int) -> Callable[[list[int]], float]:
    # bf16 moments are not one of layout.py's formats (it describes fp32 and q8): 2 B per moment.
    base = _expected(master, "fp32", 0)
    return lambda numels, grad_bytes=2: base(numels, grad_bytes) + 2.0 * n_moments


def _expected_q8(master: str, min_numel: int = 4096, n_moments: int = 2) -> Callable[[list[int]], float]:
    """layout.py's bytes with the lowbit rule of every optimizer: tensors below ``min_numel`` keep fp32 moments."""

    def f(numels: list[int], grad_bytes: int = 2) -> float:
        total = sum(
            layout.state_bytes_per_param(
                master, "q8" if n >= min_numel else "fp32", n_moments=n_moments, numel=n, grad_bytes=grad_bytes
            )
            * n
            for n in numels
        )
        return total / sum(numels)

    return f


def _expected_q8_ulp8(min_numel: int = 4096) -> Callable[[list[int]], float]:
    """ulp8 + q8 with AdamW's rule: tensors below ``min_numel`` keep fp32 moments and a remainder master."""

    def f(numels: list[int], grad_bytes: int = 2) -> float:
        total = sum(
            (
                layout.state_bytes_per_param("ulp8", "q8", n_moments=2, numel=n, grad_bytes=grad_bytes)
                if n >= min_numel
                else layout.state_bytes_per_param("remainder", "fp32", n_moments=2, numel=n, grad_bytes=grad_bytes)
            )
            * n
            for n in numels
        )
        return total / sum(numels)

    return f


def configs() -> list[dict[str, Any]]:
    bf16 = torch.bfloat16
    f32 = torch.float32
    A, L, S = fastamp.optim.AdamW, fastamp.optim.Lion, fastamp.optim.SGD
    rows = [
        dict(name="torch AdamW fp32 (also torch AMP)", dtype=f32, make=lambda ps: torch.optim.AdamW(ps, fused=True)),
        dict(name="torch AdamW, pure bf16 (no master)", dtype=bf16, make=lambda ps: torch.optim.AdamW(ps, fused=True)),
        dict(name="fastamp AdamW fp32 master", dtype=bf16, make=_fastamp(A), expect=_expected("fp32", "fp32", 2)),
        dict(
            name="fastamp AdamW remainder",
            dtype=bf16,
            make=_fastamp(A, master_weights="remainder"),
            expect=_expected("remainder", "fp32", 2),
        ),
        dict(
            name="fastamp AdamW remainder + bf16 moments (10-B)",
            dtype=bf16,
            make=_fastamp(A, master_weights="remainder", state_dtype=bf16, stochastic_rounding=True, seed=0),
            expect=_expected_bf16_moments("remainder", 2),
        ),
        dict(
            name="fastamp AdamW stochastic rounding",
            dtype=bf16,
            make=_fastamp(A, stochastic_rounding=True, seed=0),
            expect=_expected("none", "fp32", 2),
        ),
        dict(
            name="fastamp AdamW SR + bf16 moments",
            dtype=bf16,
            make=_fastamp(A, stochastic_rounding=True, state_dtype=bf16, seed=0),
            expect=_expected_bf16_moments("none", 2),
        ),
        dict(
            name="fastamp AdamW remainder + q8",
            dtype=bf16,
            make=_fastamp(A, master_weights="remainder", state_format="q8", seed=0),
            expect=_expected_q8("remainder"),
        ),
        dict(
            name="fastamp AdamW ulp8 + q8",
            dtype=bf16,
            make=_fastamp(A, master_weights="ulp8", state_format="q8", seed=0),
            expect=_expected_q8_ulp8(),
            release_goal=RELEASE_GOALS["ulp8 + q8"],
        ),
        dict(
            name="fastamp AdamW ulp8 + q8, fp16 params + Scaler",
            dtype=torch.float16,
            make=_fastamp(A, master_weights="ulp8", state_format="q8", seed=0),
            expect=_expected_q8_ulp8(),
            scaler=True,
            release_goal=RELEASE_GOALS["ulp8 + q8"],
        ),
        dict(
            name="fastamp AdamW SR + q8",
            dtype=bf16,
            make=_fastamp(A, stochastic_rounding=True, state_format="q8", seed=0),
            expect=_expected_q8("none"),
            release_goal=RELEASE_GOALS["SR + q8"],
        ),
        dict(
            name="fastamp Lion remainder",
            dtype=bf16,
            make=_fastamp(L, master_weights="remainder"),
            expect=_expected("remainder", "fp32", 1),
        ),
        dict(
            name="fastamp Lion remainder + q8",
            dtype=bf16,
            make=_fastamp(L, master_weights="remainder", state_format="q8", seed=0),
            expect=_expected_q8("remainder", n_moments=1),
        ),
        dict(
            name="fastamp Lion SR + q8",
            dtype=bf16,
            make=_fastamp(L, stochastic_rounding=True, state_format="q8", seed=0),
            expect=_expected_q8("none", n_moments=1),
        ),
        dict(
            name="fastamp SGD momentum remainder",
            dtype=bf16,
            make=lambda ps: S(ps, lr=1e-3, momentum=0.9, master_weights="remainder"),
            expect=_expected("remainder", "fp32", 1),
        ),
        dict(
            name="fastamp SGD momentum remainder + q8",
            dtype=bf16,
            make=lambda ps: S(ps, lr=1e-3, momentum=0.9, master_weights="remainder", state_format="q8", seed=0),
            expect=_expected_q8("remainder", n_moments=1),
        ),
    ]
    for ao_name in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
        rows.append(dict(name=f"torchao {ao_name} + bf16 SR", dtype=bf16, make=_torchao(ao_name), missing="torchao"))
    rows.append(dict(name="bitsandbytes AdamW8bit", dtype=bf16, make=_bnb(), missing="bitsandbytes"))
    return rows


def computed_rows(numels: list[int]) -> list[dict[str, Any]]:
    """Rows computed from allocation code, not measured: FlashOptim, and fastamp's release configuration."""
    n = sum(numels)
    rows = []
    for label, err, grad in (
        ("FlashOptim AdamW, 24-bit master (default)", 1, 2),
        ("FlashOptim AdamW, 32-bit master", 2, 2),
        ("FlashOptim AdamW, 24-bit, gradient release", 1, 0),
    ):
        b = sum(_flashoptim_bytes(k, err, grad) for k in numels)
        rows.append(dict(config=label, source="computed (flashoptim 0.1.4 allocation code; CUDA only)", bpp=b / n))
    for label, master, release in (
        ("fastamp AdamW ulp8 + q8, gradient release (computed: no grads held)", "ulp8", True),
    ):
        grad = 0 if release else 2
        b = sum(layout.state_bytes_per_param(master, "q8", numel=k, grad_bytes=grad) * k for k in numels)
        rows.append(dict(config=label, source="computed (fastamp/reference/layout.py)", bpp=b / n))
    return rows


def _grads(params: list[torch.Tensor], gen: torch.Generator) -> None:
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(p.dtype)


def measure_shape(n_tensors: int, numel: int, steps: int) -> list[dict[str, Any]]:
    out = []
    for cfg in configs():
        row: dict[str, Any] = dict(config=cfg["name"], shape=f"{n_tensors}x{numel}")
        if cfg["make"] is None:
            row.update(source=f"not measured: {cfg['missing']} is not installed")
            out.append(row)
            continue
        gen = torch.Generator().manual_seed(0)
        params = [
            torch.nn.Parameter((torch.randn(numel, generator=gen) * 0.02).to(cfg["dtype"])) for _ in range(n_tensors)
        ]
        scaler = fastamp.Scaler("cpu", init_scale=SCALE) if cfg.get("scaler") else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = cfg["make"](params)
                for _ in range(steps):
                    _grads(params, gen)
                    if scaler is None:
                        opt.step()
                    else:
                        scaler.scale(torch.ones(()))  # the scale the synthetic grads are read as scaled by
                        scaler.step(opt)
                        scaler.update()
        except Exception as e:  # noqa: BLE001 (a third-party optimizer that fails on CPU is reported, not fatal)
            row.update(source=f"failed on this machine: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            out.append(row)
            continue
        nbytes, nparams = measured_bytes(params, opt, [scaler])
        row.update(source="measured", bpp=nbytes / nparams, gib=nbytes / 2**30)
        if "expect" in cfg:
            row["expected"] = cfg["expect"]([p.numel() for p in params])
        out.append(row)
        del opt, params
    return out


class _Block(torch.nn.Module):
    """``x + tanh(x W^T)``: one param of ``d * d`` elements; maths in fp32 (the grad is in the param's dtype)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(torch.nn.functional.linear(x, self.weight.float()))


def _release_model(n_tensors: int, d: int, dtype: torch.dtype) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(*(_Block(d) for _ in range(n_tensors)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.to(dtype)


class _TrainRun:
    """One config trained on the release model, ordinary (``bucket_bytes`` None) or under release, peak grads kept."""

    def __init__(self, cfg: dict[str, Any], n_tensors: int, d: int, bucket_bytes: int | None) -> None:
        self.model = _release_model(n_tensors, d, cfg["dtype"])
        self.params = list(self.model.parameters())
        self.opt = cfg["make"](self.params)
        self.scaler = fastamp.Scaler("cpu", init_scale=SCALE) if cfg.get("scaler") else None
        self.peak = 0
        # before release's hooks: each sample sees the new grad before its bucket's step frees any (the peaks)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._sample)
        self.h = None
        if bucket_bytes is not None:
            self.h = fastamp.release(self.model, self.opt, scaler=self.scaler, bucket_bytes=bucket_bytes)

    def _sample(self, _p: torch.Tensor) -> None:
        self.peak = max(self.peak, bench_release._live_grad_bytes(self.params))

    def step(self, i: int, d: int) -> None:
        x = torch.randn(8, d, generator=torch.Generator().manual_seed(i))
        loss = self.model(x).square().mean()
        if self.h is not None:
            self.h.backward(loss)
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
            self._sample(self.params[0])
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
        else:
            loss.backward()
            self._sample(self.params[0])
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self._sample(self.params[0])

    def largest_bucket(self) -> int:
        buckets = [self.params] if self.h is None else self.h.buckets
        return max(sum(p.numel() * p.element_size() for p in b) for b in buckets)

    def state_bytes(self) -> int:
        """Params + optimizer state (+ scaler, + the release handle's buffers) from storages; grads are all freed."""
        others = [self.scaler]
        if self.h is not None:
            others += [self.h, self.h._two]
        nbytes, _ = measured_bytes(self.params, self.opt, others)
        return nbytes


def measure_release(n_tensors: int, numel: int, steps: int, buckets_mib: list[float]) -> list[dict[str, Any]]:
    """Per fastamp config: params + optimizer state + peak live grads per param, ordinary and under release."""
    d = math.isqrt(numel)
    if d * d != numel:
        raise ValueError(f"bench_memory --release: M of NxM must be a square (d x d weights), got {numel}")
    out = []
    for cfg in configs():
        if not cfg["name"].startswith("fastamp"):
            continue
        row: dict[str, Any] = dict(config=cfg["name"], shape=f"{n_tensors}x{numel}")
        ordinary = _TrainRun(cfg, n_tensors, d, None)
        for i in range(steps):
            ordinary.step(i, d)
        n = sum(p.numel() for p in ordinary.params)
        numels = [p.numel() for p in ordinary.params]
        row["ordinary_bpp"] = (ordinary.state_bytes() + ordinary.peak) / n
        row["ordinary_layout"] = cfg["expect"](numels)
        ok = abs(row["ordinary_bpp"] - row["ordinary_layout"]) <= TOLERANCE
        for mib in buckets_mib:
            key = f"{mib:g}MiB"
            try:
                run = _TrainRun(cfg, n_tensors, d, int(mib * MiB))
                for i in range(steps):
                    run.step(i, d)
            except Exception as e:  # noqa: BLE001 (a refusal is reported with its message)
                row[f"release_{key}"] = f"refused: {type(e).__name__}: {str(e).splitlines()[0]}"
                ok = False
                continue
            largest = run.largest_bucket()
            state = run.state_bytes()
            bpp = (state + run.peak) / n
            expected = cfg["expect"](numels, grad_bytes=0) + largest / n
            same = bench_release.same_run(
                ordinary.params, ordinary.opt, run.params, run.opt, ordinary.scaler, run.scaler
            )
            row.update(
                {
                    f"release_{key}": bpp,
                    f"peak_grads_{key}": run.peak / n,
                    f"largest_bucket_{key}": largest / n,
                    f"layout_{key}": expected,
                    f"bits_{key}": "ok" if same else "DIFFERS",
                }
            )
            ok = ok and same and run.peak <= largest + PEAK_MARGIN and abs(bpp - expected) <= TOLERANCE
            if "release_goal" in cfg:
                row[f"goal_met_{key}"] = bpp <= cfg["release_goal"]
            del run
        row["goal"] = cfg.get("release_goal", "")
        row["checks"] = "ok" if ok else "FAILED"
        out.append(row)
        del ordinary
    return out


def measure_gpt(steps: int) -> list[dict[str, Any]]:
    from fastamp.compare.models import TinyGPT

    out = []
    for cfg in configs():
        row: dict[str, Any] = dict(config=cfg["name"], shape="TinyGPT(3 layers, d=96)")
        if cfg["make"] is None:
            row.update(source=f"not measured: {cfg['missing']} is not installed")
            out.append(row)
            continue
        torch.manual_seed(0)
        model = TinyGPT(vocab=96, seq_len=64, n_layer=3, d_model=96, n_head=4)
        half = cfg["dtype"] in (torch.bfloat16, torch.float16)
        if half:
            fastamp.cast_model(model, cfg["dtype"])
        params = [p for p in model.parameters() if p.requires_grad]
        gen = torch.Generator().manual_seed(0)
        scaler = fastamp.Scaler("cpu", init_scale=SCALE) if cfg.get("scaler") else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = cfg["make"](params)
                for _ in range(steps):
                    x = torch.randint(0, 96, (4, 64), generator=gen)
                    with torch.autocast("cpu", dtype=cfg["dtype"], enabled=half):
                        loss = TinyGPT.loss(model(x), x)
                    if scaler is None:
                        loss.backward()
                        opt.step()
                    else:
                        scaler.scale(loss).backward()
                        scaler.step(opt)
                        scaler.update()
        except Exception as e:  # noqa: BLE001
            row.update(source=f"failed on this machine: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            out.append(row)
            continue
        nbytes, nparams = measured_bytes(params, opt, [scaler])
        row.update(source="measured", bpp=nbytes / nparams, gib=nbytes / 2**30, params=nparams)
        if "expect" in cfg and all(p.dtype is cfg["dtype"] for p in params):
            row["expected"] = cfg["expect"]([p.numel() for p in params])
        out.append(row)
    return out


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4f}" if v < 100 else f"{v:,.1f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="256x262144", help="N tensors x M elements (default 256x262144: 64M params)")
    ap.add_argument("--no-gpt", action="store_true", help="skip the small-GPT rows")
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps before measuring (default 1)")
    ap.add_argument("--quick", action="store_true", help="smoke test: the given shape, no GPT, nothing written")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument(
        "--release",
        action="store_true",
        help="only the gradient-release table: N blocks x + tanh(x W^T) with W of M = d*d elements, "
        "ordinary vs release (writes bench_memory-release-<tag>.{md,csv})",
    )
    ap.add_argument("--release-steps", type=int, default=3, help="training steps of each release-table run")
    ap.add_argument("--release-buckets-mib", default="0,32", help="release bucket sizes (0: a bucket per param)")
    args = ap.parse_args(argv)
    n_tensors, numel = (int(x) for x in args.shape.lower().split("x"))
    if args.release:
        return release_main(args, n_tensors, numel)

    rows = measure_shape(n_tensors, numel, args.steps)
    bad = [
        r
        for r in rows
        if "expected" in r and "bpp" in r and abs(r["bpp"] - r["expected"]) > TOLERANCE  # noqa: PLR2004
    ]
    gpt_rows = [] if (args.no_gpt or args.quick) else measure_gpt(args.steps)
    bad += [r for r in gpt_rows if "expected" in r and abs(r["bpp"] - r["expected"]) > TOLERANCE]
    computed = computed_rows([numel] * n_tensors)

    cols = [
        ("config", "config"),
        ("shape", "params"),
        ("bpp", "B/param"),
        ("expected", "layout.py"),
        ("source", "source"),
    ]
    text = [
        "# Training-state bytes per parameter (params + grads + optimizer state), measured",
        "",
        *(f"- {k}: {v}" for k, v in machine_info(torch.device("cpu")).items()),
        "",
        "Measured: the distinct storages of the params, their grads and the optimizer's tensors after "
        f"{args.steps} step(s), divided by the param elements (`benchmarks/bench_memory.py`). `layout.py`: "
        "the bytes `fastamp/reference/layout.py` predicts for the same tensors (bf16 params and grads); "
        f"every measured fastamp row must be within {TOLERANCE} of it.",
        "",
        f"## {args.shape} ({n_tensors * numel:,} params)",
        "",
        markdown_table(rows, cols, _cell),
        "",
    ]
    if gpt_rows:
        text += [
            f"## The small GPT of the convergence study ({gpt_rows[0].get('params', 0):,} params; "
            "bf16 rows: `fastamp.cast_model`, LayerNorms stay fp32)",
            "",
            markdown_table(gpt_rows, cols, _cell),
            "",
        ]
    text += [
        "## Computed, not measured",
        "",
        markdown_table(computed, [("config", "config"), ("bpp", "B/param"), ("source", "source")], _cell),
        "",
    ]
    proj = [
        dict(
            config=r["config"],
            source=r["source"].split(" (")[0],
            bpp=r["bpp"],
            gb=f"{r['bpp'] * PROJECTION_PARAMS / 1e9:.1f}",
        )
        for r in rows + computed
        if "bpp" in r
    ]
    text += [
        "## Projection: training state of a 7B-parameter model",
        "",
        "Bytes per param above (large shape) x 7e9, in GB (1e9 bytes): params + grads + optimizer state only "
        "(no activations, no allocator or framework overhead). A projection from the measured or computed "
        "bytes per param, not a measurement of a 7B model.",
        "",
        markdown_table(
            proj, [("config", "config"), ("source", "source"), ("bpp", "B/param"), ("gb", "GB for 7B")], _cell
        ),
        "",
    ]
    if bad:
        text += [
            "**MISMATCH** (measured vs layout.py beyond the tolerance): " + ", ".join(r["config"] for r in bad),
            "",
        ]
    print("\n".join(text))
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"bench_memory-{args.tag}")
        with open(stem + ".md", "w") as f:
            f.write("\n".join(text))
        write_csv(stem + ".csv", rows + gpt_rows + computed)
    return 1 if bad else 0


def release_main(args: argparse.Namespace, n_tensors: int, numel: int) -> int:
    buckets = [float(b) for b in args.release_buckets_mib.split(",")]
    info = machine_info(torch.device("cpu"))
    rows = measure_release(n_tensors, numel, args.release_steps, buckets)
    n = n_tensors * numel
    d = math.isqrt(numel)
    text = [
        "# Training-state bytes per parameter under gradient release (params + optimizer state + peak live grads)",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        f"Model: {n_tensors} blocks `x + tanh(x W^T)`, W {d}x{d} (the {n_tensors}x{numel} params of the main table, "
        f"{n:,} in all), batch 8, the maths in fp32 and params and grads in the config's dtype; "
        f"{args.release_steps} training steps per run, each config run ordinary "
        "(`loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)`, with the Scaler: `scaler.scale(loss)"
        ".backward(); scaler.step(opt); scaler.update()`) and under `fastamp.release(model, opt, scaler=..., "
        "bucket_bytes=B)`.",
        "",
        "B/param = (bytes of the distinct storages of the params, the optimizer's tensors, the scaler's and the "
        "release handle's, after the steps, when every grad is freed) + (the peak bytes of live `.grad` storages, "
        "sampled as each grad is accumulated, before release's hook steps its bucket, and after backward: "
        "`bench_release._live_grad_bytes`), divided by the params. Not counted: activations, autograd's grads "
        "in flight, the kernels' temporaries, the allocator.",
        "",
        "`layout.py`: ordinary: `fastamp/reference/layout.py` with bf16/fp16 grads (2 B/param); release: "
        "layout.py with `grad_bytes=0` + the largest bucket's grad bytes / params (the peak a release should "
        f"hold). Checks: every measured value within {TOLERANCE} of layout.py, peak grads <= largest bucket + "
        f"{PEAK_MARGIN // MiB} MiB, and each release run's params, `opt.state_dict()` and scaler state equal the "
        "ordinary run's bit for bit after the steps (`bench_release.same_run`). Goals (issue 23, release): "
        + ", ".join(f"{k} <= {v}" for k, v in RELEASE_GOALS.items())
        + " B/param.",
        "",
    ]
    cols = [("config", "config"), ("ordinary_bpp", "ordinary B/param"), ("ordinary_layout", "layout.py")]
    for b in buckets:
        k = f"{b:g}MiB"
        label = "bucket per param" if b == 0 else f"{k} buckets"
        cols += [
            (f"release_{k}", f"release, {label}"),
            (f"layout_{k}", "layout.py"),
            (f"peak_grads_{k}", "of which peak grads"),
            (f"bits_{k}", "bits"),
            (f"goal_met_{k}", "goal met"),
        ]
    cols += [("goal", "goal"), ("checks", "checks")]
    text += [f"## {n_tensors}x{numel} ({n:,} params)", "", markdown_table(rows, cols, _cell), ""]
    bad = [r for r in rows if r["checks"] != "ok"]
    if bad:
        text += ["**CHECK FAILED**: " + ", ".join(r["config"] for r in bad), ""]
    print("\n".join(text))
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"bench_memory-release-{args.tag}")
        with open(stem + ".md", "w") as f:
            f.write("\n".join(text))
        write_csv(stem + ".csv", rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
