"""Ahead-of-time compile tier for the Triton kernels: what a GPU would run, proven without one.

The interpreter tests (test_triton*.py) prove the arithmetic; this tier compiles the kernels
for real GPU targets (sm_80 and sm_90, ``triton.compile`` on an ``ASTSource`` with a
``GPUTarget``; the ptxas that ships inside Triton's NVIDIA backend does the last step) and
reads what came out. For every specialisation it asserts:

* it compiles;
* 0 spill bytes (ptxas ``-v`` of the very ptxas call Triton makes);
* on the data streams of the streaming kernels (unscale_check; optim: the one optimizer kernel,
  every update rule x master format x state format), compiled for aligned tensors
  (``ALIGNED=True``), every access site has a vectorised instance of at least 8 bytes
  (``ld.global.v2/.v4``, ``st.global.v2/.v4``), and no unpredicated access narrower than that
  (the full blocks' accesses; a format's helper serves several streams from one site); 4 bytes
  for the 1-byte streams (q8 codes, ulp8 corrections: 4 elements per thread,
  :data:`BYTE_STREAM_FUNCS`). The masked tail, the per-program scalars (launch table, step
  scalars, flags) and the q8 scale bytes (one per 32 elements, :data:`BLOCK_SCALE_FUNCS`) stay
  scalar by design;
* the PTX has only correctly rounded or exact floating-point instructions: add/sub/mul/div
  /sqrt with ``.rn``, min/max/abs/neg, comparisons, conversions with ``.rn`` (or exact
  widening ones); no ``fma``/``mad``, no ``.ftz``, no ``.approx``/``.full``, no rcp, rsqrt,
  ex2, lg2 (bit-exactness with the reference).

Which specialisations: the ones the real launchers produce, generated from the tables. A worker
process (run without ``TRITON_INTERPRET``, so ``chunk_config()`` and the launch options are the
GPU's) loads ``kernels/`` from this tree, replaces every ``*_kernel`` launched with
``kernel[grid](...)`` by a recording stand-in, and calls the public launchers
(``unscale_check_``, ``unscale_check_stats_``, ``update_scale_``, ``optim_``) on small CPU
tensors: the loss-scaler ops for every grad dtype and flag, ``optim_`` for every combination of
the rule x format tables (:func:`_optim_combinations`: the rules of
``fastamp.reference.optim.RULES`` with every subset of their flags, x the master formats and the
state formats of ``kernels/optim.py`` with the param dtypes each takes, x every grad dtype), with
16-byte aligned tensors and with views whose storage offset breaks the alignment. Each recorded
launch goes through Triton's own binder (the code ``kernel[grid](...)`` runs: signature,
constexprs, specialisation attributes and options, ``num_warps`` included), and the distinct
results are compiled. The recorded set is exactly what the tables allow
(``test_launchers_reach_every_combination_of_the_tables``, against a set written from the
reference's rules of where random bits are drawn).

Budget (CI runs this on 2 CPU cores): the launchers produce 2,146 distinct specialisations per
target, 2,096 of them the optimizer kernel's (counts, chunk counts, scalar addresses and the
runtime flags never add one: ``test_no_specialisation_churn``), 0.5-4 s of compile each (the q8
states' the most). By default the tier compiles a cover of 149 (124 of the optimizer kernel's,
:func:`_optim_cover`; about 3.5 minutes of CPU) with the installed Triton, and a smaller one with
each second version of ``FASTAMP_AOT_TRITON`` (:func:`_light_cover`, ~20 compiles, ~30 s: what
differs between versions is how a launch binds and compiles, which the heaviest specialisation of
each rule and state format exercises):

* for the optimizer kernel, every format combination at its heaviest flags (the most streams:
  states, masters, random bits), aligned, for sm_90, and every master and state format with every
  param dtype it takes; the heaviest of each rule and state format for sm_80; every grad dtype per
  rule for both targets; every flag combination, aligned or not, of one dtype and format
  combination per rule, for sm_90; the heaviest unaligned one per rule and state format;
* for the others, every dtype with its heaviest flags for sm_80 and sm_90, and every flag
  combination, aligned or not, of one dtype for sm_90.

The flags select whole streams or a few scalar operations, so the cover holds every kind of
instruction the full set does. It does not prove the absence of spills everywhere: ptxas's
allocator is not monotonic in the streams (at 8 elements per thread, 22 of the 1,412 compiles
of the kernels of then spilled 4-12 bytes in lighter specialisations a cover did not hold). So
the full set is compiled whenever a kernel or its launch shape changes: ``FASTAMP_AOT_FULL=1``
(4,292 compiles, 22-25 minutes on 2 cores), and benchmarks/results/triton_aot.md is written from
it (``python tests/tools/test_triton_aot.py --full --write benchmarks/results/triton_aot``).

Triton versions: the one installed, and any other listed in ``FASTAMP_AOT_TRITON``
(os.pathsep-separated; a directory holding a ``triton`` package is put first on the worker's
PYTHONPATH, e.g. one made by ``pip install --no-deps --target DIR triton==3.2.0``; a file is a
Python interpreter to run the worker with). What ``kernel[grid](...)`` does before compiling
differs between Triton 3.2, 3.3 and 3.4+; all three are handled (checked with 3.2.0, 3.3.1,
3.6.0 and 3.9.0). Skipped with a reason where Triton, its NVIDIA backend or its ptxas is
missing.

The last two tests need a GPU (and one of them two): that launches follow the tensors'
device, and that launch tables stay valid under CUDA-graph capture and replay.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHS = (80, 90)
STREAMING = ("_unscale_check_kernel", "_optim_kernel")
KERNELS = (*STREAMING, "_stats_reduce_kernel", "_update_scale_kernel")
# Pointers a kernel reads or writes once per program (launch table, device scalars, per-chunk
# results): scalar accesses by design. Every other global access is a data stream.
CONTROL_PTRS = {
    "table_ptr",
    "grad_ptrs_ptr",
    "step_scalars_ptr",
    "found_inf_ptr",
    "inv_scale_ptr",
    "rng_ptr",
    "partial_ptr",
    "chunk_counts_ptr",
    "chunk_absmax_ptr",
    "counts_ptr",
    "absmax_ptr",
    "scale_ptr",
    "growth_tracker_ptr",
    "hysteresis_tracker_ptr",
}
# The helpers of the q8 states' scale bytes (kernels/formats.py; one byte per 32 elements, a
# [BLOCK // 32] vector per state and block, each byte read by the threads of its q8 block): one byte
# wide by design, 1/32 of the elements, not a data stream. Counted with the control accesses.
BLOCK_SCALE_FUNCS = {"load_scales", "store_scales"}
# The helpers of the 1-byte-per-element streams (q8 codes, ulp8 corrections): at 4 elements per
# thread, as every stream, an access is one 4-byte load or store (128 contiguous bytes a warp), so
# their sites need 4 bytes, the others 8.
BYTE_STREAM_FUNCS = {"load_bytes", "store_bytes"}
# The update rules (kernels/rules.py) read nothing but their step-scalar row: every access located
# in that file is a control access.
CONTROL_FILES = {"rules.py"}
# constexprs derived from others (or fixed): not flags
DERIVED = {"CHUNK", "BLOCK", "N_PTR", "N_COL", "HAS_RN", "RN", "RBLOCK"}
KIND_NAMES = {0: "f32", 1: "f16", 2: "bf16", 3: "f64", 4: "i16", 5: "i8", 6: "u8"}
# seconds the workers of one tier may take (the cover; the full set, 22-25 min on 2 cores, gets 4 h)
WORKER_TIMEOUT_S = int(os.environ.get("FASTAMP_AOT_TIMEOUT", "1500"))
FULL_TIMEOUT_S = int(os.environ.get("FASTAMP_AOT_TIMEOUT", "14400"))


# --------------------------------------------------------------------------------------------
# Worker: runs in its own process, never under the interpreter.
# --------------------------------------------------------------------------------------------


def _load_kernels(root: Path):
    """Import ``root/kernels`` as ``fastamp.kernels`` without importing the rest of fastamp.

    The kernels need only torch, triton, their own package and the op table
    (``fastamp/ops/registry.py``, torch only), so any Python with those (another torch/triton pair
    included) can compile this tree's kernels. The native extension is kept out: it may be
    built for another torch, and nothing here needs it.
    """
    import importlib
    import importlib.util
    import types

    if "fastamp" not in sys.modules:
        pkg = types.ModuleType("fastamp")
        pkg.__path__ = [str(root / "fastamp")]
        sys.modules["fastamp"] = pkg
        sys.modules["fastamp._C"] = None
    spec = importlib.util.spec_from_file_location(
        "fastamp.kernels", root / "kernels" / "__init__.py", submodule_search_locations=[str(root / "kernels")]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fastamp.kernels"] = mod
    spec.loader.exec_module(mod)
    return {name: importlib.import_module(f"fastamp.kernels.{name}") for name in ("_common", "amp", "optim")}


def _install_recorders(mods) -> list:
    """Replace every launched ``*_kernel`` by a stand-in recording ``kernel[grid](*args, **kwargs)``.

    Returns the list the launches go to: ``(kernel name, JITFunction, args, kwargs)``.
    Nothing runs on a device.
    """
    from triton.runtime.jit import JITFunction

    launched = []

    class _Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((self.name, self.fn, args, kwargs))

            return launch

    C = mods["_common"]
    # The launchers refuse CPU tensors outside the interpreter; here nothing is executed.
    C.check_runnable = lambda op, device: None
    for mod in (mods["amp"], mods["optim"]):
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                setattr(mod, name, _Recorder(name, obj))
    return launched


def _tensor(n, dtype, aligned=True):
    import torch

    if aligned:
        return torch.zeros(n, dtype=dtype)
    # a view one element into its storage: not 16-byte aligned
    return torch.zeros(n + 1, dtype=dtype)[1:]


def _optim_combinations(mods) -> list:
    """Every ``(rule, hyper, flags, master kind, state format, param dtypes)`` the ``optim_`` launcher
    takes, generated from the tables: the rules of ``fastamp.reference.optim.RULES`` (each subset of a
    rule's own flags and SR_PARAM / SR_STATE; the hyperparameters only as far as they change the states
    a rule keeps: all zeros and all halves), the master formats and state formats of
    ``kernels/optim.py`` (``MASTERS``, ``STATES``: the param dtypes each takes; the grads any of
    ``GRAD_DTYPES``). MAXIMIZE and NESTEROV pick operations at run time (see :func:`_record_churn`)."""
    from fastamp.reference import optim as ref

    K = mods["optim"]
    out, seen = [], set()
    for rule, r in ref.RULES.items():
        optional = r.flags | ref.SR_PARAM | ref.SR_STATE
        bits = [1 << k for k in range(optional.bit_length()) if optional >> k & 1]
        for value in (0.0, 0.5):
            hyper = [value] * len(r.hyper)
            for chosen in itertools.product((0, 1), repeat=len(bits)):
                flags = sum(b for b, c in zip(bits, chosen) if c)
                n_state = len(r.states(hyper, flags))
                for master, (_, _, m_params) in K.MASTERS.items():
                    for fmt, (_, _, s_params) in K.STATES.items():
                        p_dtypes = [d for d in m_params if d in s_params]
                        key = (rule, flags, n_state, master, fmt)
                        if (fmt == "none") != (n_state == 0) or not p_dtypes or key in seen:
                            continue
                        seen.add(key)
                        out.append((rule, hyper, flags, master, fmt, p_dtypes))
    return out


def _optim_args(mods, rule, hyper, flags, master, fmt, tensors, scalars=None, found=None, rng_base=0):
    """``optim_``'s arguments for ``tensors`` (``(n, param dtype, grad dtype, aligned)`` each) in ``master``
    and ``fmt`` (zeros: recorded, never run)."""
    import torch

    from fastamp.reference import optim as ref

    K = mods["optim"]
    r = ref.RULES[rule]
    defs = r.states(hyper, flags)
    mdt = K.MASTERS[master][1]
    sdt = K.STATES[fmt][1]
    states = []
    for _ in defs:
        states += [_tensor(n, sdt, al) for n, _, _, al in tensors]
        if fmt == "q8":
            states += [_tensor(-(-n // 32), sdt, al) for n, _, _, al in tensors]
    k = len(r.scalars)
    return (
        [_tensor(n, p, al) for n, p, _, al in tensors],
        [_tensor(n, g, al) for n, _, g, al in tensors],
        [_tensor(n, mdt, al) for n, _, _, al in tensors] if mdt is not None else [],
        states,
        torch.ones(k) if scalars is None else scalars,
        found,
        torch.tensor([1, 2], dtype=torch.int64) if flags & (ref.SR_PARAM | ref.SR_STATE) else None,
        rng_base,
        rule,
        hyper,
        flags,
    )


def _record_launches(mods, launched):
    """Call every public launcher for every dtype/flag combination it accepts (recorded, not run)."""
    import torch

    tensor = _tensor
    n = 5
    floats = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    amp, optim = mods["amp"], mods["optim"]

    # unscale_check_ / unscale_check_stats_: grads of every dtype, aligned and not, in one call
    for write_back, sumsq, stats in itertools.product((False, True), repeat=3):
        grads = [tensor(n, dt, al) for dt in floats[:3] for al in (True, False)]
        found, inv = torch.zeros(1), torch.ones(1)
        if stats:
            counts, absmax = torch.zeros(len(grads), 3, dtype=torch.int64), torch.zeros(len(grads))
            amp.unscale_check_stats_(grads, found, inv, write_back, sumsq, counts, absmax)
        else:
            amp.unscale_check_(grads, found, inv, write_back, sumsq)
    amp.update_scale_(
        torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 10
    )

    # optim_: every combination of the rule x format tables, each with every (param, grad) dtype pair
    # its formats take, aligned and not, in one call (one launch per dtype pair and alignment)
    grads = optim.GRAD_DTYPES
    for i, (rule, hyper, flags, master, fmt, p_dtypes) in enumerate(_optim_combinations(mods)):
        tensors = [(n, p, g, al) for p in p_dtypes for g in grads for al in (True, False)]
        found = torch.zeros(1) if i % 2 else None
        optim.optim_(*_optim_args(mods, rule, hyper, flags, master, fmt, tensors, found=found))
    return launched


def _record_churn(mods, launched):
    """Launches that differ only in what must not make Triton compile again.

    Tensor counts (1, 2, 17, 40), chunk counts (tensors of 1 to 3 GPU chunks), scalars and
    flags at unaligned addresses, shared and per-tensor step scalars (row stride 0 or k), and
    the runtime flags and hyperparameters (MAXIMIZE, NESTEROV, torch.lerp's branch, SGD's weight
    decay on or off, the found_inf check). Each kernel should compile once per update rule and
    state format.
    """
    import torch

    from fastamp.reference import optim as ref

    amp = mods["amp"]
    optim = mods["optim"]
    chunk = mods["_common"].chunk_config()[0]
    for i, count in enumerate((1, 2, 17, 40)):
        sizes = [(j * 7919 + i) % (3 * chunk) + 1 for j in range(count)]
        found = torch.zeros(3)[i % 3 :][:1]  # unaligned for i = 1, 2
        amp.unscale_check_([torch.zeros(n) for n in sizes], found, torch.ones(2)[i % 2 :][:1], True, True)
        for rule, r in ref.RULES.items():
            k = len(r.scalars)
            # shared step scalars, or one row per tensor (the row stride is a runtime argument)
            scalars = torch.ones(2 * k)[i : i + k] if i % 2 else torch.ones(count, k)
            # the first never 0 (SGD's momentum: no state then); the others 0 now and then (weight decay off)
            hyper = [(0.9, 0.3)[i % 2]] + [(0.0, 0.5, 0.99, 0.3)[(i + j) % 4] for j in range(1, len(r.hyper))]
            flags = (ref.MAXIMIZE | (r.flags & ref.NESTEROV)) if i % 2 else 0
            for fmt in ("fp32", "q8"):
                tensors = [(n, torch.float32, torch.float32, True) for n in sizes]
                args = _optim_args(mods, rule, hyper, flags, "none", fmt, tensors, scalars, found if i % 2 else None)
                optim.optim_(*args)
    return launched


def _count_launches_20k(mods, launched) -> dict:
    """Kernel launches per op for 20,000 tensors of mixed sizes, one dtype group each (recorded)."""
    import torch

    from fastamp.reference import optim as ref

    amp, optim = mods["amp"], mods["optim"]
    sizes = [(i * 7919) % 5000 + 1 for i in range(20000)]
    counts = {}
    launched.clear()
    amp.unscale_check_([torch.zeros(n) for n in sizes], torch.zeros(1), torch.ones(1), True, True)
    counts["unscale_check_"] = len(launched)
    hypers = {"adamw": [0.9, 0.999, 1e-8], "sgd": [0.9, 0.0, 0.0], "lion": [0.9, 0.99]}
    sr = ref.SR_PARAM | ref.SR_STATE
    for rule, master, fmt, flags in (("adamw", "fp32", "fp32", 0), ("sgd", "fp32", "fp32", 0),
                                     ("lion", "fp32", "fp32", 0), ("adamw", "none", "q8", sr)):  # fmt: skip
        tensors = [(n, torch.bfloat16, torch.float32, True) for n in sizes]
        args = _optim_args(mods, rule, hypers[rule], flags, master, fmt, tensors, found=torch.zeros(1))
        launched.clear()
        optim.optim_(*args)
        counts[f"optim_ {rule} {fmt}"] = len(launched)
        del args
    launched.clear()
    return counts


_BINDERS = {}


def _bind(fn, args, kwargs, target):
    """What ``fn[grid](*args, **kwargs)`` would compile for ``target``: ``(ASTSource, options, constexprs)``.

    Triton's own binder decides the signature, constexprs, specialisation attributes and
    options, as on a launch; what follows it is what ``JITFunction.run`` does in that
    version: ``_pack_args`` (3.4+), the same steps inline (3.3), an ``AttrsDescriptor`` (3.2).
    """
    import inspect

    from triton.compiler import ASTSource, make_backend

    key = (id(fn), target.arch)
    old_binder = "backend" in inspect.signature(fn.create_binder).parameters  # Triton 3.2
    if key not in _BINDERS:
        backend = make_backend(target)
        if old_binder:
            fn.create_binder(backend)
            _BINDERS[key] = (backend, fn.binder)
        else:
            from triton.runtime.jit import create_function_from_signature

            _BINDERS[key] = (backend, create_function_from_signature(fn.signature, fn.params, backend))
    backend, binder = _BINDERS[key]
    kwargs = dict(kwargs)
    if hasattr(fn, "_pack_args"):  # Triton >= 3.4
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
        src = ASTSource(fn, signature, constexprs, attrs)
        named = {fn.arg_names[k[0]]: v for k, v in src.constants.items() if isinstance(k, tuple) and len(k) == 1}
    elif not old_binder:  # Triton 3.3: what JITFunction.run does inline
        from triton._utils import find_paths_if, get_iterable_path

        bound_args, specialization, _ = binder(*args, **kwargs)
        options = backend.parse_options(kwargs)
        sigvals = [x[0] for x in specialization]
        signature = {p.name: v for p, v in zip(fn.params, sigvals)}
        paths = find_paths_if(sigvals, lambda _, val: val == "constexpr")
        constexprs = {path: get_iterable_path(list(bound_args.values()), path) for path in paths}
        attrvals = [x[1] for x in specialization]
        attrs = find_paths_if(attrvals, lambda _, x: isinstance(x, str))
        attrs = {k: backend.parse_attr(get_iterable_path(attrvals, k)) for k in attrs}
        src = ASTSource(fn, signature, constexprs, attrs)
        named = {fn.arg_names[k[0]]: v for k, v in src.constants.items() if isinstance(k, tuple) and len(k) == 1}
    else:  # Triton 3.2
        bound_args, sig_and_spec, _, _, _ = binder(*args, **kwargs)
        options = backend.parse_options(kwargs)
        bound_vals = tuple(bound_args.values())
        sigkeys = [fn.params[i].name for i in fn.non_constexpr_indices]
        signature = {k: ("*i8" if v == "none" else v) for k, v in zip(sigkeys, sig_and_spec[: len(sigkeys)])}
        attrs = backend.get_attrs_descriptor(fn.params, bound_vals)
        ones = attrs.get_constants()
        constexprs = {p.name: v for v, p in zip(bound_vals, fn.params) if p.is_constexpr or p.num in ones or v is None}
        src = ASTSource(fn, signature, constexprs, attrs)
        named = dict(constexprs)
    declared = [p.name for p in fn.params if p.is_constexpr]
    flags = {k: _plain(named[k]) for k in declared if k in named}
    return src, options, flags


def _plain(v):
    v = getattr(v, "value", v)
    return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)


def _ptxas_log_capture():
    """Keep the stderr of the ptxas calls Triton makes (its ``-v`` resource report).

    Triton runs ``ptxas -v`` with stderr to a temporary file that it deletes; a wrapper around
    ``subprocess.run`` reads it first. Returns a list that collects the logs.
    """
    logs = []
    orig = subprocess.run

    def run(cmd, *a, **kw):
        result = orig(cmd, *a, **kw)
        if isinstance(cmd, (list, tuple)) and cmd and os.path.basename(str(cmd[0])).startswith("ptxas"):
            err = kw.get("stderr")
            name = getattr(err, "name", None)
            text = ""
            if name and os.path.exists(name):
                with open(name) as f:
                    text = f.read()
            logs.append({"cmd": [str(c) for c in cmd], "log": text})
        return result

    subprocess.run = run
    return logs


def _parse_ptxas(log: str) -> dict:
    regs = re.findall(r"Used (\d+) registers", log)
    frame = re.findall(r"(\d+) bytes stack frame", log)
    st = re.findall(r"(\d+) bytes spill stores", log)
    ld = re.findall(r"(\d+) bytes spill loads", log)
    return {
        "regs": max(map(int, regs)) if regs else None,
        "stack": max(map(int, frame)) if frame else 0,
        "spill_stores": max(map(int, st)) if st else 0,
        "spill_loads": max(map(int, ld)) if ld else 0,
    }


_INSTR = re.compile(r"^\s*(@!?%p\d+\s+)?([a-z][\w:]*(?:\.[\w:]+)*)\b")
_FLOAT_TYPES = {"f16", "f16x2", "bf16", "bf16x2", "f32", "f64"}
_FORBIDDEN_OPS = {"fma", "mad", "rcp", "rsqrt", "ex2", "lg2", "sin", "cos", "tanh"}
_FORBIDDEN_MODS = {"ftz", "approx", "full", "sat"}
_ROUNDED_OPS = {"add", "sub", "mul", "div", "sqrt"}  # must carry .rn on float types
_EXACT_OPS = {"min", "max", "abs", "neg", "setp", "selp", "mov", "ld", "st", "testp", "copysign", "set", "slct"}


def _fp_violation(op: str) -> str | None:
    """Why a PTX opcode breaks bit-exactness, or None. ``op`` is e.g. ``add.rn.f32``."""
    parts = op.split(".")
    base, mods = parts[0], set(parts[1:])
    floaty = bool(mods & _FLOAT_TYPES)
    if mods & _FORBIDDEN_MODS and (floaty or base in ("cvt", "div", "sqrt", "rcp")):
        return "modifier " + "/".join(sorted(mods & _FORBIDDEN_MODS))
    if base in _FORBIDDEN_OPS and (floaty or base != "mad"):
        return "not correctly rounded or contracted"
    if not floaty:
        return None
    if base in _ROUNDED_OPS:
        return None if "rn" in mods else "no .rn rounding"
    if base == "cvt":
        # float -> narrower float must round to nearest; float -> int truncates/rounds exactly as asked
        types = [p for p in parts[1:] if re.fullmatch(r"[fsub]\d+x?\d*|bf16x?2?", p)]
        rnd = mods & {"rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi"}
        if len(types) == 2 and types[0] in _FLOAT_TYPES and types[1] in _FLOAT_TYPES:
            narrow = _fbits(types[0]) < _fbits(types[1])
            if narrow and "rn" not in rnd:
                return "narrowing conversion without .rn"
        return None
    if base in _EXACT_OPS:
        return None
    return "float instruction not on the exact list"


def _fbits(t: str) -> int:
    return int(re.sub(r"\D", "", t.split("x")[0]) or 0)


def _analyse_ptx(ptx: str, source_cache: dict) -> dict:
    """Global accesses (width, predicate, source site) and floating-point instruction check."""
    files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, flags=re.M))
    by_name = {Path(path).name: idx for idx, path in files.items()}
    loc = inl = None
    accesses = []
    bad = Counter()
    ops = Counter()
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".loc"):
            m = re.match(r"\.loc\s+(\d+)\s+(\d+)\s+(\d+)(.*)", s)
            if m:
                loc = (m.group(1), int(m.group(2)))
                # the calling line: `inlined_at F L C` (Triton 3.9), or the first `@[ file:L:C`
                # of the call chain in the comment (3.6); Triton 3.2 gives neither
                mi = re.search(r"inlined_at\s+(\d+)\s+(\d+)", m.group(4))
                mc = re.search(r"@\[\s*([^:\s]+):(\d+):\d+", m.group(4))
                if mi:
                    inl = (mi.group(1), int(mi.group(2)))
                elif mc and mc.group(1) in by_name:
                    inl = (by_name[mc.group(1)], int(mc.group(2)))
                else:
                    inl = None
            continue
        if not s or s.startswith(("//", ".", "$", "{", "}")):
            continue
        m = _INSTR.match(s)
        if not m:
            continue
        op = m.group(2)
        ops[op] += 1
        why = _fp_violation(op)
        if why:
            bad[f"{op} ({why})"] += 1
        parts = op.split(".")
        if parts[0] in ("ld", "st") and "global" in parts:
            vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
            bits = next((_fbits(p) for p in reversed(parts) if re.fullmatch(r"[bfsu]\d+", p)), 0)
            # the masked and unmasked instances of a helper share its calling line
            where, control, need = _classify(loc, inl, files, source_cache)
            accesses.append(
                {
                    "kind": parts[0],
                    "bytes": vec * bits // 8,
                    "vector": vec > 1,
                    "predicated": bool(m.group(1)),
                    "site": where,
                    "control": control,
                    "need": need,
                }
            )
    return {"accesses": accesses, "bad_fp": dict(bad), "n_instr": sum(ops.values())}


def _classify(loc, inl, files, source_cache):
    """Where a global access comes from and whether it is a control access.

    PTX debug locations name the helper line and, for inlined helpers, the calling line.
    Helper-internal lines are not always exact (Triton 3.9 reports some a line or two off),
    calling lines are. So: an access inlined from a helper is control when the calling line
    names a control pointer or control helper, data otherwise, and its site is the calling
    line (one per stream; the masked and unmasked instances share it). Without calling lines
    (Triton 3.2), an access is data when it lies in one of the element-wise memory helpers,
    and its site is that helper. An access in the kernel body itself is data only when its
    line loads/stores through a data pointer. A misplaced control access can only be counted
    as data (a false failure, never a pass). The third value is the access width a data site
    needs: 4 bytes for the 1-byte streams (:data:`BYTE_STREAM_FUNCS`), 8 for every other. An access
    located in a file of :data:`CONTROL_FILES` (the update rules' step-scalar reads) is control.
    """
    if loc is not None and Path(files.get(loc[0], "")).name in CONTROL_FILES:
        return _line(loc, files, source_cache)[1], True, 8
    if inl is not None:
        text, where, _ = _line(inl, files, source_cache)
        names = set(re.findall(r"[A-Za-z_]\w*", text))
        return where, bool(names & (CONTROL_PTRS | CONTROL_CALLS | BLOCK_SCALE_FUNCS)), _need(names)
    text, where, func = _line(loc, files, source_cache)
    if func in BLOCK_SCALE_FUNCS:
        return func, True, 8
    if func in DATA_FUNCS | BYTE_STREAM_FUNCS:
        return func, False, _need({func})
    m = re.search(r"tl\.(?:load|store)\(\s*([A-Za-z_]\w*)", text)
    return where, not (m and m.group(1) not in CONTROL_PTRS), 8


def _need(names) -> int:
    return 4 if names & BYTE_STREAM_FUNCS else 8


# helpers that read only the launch table and device scalars
CONTROL_CALLS = {"chunk_of", "chunk_end", "load_ptr", "sr_base_key"}
# the element-wise memory helpers of kernels/_common.py
DATA_FUNCS = {"load_raw", "load_f32", "store_raw", "store_from_f32", "store_state"}


def _line(loc, files, source_cache):
    """(source text, ``file:line``, enclosing function name) of a debug location."""
    if loc is None:
        return "", "?", None
    path = files.get(loc[0], "?")
    if path not in source_cache:
        try:
            source_cache[path] = Path(path).read_text().splitlines()
        except OSError:
            source_cache[path] = []
    lines = source_cache[path]
    lineno = loc[1]
    text = lines[lineno - 1] if 0 < lineno <= len(lines) else ""
    return text, f"{Path(path).name}:{lineno}", _enclosing_function(lines, lineno)


def _enclosing_function(lines, lineno):
    name = None
    for i in range(min(lineno, len(lines)) - 1, -1, -1):
        m = re.match(r"def\s+(\w+)\s*\(", lines[i])
        if m:
            name = m.group(1)
            break
    return name


def _summarise(analysis, ptxas):
    """Per data site (``kind site``) the widest access; a site is scalar when that is narrower than it
    needs, or when any of its unpredicated accesses is (the full blocks' instances: the masked tail's
    are predicated). A helper called for several streams (a format's decode for each state) is one
    site; the second rule holds each stream's own instances to the width."""
    data = [a for a in analysis["accesses"] if not a["control"]]
    sites = defaultdict(list)
    need = {}
    narrow = set()
    for a in data:
        name = f"{a['kind']} {a['site']}"
        sites[(a["kind"], a["site"])].append(a["bytes"])
        need[name] = a.get("need", 8)
        if not a.get("predicated", True) and a["bytes"] < need[name]:
            narrow.add(name)
    site_best = {f"{k[0]} {k[1]}": max(v) for k, v in sites.items()}
    vec = [a["bytes"] for a in data if a["vector"]]
    return {
        **ptxas,
        "n_data_sites": len(site_best),
        "n_vector_sites": sum(1 for k, b in site_best.items() if b >= need[k] and k not in narrow),
        "min_site_bytes": min(site_best.values()) if site_best else None,
        "max_vector_bytes": max(vec) if vec else 0,
        "min_vector_bytes": min(vec) if vec else 0,
        "scalar_sites": sorted(k for k, b in site_best.items() if b < need[k] or k in narrow),
        "bad_fp": analysis["bad_fp"],
    }


def _heaviness(spec: dict) -> int:
    """How much a specialisation holds, to pick the heaviest of a set: for the optimizer kernel its
    streams (states, a master, random bits of the param and of the states) and whether its loads are
    vectorised; for the others the flags that switch a stream or an operation on."""
    f = spec["flags"]
    if spec["kernel"] == "_optim_kernel":
        return f["N_STATE"] + (f["MASTER"] != 0) + f["SR_P"] + f["SR_S"] + f["ALIGNED"]
    return sum(bool(v) for k, v in f.items() if not k.endswith("KIND") and k not in DERIVED)


def _heaviest(specs: dict, keys) -> str:
    """The heaviest of ``keys`` (:func:`_heaviness`; ties: the largest key, so the choice is stable)."""
    return max(keys, key=lambda k: (_heaviness(specs[k]), k))


def _light_cover(specs: dict, by_kernel: dict) -> list:
    """The cover of a second Triton version (``FASTAMP_AOT_TRITON``): what differs between versions
    is how a launch binds and compiles, not the maths, so the heaviest specialisation of each
    (rule, state format) of the optimizer kernel and of each dtype of the others for sm_90, the
    heaviest per rule / kernel for sm_80, and the heaviest unaligned one per rule (~20 compiles,
    against ~150 for the installed Triton's cover)."""
    chosen = set()
    for kernel, keys in by_kernel.items():
        groups = defaultdict(list)
        unaligned = defaultdict(list)
        for key in keys:
            f = specs[key]["flags"]
            group = (
                (f["RULE"], f["STATE"])
                if kernel == "_optim_kernel"
                else tuple(sorted((k, v) for k, v in f.items() if k.endswith("KIND")))
            )
            (groups if f.get("ALIGNED", True) else unaligned)[group].append(key)
        chosen.update((_heaviest(specs, ks), 90) for ks in groups.values())
        per_rule = defaultdict(list)
        for group, ks in groups.items():
            per_rule[group[0] if kernel == "_optim_kernel" else None].extend(ks)
        chosen.update((_heaviest(specs, ks), 80) for ks in per_rule.values())
        by_rule = defaultdict(list)
        for group, ks in unaligned.items():
            by_rule[group[0] if kernel == "_optim_kernel" else None].extend(ks)
        chosen.update((_heaviest(specs, ks), 90) for ks in by_rule.values())
    return sorted(chosen)


def _subset(specs: dict, full: bool, light: bool = False) -> list:
    """(key, arch) pairs to compile: all of them, the default cover (see the module docstring), or
    with ``light`` the cover of a second Triton version (:func:`_light_cover`)."""
    if full:
        return [(k, a) for k in specs for a in ARCHS]
    chosen = set()
    by_kernel = defaultdict(list)
    for key, spec in specs.items():
        by_kernel[spec["kernel"]].append(key)
    if light:
        return _light_cover(specs, by_kernel)
    for kernel, keys in by_kernel.items():
        if kernel == "_optim_kernel":
            chosen.update(_optim_cover(specs, keys))
            continue
        groups = defaultdict(list)
        for key in keys:
            flags = specs[key]["flags"]
            groups[tuple(sorted((k, v) for k, v in flags.items() if k.endswith("KIND")))].append(key)

        for members in groups.values():
            chosen.update((_heaviest(specs, members), a) for a in ARCHS)
        rep = max(groups, key=lambda d: (len(groups[d]), str(d)))
        chosen.update((key, 90) for key in groups[rep])
    return sorted(chosen)


def _optim_cover(specs: dict, keys: list) -> set:
    """The default cover of the generic optimizer kernel (``keys``: its specialisations).

    * every format combination (rule x master format x state format, with or without states) at its
      heaviest flags (the most streams: states, masters, random bits), aligned, for sm_90, with a
      param dtype that rotates over the combinations;
    * every (master format, state format, param dtype) at its heaviest, aligned, for sm_90: each
      format's decode and encode with every param dtype it meets;
    * the heaviest of each (rule, state format), aligned, for sm_80;
    * every grad dtype per rule at its heaviest, for sm_80 and sm_90;
    * every flag combination, aligned or not, of one dtype and format combination per rule (the one
      with the most specialisations), for sm_90;
    * the heaviest unaligned one (the scalar fallback) per rule and state format, for sm_90.

    So every rule's maths, every format's decode and encode with every dtype it meets, every grad
    load and every flag are compiled, and every rule and state format for both targets (124 of the
    2,096; the cover until 2026-12-07 held 197, every format combination with every param dtype for
    sm_90 and each combination for sm_80 too, ~2.5 min more CPU per run). The full set when the
    kernel changes (``FASTAMP_AOT_FULL=1``): ptxas's allocator is not monotonic in the streams.
    """
    flags = {k: specs[k]["flags"] for k in keys}

    chosen = set()
    by_format, by_dtype, by_state, by_grad = (defaultdict(list) for _ in range(4))
    for k in keys:
        f = flags[k]
        if not f["ALIGNED"]:
            continue
        by_format[(f["RULE"], f["MASTER"], f["STATE"], f["N_STATE"] > 0)].append(k)
        by_dtype[(f["MASTER"], f["STATE"], f["P_KIND"])].append(k)
        by_state[(f["RULE"], f["STATE"])].append(k)
        by_grad[(f["RULE"], f["G_KIND"])].append(k)
    for i, (_, ks) in enumerate(sorted(by_format.items())):
        params = sorted({flags[k]["P_KIND"] for k in ks})
        p = params[i % len(params)]
        chosen.add((_heaviest(specs, [k for k in ks if flags[k]["P_KIND"] == p]), 90))
    chosen.update((_heaviest(specs, ks), 90) for ks in by_dtype.values())
    chosen.update((_heaviest(specs, ks), 80) for ks in by_state.values())
    for ks in by_grad.values():
        chosen.update((_heaviest(specs, ks), a) for a in ARCHS)
    groups = defaultdict(list)
    for k in keys:
        f = flags[k]
        groups[(f["RULE"], f["P_KIND"], f["G_KIND"], f["MASTER"], f["STATE"])].append(k)
    for rule in {d[0] for d in groups}:
        rep = max((d for d in groups if d[0] == rule), key=lambda d: (len(groups[d]), str(d)))
        chosen.update((k, 90) for k in groups[rep])
    unaligned = defaultdict(list)
    for k in keys:
        if not flags[k]["ALIGNED"]:
            unaligned[(flags[k]["RULE"], flags[k]["STATE"])].append(k)
    chosen.update((_heaviest(specs, ks), 90) for ks in unaligned.values())
    return chosen


def worker_main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=str(ROOT))
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--light", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dump-ptx")
    ap.add_argument("--only", help="compile only specialisations whose key matches this regex")
    args = ap.parse_args(argv)
    out = {"rank": args.rank, "results": [], "specs": {}}

    def finish(**extra):
        out.update(extra)
        Path(args.out).write_text(json.dumps(out))
        return 0

    try:
        import triton
    except Exception as e:
        return finish(skip=f"triton is not importable: {type(e).__name__}: {e}")
    out["triton"] = triton.__version__
    try:
        from triton.backends import backends

        if "nvidia" not in backends:
            return finish(skip=f"triton {triton.__version__} has no NVIDIA backend")
        import triton.backends.nvidia as nv

        bundled = Path(nv.__file__).parent / "bin" / "ptxas"
        env_ptxas = os.environ.get("TRITON_PTXAS_PATH")
        if not (bundled.exists() or (env_ptxas and Path(env_ptxas).exists())):
            return finish(skip=f"triton {triton.__version__}: no ptxas in its NVIDIA backend ({bundled})")
        from triton.backends.compiler import GPUTarget
    except Exception as e:
        return finish(skip=f"triton {triton.__version__}: NVIDIA backend unusable: {type(e).__name__}: {e}")

    t0 = time.time()
    root = Path(args.root).resolve()
    mods = _load_kernels(root)
    # the source as compiled (the PTX line info points into it), whatever edits come later
    source_cache = {str(p): p.read_text().splitlines() for p in (root / "kernels").glob("*.py")}
    out["chunk_config"] = list(mods["_common"].chunk_config())
    sink = _install_recorders(mods)
    launched = list(_record_launches(mods, sink))
    out["n_launches"] = len(launched)
    sink.clear()
    churn = defaultdict(set)
    for name, fn, a, kw in _record_churn(mods, sink):
        src, options, flags = _bind(fn, a, kw, GPUTarget("cuda", ARCHS[-1], 32))
        churn[_variant_name(name, flags)].add(f"{src.hash()}:{options.num_warps}")
    out["churn"] = {k: len(v) for k, v in churn.items()}
    out["launches_20k"] = _count_launches_20k(mods, sink)
    specs = {}
    sources = {}
    reps = {}
    seen = set()
    for name, fn, a, kw in launched:
        # what the binder can depend on; launches equal in it bind the same (saves time only)
        pre = (name, _args_key(fn, a), tuple(sorted((k, _arg_key(v, False)) for k, v in kw.items())))
        if pre in seen:
            continue
        seen.add(pre)
        src, options, flags = _bind(fn, a, kw, GPUTarget("cuda", ARCHS[-1], 32))
        key = f"{name}:{_label(flags)}:w{options.num_warps}:{src.hash()[:12]}"
        specs.setdefault(key, {"kernel": name, "flags": flags, "num_warps": options.num_warps})
        sources.setdefault((key, ARCHS[-1]), (src, options))
        reps.setdefault(key, (fn, a, kw))
    out["specs"] = specs
    out["record_s"] = time.time() - t0
    todo = _subset(specs, args.full, args.light)
    if args.only:
        todo = [(k, a) for k, a in todo if re.search(args.only, f"{k}:sm_{a}")]
    todo = todo[args.rank :: args.workers]
    logs = _ptxas_log_capture()
    for key, arch in todo:
        if (key, arch) not in sources:
            fn, a, kw = reps[key]
            src, options, _ = _bind(fn, a, kw, GPUTarget("cuda", arch, 32))
            if f"{src.hash()[:12]}" != key.rsplit(":", 1)[1]:
                raise AssertionError(f"{key}: binds differently for sm_{arch}")
            sources[(key, arch)] = (src, options)
        src, options = sources[(key, arch)]
        row = {"key": key, "arch": arch, "kernel": specs[key]["kernel"], "flags": specs[key]["flags"]}
        row["num_warps"] = options.num_warps
        n_logs = len(logs)
        t = time.time()
        try:
            ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options.__dict__)
        except Exception as e:
            row.update(compiled=False, error=f"{type(e).__name__}: {str(e)[-3000:]}")
            out["results"].append(row)
            continue
        row["compile_s"] = round(time.time() - t, 3)
        ptx = ck.asm["ptx"]
        if args.dump_ptx:
            Path(args.dump_ptx).mkdir(parents=True, exist_ok=True)
            (Path(args.dump_ptx) / f"{key.replace(':', '_')}_sm{arch}.ptx").write_text(ptx)
        new_logs = logs[n_logs:]
        if not new_logs:
            row.update(compiled=True, error="no ptxas log captured (Triton cache hit?)")
        else:
            analysis = _analyse_ptx(ptx, source_cache)
            row.update(compiled=True, **_summarise(analysis, _parse_ptxas(new_logs[-1]["log"])))
        out["results"].append(row)
    out["total_s"] = time.time() - t0
    return finish()


