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

import fastamp  # noqa: E402
from fastamp._harness import machine_info, markdown_table, write_csv  # noqa: E402
from fastamp.reference import layout  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TOLERANCE = 0.01  # B/param between a measured fastamp row and layout.py (issue 22: "must match ±0.01")
PROJECTION_PARAMS = 7e9

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


def measured_bytes(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes of the distinct storages of ``params``, their grads and the optimizer's tensors; and the param elements."""
    tensors: list[torch.Tensor] = []
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

    def f(numels: list[int]) -> float:
        total = sum(layout.state_bytes_per_param(master, moments, n_moments=n_moments, numel=n) * n for n in numels)
        return total / sum(numels)

    return f


def _expected_bf16_moments(master: str, n_moments: int) -> Callable[[list[int]], float]:
    # bf16 moments are not one of layout.py's formats (it describes fp32 and q8): 2 B per moment.
    base = _expected(master, "fp32", 0)
    return lambda numels: base(numels) + 2.0 * n_moments


def _expected_q8(master: str, min_numel: int = 4096) -> Callable[[list[int]], float]:
    """layout.py's bytes with AdamW's lowbit rule: tensors below ``min_numel`` keep fp32 moments."""

    def f(numels: list[int]) -> float:
        total = sum(
            layout.state_bytes_per_param(master, "q8" if n >= min_numel else "fp32", n_moments=2, numel=n) * n
            for n in numels
        )
        return total / sum(numels)

    return f


def _expected_q8_ulp8(min_numel: int = 4096) -> Callable[[list[int]], float]:
    """ulp8 + q8 with AdamW's rule: tensors below ``min_numel`` keep fp32 moments and a remainder master."""

    def f(numels: list[int]) -> float:
        total = sum(
            (
                layout.state_bytes_per_param("ulp8", "q8", n_moments=2, numel=n)
                if n >= min_numel
                else layout.state_bytes_per_param("remainder", "fp32", n_moments=2, numel=n)
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
        ),
        dict(
            name="fastamp AdamW SR + q8",
            dtype=bf16,
            make=_fastamp(A, stochastic_rounding=True, state_format="q8", seed=0),
            expect=_expected_q8("none"),
        ),
        dict(
            name="fastamp Lion remainder",
            dtype=bf16,
            make=_fastamp(L, master_weights="remainder"),
            expect=_expected("remainder", "fp32", 1),
        ),
        dict(
            name="fastamp SGD momentum remainder",
            dtype=bf16,
            make=lambda ps: S(ps, lr=1e-3, momentum=0.9, master_weights="remainder"),
            expect=_expected("remainder", "fp32", 1),
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
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = cfg["make"](params)
                for _ in range(steps):
                    _grads(params, gen)
                    opt.step()
        except Exception as e:  # noqa: BLE001 (a third-party optimizer that fails on CPU is reported, not fatal)
            row.update(source=f"failed on this machine: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            out.append(row)
            continue
        nbytes, nparams = measured_bytes(params, opt)
        row.update(source="measured", bpp=nbytes / nparams, gib=nbytes / 2**30)
        if "expect" in cfg:
            row["expected"] = cfg["expect"]([p.numel() for p in params])
        out.append(row)
        del opt, params
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
        if cfg["dtype"] is torch.bfloat16:
            fastamp.cast_model(model, torch.bfloat16)
        params = [p for p in model.parameters() if p.requires_grad]
        gen = torch.Generator().manual_seed(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = cfg["make"](params)
                for _ in range(steps):
                    x = torch.randint(0, 96, (4, 64), generator=gen)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg["dtype"] is torch.bfloat16):
                        loss = TinyGPT.loss(model(x), x)
                    loss.backward()
                    opt.step()
        except Exception as e:  # noqa: BLE001
            row.update(source=f"failed on this machine: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            out.append(row)
            continue
        nbytes, nparams = measured_bytes(params, opt)
        row.update(source="measured", bpp=nbytes / nparams, gib=nbytes / 2**30, params=nparams)
        if "expect" in cfg and all(p.dtype is torch.bfloat16 for p in params):
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
    args = ap.parse_args(argv)
    n_tensors, numel = (int(x) for x in args.shape.lower().split("x"))

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


if __name__ == "__main__":
    sys.exit(main())
