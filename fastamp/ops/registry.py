"""The op table: every op's schema and fake (meta) kernel, written once, and their registration.

:data:`OPS` maps each op to its ``torch.library`` schema, its fake kernel and a note on what
it mutates and returns. Two namespaces are registered from it, with the same schema and
fake:

* ``fastamp::<op>``: the native kernels of ``fastamp._C`` (csrc/). ``_C`` registers only
  kernels (``TORCH_LIBRARY_IMPL``) plus ``build_info()`` / ``cpu_isa()``; the schemas are
  defined here, right after it loads. The dispatcher then compares every C++ kernel's
  signature with the schema from this table and raises on a difference, here, in Python:
  :data:`NATIVE_ERROR` says what differs and the native backend is unavailable, while
  ``import fastamp`` keeps working. (The other order, schemas first, would make the same
  check inside ``_C``'s static initialisers, where a failure aborts the process.) That a
  CPU and a CUDA kernel of one op have the same C++ signature, which the dispatcher checks
  when ``_C`` loads by aborting, is made a compile error by csrc/op_signatures.h.
* ``fastamp_triton::<op>``: the Triton launchers of ``fastamp.kernels``; each kernel module
  calls :func:`register_triton` when it is imported (Triton is never imported here). The per-rule
  optimizer ops have no Triton op: Triton runs them as its generic ``optim_`` kernel.

:data:`OPTIM_OPS`, in the same form, holds the optimizers' step-scalar op for torch.compile
(``fastamp_optim::step_scalars``, one for every rule, see :mod:`fastamp.optim.engine.traced`):
its kernel is the eager Python code, registered for every device by :func:`register_optim`
when that module is imported.

Importing this module never fails: if ``fastamp._C`` is missing (``FASTAMP_NO_EXT=1``
builds) or does not load against the installed torch, ``NATIVE_ERROR`` says why.

Schema conventions: ``Tensor(a!)`` marks every argument an op writes (lists too), nothing
aliases an output (the returned tensor of the check ops is new), and every op of
:data:`OPS` returns either nothing or that one 0-dim fp32 tensor; the fake kernels say only
that. The op of :data:`OPTIM_OPS` writes nothing and returns a new fp32 tensor: ``[k]`` for
0-dim ``counts``, ``[n, k]`` (one row per count) for a 1-D vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

NATIVE_NS = "fastamp"
TRITON_NS = "fastamp_triton"
OPTIM_NS = "fastamp_optim"
REF_NS = "fastamp_ref"


def _fake_sum_of_squares(args: dict):
    return args["found_inf"].new_empty((), dtype=torch.float32)


def _fake_in_place(args: dict):
    return None


def _fake_rule_step_scalars(args: dict):
    # a 0-dim count gives one set [k], a 1-D vector of counts one row each [len, k]
    from fastamp.reference.optim import RULES

    width = len(RULES[args["rule"]].scalars)
    return args["counts"].new_empty((*args["counts"].shape, width), dtype=torch.float32)


@dataclass(frozen=True)
class OpDef:
    """One op: ``schema`` (arguments and returns), its ``fake`` kernel and what it mutates.

    ``fake`` gets the arguments by name; ``device_arg`` names the tensor whose device the
    fake checks (a meta/fake tensor among real ones is refused rather than answered).
    """

    schema: str
    fake: Callable[[dict], object]
    device_arg: str
    doc: str


OPS: dict[str, OpDef] = {
    "unscale_check_": OpDef(
        "(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale, bool write_back, bool compute_sumsq) -> Tensor",
        _fake_sum_of_squares,
        "found_inf",
        "writes grads (when write_back) and found_inf (set, never reset); returns a new 0-dim fp32 sum of squares",
    ),
    "update_scale_": OpDef(
        "(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, Tensor found_inf, "
        "float growth_factor, float backoff_factor, int growth_interval, int hysteresis, float min_scale, "
        "float max_scale) -> ()",
        _fake_in_place,
        "scale",
        "writes scale and both trackers; reads found_inf",
    ),
    "adamw_": OpDef(
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, Tensor(c!)[] exp_avgs, "
        "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor step_scalars, Tensor? found_inf, "
        "float beta1, float beta2, float eps, bool amsgrad, bool maximize) -> ()",
        _fake_in_place,
        "step_scalars",
        "writes params, masters, both moments and max_exp_avg_sqs (nothing at all when found_inf is non-zero); "
        "step_scalars: fp32 [4] shared by all tensors or [n, 4] (contiguous, row i for tensor i)",
    ),
    "adamw_bf16_": OpDef(
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] remainders, Tensor(c!)[] exp_avgs, "
        "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor step_scalars, Tensor? found_inf, Tensor? rng, "
        "int rng_base, float beta1, float beta2, float eps, bool amsgrad, bool maximize) -> ()",
        _fake_in_place,
        "step_scalars",
        "writes params, remainders, both moments and max_exp_avg_sqs (nothing when found_inf is non-zero); "
        "reads rng, never advances it; step_scalars: fp32 [4] shared or [n, 4] (contiguous, row i for tensor i)",
    ),
    "sgd_": OpDef(
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, Tensor(c!)[] momentum_buffers, "
        "Tensor step_scalars, Tensor? found_inf, Tensor? rng, int rng_base, float momentum, float dampening, "
        "float weight_decay, bool nesterov, bool maximize) -> ()",
        _fake_in_place,
        "step_scalars",
        "writes params, masters and momentum_buffers (nothing when found_inf is non-zero); reads rng; "
        "step_scalars: fp32 [3] shared or [n, 3] (contiguous, row i for tensor i)",
    ),
    "lion_": OpDef(
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, Tensor(c!)[] exp_avgs, Tensor step_scalars, "
        "Tensor? found_inf, Tensor? rng, int rng_base, float beta1, float beta2, bool maximize) -> ()",
        _fake_in_place,
        "step_scalars",
        "writes params, masters and exp_avgs (nothing when found_inf is non-zero); reads rng; "
        "step_scalars: fp32 [3] shared or [n, 3] (contiguous, row i for tensor i)",
    ),
    "unscale_check_stats_": OpDef(
        "(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale, bool write_back, bool compute_sumsq, "
        "Tensor(c!) counts, Tensor(d!) absmax) -> Tensor",
        _fake_sum_of_squares,
        "found_inf",
        "unscale_check_, and overwrites counts and absmax with per-tensor statistics",
    ),
}

NATIVE_OPS = tuple(OPS)

# Gradient release's check pass (fastamp/_release.py), defined in the native namespace, with
# CPU and CUDA kernels (csrc/cpu/amp.cpp, csrc/cuda/amp.cu; a native build may lack the CUDA ones,
# native_has_kernel says); the reference and Triton have them as plain functions
# (fastamp.reference.amp / fastamp.kernels.amp), so they stay out of OPS, whose ops every backend
# registers. unscale_check_partials_ keeps the per-chunk fp64 partials unscale_check_ folds;
# sumsq_fold folds them, in a given order, as unscale_check_ does.
RELEASE_OPS: dict[str, OpDef] = {
    "unscale_check_partials_": OpDef(
        "(Tensor[] grads, Tensor(a!) found_inf, Tensor inv_scale, Tensor(b!) partials, int[] offsets) -> ()",
        _fake_in_place,
        "found_inf",
        "reads grads; writes found_inf (set, never reset) and grad i's chunk partials (fp64) into "
        "partials[offsets[i]:]",
    ),
    "sumsq_fold": OpDef(
        "(Tensor partials, Tensor index) -> Tensor",
        lambda args: args["partials"].new_empty((), dtype=torch.float32),
        "partials",
        "writes nothing; returns a new 0-dim fp32: the fp64 sum of partials[index] in index order",
    ),
}

# The rules on 8-bit block-scaled moments (the q8 format of fastamp/reference/q8.py; semantics:
# fastamp.reference.adamw_q8_, sgd_q8_, lion_q8_), defined in the native and Triton namespaces
# and as opaque reference ops (reference_op). No backend has kernels of their own: the native
# CPU and CUDA run them as optim_ (as_optim, registered by _load_native), Triton as its generic
# optim_ kernel (kernels/optim.py). They stay out of OPS, whose ops every backend registers with
# one kernel per device.
Q8_OPS: dict[str, OpDef] = {
    "adamw_q8_": OpDef(
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, Tensor(c!)[] exp_avg_codes, "
        "Tensor(d!)[] exp_avg_scales, Tensor(e!)[] exp_avg_sq_codes, Tensor(f!)[] exp_avg_sq_scales, "
        "Tensor step_scalars, Tensor? found_inf, Tensor? rng, int rng_base, float beta1, float beta2, float eps, "
        "bool maximize, bool sr_param, bool sr_codes) -> ()",
        _fake_in_place,
        "step_scalars",
        "writes params, masters and both moments' codes and scales (nothing when found_inf is non-zero); reads rng "
        "(when sr_param or sr_codes), never advances it; step_scalars: fp32 [4] shared or [n, 4] (contiguous, row i "
        "for tensor i)",
    ),
    "sgd_q8_": OpDef(
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, Tensor(c!)[] momentum_buffer_codes, "
        "Tensor(d!)[] momentum_buffer_scales, Tensor step_scalars, Tensor? found_inf, Tensor? rng, int rng_base, "
        "float momentum, float dampening, float weight_decay, bool nesterov, bool maximize, bool sr_param, "
        "bool sr_codes) -> ()",
        _fake_in_place,
        "step_scalars",
        "writes params, masters and the momentum buffers' codes and scales (nothing when found_inf is non-zero); "
        "reads rng (when sr_param or sr_codes); step_scalars: fp32 [3] shared or [n, 3]",
    ),
    "lion_q8_": OpDef(
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, Tensor(c!)[] exp_avg_codes, "
        "Tensor(d!)[] exp_avg_scales, Tensor step_scalars, Tensor? found_inf, Tensor? rng, int rng_base, "
        "float beta1, float beta2, bool maximize, bool sr_param, bool sr_codes) -> ()",
        _fake_in_place,
        "step_scalars",
        "writes params, masters and exp_avg's codes and scales (nothing when found_inf is non-zero); reads rng "
        "(when sr_param or sr_codes); step_scalars: fp32 [3] shared or [n, 3]",
    ),
}

# The one optimizer op: an update rule x a master format x a state format (semantics:
# fastamp.reference.optim_, whose docstring defines every argument). Defined in the native and
# Triton namespaces and as an opaque reference op (reference_op). The native CPU and CUDA and
# Triton each have one generic kernel of it (csrc/cpu/optim.cpp, csrc/cuda/optim.cuh,
# kernels/optim.py); the per-rule ops run as optim_ on their arguments (as_optim).
GENERIC_OPS: dict[str, OpDef] = {
    "optim_": OpDef(
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, Tensor(c!)[] states, Tensor step_scalars, "
        "Tensor? found_inf, Tensor? rng, int rng_base, str rule, float[] hyper, int flags) -> ()",
        _fake_in_place,
        "step_scalars",
        "writes params, masters and states (nothing when found_inf is non-zero); reads rng (under the SR flags), "
        "never advances it; step_scalars: fp32 [k] shared or [n, k] (contiguous, row i for tensor i), k the rule's",
    ),
}

# The per-rule optimizer ops: what reference.to_optim maps onto optim_.
PER_RULE_OPS = ("adamw_", "adamw_bf16_", "adamw_q8_", "sgd_", "sgd_q8_", "lion_", "lion_q8_")


# The step scalars of a compiled optimizer step: opaque ops, so that inductor does not
# re-derive eager's fp64 maths with another rounding. Kernels: fastamp/optim/engine/traced.py.
OPTIM_OPS: dict[str, OpDef] = {
    # one op for every update rule: the rule's own function (fastamp.optim.engine.traced.STEP_SCALARS,
    # registered by its module in fastamp/optim/rules/) computes the row from ``args``
    "step_scalars": OpDef(
        "(str rule, Tensor counts, Tensor? found_inf, Tensor? grad_scale, Tensor lr, float[] args) -> Tensor",
        _fake_rule_step_scalars,
        "counts",
        "writes nothing; returns a new fp32 [k] (0-dim counts: one set) or [n, k] (1-D counts: one row each), "
        "k the width of the rule's row (fastamp.reference.optim.RULES[rule].scalars)",
    ),
}

_TABLES = {
    NATIVE_NS: {**OPS, **RELEASE_OPS, **Q8_OPS, **GENERIC_OPS},
    TRITON_NS: {**OPS, **Q8_OPS, **GENERIC_OPS},
    OPTIM_NS: OPTIM_OPS,
    REF_NS: {**Q8_OPS, **GENERIC_OPS},
}

# How a Python argument is made the schema's type (tensors pass as they are).
_COERCE = {
    "List[Tensor]": list,
    "float": float,
    "int": int,
    "bool": bool,
    "str": str,
    "List[float]": lambda xs: [float(x) for x in xs],
}


def schema(ns: str, op: str) -> torch._C.FunctionSchema:
    """The parsed schema of ``ns::op`` from the table."""
    return torch._C.parse_schema(f"{ns}::{op}{_TABLES[ns][op].schema}")


def _coercers(op: str) -> tuple:
    return tuple(_COERCE.get(str(a.type)) for a in schema(NATIVE_NS, op).arguments)


_COERCERS = {op: _coercers(op) for op in (*OPS, *Q8_OPS, *GENERIC_OPS)}


def coerce(op: str, args) -> tuple:
    """``args`` (positional, all of them) as the schema's types: lists for ``Tensor[]``, Python scalars."""
    coercers = _COERCERS[op]
    if len(args) != len(coercers):
        raise TypeError(f"{op}: expected {len(coercers)} arguments, got {len(args)}")
    # a list stays the same object (no op keeps or changes its lists; a copy of 20,000 tensors
    # costs more than the rest of a planned Triton launch's Python)
    return tuple(a if c is None or (c is list and type(a) is list) else c(a) for c, a in zip(coercers, args))


