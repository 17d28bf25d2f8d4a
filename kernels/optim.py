"""Triton ``optim_`` (:func:`fastamp.reference.optim_`): the one optimizer kernel, an update rule x a master format x a state format.

One ``@triton.jit`` kernel, :func:`_optim_kernel`, specialised by constexprs: the update rule
(``RULE``: the element maths of ``rules.py``, written once per rule), the param and grad dtypes,
the master format (``MASTER``) and the state format (``STATE``) with the number of states
(``N_STATE``: AdamW 2, or 3 under AMSGRAD; SGD 1 with a momentum, else 0; Lion 1), each format's
decode and encode written once (``formats.py``), and stochastic rounding of the param (``SR_P``)
and of the states (``SR_S``), set only where the reference draws random bits. Registered as
``fastamp_triton::optim_`` from ``registry.GENERIC_OPS`` (schema and fake shared with the native
op, ``opcheck`` clean).

Launches: one per (param dtype, grad dtype) group of a call covers every chunk of every tensor
(``_common.optimizer_launches``: a launch table of ``data_ptr()`` values, cached as a plan for a
repeated call; tensors whose data is not 16-byte aligned go to a second launch, compiled without
the alignment hint). Table columns: param, [master], each state's column (q8: its codes, then its
scale bytes), [tensor id, where random bits are drawn]; the grads' addresses are a tensor of their
own (a planned call writes only that one). Each program reads ``found_inf``
and, when it is non-zero (NaN included), treats its chunk as empty: a skipped step writes nothing,
without a host sync. The step scalars are the rule's row (``[k]`` shared, or ``[n, k]``: the
table's last column gives each tensor its row). Hyperparameters travel as fp32 numbers, and
maximize, torch.lerp's branch, Nesterov and weight decay on/off as runtime flags: they compile no
new variant.

Blocks: a program walks its chunk in blocks of ``BLOCK`` elements, full blocks without a mask
(16-byte vector accesses where the tensors are aligned), the tensor's last partial block masked.
With q8 states every stream of the launch sees a block as ``[BLOCK // 32, 32]``, one row per q8
block (its absmax is the new scale byte); chunks and blocks start at multiples of 32, so no q8
block is split between programs.

The per-rule ops (``adamw_``, ``adamw_bf16_``, ``adamw_q8_``, ``sgd_``, ``sgd_q8_``, ``lion_``,
``lion_q8_``) have no kernel or op of their own here: ``fastamp.functional`` and the optimizers
run them as ``optim_``, and ``fastamp.kernels.get_op`` answers for their names with this kernel
on their arguments (:func:`fastamp.reference.optim.to_optim`).

Agreement with the reference: bit-exact under ``TRITON_INTERPRET=1`` (numpy fp32 arithmetic, one
rounding per operation in the reference's order; bf16 rounding, the master splits, the q8 and
ulp8 codecs and the random bits in integer maths). On an NVIDIA GPU the kernel is compiled without
FMA contraction, and AdamW's divisions and square root are the IEEE ``div.rn.f32`` /
``sqrt.rn.f32`` (``_common.RN``), so it is expected to be bit-exact there too
(tests/tools/test_triton_aot.py checks the PTX of every specialisation for it); with Triton older
than 3.2 (approximate sqrt/division) AdamW stays within ``tolerances.ADAMW_GPU_RTOL`` per step. SGD
and Lion are only multiplies, adds and comparisons: exact on every target.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from fastamp.kernels import _common as C
from fastamp.kernels import _guards as G
from fastamp.kernels import formats as F
from fastamp.kernels import rules as R
from torch import Tensor

from fastamp.ops import registry
from fastamp.reference import optim as ref
from fastamp.reference.q8 import num_blocks

__all__ = ["optim_", "MASTERS", "STATES", "GRAD_DTYPES", "PER_RULE_OPS", "launch_flags"]

_ALL = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_F3 = (torch.float32, torch.float16, torch.bfloat16)

RULE_IDS = R.RULE_IDS
# The formats: the master kind of a ``masters`` list's dtype and the param dtypes it takes; the state
# format (reference.optim.state_format) and the param dtypes it takes (its 16-bit and 8-bit formats
# are for 16- and 32-bit params). Every combination of the two that both allow runs (the AOT tier
# compiles exactly these: tests/tools/test_triton_aot.py).
MASTERS = {
    "none": (F.MASTER_NONE, None, _ALL),
    "fp32": (F.MASTER_FP32, torch.float32, _ALL),
    "remainder": (F.MASTER_REMAINDER, torch.int16, (torch.bfloat16,)),
    "ulp8": (F.MASTER_ULP8, torch.int8, (torch.bfloat16, torch.float16)),
}
STATES = {
    "none": (F.STATE_FP32, None, _ALL),
    "fp32": (F.STATE_FP32, torch.float32, _ALL),
    "bf16": (F.STATE_BF16, torch.bfloat16, _F3),
    "q8": (F.STATE_Q8, torch.uint8, _F3),
}
GRAD_DTYPES = _ALL
_MASTER_OF_DTYPE = {dt: kind for kind, (_, dt, _) in MASTERS.items() if dt is not None}


@C.jit_launched
def _optim_kernel(
    table_ptr,
    grad_ptrs_ptr,
    n_tensors,
    n_chunks,
    step_scalars_ptr,
    found_inf_ptr,
    rng_ptr,
    hyper0,
    hyper1,
    hyper2,
    hyper3,
    hyper4,
    check_found_inf,
    maximize,
    lerp_small,
    nesterov,
    has_weight_decay,
    RULE: tl.constexpr,
    P_KIND: tl.constexpr,
    G_KIND: tl.constexpr,
    MASTER: tl.constexpr,
    STATE: tl.constexpr,
    N_STATE: tl.constexpr,
    SR_P: tl.constexpr,
    SR_S: tl.constexpr,
    N_PTR: tl.constexpr,
    ALIGNED: tl.constexpr,
    RN: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # table columns: param, [master], state 0 [its scales], state 1 ..., [tensor id]; the grads'
    # addresses apart (grad_ptrs_ptr: the one column a planned call writes anew)
    pid = tl.program_id(0)
    t, start, numel = C.chunk_of(table_ptr, n_tensors, n_chunks, pid, N_PTR, CHUNK)
    p_ptr = C.load_ptr(table_ptr, t, P_KIND, ALIGNED)
    g_ptr = C.load_ptr(grad_ptrs_ptr, t, G_KIND, ALIGNED)
    HAS_M: tl.constexpr = MASTER != 0
    if MASTER == 1:
        w_ptr = C.load_ptr(table_ptr, n_tensors + t, 0, ALIGNED)
    elif MASTER == 2:
        w_ptr = C.load_ptr(table_ptr, n_tensors + t, 4, ALIGNED)
    elif MASTER == 3:
        w_ptr = C.load_ptr(table_ptr, n_tensors + t, 5, ALIGNED)
    else:
        w_ptr = p_ptr
    # each state's value column (fp32, bf16 bits, or q8 codes), and a q8 state's scale bytes after it;
    # the columns of absent states are never read (the param's stands in)
    Q8: tl.constexpr = STATE == 2
    S_KIND: tl.constexpr = 2 * (STATE == 1) + 6 * Q8
    PER: tl.constexpr = 1 + Q8
    COL: tl.constexpr = 1 + HAS_M
    if N_STATE > 0:
        c0_ptr = C.load_ptr(table_ptr, COL * n_tensors + t, S_KIND, ALIGNED)
    else:
        c0_ptr = C.load_ptr(table_ptr, t, S_KIND, ALIGNED)
    if N_STATE > 1:
        c1_ptr = C.load_ptr(table_ptr, (COL + PER) * n_tensors + t, S_KIND, ALIGNED)
    else:
        c1_ptr = c0_ptr
    if N_STATE > 2:
        c2_ptr = C.load_ptr(table_ptr, (COL + 2 * PER) * n_tensors + t, S_KIND, ALIGNED)
    else:
        c2_ptr = c0_ptr
    if Q8 and N_STATE > 0:
        s0_ptr = C.load_ptr(table_ptr, (COL + 1) * n_tensors + t, 6, ALIGNED)
    else:
        s0_ptr = C.load_ptr(table_ptr, t, 6, ALIGNED)
    if Q8 and N_STATE > 1:
        s1_ptr = C.load_ptr(table_ptr, (COL + 3) * n_tensors + t, 6, ALIGNED)
    else:
        s1_ptr = s0_ptr
    if Q8 and N_STATE > 2:
        s2_ptr = C.load_ptr(table_ptr, (COL + 5) * n_tensors + t, 6, ALIGNED)
    else:
        s2_ptr = s0_ptr
    # random streams 4 * id + 0 (param) and + 1 + j (state j), where anything is rounded stochastically
    HAS_RNG: tl.constexpr = SR_P or SR_S
    if HAS_RNG:
        tensor_id = tl.load(table_ptr + (COL + N_STATE * PER) * n_tensors + t)
        base = C.sr_base_key(rng_ptr)
        key_p = C.sr_stream_key(base, tensor_id, 0)
        key_0 = C.sr_stream_key(base, tensor_id, 1)
        key_1 = C.sr_stream_key(base, tensor_id, 2)
        key_2 = C.sr_stream_key(base, tensor_id, 3)
    else:
        key_p = tl.full([], 0, tl.uint32)
        key_0 = key_p
        key_1 = key_p
        key_2 = key_p
    # this tensor's row of an [n, k] step_scalars, or the shared [k]
    scalars_ptr = C.scalar_row(table_ptr, n_tensors, n_chunks, t, step_scalars_ptr, N_PTR)
    # A non-zero (or NaN) found_inf empties the chunk: no load, no store.
    end = C.chunk_end(start, numel, found_inf_ptr, check_found_inf, CHUNK)
    # Full blocks unmasked (vector loads/stores), then the tensor's last partial block masked (all
    # lanes off when there is none). A while loop: a range() over bounds read from memory breaks
    # Triton 3.6's interpreter, and Triton 3.2 compiles no helper call under a runtime `if` inside
    # a loop.
    off = start
    while off + BLOCK <= end:
        _optim_block(
            p_ptr, g_ptr, w_ptr, c0_ptr, s0_ptr, c1_ptr, s1_ptr, c2_ptr, s2_ptr, off, end, scalars_ptr,
            key_p, key_0, key_1, key_2, hyper0, hyper1, hyper2, hyper3, hyper4, maximize, lerp_small, nesterov,
            has_weight_decay, RULE, P_KIND, G_KIND, MASTER, STATE, N_STATE, SR_P, SR_S, RN, BLOCK, False,
        )  # fmt: skip
        off += BLOCK
    _optim_block(
        p_ptr, g_ptr, w_ptr, c0_ptr, s0_ptr, c1_ptr, s1_ptr, c2_ptr, s2_ptr, off, end, scalars_ptr,
        key_p, key_0, key_1, key_2, hyper0, hyper1, hyper2, hyper3, hyper4, maximize, lerp_small, nesterov,
        has_weight_decay, RULE, P_KIND, G_KIND, MASTER, STATE, N_STATE, SR_P, SR_S, RN, BLOCK, True,
    )  # fmt: skip


@triton.jit
def _optim_block(
    p_ptr,
    g_ptr,
    w_ptr,
    c0_ptr,
    s0_ptr,
    c1_ptr,
    s1_ptr,
    c2_ptr,
    s2_ptr,
    off,
    end,
    scalars_ptr,
    key_p,
    key_0,
    key_1,
    key_2,
    hyper0,
    hyper1,
    hyper2,
    hyper3,
    hyper4,
    maximize,
    lerp_small,
    nesterov,
    has_weight_decay,
    RULE: tl.constexpr,
    P_KIND: tl.constexpr,
    G_KIND: tl.constexpr,
    MASTER: tl.constexpr,
    STATE: tl.constexpr,
    N_STATE: tl.constexpr,
    SR_P: tl.constexpr,
    SR_S: tl.constexpr,
    RN: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One block of elements ``off + [0, BLOCK)``: decode, the rule, encode; only a MASKED block may run past ``end``."""
    if STATE == 2:
        idx, bidx, bmask = F.q8_index(off, end, BLOCK)
    else:
        idx = C.block_index(off, BLOCK)
        bidx = idx
        bmask = idx < end
    mask = idx < end
    p = F.load_master(p_ptr, w_ptr, idx, mask, P_KIND, MASTER, MASKED)
    g = C.load_f32(g_ptr, idx, mask, G_KIND, MASKED)
    # the states, decoded (AdamW's second and third are v codes in q8); absent ones stand in as p
    if N_STATE > 0:
        s0 = F.load_state(c0_ptr, s0_ptr, idx, mask, bidx, bmask, STATE, False, MASKED)
    else:
        s0 = p
    if N_STATE > 1:
        s1 = F.load_state(c1_ptr, s1_ptr, idx, mask, bidx, bmask, STATE, True, MASKED)
    else:
        s1 = s0
    if N_STATE > 2:
        s2 = F.load_state(c2_ptr, s2_ptr, idx, mask, bidx, bmask, STATE, True, MASKED)
    else:
        s2 = s1
    pv, n0, n1, n2, root = R.step(
        p, g, s0, s1, s2, scalars_ptr, hyper0, hyper1, hyper2, hyper3, hyper4, maximize, lerp_small, nesterov,
        has_weight_decay, RULE, N_STATE, RN,
    )  # fmt: skip
    F.store_master(p_ptr, w_ptr, idx, pv, mask, key_p, off, P_KIND, MASTER, SR_P, MASKED)
    if N_STATE > 0:
        F.store_state(c0_ptr, s0_ptr, idx, mask, bidx, bmask, n0, n0, key_0, off, STATE, False, SR_S, MASKED)
    if N_STATE > 1:
        # a q8 v code encodes sqrt_rn(v): the update's root, unless AMSGRAD divided by another moment's
        if STATE == 2 and N_STATE > 2:
            root1 = C.sqrt_rn(n1, RN)
        else:
            root1 = root
        F.store_state(c1_ptr, s1_ptr, idx, mask, bidx, bmask, n1, root1, key_1, off, STATE, True, SR_S, MASKED)
    if N_STATE > 2:
        F.store_state(c2_ptr, s2_ptr, idx, mask, bidx, bmask, n2, root, key_2, off, STATE, True, SR_S, MASKED)


