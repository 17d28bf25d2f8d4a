"""The arguments of ``optim_`` calls for the CUDA kernel's tests: on a GPU (tests/backends/test_cuda_optim.py)
and emulated on the host (tests/tools/test_cuda_emulated.py), which run the same kernel source.

A call mixes every (param, grad) dtype pair a master format takes, with the master formats' edge values
planted in the params, a zero q8 block and subnormals in the grads, and random q8 codes under scale bytes
across the range.
"""

import re
from pathlib import Path

import torch

from fastamp import reference as R
from fastamp.reference import q8
from fastamp.reference.optim import RULES

CHUNK = 65536  # csrc/cuda/launch_plan.h kChunkSize
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HYPER = {"adamw": (0.9, 0.999, 1e-8), "sgd": (0.9, 0.1, 1e-2), "lion": (0.9, 0.99)}
RULE_FLAGS = {name: r.flags for name, r in RULES.items()}  # each rule's own flags (AMSGRAD, NESTEROV)
MASTERS = ("none", "fp32", "remainder", "ulp8")
# the param dtypes each master format takes (a call mixes them, and every grad dtype)
PARAM_DTYPES = {
    "none": DTYPES,
    "fp32": DTYPES,
    "remainder": (torch.bfloat16,),
    "ulp8": (torch.bfloat16, torch.float16),
}
_FORMATS = {"kStatesFp32": "kFloat32", "kStatesBf16": "kBFloat16", "kStatesQ8": "kQ8"}
_FORMAT_NAMES = {"kFloat32": "fp32", "kBFloat16": "bf16", "kQ8": "q8"}
_CSRC = Path(__file__).resolve().parents[1] / "csrc"


def rule_rows() -> list[tuple[str, str]]:
    """csrc/optim_rules.h's FASTAMP_OPTIM_RULES rows ``X(AdamW, adamw)``: ``[(Name, name)]`` in id order."""
    text = (_CSRC / "optim_rules.h").read_text()
    body = text.split("#define FASTAMP_OPTIM_RULES(X)", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"X\((\w+), (\w+)\)", body)


def rule_max_states() -> dict[str, int]:
    """``{"kAdamW": 3, ...}``: each rule's ``kMaxStates`` (csrc/rules/<name>.h), the depth of its launch tables."""
    out = {}
    for name, file in rule_rows():
        found = re.findall(r"\bkMaxStates = (\d+)", (_CSRC / "rules" / f"{file}.h").read_text())
        assert len(found) == 1, f"csrc/rules/{file}.h: one kMaxStates, found {found}"
        out[f"k{name}"] = int(found[0])
    return out


def cuda_combos() -> list[tuple[str, str]]:
    """The (rule, state format) pairs the CUDA kernel is built for, as enumerators (``("kAdamW", "kQ8")``):
    each rule's ``kCudaStates`` in csrc/rules/<name>.h, in rule order, then fp32, bf16, q8."""
    out = []
    for name, file in rule_rows():
        text = (_CSRC / "rules" / f"{file}.h").read_text()
        found = re.findall(r"static constexpr unsigned kCudaStates = ([\w |]+);", text)
        assert len(found) == 1, f"csrc/rules/{file}.h: one kCudaStates line, found {found}"
        bits = [b.strip() for b in found[0].split("|")]
        assert set(bits) <= set(_FORMATS), f"csrc/rules/{file}.h: kCudaStates {bits}"
        out += [(f"k{name}", fmt) for bit, fmt in _FORMATS.items() if bit in bits]
    return out


def compiled_combos() -> list[tuple[str, str]]:
    """The (rule, state format) pairs the kernel is built for (:func:`cuda_combos`), by name: ``("adamw", "q8")``."""
    names = {f"k{name}": file for name, file in rule_rows()}
    return [(names[r], _FORMAT_NAMES[f]) for r, f in cuda_combos()]