def _variant_name(kernel: str, flags: dict) -> str:
    """A kernel's name, with its update rule and state format where it has several (``_optim_kernel[RULE=2,STATE=0]``)."""
    if "RULE" in flags:
        return f"{kernel}[RULE={flags['RULE']},STATE={flags['STATE']}]"
    return kernel


def _args_key(fn, args):
    return tuple(_arg_key(x, p.do_not_specialize) for x, p in zip(args, fn.params))


def _arg_key(x, unspecialised):
    """What Triton's binder can read from an argument: dtype, alignment, int value (or only its width)."""
    if hasattr(x, "data_ptr"):
        return ("tensor", str(x.dtype), unspecialised or x.data_ptr() % 16 == 0)
    if isinstance(x, int) and not isinstance(x, bool) and unspecialised:
        return ("int", -(2**31) <= x < 2**31)
    return (type(x).__name__, x)


def _label(flags: dict) -> str:
    parts = []
    for k, v in flags.items():
        if k in DERIVED:
            continue
        if k.endswith("KIND"):
            parts.append(f"{k.replace('_KIND', '') or 'KIND'}={KIND_NAMES.get(v, v)}")
        elif isinstance(v, bool):
            if v:
                parts.append(k)
        else:
            parts.append(f"{k}={v}")
    return ",".join(parts)