def launch_flags(master: str, state: str, n_state: int, p_dtype, sr_param: bool, sr_state: bool) -> tuple:
    """``(SR_P, SR_S)``: where the reference draws random bits. SR_PARAM rounds a bf16 param without a
    master, or an ulp8 correction; SR_STATE rounds bf16 states and q8 codes (never fp32 ones)."""
    sr_p = sr_param and (master == "ulp8" or (master == "none" and p_dtype == torch.bfloat16))
    sr_s = sr_state and n_state > 0 and state in ("bf16", "q8")
    return bool(sr_p), bool(sr_s)


def _optim_impl(
    params: list[Tensor],
    grads: list[Tensor],
    masters: list[Tensor],
    states: list[Tensor],
    step_scalars: Tensor,
    found_inf: Optional[Tensor],
    rng: Optional[Tensor],
    rng_base: int,
    rule: str,
    hyper: list[float],
    flags: int,
    *,
    direct: bool = False,
) -> None:
    op = "optim_"
    if len(params) == 0:
        return
    dev = params[0].device
    r = ref.RULES.get(rule)
    G.guard(r is not None, op, f"unknown rule {rule!r}")
    G.guard(len(hyper) == len(r.hyper), op, f"rule {rule!r} takes hyper {list(r.hyper)}, got {len(hyper)} values")
    sr_param, sr_state = bool(flags & ref.SR_PARAM), bool(flags & ref.SR_STATE)
    G.guard(rng is not None or not (sr_param or sr_state), op, "SR_PARAM / SR_STATE need rng")
    n = len(params)
    defs = r.states(hyper, flags)
    fmt = ref.state_format(states)
    G.guard(fmt in STATES, op, f"states must be float32, bfloat16 or uint8 (q8), got {fmt}")
    per = ref.streams_per_state(fmt)
    G.guard(
        len(states) == n * per * len(defs),
        op,
        f"rule {rule!r} keeps {len(defs)} state(s) here ({per} list(s) each in {fmt}): "
        f"{n * per * len(defs)} state tensors for {n} params, got {len(states)}",
    )
    master = _MASTER_OF_DTYPE.get(masters[0].dtype) if masters else "none"
    G.guard(
        master is not None, op, f"masters must be float32, int16 or int8, got {masters[0].dtype if masters else None}"
    )
    master_id, master_dtype, m_params = MASTERS[master]
    state_id, state_dtype, s_params = STATES[fmt]
    p_dtypes = tuple(d for d in m_params if d in s_params)
    head = [("params", params, p_dtypes, True), ("grads", grads, GRAD_DTYPES, False)]
    if masters:
        head.append(("masters", masters, (master_dtype,), True))

    def columns() -> list:
        # each state's column(s) apart (the launch table's columns), for a call being planned
        lists = list(head)
        for j, d in enumerate(defs):
            at = j * per * n
            if per == 2:
                lists.append((f"{d.key}_codes", states[at : at + n], (state_dtype,), True))
                lists.append((f"{d.key}_scales", states[at + n : at + 2 * n], (state_dtype,), True, num_blocks))
            else:
                lists.append((d.key, states[at : at + n], (state_dtype,), True))
        return lists

    scalars, found_inf, rng, stride = C.checked_scalars(op, dev, params, step_scalars, len(r.scalars), found_inf, rng)
    n_state = len(defs)

    def sr(gkey) -> tuple:
        return launch_flags(master, fmt, n_state, gkey[0], sr_param, sr_state)

    def use_rng(gkey) -> bool:
        return any(sr(gkey))

    hyper_args, runtime = R.host_args(rule, hyper, flags, n_state, bool(flags & ref.MAXIMIZE))
    chunk, block, opts = C.launch_config("optim")
    with C.device_guard(dev):
        # a plan compares the states as one list (the columns' tensors in column order)
        launches = C.optimizer_launches(
            op, dev, [*head, ("states", states)] if states else head, lambda i: (params[i].dtype, grads[i].dtype),
            chunk, stride, lambda k: rng_base if use_rng(k) else None,
            (rule, master_id, state_id, n_state, sr_param, sr_state, rng_base), direct, columns,
        )  # fmt: skip
        for gkey, n_tensors, table, grad_ptrs, n_chunks, n_ptr in launches:
            p_dtype, g_dtype, aligned = gkey
            sr_p, sr_s = sr(gkey)
            _optim_kernel[(n_chunks,)](
                table,
                grad_ptrs,
                n_tensors,
                n_chunks,
                scalars,
                found_inf if found_inf is not None else scalars,
                rng if sr_p or sr_s else table,
                *hyper_args,
                int(found_inf is not None),
                *runtime,
                RULE=RULE_IDS[rule],
                P_KIND=C.DTYPE_KIND[p_dtype],
                G_KIND=C.DTYPE_KIND[g_dtype],
                MASTER=master_id,
                STATE=state_id,
                N_STATE=n_state,
                SR_P=sr_p,
                SR_S=sr_s,
                N_PTR=n_ptr,
                ALIGNED=aligned,
                RN=C.RN,
                CHUNK=chunk,
                BLOCK=block,
                **opts,
            )


