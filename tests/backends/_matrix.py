"""The axes of test_optim_matrix.py: BACKENDS x RULES x FORMATS, and the adapter onto today's ops.

A newcomer extends a table by one row:

- ``RULES``: an update rule (its per-param state, its step scalars, its hyperparameter cases);
- ``FORMATS``: how the master and the optimizer state are stored (fp32 master, none, bf16 +
  int16 remainder, 16-bit param + int8 ulp8 correction, stochastic rounding; fp32, bf16 or 8-bit
  q8 state);
- ``BACKENDS``: where the kernels run (native CPU on each instruction set, Triton, native
  CUDA), each with the reason it cannot run here.

Every (update rule, format) pair is one op, ``optim_`` (:func:`fastamp.reference.optim_`):
:func:`op_call` builds its arguments; every backend has one generic kernel of it.
:func:`per_rule_call` keeps the per-rule ops' own argument lists (they run as ``optim_``), and
:func:`functional_call` goes through ``fastamp.functional``'s per-rule op where one covers the pair (its checks name its
lists), else through ``fastamp.functional.optim_``.
"""

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from helpers import assert_bits_equal, native_cpu_isas
from tolerances import ADAMW_GPU_RTOL

from fastamp import backends, functional, reference
from fastamp.ops import registry
from fastamp.reference import optim as R

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = (F32, F16, BF16)
SHORT = {F32: "f32", F16: "f16", BF16: "bf16"}

# ---- BACKENDS ----------------------------------------------------------------------------------------

CPU_CHUNK = 16384  # csrc/cpu/multi_tensor.h kChunkElems
CPU_VECTOR = 16  # the widest vector block of the CPU kernels (AVX-512 fp32)
CUDA_CHUNK = 65536  # csrc/cuda/launchers.h kChunkSize
CUDA_VECTOR = 8


@dataclass(frozen=True)
class Backend:
    """One place the kernels run. ``exact``: bit-exact with the reference for every rule (else a
    rule's ``gpu_exact`` decides and the ``tolerances`` budgets apply)."""

    id: str
    kind: str  # the name fastamp.backends knows: "native" or "triton"
    device: str
    chunk: int  # elements per work item of the multi-tensor launch
    block: int  # elements per vector block / Triton block
    exact: bool
    isa: str | None = None
    why_not: str | None = None  # the skip reason where it cannot run here
    gpu: bool = False
    interpreted: bool = False  # Triton's CPU interpreter: each launch costs ~0.1 s of Python, whatever its size

    def op(self, name: str) -> Callable:
        return backends.get_impl(name, self.kind)

    @property
    def prefix(self) -> str:
        """How the kernel's own refusals start (the launcher's guards for Triton)."""
        return "fastamp::" if self.kind == "native" else "fastamp_triton::"

    def sizes(self) -> list[int]:
        """Every size the kernels treat differently: empty, one, primes, around the vector block and the
        chunk, more than one chunk."""
        b, c = self.block, self.chunk
        return sorted({0, 1, 2, 3, 7, 13, 17, 31, 97, 257, 1021, b - 1, b, b + 1, c - 1, c, c + 1, 2 * c + 3})

    def alone_sizes(self) -> list[int]:
        """The sizes worth a call of their own: each of the scalar tail's lengths and the vector block on
        the native kernels; on the interpreter (whose tail is a masked block like any other) no launch,
        one element and one full block."""
        if self.interpreted:
            return [0, 1, self.block]
        return [n for n in self.sizes() if n <= 33 or abs(n - self.block) <= 1]

    def short_sizes(self) -> list[int]:
        """The sizes of the comparisons that loop over many combinations (a tail, a block, a chunk boundary);
        on the interpreter, whose tails are all one masked block, no tail lengths of the native vector loop."""
        if self.interpreted:
            return [0, 1, 33, self.block + 1, self.chunk + 3]
        return [0, 1, 7, 17, 33, self.block + 1, 257, self.chunk + 3]


def _native_cpu(isa: str) -> Backend:
    why = None
    if not registry.native_has_kernel("optim_", "cpu"):
        why = "fastamp._C has no CPU kernels (not built)"
    elif isa not in native_cpu_isas():
        why = f"this CPU runs the {native_cpu_isas()} paths, not {isa}"
    return Backend(f"native-cpu-{isa}", "native", "cpu", CPU_CHUNK, CPU_VECTOR, True, isa=isa, why_not=why)


def _triton(device: str) -> Backend:
    try:
        from fastamp import kernels
    except ImportError as e:  # pragma: no cover - fastamp.kernels imports without triton
        return Backend(f"triton-{device}", "triton", device, 0, 0, True, why_not=str(e))
    ok, why = kernels.available(device)
    chunk, block = (0, 0)
    if ok:
        from fastamp.kernels import amp

        chunk, block = amp.C.chunk_config()
    # on a GPU Triton may use approximate sqrt/division and contract to FMA (tolerances.ADAMW_GPU_RTOL);
    # under the CPU interpreter it is bit-exact
    return Backend(
        f"triton-{device}", "triton", device, chunk, block, device == "cpu", why_not=None if ok else why,
        gpu=device == "cuda", interpreted=device == "cpu",
    )  # fmt: skip


def _native_cuda() -> Backend:
    why = None
    if torch.cuda.is_available() and not registry.native_has_kernel("optim_", "cuda"):
        why = f"fastamp._C has no CUDA kernels (built: {registry.build_info()})"
    return Backend("native-cuda", "native", "cuda", CUDA_CHUNK, CUDA_VECTOR, True, why_not=why, gpu=True)


BACKENDS = [
    *(_native_cpu(isa) for isa in ("avx512", "avx2", "scalar")),
    _triton("cpu"),
    _triton("cuda"),
    _native_cuda(),
]
_CUDA_REASON = "needs a CUDA device (run by benchmarks/gpu_check.sh on a GPU machine)"