def _param(n, dtype, master, gen):
    """(param, [master]) with the master formats' edge values planted."""
    p32 = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-6, 6, (n,), generator=gen).float()
    if n >= 24:
        p32[:12] = torch.tensor([0.0, -0.0, 2.0**-14, -(2.0**-14) * 0.9999, 2.0**-17, 3e-8, -1e-9, 65504.0,
                                 -65519.0, 1e-40, 1.0 + 2.0**-8, 1.5])  # fmt: skip
    if master == "remainder":
        p, m = R.split_master(p32)
        return p, [m]
    if master == "ulp8":
        p, c = R.ulp8_encode(p32, dtype, R.sr_random16(3, torch.tensor(9), 0, n, "cpu"))
        return p, [c]
    if master == "fp32":
        return p32.to(dtype), [p32.clone()]
    return p32.to(dtype), []


def _state(n, fmt, root, gen, nonfinite):
    """One state of one param in ``fmt``: a tensor list (q8: codes, scales)."""
    if fmt == "q8":
        lo = q8.W_SCALE_MIN if root else q8.M_SCALE_MIN
        scales = torch.randint(lo, lo + 60, (q8.num_blocks(n),), generator=gen, dtype=torch.uint8)
        if nonfinite and scales.numel() > 3:
            scales[3] = q8.NONFINITE_SCALE  # a non-finite block
        return [torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8), scales]
    x = torch.rand(n, generator=gen) * 0.01 if root else torch.randn(n, generator=gen) * 0.1
    return [x.to(torch.bfloat16 if fmt == "bf16" else torch.float32)]


def _grad(n, dtype, gen, nonfinite):
    g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2)
    if n >= 40:
        g[0:32] = 0.0  # a zero q8 block
        if nonfinite:
            g[32:37] = torch.tensor([-0.0, 1e-40, -3e-39, 6e4, float("inf") if n > 5000 else 1.0])
        else:
            g[32:36] = torch.tensor([-0.0, 1e-40, -3e-39, 6e4])
    return g.to(dtype)


def make_call(rule, fmt, master, flags, hyper=None, sizes=(), seed=0, *, device="cpu", nonfinite=False, shift=None):
    """(params, masters, states, grads) on ``device`` of a call of ``sizes``; ``nonfinite``: a non-finite q8
    block and an inf grad in the large tensors too; ``shift(i, p, g) -> (p, g)``: e.g. misaligned views."""
    gen = torch.Generator().manual_seed(seed)
    hyper = HYPER[rule] if hyper is None else hyper
    defs = RULES[rule].states(hyper, flags)
    pdts = PARAM_DTYPES[master]
    params, masters, grads, per_param = [], [], [], []
    for i, n in enumerate(sizes):
        p, m = _param(n, pdts[i % len(pdts)], master, gen)
        g = _grad(n, DTYPES[(i // len(pdts)) % 3], gen, nonfinite)
        p, m, g = p.to(device), [t.to(device) for t in m], g.to(device)
        if shift is not None:
            p, g = shift(i, p, g)
        params.append(p)
        masters += m
        grads.append(g)
        per_param.append([[t.to(device) for t in _state(n, fmt, d.q8_code == "v", gen, nonfinite)] for d in defs])
    per = 2 if fmt == "q8" else 1
    states = [per_param[i][j][k] for j in range(len(defs)) for k in range(per) for i in range(len(sizes))]
    return params, masters, states, grads


def step_scalars(rule, step, rows=None, device="cpu"):
    """The rule's step scalars for step ``step`` (1-based), shared ([k]) or one row per tensor ([rows, k])."""
    counts = torch.tensor(float(step)) if rows is None else torch.arange(step, step + rows, dtype=torch.float32)
    counts = counts.to(device)
    gm = torch.tensor(2.0**-10 * 0.7, device=device)
    if rule == "adamw":
        return R.adamw_step_scalars(1e-2, counts, 0.9, 0.999, 0.1, gm)
    if rule == "sgd":
        return R.sgd_step_scalars(0.05, counts - 1, gm)
    sc = R.lion_step_scalars(torch.tensor(0.01, device=device), 0.1, gm)
    return sc if rows is None else sc.expand(rows, 3).contiguous()