def _make_fake(ns: str, op: str):
    names = [a.name for a in schema(ns, op).arguments]
    entry = _TABLES[ns][op]

    def fake(*args, **kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        _only_fake(f"{ns}::{op}", bound[entry.device_arg])
        return entry.fake(bound)

    fake.__name__ = f"{op}fake"
    return fake


def _only_fake(qualname: str, t) -> None:
    # The fake impl also serves the Meta dispatch key: a call mixing real tensors with meta
    # ones lands here instead of on a kernel. Refuse it rather than return garbage.
    from torch._subclasses.fake_tensor import is_fake

    if not (t.is_meta or is_fake(t)):
        raise RuntimeError(f"{qualname}: tensors on different devices (a meta tensor among {t.device} tensors)")


def _define(lib: torch.library.Library, ns: str, op: str) -> None:
    """Define ``ns::op`` from the table in ``lib`` and register its fake.

    An op already defined with the same schema is accepted: a ``_C`` built before the
    schemas moved here still defines them itself. Any other schema is an error.
    """
    want = schema(ns, op)
    try:
        have = torch._C._dispatch_find_schema_or_throw(f"{ns}::{op}", "").schema()
    except RuntimeError:
        have = None
    if have is None:
        lib.define(f"{op}{_TABLES[ns][op].schema}", tags=(torch.Tag.pt2_compliant_tag,))
    elif str(have) != str(want):
        raise RuntimeError(f"{ns}::{op} is already defined as {have}, but the op table says {want}")
    torch.library.register_fake(f"{ns}::{op}", _make_fake(ns, op), lib=lib)


NATIVE_LOADED = False
NATIVE_ERROR: str | None = None
_LIBS: dict[str, torch.library.Library] = {}


def _load_native() -> None:
    global NATIVE_LOADED, NATIVE_ERROR
    try:
        from fastamp import _C  # noqa: F401  (loading it runs the TORCH_LIBRARY_IMPL registrations)
    except Exception as e:  # ImportError, or OSError / undefined symbol against another torch
        NATIVE_ERROR = f"{type(e).__name__}: {e}"
        return
    lib = _LIBS[NATIVE_NS] = torch.library.Library(NATIVE_NS, "FRAGMENT")
    try:
        for op in (*OPS, *RELEASE_OPS, *Q8_OPS, *GENERIC_OPS):
            _define(lib, NATIVE_NS, op)
    except RuntimeError as e:  # a C++ kernel whose signature differs from the table's schema
        NATIVE_ERROR = f"fastamp._C does not match the op table of fastamp/ops/registry.py: {e}"
        return
    NATIVE_LOADED = True
    for key in ("CPU", "CUDA"):
        dt = key.lower()
        if not native_has_kernel("optim_", dt):
            continue
        # a device with the generic kernel: a per-rule op without a kernel of its own runs as optim_
        # (callers may still name the per-rule ops)
        for op in PER_RULE_OPS:
            if not native_has_kernel(op, dt):
                lib.impl(op, as_optim(op), key)
                AS_OPTIM.add((op, dt))


# (per-rule op, device type) pairs of the native ops that run as optim_ (as_optim)
AS_OPTIM: set[tuple[str, str]] = set()


def as_optim(op: str) -> Callable:
    """A kernel of the per-rule op ``op`` (its arguments, all positional): ``fastamp::optim_`` on them (reference.to_optim)."""

    def per_rule(*args) -> None:
        from fastamp.reference.optim import to_optim

        torch.ops.fastamp.optim_(*coerce("optim_", to_optim(op, args)))

    per_rule.__name__ = f"{op}as_optim"
    return per_rule


def _register(ns: str, op: str, impl: Callable, keys: tuple[str, ...]):
    lib = _LIBS.get(ns)
    if lib is None:
        lib = _LIBS[ns] = torch.library.Library(ns, "FRAGMENT")
    _define(lib, ns, op)
    for key in keys:
        lib.impl(op, impl, key)
    return getattr(getattr(torch.ops, ns), op)


def register_triton(op: str, impl: Callable):
    """Define ``fastamp_triton::op`` from the table with ``impl`` as its CPU and CUDA kernel; the op."""
    return _register(TRITON_NS, op, impl, ("CPU", "CUDA"))


def register_optim(op: str, impl: Callable):
    """Define ``fastamp_optim::op`` from :data:`OPTIM_OPS` with ``impl`` as its kernel on every device; the op."""
    return _register(OPTIM_NS, op, impl, ("CompositeExplicitAutograd",))


def reference_op(op: str):
    """``fastamp_ref::op``: the torch reference of an op of :data:`Q8_OPS` or ``optim_`` as an opaque op (every device).

    What the ``torch`` backend's compiled steps call instead of tracing the reference: inductor
    (torch 2.13, CPU) miscompiles the q8 codec's integer maths, writing garbage into the last
    elements of a tensor whose size is not a multiple of its vector width; opaque, the eager code
    runs as it is. Registered on first use.
    """
    ns = getattr(torch.ops, REF_NS)
    if not hasattr(ns, op):
        from fastamp import reference

        register_ref = _register(REF_NS, op, getattr(reference, op), ("CompositeExplicitAutograd",))
        return register_ref
    return getattr(ns, op)


def native_has_kernel(op: str, device_type: str) -> bool:
    """Whether ``fastamp::op`` has a kernel registered for ``device_type`` ('cpu'/'cuda')."""
    if not NATIVE_LOADED:
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"{NATIVE_NS}::{op}", key))
    except RuntimeError:
        return False


def build_info() -> str | None:
    return torch.ops.fastamp.build_info() if NATIVE_LOADED else None


def cpu_isa() -> str | None:
    """The instruction set the native CPU kernels run (``FASTAMP_CPU_ISA`` may narrow it), None without them."""
    return torch.ops.fastamp.cpu_isa() if NATIVE_LOADED and hasattr(torch.ops.fastamp, "cpu_isa") else None


_load_native()