def backend_marks(b: Backend) -> list:
    marks = []
    if b.gpu:
        marks.append(pytest.mark.gpu(reason=_CUDA_REASON))  # conftest skips it without CUDA
    if b.why_not is not None and (not b.gpu or torch.cuda.is_available()):
        marks.append(pytest.mark.skip(reason=f"{b.id}: {b.why_not}"))
    return marks


# ---- RULES ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """An update rule: its per-param state lists, its step scalars, its hyperparameter cases.

    ``step_scalars(hyper, applied, grad_mul, device)``: the scalars of the step after ``applied``
    applied steps. ``make_state(hyper, sizes, gen, dtype)``: the rule's state lists, stored in ``dtype``.
    ``kernel_variant(hyper)``: the hyperparameter the kernels are compiled for (a C++ template or
    Triton constexpr argument, as the dtypes are; the others are run-time branches of one code):
    test_matches_reference runs every dtype pair of every format with each of its values.
    ``gpu_exact``: only + - * and integer maths, so bit-exact on a GPU too. ``states``: the state
    formats the rule is tested with. ``hyper_list(h)`` / ``flags(h)``: ``optim_``'s ``hyper`` and
    rule flags of a hyperparameter case. ``full_state``: the case of ``hypers`` that uses every
    state list (AdamW's amsgrad max, SGD's momentum buffers). ``per_rule_op``: the rule has a
    per-rule op of its own (``adamw_``, ``sgd_``, ``lion_``: the ops from before ``optim_``); a new
    rule runs as ``optim_`` only.
    """

    name: str
    state_keys: tuple[str, ...]
    step_scalars: Callable
    make_state: Callable
    kernel_variant: Callable
    hyper_list: Callable
    flags: Callable
    hypers: dict = field(default_factory=dict)
    gpu_exact: bool = False
    states: tuple = ("fp32", "q8")
    full_state: str = "default"
    per_rule_op: bool = False


def _flag(on, bit: int) -> int:
    return bit if on else 0


def _adamw_scalars(h, applied, grad_mul, dev):
    step = torch.tensor(float(applied + 1), device=dev)
    return reference.adamw_step_scalars(h["lr"], step, h["beta1"], h["beta2"], h["weight_decay"], grad_mul)


def _adamw_state(h, sizes, gen, dtype):
    m = [(torch.randn(n, generator=gen) * 0.1).to(dtype) for n in sizes]
    v = [(torch.rand(n, generator=gen) * 0.01).to(dtype) for n in sizes]
    vmax = [(t.float() * 1.5).to(dtype) for t in v] if h["amsgrad"] else []
    return {"exp_avgs": m, "exp_avg_sqs": v, "max_exp_avg_sqs": vmax}


def _adam(lr, beta1, beta2, eps, weight_decay, amsgrad=False, maximize=False):
    return dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)


def _sgd_scalars(h, applied, grad_mul, dev):
    return reference.sgd_step_scalars(h["lr"], torch.tensor(applied, device=dev), grad_mul)


def _sgd_state(h, sizes, gen, dtype):
    # NaN: the first step (is_first) must set the buffer to the grad without reading it
    bufs = [torch.full((n,), math.nan, dtype=dtype) for n in sizes] if h["momentum"] else []
    return {"momentum_buffers": bufs}


def _sgd(momentum, dampening, weight_decay, nesterov=False, maximize=False, lr=0.05):
    return dict(
        lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov, maximize=maximize
    )


def _lion_scalars(h, applied, grad_mul, dev):
    return reference.lion_step_scalars(h["lr"], h["weight_decay"], grad_mul, dev)


def _lion_state(h, sizes, gen, dtype):
    # small moments: c = beta1*m + (1-beta1)*g changes sign in many elements; exact zeros of both signs
    m = [(torch.randn(n, generator=gen) * 0.01).to(dtype) for n in sizes]
    for t in m:
        t[: min(2, t.numel())] = torch.tensor([0.0, -0.0][: min(2, t.numel())], dtype=dtype)
    return {"exp_avgs": m}


def _lion(beta1, beta2, weight_decay, maximize=False, lr=1e-3):
    return dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, maximize=maximize)


RULES = [
    Rule(
        "adamw",
        ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"),
        _adamw_scalars,
        _adamw_state,
        lambda h: h["amsgrad"],  # AMSGRAD
        lambda h: [h["beta1"], h["beta2"], h["eps"]],
        lambda h: _flag(h["maximize"], R.MAXIMIZE) | _flag(h["amsgrad"], R.AMSGRAD),
        hypers={
            "default": _adam(1e-2, 0.9, 0.999, 1e-8, 0.01),
            "amsgrad": _adam(1e-2, 0.9, 0.999, 1e-8, 0.1, amsgrad=True),
            "maximize": _adam(1e-2, 0.9, 0.999, 1e-8, 0.01, maximize=True),
            "amsgrad-maximize": _adam(1e-2, 0.9, 0.999, 1e-8, 0.01, amsgrad=True, maximize=True),
            # 1-beta1 >= 0.5: the other lerp branch; lr 1 magnifies every rounding
            "lerp-high-lr1": _adam(1.0, 0.1, 0.25, 1e-8, 0.0, amsgrad=True),
            "half": _adam(0.3, 0.5, 0.5, 1e-3, 0.1, amsgrad=True, maximize=True),
            "zero-betas": _adam(1e-3, 0.0, 0.0, 1e-8, 0.01),
            "long-memory-big-decay": _adam(1e-4, 0.999, 0.99999, 1e-6, 1.0, amsgrad=True),
        },
        states=("fp32", "bf16", "q8"),
        full_state="amsgrad",
        per_rule_op=True,
    ),
    Rule(
        "sgd",
        ("momentum_buffers",),
        _sgd_scalars,
        _sgd_state,
        lambda h: h["momentum"] != 0,  # MOM / HAS_MOMENTUM
        lambda h: [h["momentum"], h["dampening"], h["weight_decay"]],
        lambda h: _flag(h["maximize"], R.MAXIMIZE) | _flag(h["nesterov"], R.NESTEROV),
        hypers={
            "plain": _sgd(0.0, 0.0, 0.0),
            "momentum": _sgd(0.9, 0.0, 0.0),
            "dampening-wd": _sgd(0.9, 0.1, 1e-2),
            "nesterov-wd-maximize": _sgd(0.9, 0.0, 5e-4, nesterov=True, maximize=True),
            "wd-only-maximize": _sgd(0.0, 0.0, 0.3, maximize=True),
            "half-dampening": _sgd(0.5, 0.5, 1e-3, nesterov=False, lr=0.1),
            "nesterov-half": _sgd(0.5, 0.0, 0.01, nesterov=True),
        },
        gpu_exact=True,
        full_state="nesterov-wd-maximize",
        per_rule_op=True,
    ),
    Rule(
        "lion",
        ("exp_avgs",),
        _lion_scalars,
        _lion_state,
        lambda h: None,  # one kernel per dtype pair and format: every hyperparameter is a run-time value
        lambda h: [h["beta1"], h["beta2"]],
        lambda h: _flag(h["maximize"], R.MAXIMIZE),
        hypers={
            "default": _lion(0.9, 0.99, 0.0),
            "wd-maximize": _lion(0.9, 0.99, 0.1, maximize=True),
            "big-lr-zero-betas": _lion(0.0, 0.0, 1.0, lr=0.5),
            "one-betas": _lion(1.0, 1.0, 0.01),
            "odd-betas": _lion(0.95, 0.98, 0.3, lr=3e-2),
        },
        gpu_exact=True,
        full_state="wd-maximize",
        per_rule_op=True,
    ),
]
RULE = {r.name: r for r in RULES}


# ---- FORMATS -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Format:
    """How the master and the rule's state are stored.

    ``master``: "fp32" (an fp32 copy beside a param of any float dtype), "none" (the param is
    updated directly, rounded to nearest-even), "remainder" (bf16 param + int16 remainder: the
    exact fp32 master) or "ulp8" (bf16 / fp16 param + int8 correction in units of its ulp).
    ``sr_param``: a bf16 param without master, or the ulp8 correction, rounded stochastically;
    ``sr_state``: bf16 state or q8 codes rounded stochastically (both from an ``[seed, counter]``
    rng: ``optim_``'s SR_PARAM / SR_STATE). ``state``: the rule's state storage, "fp32", "bf16"
    or "q8" (uint8 codes and block scales, fastamp.reference.q8).
    """

    name: str
    param_dtypes: tuple
    master: str
    sr_param: bool = False
    state: str = "fp32"
    sr_state: bool = False
    # in every case; the others (combinations of flags the rows above bracket) only in test_matches_reference
    cover: bool = True

    @property
    def sr(self) -> bool:
        return self.sr_param or self.sr_state

    @property
    def state_dtype(self) -> torch.dtype:
        return {"fp32": F32, "bf16": BF16, "q8": torch.uint8}[self.state]


LOW = (BF16, F16)
FORMATS = [
    Format("fp32-master", DTYPES, "fp32"),
    Format("param-only", DTYPES, "none"),
    Format("bf16-remainder", (BF16,), "remainder"),
    Format("bf16-sr", (BF16,), "none", sr_param=True),
    Format("bf16-moments", (BF16,), "remainder", state="bf16"),  # bf16 state rounded to nearest-even
    Format("bf16-moments-sr", (BF16,), "none", sr_param=True, state="bf16", sr_state=True),
    Format("bf16-moments-param-only", (BF16,), "none", state="bf16", cover=False),
    Format("bf16-moments-remainder-sr", (BF16,), "remainder", state="bf16", sr_state=True),
    Format("ulp8", LOW, "ulp8", sr_param=True),
    Format("ulp8-nearest", LOW, "ulp8", cover=False),
    Format("q8-fp32-master", LOW, "fp32", state="q8", sr_state=True),
    Format("q8-param-only", DTYPES, "none", state="q8", sr_state=True, cover=False),
    Format("q8-bf16-remainder", (BF16,), "remainder", state="q8", sr_state=True),
    Format("q8-bf16-remainder-nearest", (BF16,), "remainder", state="q8", cover=False),
    Format("q8-bf16-sr", (BF16,), "none", sr_param=True, state="q8", sr_state=True),
    Format("q8-ulp8", LOW, "ulp8", sr_param=True, state="q8", sr_state=True),
]
FORMAT = {f.name: f for f in FORMATS}


def supports(rule: Rule, fmt: Format) -> bool:
    return fmt.state in rule.states


RULE_FORMATS = [(r, f) for r in RULES for f in FORMATS if supports(r, f)]


# ---- state ---------------------------------------------------------------------------------------------

BF16_MAX = 3.3895313892515355e38


def _f32_from_bits(bits) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


# ties (low half 0x8000, both signs, odd and even bf16 neighbours), subnormals, the smallest normal,
# values next to bf16's max (one rounds to inf), the largest fp32
_EDGE_MASTER_BITS = [
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x00008000, 0x80018000, 0x00000001, 0x807FFFFF, 0x00800000,
    0x7F7F8000, 0x7F7F7FFF, 0xFF7F8000, 0x7F7FFFFF, 0x3F80FFFF,
]  # fmt: skip
_EDGE_MASTER_VALUES = [0.0, -0.0, 1e-40, -3e-39, BF16_MAX, -BF16_MAX, 65504.0, -65520.0, 2.0**-24]


def edge_masters(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 masters over many magnitudes, with 25% exact bf16 ties and the split's edge cases planted."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 12, (n,), generator=gen).float())
    if n == 0:
        return x
    ints = x.view(torch.int32)
    tie = torch.rand(n, generator=gen) < 0.25
    ints[tie] = (ints[tie] & ~0xFFFF) | 0x8000
    specials = torch.cat([_f32_from_bits(_EDGE_MASTER_BITS), torch.tensor(_EDGE_MASTER_VALUES)])
    k = min(n, specials.numel())
    x[torch.randperm(n, generator=gen)[:k]] = specials[:k]
    return x


# finite grads: zeros of both signs, subnormals (fp32 and fp16), fp16 max and just past it, huge fp32
_GRAD_SPECIALS = [0.0, -0.0, 1e-45, -1e-40, 2.0**-24, 6.1e-5, 65504.0, -65504.0, 65520.0, 3e38, -3e38, 1e-30]
NONFINITE = [math.inf, -math.inf, math.nan]


def edge_grads(n: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 64.0) -> torch.Tensor:
    g = torch.randn(n, generator=gen) * scale
    if n:
        k = min(n, len(_GRAD_SPECIALS))
        g[torch.randperm(n, generator=gen)[:k]] = torch.tensor(_GRAD_SPECIALS[:k])
        if dtype == F16:
            g = g.clamp(-65504, 65504)  # finite in the grad's dtype: non-finite grads are a case of their own
    return g.to(dtype)


def make_state(rule, fmt, pdt, gdt, hyper, sizes, seed, device="cpu", edge=True) -> dict:
    """Params, grads, master and the rule's state: one tensor per size, on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    masters = [edge_masters(n, gen) if edge else torch.randn(n, generator=gen) for n in sizes]
    if fmt.master in ("remainder", "ulp8"):
        assert pdt in (BF16, F16) and (pdt == BF16 or fmt.master == "ulp8")
        split = [
            reference.split_master(m) if fmt.master == "remainder" else reference.ulp8_encode(m, pdt) for m in masters
        ]
        params, master = [p for p, _ in split], [r for _, r in split]
    else:
        params = [m.to(pdt) for m in masters]
        master = masters if fmt.master == "fp32" else []
    grads = [edge_grads(n, gdt, gen) if edge else torch.randn(n, generator=gen).to(gdt) for n in sizes]
    dense = F32 if fmt.state == "q8" else fmt.state_dtype
    st = {"params": params, "grads": grads, "master": master, **rule.make_state(hyper, sizes, gen, dense)}
    if fmt.state == "q8":
        encode_q8_states(rule, st)
    return {k: [t.to(device) for t in v] for k, v in st.items()}


def q8_code_of(rule: Rule, key: str) -> str:
    """The q8 code ("m" or "v") ``key``'s state is stored with: ``optim_``'s for the rule's state at that position."""
    return (
        R.RULES[rule.name]
        .states((1.0,) * len(R.RULES[rule.name].hyper), R.ALL_FLAGS)[rule.state_keys.index(key)]
        .q8_code
    )


def encode_q8_states(rule: Rule, st: dict, keys=None) -> None:
    """The rule's fp32 state lists of ``st`` (``keys``, default all) as q8, in place: ``key`` holds the
    codes, ``key + "_scales"`` the scales (rounded to nearest)."""
    for key in rule.state_keys if keys is None else keys:
        encode = reference.q8_encode_v if q8_code_of(rule, key) == "v" else reference.q8_encode_m
        pairs = [encode(t) for t in st[key]]
        st[key] = [c for c, _ in pairs]
        st[key + "_scales"] = [s for _, s in pairs]


def decode_q8_state(rule: Rule, st: dict, key: str) -> list[torch.Tensor]:
    """The fp32 values of a q8 state list of ``st`` (see :func:`encode_q8_states`)."""
    decode = reference.q8_decode_v if q8_code_of(rule, key) == "v" else reference.q8_decode_m
    return [decode(c, s) for c, s in zip(st[key], st[key + "_scales"])]


def _clone_at_same_offset(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous ``t`` as far past an aligned address as ``t`` is (a plain clone realigns)."""
    off = t.storage_offset()
    if off == 0 or not t.is_contiguous():
        return t.clone()
    out = torch.empty(off + t.numel(), dtype=t.dtype, device=t.device)[off:].view(t.shape)
    return out.copy_(t)


def clone_state(st: dict) -> dict:
    """A deep copy, each tensor misaligned as its original is."""
    return {k: [_clone_at_same_offset(t) for t in v] for k, v in st.items()}


# ---- the op: (rule, format) -> optim_'s arguments -------------------------------------------------


def flags_of(rule: Rule, fmt: Format, h: dict) -> int:
    return rule.flags(h) | _flag(fmt.sr_param, R.SR_PARAM) | _flag(fmt.sr_state, R.SR_STATE)


def states_of(rule: Rule, fmt: Format, st: dict, h: dict) -> list[torch.Tensor]:
    """``optim_``'s ``states`` list: the rule's state lists in order (q8: codes, then scales, per state)."""
    active = len(R.RULES[rule.name].states(rule.hyper_list(h), rule.flags(h)))
    out: list[torch.Tensor] = []
    for key in rule.state_keys[:active]:
        out += st[key]
        if fmt.state == "q8":
            out += st[key + "_scales"]
    return out


def op_call(rule: Rule, fmt: Format, st: dict, scalars, found_inf, rng, rng_base: int, h: dict):
    """("optim_", positional args) of one step of ``rule`` on state ``st`` stored as ``fmt``."""
    rng = rng if fmt.sr else None
    args = (st["params"], st["grads"], st["master"], states_of(rule, fmt, st, h), scalars, found_inf, rng, rng_base,
            rule.name, rule.hyper_list(h), flags_of(rule, fmt, h))  # fmt: skip
    return "optim_", args


def per_rule_covers(rule: Rule, fmt: Format) -> bool:
    """Whether a per-rule op of ``rule`` (``adamw_``, ``adamw_bf16_``, ``sgd_``, ``lion_``) takes the format's lists."""
    return rule.per_rule_op and fmt.state != "q8" and fmt.master != "ulp8"


def op_name(rule: Rule, fmt: Format) -> str:
    if rule.name in ("sgd", "lion"):
        return rule.name + "_"
    return "adamw_" if (fmt.master != "remainder" and not fmt.sr and fmt.state_dtype == F32) else "adamw_bf16_"


def per_rule_call(rule: Rule, fmt: Format, st: dict, scalars, found_inf, rng, rng_base: int, h: dict):
    """(op name, positional args) of the per-rule op that takes one step of ``rule`` on ``st`` stored as a
    dense, non-ulp8 ``fmt`` (:func:`per_rule_covers`): the lists of ``st`` as they are, broken or not."""
    op = op_name(rule, fmt)
    rng = rng if fmt.sr else None
    if rule.name == "sgd":
        tensors = (st["params"], st["grads"], st["master"], st["momentum_buffers"], scalars, found_inf, rng)
        return op, (*tensors, rng_base, h["momentum"], h["dampening"], h["weight_decay"], h["nesterov"], h["maximize"])
    if rule.name == "lion":
        tensors = (st["params"], st["grads"], st["master"], st["exp_avgs"], scalars, found_inf, rng)
        return op, (*tensors, rng_base, h["beta1"], h["beta2"], h["maximize"])
    lists = (st["params"], st["grads"], st["master"], st["exp_avgs"], st["exp_avg_sqs"], st["max_exp_avg_sqs"])
    flags = (h["beta1"], h["beta2"], h["eps"], h["amsgrad"], h["maximize"])
    if op == "adamw_":
        return op, (*lists, scalars, found_inf, *flags)
    return op, (*lists, scalars, found_inf, rng, rng_base, *flags)


def functional_call(backend: Backend, rule: Rule, fmt: Format, st: dict, scalars, found_inf, rng, rng_base, h):
    """The same step through ``fastamp.functional``: its per-rule op where one covers the format (its checks
    name that op's lists), else ``fastamp.functional.optim_``."""
    if not per_rule_covers(rule, fmt):
        _, args = op_call(rule, fmt, st, scalars, found_inf, rng, rng_base, h)
        params, grads, master, states, scalars, found_inf, rng, rng_base, name, hyper, flags = args
        functional.optim_(params, grads, master, states, scalars, found_inf, rng, rng_base, rule=name, hyper=hyper,
                          flags=flags, backend=backend.kind)  # fmt: skip
        return
    op = op_name(rule, fmt)
    rng = rng if fmt.sr else None
    fn = getattr(functional, op)
    if rule.name == "sgd":
        tensors = (st["params"], st["grads"], st["master"], st["momentum_buffers"], scalars, found_inf, rng, rng_base)
        kw = {k: h[k] for k in ("momentum", "dampening", "weight_decay", "nesterov", "maximize")}
    elif rule.name == "lion":
        tensors = (st["params"], st["grads"], st["master"], st["exp_avgs"], scalars, found_inf, rng, rng_base)
        kw = {k: h[k] for k in ("beta1", "beta2", "maximize")}
    else:
        tensors = (st["params"], st["grads"], st["master"], st["exp_avgs"], st["exp_avg_sqs"], st["max_exp_avg_sqs"])
        tensors += (scalars, found_inf) if op == "adamw_" else (scalars, found_inf, rng, rng_base)
        kw = {k: h[k] for k in ("beta1", "beta2", "eps", "amsgrad", "maximize")}
    fn(*tensors, backend=backend.kind, **kw)


def run_steps(fn_of_op, rule, fmt, st, h, steps, *, found=None, first=0, grad_mul=1 / 64.0, seed=0, rng_base=3):
    """``steps`` steps of ``rule`` on ``st`` in place, each op looked up by ``fn_of_op(op name)``."""
    dev = st["params"][0].device if st["params"] else torch.device("cpu")
    for k in range(first, first + steps):
        scalars = rule.step_scalars(h, k, torch.tensor(grad_mul, device=dev), dev)
        fi = None if found is None else torch.tensor([found], device=dev)
        rng = torch.tensor([0x5EED + seed, 1000 + k], dtype=torch.int64, device=dev)
        op, args = op_call(rule, fmt, st, scalars, fi, rng, rng_base, h)
        fn_of_op(op)(*args)


def ref_op(op: str) -> Callable:
    return getattr(reference, op)


# ---- comparison ----------------------------------------------------------------------------------------


def assert_state_matches(backend: Backend, rule: Rule, fmt: Format, got: dict, exp: dict, what: str = "") -> None:
    """Bit for bit where the backend is bit-exact; on a GPU Triton's AdamW within the tolerances budgets."""
    assert got.keys() == exp.keys()
    for key in got:
        assert len(got[key]) == len(exp[key]), (what, key)
        for i, (a, e) in enumerate(zip(got[key], exp[key])):
            name = f"{what} {key}[{i}] ({a.dtype}, n={a.numel()})"
            if backend.exact or rule.gpu_exact:
                assert_bits_equal(a, e, name)
                continue
            # Triton on a GPU: correctly rounded sqrt/div are requested but not guaranteed by every
            # Triton: fp32 within ADAMW_GPU_RTOL, 16-bit params within one of their ulps, remainders
            # through the joined master, bf16 state within two ulps (a stochastically rounded value
            # may land on the other neighbour)
            if key == "master" and a.dtype == torch.int16:
                a, e = reference.join_master(got["params"][i], a), reference.join_master(exp["params"][i], e)
            if key == "master" and a.dtype == torch.int8:
                a, e = reference.ulp8_decode(got["params"][i], a), reference.ulp8_decode(exp["params"][i], e)
            if a.dtype == torch.uint8:
                # q8 codes and scale bytes: a moment within the budget above may round to the next code, and
                # a block maximum near a power of two to the next scale byte
                diff = (a.int() - e.int()).abs()
                assert int(diff.max()) <= 1 if diff.numel() else True, name
                continue
            if a.dtype == F32:
                rtol = ADAMW_GPU_RTOL
            elif key == "params":
                rtol = torch.finfo(a.dtype).eps
            else:
                rtol = 2 * torch.finfo(a.dtype).eps
            torch.testing.assert_close(a.float(), e.float(), rtol=rtol, atol=1e-30, equal_nan=True, msg=name)


def assert_unchanged(st: dict, before: dict, what: str) -> None:
    for key in st:
        for i, (a, b) in enumerate(zip(st[key], before[key])):
            assert_bits_equal(a, b, f"{what}: {key}[{i}]")


# ---- bad inputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bad:
    """One refused input. ``mutate(state, dev)`` breaks the state in place and returns overrides of
    the other tensor arguments (``scalars``, ``found_inf``, ``rng``). Per backend family, what the
    kernel's refusal says after its op name ("" = only that it is refused by that op);
    ``functional``: (exception, message) of ``fastamp.functional``'s checks, the same on every backend.
    ``only``: the backend families where the input is bad at all (a CPU tensor is fine on the CPU)."""

    id: str
    rule: str
    fmt: str
    mutate: Callable
    cpu: str = ""
    cuda: str = ""
    triton: str = ""
    functional: tuple | None = None
    pdt: torch.dtype = BF16
    gdt: torch.dtype = F16
    hyper: str = ""
    only: tuple = ()


# The Triton launcher takes these (fp64 tensors through its own fallback; an int32/fp64 found_inf, fp64
# step_scalars, a 3-element rng, mixed moment dtypes read as they come): refused on the native kernels only.
NATIVE_ONLY = ("cpu", "cuda")


def family(b: Backend) -> str:
    return "triton" if b.kind == "triton" else b.device


def _put(key, i, make):
    def mutate(st, dev):
        st[key][i] = make(st[key][i], dev)

    return mutate


def _drop(key, keep):
    def mutate(st, dev):
        st[key] = st[key][:keep]

    return mutate


def _args(**over):
    return lambda st, dev: {k: v(dev) for k, v in over.items()}


def _nc(n, dtype=F32):
    return lambda t, dev: torch.zeros(n, 2, dtype=dtype, device=dev)[:, 0]


def _zeros(n, dtype):
    return lambda t, dev: torch.zeros(n, dtype=dtype, device=dev)


def _double(st, key):
    st[key] = st[key] + [t.clone() for t in st[key]]


def _all_params(dtype):
    def mutate(st, dev):
        st["params"] = [torch.zeros(t.numel(), dtype=dtype, device=dev) for t in st["params"]]

    return mutate


_GOT = "got 2 params but 1 grads"
BAD = [
    # adamw_ (fp32 masters)
    Bad("grads-count", "adamw", "fp32-master", _drop("grads", 1), _GOT, "expected 2 grads", functional=(ValueError, _GOT)),
    Bad("exp_avgs-count", "adamw", "fp32-master", lambda st, dev: _double(st, "exp_avgs"), "exp_avgs", "expected 2 exp_avgs"),
    Bad("masters-count", "adamw", "fp32-master", _drop("master", 1),
        "masters must be empty or have one tensor per param", "expected 0 or 2 masters"),
    Bad("amsgrad-without-max", "adamw", "fp32-master", _drop("max_exp_avg_sqs", 0),
        "amsgrad needs one max_exp_avg_sqs", "amsgrad needs 2 max_exp_avg_sqs",
        functional=(ValueError, "got 2 params but 0 max_exp_avg_sqs")),
    Bad("grad-numel", "adamw", "fp32-master", _put("grads", 1, _zeros(8, F16)),
        r"grads\[1\] has 8 elements but params\[1\] has 9", r"grads\[1\] has 8 elements"),
    Bad("grad-numel-fp32", "adamw", "fp32-master", _put("grads", 1, _zeros(7, F32)), gdt=F32,
        cuda=r"grads\[1\] has 7 elements"),
    Bad("exp_avg_sq-fp64", "adamw", "fp32-master", _put("exp_avg_sqs", 1, _zeros(9, torch.float64)),
        r"exp_avg_sqs\[1\] must have dtype Float"),
    Bad("exp_avg-fp64", "adamw", "param-only", _put("exp_avgs", 1, lambda t, dev: t.double()), pdt=F32, gdt=F32,
        functional=(TypeError, r"exp_avgs\[1\] must be float32")),
    Bad("exp_avg_sq-short", "adamw", "param-only", _put("exp_avg_sqs", 0, lambda t, dev: t[:3]), pdt=F32, gdt=F32,
        functional=(ValueError, r"exp_avg_sqs\[0\] has 3 elements")),
    # (mixed param or grad dtypes in one call are no refusal: every backend groups them, the CPU's
    # generic kernel of optim_ too, bit for bit: tests/backends/test_native_cpu_optim.py's every combination)
    Bad("params-fp64", "adamw", "fp32-master", _all_params(torch.float64), "params must be float32, float16 or bfloat16", only=NATIVE_ONLY),
    Bad("master-fp16", "adamw", "fp32-master", _put("master", 0, lambda t, dev: t.half()), gdt=F32,
        cuda=r"masters\[0\] must be float32"),
    Bad("exp_avg-strided", "adamw", "fp32-master", _put("exp_avgs", 1, _nc(9)), r"exp_avgs\[1\] must be contiguous"),
    Bad("exp_avg_sq-strided", "adamw", "fp32-master", _put("exp_avg_sqs", 0, _nc(5)), gdt=F32,
        cuda=r"exp_avg_sqs\[0\] must be contiguous"),
    Bad("param-strided", "adamw", "param-only", _put("params", 1, _nc(9)), pdt=F32, gdt=F32,
        functional=(ValueError, r"params\[1\] must be contiguous")),
    Bad("param-on-cpu", "adamw", "fp32-master", _put("params", 1, lambda t, dev: t.cpu()), gdt=F32,
        cuda=r"params\[1\] is on cpu", only=("cuda",)),
    Bad("scalars-3", "adamw", "fp32-master", _args(scalars=lambda dev: torch.zeros(3, device=dev)),
        r"step_scalars must be a contiguous float32 tensor of shape \[4\] or \[\d+, 4\]", "step_scalars",
        "step_scalars must hold 4 floats",
        functional=(ValueError, "step_scalars must be 4 floats")),
    Bad("scalars-fp64", "adamw", "fp32-master", _args(scalars=lambda dev: torch.zeros(4, dtype=torch.float64, device=dev)),
        "step_scalars must be a contiguous float32", only=NATIVE_ONLY),
    Bad("found-int32", "adamw", "fp32-master", _args(found_inf=lambda dev: torch.zeros(1, dtype=torch.int32, device=dev)),
        "found_inf must be a 1-element float32 tensor", only=NATIVE_ONLY),
    Bad("found-2", "adamw", "fp32-master", _args(found_inf=lambda dev: torch.zeros(2, device=dev)),
        "found_inf must be a 1-element float32 tensor"),
    Bad("found-on-cpu", "adamw", "fp32-master", _args(found_inf=lambda dev: torch.zeros(1)), gdt=F32, cuda="found_inf",
        only=("cuda",)),
    # adamw_bf16_ (int16 remainders, bf16 moments, stochastic rounding)
    Bad("rem-grads-count", "adamw", "bf16-remainder", _drop("grads", 1), _GOT, "grads"),
    Bad("rem-count", "adamw", "bf16-remainder", _drop("master", 1),
        "remainders must be empty or have one tensor per param, got 1", "expected 0 or 2 remainders",
        functional=(ValueError, "got 2 params but 1 remainders")),
    Bad("rem-amsgrad-without-max", "adamw", "bf16-remainder", _drop("max_exp_avg_sqs", 0),
        "amsgrad needs one max_exp_avg_sqs tensor per param, got 0"),
    Bad("rem-param-fp32", "adamw", "bf16-remainder", _put("params", 1, _zeros(9, F32)),
        # (one check of every rule on the CPU, in the generic kernel of optim_: sgd_'s words, adamw_bf16_'s list)
        r"int16 remainders need bfloat16 params, but params\[1\] is Float", r"params\[1\] must be bfloat16", "",
        functional=(TypeError, r"params\[1\] must be bfloat16")),
    Bad("rem-int32", "adamw", "bf16-remainder", _put("master", 1, _zeros(9, torch.int32)),
        r"remainders\[1\] must have dtype Short", r"remainders\[1\] must be int16"),
    Bad("rem-int32-first", "adamw", "bf16-remainder", _put("master", 0, lambda t, dev: t.int()), gdt=F32,
        cuda=r"remainders\[0\] must be int16", functional=(TypeError, r"remainders\[0\] must be int16")),
    Bad("rem-numel", "adamw", "bf16-remainder", _put("master", 1, _zeros(8, torch.int16)),
        r"remainders\[1\] has 8 elements but params"),
    Bad("rem-grad-numel", "adamw", "bf16-remainder", _put("grads", 0, _zeros(7, F32)), gdt=F32,
        cuda=r"grads\[0\] has 7 elements"),
    Bad("rem-grad-fp64", "adamw", "bf16-remainder", _put("grads", 1, _zeros(9, torch.float64)),
        r"grads\[1\] must be float32, float16 or bfloat16", only=NATIVE_ONLY),
    Bad("rem-exp_avg-fp16", "adamw", "bf16-remainder", _put("exp_avgs", 0, _zeros(5, F16)),
        "moments must be float32 or bfloat16", functional=(TypeError, r"exp_avgs\[0\] must be float32 or bfloat16")),
    Bad("rem-exp_avg_sq-bf16", "adamw", "bf16-remainder", _put("exp_avg_sqs", 1, lambda t, dev: t.bfloat16()),
        r"exp_avg_sqs\[1\] must have dtype Float, got BFloat16", r"exp_avg_sqs\[1\] must be Float", only=NATIVE_ONLY),
    Bad("rem-exp_avg-strided", "adamw", "bf16-remainder", _put("exp_avgs", 1, _nc(9)), r"exp_avgs\[1\] must be contiguous"),
    Bad("rem-scalars-3", "adamw", "bf16-remainder", _args(scalars=lambda dev: torch.zeros(3, device=dev)),
        r"step_scalars must be a contiguous float32 tensor of shape \[4\] or \[\d+, 4\]", "step_scalars"),
    Bad("rem-found-2", "adamw", "bf16-remainder", _args(found_inf=lambda dev: torch.zeros(2, device=dev)),
        "found_inf must be a 1-element float32 tensor"),
    Bad("sr-rng-fp32", "adamw", "bf16-sr", _args(rng=lambda dev: torch.zeros(2, device=dev)),
        r"rng must be a contiguous int64 tensor of 2 elements \[seed, counter\], got dtype Float", "rng must be int64",
        "rng", functional=(ValueError, "rng must be an int64")),
    Bad("sr-rng-3", "adamw", "bf16-sr", _args(rng=lambda dev: torch.zeros(3, dtype=torch.int64, device=dev)),
        "rng must be a contiguous int64 tensor of 2 elements", "rng must be a contiguous 2-element", only=NATIVE_ONLY),
    # sgd_
    Bad("sgd-grads-count", "sgd", "bf16-remainder", _drop("grads", 1), _GOT, hyper="momentum"),
    Bad("sgd-masters-count", "sgd", "bf16-remainder", _drop("master", 1),
        "masters must be empty or have one tensor per param, got 1", hyper="momentum"),
    Bad("sgd-buffers-missing", "sgd", "bf16-remainder", _drop("momentum_buffers", 0),
        "momentum=0.9 needs one momentum_buffers tensor per param, got 0", hyper="momentum"),
    Bad("sgd-fp32-buffers-missing", "sgd", "fp32-master", _drop("momentum_buffers", 0), cuda="momentum_buffers",
        pdt=F16, hyper="momentum", functional=(ValueError, "got 2 params but 0 momentum_buffers")),
    Bad("sgd-masters-fp64", "sgd", "bf16-remainder",
        lambda st, dev: st.__setitem__("master", [torch.zeros(t.numel(), dtype=torch.float64, device=dev)
                                                  for t in st["master"]]),
        "masters must be float32 .* or int16 .*, got Double", hyper="momentum"),
    Bad("sgd-masters-mixed", "sgd", "bf16-remainder", _put("master", 1, _zeros(9, F32)),
        r"masters\[1\] must have dtype Short, got Float", hyper="momentum"),
    Bad("sgd-master-fp64", "sgd", "fp32-master", _put("master", 1, lambda t, dev: t.double()), pdt=F16,
        cuda=r"masters\[1\] must be Float", hyper="momentum"),
    Bad("sgd-rem-param-fp32", "sgd", "bf16-remainder", _put("params", 1, _zeros(9, F32)),
        r"int16 remainder masters need bfloat16 params, but params\[1\] is Float", hyper="momentum"),
    Bad("sgd-rem-fp16-params", "sgd", "fp32-master",
        lambda st, dev: st.__setitem__("master", [torch.zeros(t.numel(), dtype=torch.int16, device=dev)
                                                  for t in st["master"]]),
        cuda=r"remainder masters need bfloat16 params.*params\[0\]", triton="params", pdt=F16, hyper="momentum",
        functional=(TypeError, r"int16 remainders need bfloat16 params, but params\[0\]")),
    Bad("sgd-param-fp64", "sgd", "bf16-remainder", _put("params", 1, _zeros(9, torch.float64)),
        r"params\[1\] must be float32, float16 or bfloat16", hyper="momentum"),
    Bad("sgd-grad-int32", "sgd", "bf16-remainder", _put("grads", 1, _zeros(9, torch.int32)),
        r"grads\[1\] must be float32, float16 or bfloat16", hyper="momentum"),
    Bad("sgd-buffer-fp16", "sgd", "bf16-remainder", _put("momentum_buffers", 1, _zeros(9, F16)),
        r"momentum_buffers\[1\] must have dtype Float", hyper="momentum"),
    Bad("sgd-buffer-numel", "sgd", "bf16-remainder", _put("momentum_buffers", 1, _zeros(10, F32)),
        r"momentum_buffers\[1\] has 10 elements", hyper="momentum"),
    Bad("sgd-scalars-4", "sgd", "bf16-remainder", _args(scalars=lambda dev: torch.zeros(4, device=dev)),
        r"step_scalars must be a contiguous float32 tensor of shape \[3\] or \[\d+, 3\] \(\[lr, grad_mul",
        r"step_scalars must be a contiguous float32 tensor of shape \[3\] or \[\d+, 3\]", "step_scalars",
        functional=(ValueError, "step_scalars must be 3 floats"), hyper="momentum"),
    Bad("sgd-found-fp64", "sgd", "bf16-remainder", _args(found_inf=lambda dev: torch.zeros(1, dtype=torch.float64,
                                                                                              device=dev)),
        "found_inf must be a 1-element float32 tensor", hyper="momentum", only=NATIVE_ONLY),
    Bad("sgd-rng-int32", "sgd", "bf16-sr", _args(rng=lambda dev: torch.zeros(2, dtype=torch.int32, device=dev)),
        "rng must be a contiguous int64 tensor of 2 elements", hyper="momentum"),
    # lion_ (the same master and state checks as sgd_, its own names)
    Bad("lion-grads-count", "lion", "bf16-remainder", _drop("grads", 1), _GOT, hyper="default",
        functional=(ValueError, _GOT)),
    Bad("lion-exp_avgs-missing", "lion", "fp32-master", _drop("exp_avgs", 0), "exp_avgs", pdt=F16, hyper="default",
        functional=(ValueError, "got 2 params but 0 exp_avgs")),
    Bad("lion-exp_avg-fp16", "lion", "bf16-remainder", _put("exp_avgs", 1, _zeros(9, F16)),
        r"exp_avgs\[1\]", hyper="default", functional=(TypeError, r"exp_avgs\[1\] must be float32")),
    Bad("lion-exp_avg-numel", "lion", "bf16-remainder", _put("exp_avgs", 0, _zeros(4, F32)),
        r"exp_avgs\[0\] has 4 elements", hyper="default", functional=(ValueError, r"exp_avgs\[0\] has 4 elements")),
    Bad("lion-rem-fp16-params", "lion", "fp32-master",
        lambda st, dev: st.__setitem__("master", [torch.zeros(t.numel(), dtype=torch.int16, device=dev)
                                                  for t in st["master"]]),
        cuda=r"remainder masters need bfloat16 params.*params\[0\]", triton="params", pdt=F16, hyper="default",
        functional=(TypeError, r"int16 remainders need bfloat16 params, but params\[0\]")),
    Bad("lion-scalars-4", "lion", "bf16-remainder", _args(scalars=lambda dev: torch.zeros(4, device=dev)),
        r"step_scalars must be a contiguous float32 tensor of shape \[3\] or \[\d+, 3\]", "step_scalars",
        "step_scalars", functional=(ValueError, r"step_scalars must be 3 floats \[lr, decay, grad_mul\]"),
        hyper="default"),
    Bad("lion-rng-int32", "lion", "bf16-sr", _args(rng=lambda dev: torch.zeros(2, dtype=torch.int32, device=dev)),
        "rng must be a contiguous int64 tensor of 2 elements", "rng", "rng", hyper="default"),
]  # fmt: skip