# --------------------------------------------------------------------------------------------
# Driver: runs the workers, merges their results.
# --------------------------------------------------------------------------------------------


def run_tier(
    workdir: Path, python=None, pythonpath=None, full=False, workers=None, root=ROOT, dump_ptx=None, only=None
) -> dict:
    """Compile in ``workers`` processes (specialisations dealt round-robin); merged results.

    Triton's cache goes under ``workdir`` (fresh per call), so every compile runs ptxas and
    its report can be read.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    n = workers or int(os.environ.get("FASTAMP_AOT_JOBS", "0")) or max(1, min(os.cpu_count() or 1, 8))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(workdir / "triton_cache")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    t0 = time.time()
    procs = []
    for rank in range(n):
        cmd = [python or sys.executable, str(Path(__file__).resolve()), "--worker", "--root", str(root)]
        cmd += ["--rank", str(rank), "--workers", str(n), "--out", str(workdir / f"worker{rank}.json")]
        if full:
            cmd.append("--full")
        elif python or pythonpath:  # a second Triton version: its own, smaller cover
            cmd.append("--light")
        if dump_ptx:
            cmd += ["--dump-ptx", str(dump_ptx)]
        if only:
            cmd += ["--only", only]
        log = open(workdir / f"worker{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(workdir)), log))
    merged = {"results": [], "workers": n}
    limit = FULL_TIMEOUT_S if full else WORKER_TIMEOUT_S
    for rank, (proc, log) in enumerate(procs):
        killed = False
        try:
            proc.wait(timeout=max(1, limit - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed = True
        log.close()
        path = workdir / f"worker{rank}.json"
        if proc.returncode != 0 or not path.exists():
            tail = (workdir / f"worker{rank}.log").read_text()[-4000:]
            why = f"killed after {limit} s (FASTAMP_AOT_TIMEOUT)" if killed else f"exited with {proc.returncode}"
            merged.setdefault("errors", []).append(f"worker {rank} {why}:\n{tail}")
            continue
        res = json.loads(path.read_text())
        if res.get("skip"):
            merged["skip"] = res["skip"]
        for k in ("triton", "specs", "chunk_config", "n_launches", "record_s", "churn", "launches_20k"):
            if k in res:
                merged.setdefault(k, res[k])
        merged["results"].extend(res["results"])
    merged["wall_s"] = round(time.time() - t0, 1)
    merged["full"] = full
    return merged


# --------------------------------------------------------------------------------------------
# Results file: per kernel and target, registers / spills / vector widths.
# --------------------------------------------------------------------------------------------

CSV_FIELDS = [
    "kernel", "arch", "spec", "num_warps", "BLOCK", "CHUNK", "compiled", "regs", "spill_stores", "spill_loads",
    "stack", "n_data_sites", "n_vector_sites", "min_site_bytes", "max_vector_bytes", "bad_fp", "compile_s",
]  # fmt: skip


def _rows(merged):
    for r in sorted(merged["results"], key=lambda r: (KERNELS.index(r["kernel"]), r["key"], r["arch"])):
        yield {
            "kernel": r["kernel"],
            "arch": f"sm_{r['arch']}",
            "spec": r["key"].split(":")[1],
            "num_warps": r.get("num_warps"),
            "BLOCK": r["flags"].get("BLOCK", r["flags"].get("RBLOCK", "")),
            "CHUNK": r["flags"].get("CHUNK", ""),
            "compiled": r.get("compiled"),
            "regs": r.get("regs"),
            "spill_stores": r.get("spill_stores"),
            "spill_loads": r.get("spill_loads"),
            "stack": r.get("stack"),
            "n_data_sites": r.get("n_data_sites"),
            "n_vector_sites": r.get("n_vector_sites"),
            "min_site_bytes": r.get("min_site_bytes"),
            "max_vector_bytes": r.get("max_vector_bytes"),
            "bad_fp": ";".join(r.get("bad_fp") or {}) or "",
            "compile_s": r.get("compile_s"),
        }


def write_results(merged, prefix: Path, note: str = "") -> None:
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    rows = list(_rows(merged))
    with open(prefix.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
    lines = [
        "# Triton kernels compiled ahead of time (sm_80, sm_90)",
        "",
        f"Triton {merged.get('triton')}, {'all' if merged['full'] else 'the default CI cover of the'} "
        f"{len(merged.get('specs', {}))} distinct specialisations per target that the launchers produce, "
        f"{len(merged['results'])} compiles by `tests/tools/test_triton_aot.py` "
        f"in {merged['wall_s']} s with {merged['workers']} processes. GPU chunk config (CHUNK, default BLOCK): "
        f"{tuple(merged.get('chunk_config') or ())}. Per-specialisation figures: "
        f"[{prefix.with_suffix('.csv').name}]({prefix.with_suffix('.csv').name}).",
        "",
        "Columns: registers per thread (min-max over the specialisations), spill bytes (ptxas -v, max), "
        "data-stream access width in bytes for 16-byte aligned tensors (the widest access at each access "
        "site, min-max over sites and specialisations: the unmasked full blocks; 16 = `ld/st.global.v4.b32`, "
        "8 = `.v2.b32`, as 16-bit streams get at 4 elements per thread), the same for the unaligned fallback "
        "(`ALIGNED=False`, scalar by design), and inexact PTX floating-point instructions (fma/ftz/approx...; "
        "must be 0).",
        "",
        "| kernel | target | specs | num_warps | BLOCK | registers | spills (B) | aligned: data width (B) "
        "| unaligned: data width (B) | inexact fp |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = defaultdict(list)
    for r in merged["results"]:
        by[(r["kernel"], r["arch"])].append(r)
    for kernel in KERNELS:
        for arch in ARCHS:
            rs = [r for r in by.get((kernel, arch), []) if r.get("compiled") and r.get("regs") is not None]
            if not rs:
                continue
            regs = [r["regs"] for r in rs]
            spills = max(max(r["spill_stores"], r["spill_loads"]) for r in rs)
            warps = sorted({r["num_warps"] for r in rs})
            blocks = sorted({r["flags"].get("BLOCK", r["flags"].get("RBLOCK")) for r in rs}, key=str)
            bad = sum(sum((r.get("bad_fp") or {}).values()) for r in rs)
            lines.append(
                f"| `{kernel}` | sm_{arch} | {len(rs)} | {'/'.join(map(str, warps))} | "
                f"{'/'.join(map(str, blocks))} | {min(regs)}-{max(regs)} | {spills} | "
                f"{_width(kernel, rs, True)} | {_width(kernel, rs, False)} | {bad} |"
            )
    failed = [r for r in merged["results"] if not r.get("compiled")]
    lines += ["", f"Failed compiles: {len(failed)}."]
    for r in failed[:10]:
        lines.append(f"- `{r['key']}` sm_{r['arch']}: {r.get('error', '')[:300]}")
    if merged.get("launches_20k"):
        lines += ["", f"Launches per op at 20,000 tensors of one dtype group: {merged['launches_20k']}."]
    if note:
        lines += ["", note]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _width(kernel, rows, aligned):
    sel = [r for r in rows if r["flags"].get("ALIGNED", True) == aligned and r.get("min_site_bytes") is not None]
    if kernel not in STREAMING or not sel:
        return "-"
    lo = min(r["min_site_bytes"] for r in sel)
    hi = max(max(r["min_site_bytes"], r.get("max_vector_bytes") or 0) for r in sel)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def main(argv) -> int:
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    ap = argparse.ArgumentParser(description="Compile every Triton specialisation for sm_80/sm_90; write figures.")
    ap.add_argument("--full", action="store_true", help="every specialisation for both targets (slow)")
    ap.add_argument("--write", help="results prefix, e.g. benchmarks/results/triton_aot")
    ap.add_argument("--root", default=str(ROOT), help="tree whose kernels/ to compile")
    ap.add_argument("--python", help="interpreter to run the workers with")
    ap.add_argument("--pythonpath", help="prepended to the workers' PYTHONPATH (e.g. a side triton)")
    ap.add_argument("--workers", type=int)
    ap.add_argument("--dump-ptx", help="write every PTX here")
    ap.add_argument("--note", default="", help="markdown appended to the results file (@FILE reads it)")
    ap.add_argument("--only", help="compile only specialisations whose key (kernel:spec:...:sm_NN) matches")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fastamp_aot_") as tmp:
        merged = run_tier(
            Path(tmp), args.python, args.pythonpath, args.full, args.workers, Path(args.root), args.dump_ptx, args.only
        )
    for e in merged.get("errors", []):
        print(e, file=sys.stderr)
    if merged.get("skip"):
        print("skipped:", merged["skip"])
        return 0
    if args.write:
        note = Path(args.note[1:]).read_text() if args.note.startswith("@") else args.note
        write_results(merged, Path(args.write), note)
    n_bad = sum(1 for r in merged["results"] if _problems(r))
    print(
        f"triton {merged.get('triton')}: {len(merged['results'])} compiles of {len(merged.get('specs', {}))} "
        f"specialisations in {merged['wall_s']} s (recording {merged.get('record_s', 0):.1f} s); {n_bad} with "
        f"problems; compiled variants per kernel over the churn launches: {merged.get('churn')}"
    )
    for r in merged["results"]:
        for p in _problems(r):
            print(f"  {r['key']} sm_{r['arch']}: {p}")
    return 1 if n_bad or merged.get("errors") else 0


def _problems(r) -> list:
    if not r.get("compiled"):
        return ["does not compile: " + r.get("error", "")[:500]]
    out = []
    if r.get("regs") is None:
        out.append(r.get("error") or "no ptxas report")
        return out
    if r["spill_stores"] or r["spill_loads"]:
        out.append(f"spills {r['spill_stores']} B stores / {r['spill_loads']} B loads ({r['regs']} registers)")
    if r["kernel"] in STREAMING and r["flags"].get("ALIGNED", True):
        if r["n_data_sites"] == 0:
            out.append("no data-stream access found")
        elif r["scalar_sites"]:
            out.append(f"data accesses narrower than 8 bytes at {', '.join(r['scalar_sites'][:6])}")
    if r.get("bad_fp"):
        out.append(f"inexact PTX: {r['bad_fp']}")
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------

import pytest  # noqa: E402

# every test here waits for one shared compile; make test's --dist loadfile keeps this file on one xdist
# worker, so the other workers run other tests meanwhile instead of waiting on its lock


def _tritons():
    out = [pytest.param((None, None), id="installed")]
    for entry in filter(None, os.environ.get("FASTAMP_AOT_TRITON", "").split(os.pathsep)):
        p = Path(entry)
        spec = (str(p), None) if p.is_file() else (None, str(p))
        out.append(pytest.param(spec, id=p.name or entry))
    return out


def _tier_key(python, pythonpath, full) -> str:
    """What a tier's results depend on: this tree's kernels and fastamp sources, this file, the
    Triton asked for (interpreter, side install) and the environment the compile workers see."""
    h = hashlib.sha256()
    files = sorted((ROOT / "kernels").rglob("*.py")) + sorted((ROOT / "fastamp").rglob("*.py"))
    for path in (*files, Path(__file__).resolve()):
        h.update(f"{path.relative_to(ROOT)}\0".encode())
        h.update(path.read_bytes())
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("TRITON_", "FASTAMP_", "PYTHONPATH")))
    h.update(repr((python or sys.executable, pythonpath, full, env)).encode())
    return h.hexdigest()[:24]


def _tier_once_per_run(tmp_path_factory, python, pythonpath, full) -> dict:
    """``run_tier``'s results, compiled once per pytest run whatever the number of xdist workers.

    Under xdist every worker needs the results of the same compiles (``--dist load`` spreads this
    module's tests over all of them). The first worker to get the lock compiles; the others wait
    for it and read its results. The shared folder is the run's own base temp directory (the
    parent of each worker's), so nothing outlives the run: a fresh checkout starts empty, and a
    kernel edited between runs is compiled again. The key also holds the sources' hash, so not
    even an edit during a run is served stale results.
    """
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return run_tier(tmp_path_factory.mktemp("aot"), python, pythonpath, full)
    from filelock import FileLock  # a dependency of torch

    shared = tmp_path_factory.getbasetemp().parent / "triton_aot"
    shared.mkdir(exist_ok=True)
    key = _tier_key(python, pythonpath, full)
    done = shared / f"{key}.json"
    with FileLock(str(shared / f"{key}.lock")):
        if not done.exists():
            merged = run_tier(shared / key, python, pythonpath, full)
            partial = shared / f"{key}.json.part"
            partial.write_text(json.dumps(merged))
            os.replace(partial, done)
    return json.loads(done.read_text())


@pytest.fixture(scope="module", params=_tritons())
def tier(request, tmp_path_factory):
    """Every compile of this module, done once per Triton and run (workers in parallel); skip where none can run."""
    pytest.importorskip("triton")
    python, pythonpath = request.param
    full = os.environ.get("FASTAMP_AOT_FULL") == "1"
    merged = _tier_once_per_run(tmp_path_factory, python, pythonpath, full)
    if merged.get("skip"):
        pytest.skip(merged["skip"])
    if merged.get("errors"):
        pytest.fail("\n".join(merged["errors"]))
    asked = re.fullmatch(r"triton-(\d+\.\d+\.\d+)", Path(pythonpath or python or "").name)
    if asked:  # a side install named for its version (make test's triton-3.2.0) must be what compiled
        assert merged.get("triton") == asked.group(1), (merged.get("triton"), pythonpath or python)
    return merged


def _by_kernel(tier, kernel):
    rows = [r for r in tier["results"] if r["kernel"] == kernel]
    assert rows, f"{kernel}: nothing compiled"
    return rows


def _fail_list(rows, check):
    bad = []
    for r in rows:
        why = check(r)
        if why:
            bad.append(f"{r['key']} sm_{r['arch']}: {why}")
    return bad


def _expected_optim_specs() -> set:
    """The constexprs of every ``_optim_kernel`` specialisation the tables allow, written from the
    reference's rules: ``(RULE, P_KIND, G_KIND, MASTER, STATE, N_STATE, SR_P, SR_S, ALIGNED)``.

    Random bits are drawn only where the reference draws them: SR_PARAM rounds a bf16 param without
    a master and an ulp8 correction; SR_STATE rounds bf16 states and q8 codes."""
    import torch
    from fastamp.kernels import _common as C
    from fastamp.kernels import optim as K

    from fastamp.reference import optim as ref

    want = set()
    for rule, r in ref.RULES.items():
        for flags in range(ref.ALL_FLAGS + 1):
            if flags & ~(r.flags | ref.SR_PARAM | ref.SR_STATE):
                continue
            for hyper in ([0.0] * len(r.hyper), [0.5] * len(r.hyper)):
                n_state = len(r.states(hyper, flags))
                for master, (master_id, _, m_params) in K.MASTERS.items():
                    for fmt, (state_id, _, s_params) in K.STATES.items():
                        if (fmt == "none") != (n_state == 0):
                            continue
                        for p in (d for d in m_params if d in s_params):
                            sr_p = bool(flags & ref.SR_PARAM) and (
                                master == "ulp8" or (master == "none" and p == torch.bfloat16)
                            )
                            sr_s = bool(flags & ref.SR_STATE) and fmt in ("bf16", "q8")
                            for g, aligned in itertools.product(K.GRAD_DTYPES, (True, False)):
                                want.add((K.RULE_IDS[rule], C.DTYPE_KIND[p], C.DTYPE_KIND[g], master_id, state_id,
                                          n_state, sr_p, sr_s, aligned))  # fmt: skip
    return want


@pytest.mark.slow  # the tier fixture compiles the cover (a few minutes)
def test_launchers_reach_every_combination_of_the_tables(tier):
    """The recorded launches are every specialisation the rule x format tables allow, and no other
    (random bits only where the reference draws them), and every dtype of the other kernels."""
    pytest.importorskip("triton")
    specs = list(tier["specs"].values())
    assert {s["kernel"] for s in specs} == set(KERNELS), sorted({s["kernel"] for s in specs})
    names = ("RULE", "P_KIND", "G_KIND", "MASTER", "STATE", "N_STATE", "SR_P", "SR_S", "ALIGNED")
    got = {tuple(s["flags"][k] for k in names) for s in specs if s["kernel"] == "_optim_kernel"}
    want = _expected_optim_specs()
    assert got == want, (f"{len(got - want)} unexpected, e.g. {sorted(got - want)[:5]}; "
                         f"{len(want - got)} missing, e.g. {sorted(want - got)[:5]}")  # fmt: skip
    assert sum(s["kernel"] == "_optim_kernel" for s in specs) == len(want), "one specialisation per combination"
    unscale = {(s["flags"]["KIND"], s["flags"]["ALIGNED"]) for s in specs if s["kernel"] == "_unscale_check_kernel"}
    assert unscale == {(k, al) for k in (0, 1, 2) for al in (True, False)}  # f32, f16, bf16 grads


@pytest.mark.slow
def test_few_launches_at_20000_tensors(tier):
    """One launch per dtype group, whatever the tensor count (the launch table carries the tensors)."""
    want = {"unscale_check_": 1, "optim_ adamw fp32": 1, "optim_ sgd fp32": 1, "optim_ lion fp32": 1,
            "optim_ adamw q8": 1}  # fmt: skip
    assert tier["launches_20k"] == want, tier["launches_20k"]


@pytest.mark.slow
def test_no_specialisation_churn(tier):
    """Tensor and chunk counts, unaligned scalars and the runtime flags never compile another variant."""
    from fastamp.kernels import rules

    churn = tier["churn"]
    want = {"_unscale_check_kernel"} | {
        f"_optim_kernel[RULE={r},STATE={s}]" for r in rules.RULE_IDS.values() for s in (0, 2)
    }
    assert set(churn) == want, churn
    assert all(n == 1 for n in churn.values()), f"distinct compiled variants per kernel: {churn}"


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_compiles_for_sm80_and_sm90(tier, kernel):
    rows = _by_kernel(tier, kernel)
    assert {r["arch"] for r in rows} == set(ARCHS)
    bad = _fail_list(rows, lambda r: None if r.get("compiled") else r.get("error", "")[:800])
    assert not bad, "\n".join(bad[:10])


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_no_spills(tier, kernel):
    rows = [r for r in _by_kernel(tier, kernel) if r.get("compiled")]

    def check(r):
        if r.get("regs") is None:
            return r.get("error") or "no ptxas report"
        if r["spill_stores"] or r["spill_loads"]:
            return f"{r['spill_stores']} B spill stores, {r['spill_loads']} B spill loads, {r['regs']} registers"
        return None

    bad = _fail_list(rows, check)
    assert not bad, f"{len(bad)} of {len(rows)} spill:\n" + "\n".join(bad[:10])


@pytest.mark.slow
@pytest.mark.parametrize("kernel", STREAMING)
def test_data_streams_vectorised(tier, kernel):
    """Aligned tensors: every data access site has a >= 8-byte vector access (the unmasked full blocks)."""
    rows = [r for r in _by_kernel(tier, kernel) if r.get("compiled") and r["flags"].get("ALIGNED", True)]
    assert rows

    def check(r):
        if r.get("regs") is None:
            return "no report"
        if r["n_data_sites"] == 0:
            return "no data-stream access found"
        if r["scalar_sites"]:
            return f"narrower than 8 bytes: {', '.join(r['scalar_sites'][:6])}"
        return None

    bad = _fail_list(rows, check)
    assert not bad, f"{len(bad)} of {len(rows)} not vectorised:\n" + "\n".join(bad[:10])


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_ptx_is_correctly_rounded(tier, kernel):
    rows = [r for r in _by_kernel(tier, kernel) if r.get("compiled")]
    bad = _fail_list(rows, lambda r: r.get("bad_fp") or None)
    assert not bad, "\n".join(bad[:10])


def test_fp_rules_can_fail():
    """The PTX checks reject what they must (a check that cannot fail proves nothing)."""
    for op in ("fma.rn.f32", "mad.f32", "add.f32", "mul.ftz.f32", "sqrt.approx.f32", "div.full.f32", "rcp.rn.f32",
               "ex2.approx.ftz.f32", "cvt.f16.f32", "setp.lt.ftz.f32", "rsqrt.approx.f32"):  # fmt: skip
        assert _fp_violation(op), op
    for op in ("add.rn.f32", "div.rn.f32", "sqrt.rn.f32", "mul.rn.f64", "max.f32", "cvt.rn.f16.f32", "cvt.f32.f16",
               "cvt.f64.f32", "cvt.rn.f32.f64", "setp.nan.f32", "selp.f32", "mad.wide.s32", "mad.lo.s32", "ld.global.v4.b32",
               "neg.f32", "abs.f32", "cvt.rzi.s32.f32"):  # fmt: skip
        assert _fp_violation(op) is None, op
    ptx = (
        ".loc 1 3 0\n@%p1 ld.global.b32 { %r1 }, [ %rd1 + 0 ];\n.loc 1 4 0\nld.global.v4.b32 { %r1, %r2, %r3, %r4 }, "
        '[ %rd2 + 0 ];\n.loc 1 5 0\nld.global.b64 { %rd3 }, [ %rd4 + 0 ];\n.file 1 "/nonexistent/k.py"\n'
    )
    src = ["", "", "x = tl.load(p_ptr + i)", "y = tl.load(q_ptr + i)", "t = tl.load(table_ptr + 1)"]
    acc = _analyse_ptx(ptx, {"/nonexistent/k.py": src})["accesses"]
    assert [(a["bytes"], a["vector"], a["predicated"], a["control"]) for a in acc] == [
        (4, False, True, False),
        (16, True, False, False),
        (8, False, False, True),
    ]
    summary = _summarise({"accesses": acc, "bad_fp": {}}, {"regs": 10})
    assert summary["scalar_sites"] == ["ld k.py:3"] and summary["n_vector_sites"] == 1
    # a 4-byte access is enough in a 1-byte stream's helper, not in another's; scale bytes are control
    ptx = ('.loc 1 2 0\nld.global.b32 { %r1 }, [ %rd1 + 0 ];\n.loc 1 4 0\nld.global.b32 { %r2 }, [ %rd2 + 0 ];\n'
           '.loc 1 6 0\nld.global.b8 { %r3 }, [ %rd3 + 0 ];\n.file 1 "/nonexistent/q.py"\n')  # fmt: skip
    src = ["def load_bytes(ptr, i):", "    return tl.load(ptr + i)", "def load_raw(ptr, i):",
           "    return tl.load(ptr + i)", "def load_scales(ptr, i):", "    return tl.load(ptr + i)"]  # fmt: skip
    summary = _summarise(_analyse_ptx(ptx, {"/nonexistent/q.py": src}), {"regs": 10})
    assert summary["scalar_sites"] == ["ld load_raw"] and summary["n_data_sites"] == 2, summary
    # one helper line serving two streams (inlined at f.py:2): a vector access of one does not cover an
    # unpredicated scalar one of the other; a predicated one (the masked tail) it does. Accesses in
    # rules.py (the step-scalar row) are control wherever they are inlined.
    ptx = (".loc 2 1 0, function_name $L0, inlined_at 1 2 0\nld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n"
           ".loc 2 1 0, function_name $L0, inlined_at 1 2 0\n{0}ld.global.b32 { %r5 }, [ %rd2 + 0 ];\n"
           ".loc 3 1 0, function_name $L1, inlined_at 1 2 0\nld.global.b32 { %r6 }, [ %rd3 + 0 ];\n"
           '.file 1 "/nonexistent/f.py"\n.file 2 "/nonexistent/h.py"\n.file 3 "/nonexistent/rules.py"\n')  # fmt: skip
    sources = {"/nonexistent/f.py": ["", "    x = load_state(c_ptr, idx)"], "/nonexistent/h.py": ["return tl.load(p)"],
               "/nonexistent/rules.py": ["lr = tl.load(scalars_ptr)"]}  # fmt: skip
    for pred, narrow in (("", ["ld f.py:2"]), ("@%p1 ", [])):
        analysis = _analyse_ptx(ptx.replace("{0}", pred), sources)
        assert [a["control"] for a in analysis["accesses"]] == [False, False, True]
        assert _summarise(analysis, {"regs": 10})["scalar_sites"] == narrow, pred
    assert _parse_ptxas("    704 bytes stack frame, 700 bytes spill stores, 696 bytes spill loads\n"
                        "ptxas info    : Used 255 registers, used 1 barriers") == {
        "regs": 255, "stack": 704, "spill_stores": 700, "spill_loads": 696}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launch-time properties a compiler cannot show: device guard, tables under CUDA-graph capture.
# GPU only (benchmarks/gpu_check.sh runs them where one is lent).
# --------------------------------------------------------------------------------------------


def _cuda_ok():
    import torch

    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


# gpu: conftest.py skips these without a CUDA device; on one, TRITON_INTERPRET=1 would not run what is checked.
requires_cuda = pytest.mark.gpu(reason="needs a CUDA device (run by benchmarks/gpu_check.sh)")
compiled_triton = pytest.mark.skipif(
    __import__("torch").cuda.is_available() and not _cuda_ok(), reason="TRITON_INTERPRET=1: needs compiled Triton"
)


def _adamw_state(device, sizes, seed):
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randn(n, generator=gen).to(device)

    params = [rand(n).bfloat16() for n in sizes]
    return {
        "params": params,
        "grads": [rand(n).bfloat16() for n in sizes],
        "masters": [p.float() for p in params],
        "m": [rand(n) * 0.1 for n in sizes],
        "v": [rand(n).abs() * 0.01 for n in sizes],
    }


def _adamw_call(fn, st, scalars, found_inf):
    """AdamW through ``fn`` (the Triton ``optim_``) on the state ``st``: fp32 masters and moments."""
    fn(st["params"], st["grads"], st["masters"], [*st["m"], *st["v"]], scalars, found_inf, None, 0, "adamw",
       [0.9, 0.999, 1e-8], 0)  # fmt: skip


def _clone(st):
    return {k: [t.clone() for t in v] for k, v in st.items()}


def _assert_same(a, b):
    import torch

    for k in a:
        for x, y in zip(a[k], b[k]):
            assert torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32),
                               y.view(torch.int16) if y.dtype == torch.bfloat16 else y.view(torch.int32)), k  # fmt: skip


@requires_cuda
@compiled_triton
@pytest.mark.skipif(not _cuda_ok() or __import__("torch").cuda.device_count() < 2, reason="needs two CUDA devices")
def test_launches_run_on_the_tensors_device():
    """Tensors on cuda:1 while cuda:0 is current: the kernels run on cuda:1, in its current stream's order."""
    import torch
    from fastamp.kernels import amp as tamp
    from fastamp.kernels import optim as toptim

    dev = torch.device("cuda", 1)
    st = _adamw_state(dev, [3, 5000, 70000], seed=1)
    ref = _clone(st)
    scalars = torch.tensor([1e-3, 0.9, 0.99, 1.0], device=dev)
    with torch.cuda.device(dev):
        _adamw_call(toptim.optim_, ref, scalars, None)
    with torch.cuda.device(0):
        _adamw_call(toptim.optim_, st, scalars, None)
    torch.cuda.synchronize(dev)
    _assert_same(st, ref)
    # Ordering: work queued on cuda:1's stream before the call must run before the kernel. A
    # launch on cuda:0's stream would set the flag at once (peer access) and the queued
    # zero_() would clear it afterwards, or fault.
    grads = [g.clone() for g in st["grads"]]
    grads[1][7] = float("inf")
    found = torch.ones(1, device=dev)
    with torch.cuda.device(dev):
        torch.cuda._sleep(100_000_000)
        found.zero_()
    with torch.cuda.device(0):
        tamp.unscale_check_(grads, found, torch.full((1,), 0.5, device=dev))
    torch.cuda.synchronize(dev)
    assert found.item() == 1.0


@requires_cuda
@compiled_triton
def test_tables_stay_valid_under_cuda_graph_replay():
    """A table made during capture is written by the graph itself and outlives every cache and pool churn."""
    import torch
    from fastamp.kernels import _common as C
    from fastamp.kernels import optim as toptim

    dev = torch.device("cuda")
    sizes = [3, 5000, 70000, 16384]
    scalars = torch.tensor([1e-3, 0.9, 0.99, 1.0], device=dev)
    found = torch.zeros(1, device=dev)
    st = _adamw_state(dev, sizes, seed=2)
    eager = _clone(st)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # compile and load the kernel outside the capture, on other tensors: the captured
        # call below then misses the table cache and builds its table during the capture
        _adamw_call(toptim.optim_, _adamw_state(dev, sizes, seed=3), scalars, found)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _adamw_call(toptim.optim_, st, scalars, found)
    C._TABLE_CACHE.clear()
    junk = [torch.full((1 << 12,), -1, dtype=torch.int64).pin_memory() for _ in range(32)]
    junk += [torch.full((1 << 16,), -1, dtype=torch.int64, device=dev) for _ in range(32)]
    del junk
    for _ in range(3):
        graph.replay()
        _adamw_call(toptim.optim_, eager, scalars, found)
    torch.cuda.synchronize()
    _assert_same(st, eager)