_optim_op = registry.register_triton("optim_", _optim_impl)


def optim_(*args) -> None:
    """Triton :func:`fastamp.reference.optim_` (its arguments, all positional): one launch per (param, grad) dtype group, no host sync."""
    C.call_launcher(_optim_op, _optim_impl, registry.coerce("optim_", args))


# ---- the per-rule ops, as this kernel runs them ----
# fastamp.functional's per-rule ops (adamw_, ..., lion_q8_) run as optim_ on every backend, and the
# optimizers call optim_ themselves; kernels.get_op still answers for the per-rule names (what
# backends.available / get_impl report for them on Triton): this kernel on the op's arguments,
# mapped by reference.to_optim. No op of their own is registered.

PER_RULE_OPS = ("adamw_", "adamw_bf16_", "adamw_q8_", "sgd_", "sgd_q8_", "lion_", "lion_q8_")


def _per_rule(name: str):
    def launcher(*args) -> None:
        optim_(*ref.to_optim(name, args))

    launcher.__name__ = launcher.__qualname__ = name
    launcher.__doc__ = (
        f"Triton :func:`fastamp.reference.{name}` (its arguments, all positional): :func:`optim_` on them."
    )
    return launcher


_PER_RULE = {name: _per_rule(name) for name in PER_RULE_OPS}


def __getattr__(name: str):
    try:
        return _PER_RULE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
