"""Tier 2 on CUDA for ``optim_``, the one optimizer op: the native CUDA kernel (csrc/cuda/optim.cuh).

Every (rule, state format) pair the kernel is built for (the rules' kCudaStates, csrc/rules/<name>.h)
with every master format (none, fp32, int16 remainder, int8 ulp8) and the flags (MAXIMIZE, AMSGRAD,
NESTEROV, SR_PARAM and SR_STATE together and each alone), in calls mixing every (param, grad) dtype
pair the master format allows, against ``fastamp.reference.optim_`` run on the same device, bit for
bit (NaN as NaN whatever its payload): params, masters, dense states, q8 codes and scale bytes. Among them the
combinations the per-rule kernels never had: SGD and Lion on fused q8 states (the reference's
``one_state_q8`` composition, one kernel here), ulp8 masters under SGD and Lion and with fp32 or bf16
states, AMSGRAD on q8 states, bf16 AdamW states under any master. Then what only a CUDA launch shows:
found_inf skips, per-tensor step-scalar rows and random streams, graph capture, the binding's
refusals (each changing nothing), opcheck, and the per-rule ops running as optim_ on CUDA.

Skipped without a CUDA device; compile-checked in tests/tools/test_cuda_compile.py, registers in
test_cuda_ptxas.py. Run on a GPU machine after building with CUDA (benchmarks/gpu_check.sh).
"""

import math

import cuda_optim_calls as calls
import pytest
import torch
from cuda_optim_calls import CHUNK, HYPER, MASTERS, RULE_FLAGS, compiled_combos
from helpers import assert_bits_equal, misaligned

from fastamp import functional
from fastamp import reference as R
from fastamp.ops import registry
from fastamp.reference.optim import AMSGRAD, MAXIMIZE, NESTEROV, RULES, SR_PARAM, SR_STATE, to_optim

pytestmark = pytest.mark.gpu(reason="needs a CUDA device (CUDA kernels are compile-checked in test_cuda_compile.py)")

DEV = "cuda"
# around the vector width (4), the q8 block (32), a pass of a block (1024) and the chunk; one empty
SIZES = [1, 5, 31, 33, 0, 1023, 4100, CHUNK + 37]
FORMATS = ("fp32", "bf16", "q8")
COMBOS = compiled_combos()


def native_optim(*args):
    torch.ops.fastamp.optim_(*registry.coerce("optim_", args))


def make_call(rule, fmt, master, flags, hyper=None, sizes=SIZES, seed=0, misalign=False):
    """(params, masters, states, grads) on the GPU of a call mixing every (param, grad) dtype pair ``master`` allows."""

    def shift(i, p, g):
        return (misaligned(p), misaligned(g)) if misalign and i % 3 == 1 and p.numel() > 1 else (p, g)

    return calls.make_call(rule, fmt, master, flags, hyper, sizes, seed, device=DEV, shift=shift)


def step_scalars(rule, step, rows=None):
    """The rule's step scalars for step ``step`` (1-based) on the GPU, shared ([k]) or one row per tensor ([rows, k])."""
    return calls.step_scalars(rule, step, rows, device=DEV)


def run_both(call, rule, flags, steps=2, rows=False, found=None, rng_base=3, hyper=None):
    """``steps`` steps of the native kernel and of the reference on copies of ``call``; their lists."""
    params, masters, states, grads = call
    hyper = HYPER[rule] if hyper is None else hyper
    nat = [[t.clone() for t in lst] for lst in (params, masters, states)]
    ref = [[t.clone() for t in lst] for lst in (params, masters, states)]
    for step in range(1, steps + 1):
        sc = step_scalars(rule, step, len(params) if rows else None)
        rng = torch.tensor([-987654321012, 2**40 + step], dtype=torch.int64, device=DEV)  # low 32 bits count
        fi = None if found is None else torch.full((1,), found, device=DEV)
        for impl, (p, m, s) in ((native_optim, nat), (R.optim_, ref)):
            impl(p, grads, m, s, sc, fi, rng.clone(), rng_base, rule, list(hyper), flags)
    torch.cuda.synchronize()
    return nat, ref


def assert_same(nat, ref, what):
    for name, a, b in zip(("params", "masters", "states"), nat, ref):
        assert len(a) == len(b), f"{what}: {name}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bits_equal(x, y, f"{what}: {name}[{i}] (n={x.numel()}, {x.dtype})")


def test_optim_has_a_cuda_kernel_and_the_per_rule_ops_run_as_optim():
    assert registry.NATIVE_LOADED, f"fastamp._C failed to load: {registry.NATIVE_ERROR}"
    assert registry.native_has_kernel("optim_", "cuda"), f"no CUDA kernel of optim_; build {registry.build_info()!r}"
    for op in registry.PER_RULE_OPS:
        assert (op, "cuda") in registry.AS_OPTIM, op
        assert registry.native_has_kernel(op, "cuda"), op


FLAG_SETS = {
    "plain": 0,
    "all": MAXIMIZE | SR_PARAM | SR_STATE,  # with the rule's own flag (AMSGRAD / NESTEROV)
    "sr_param": SR_PARAM,
    "sr_state": SR_STATE,
}


@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("rule, fmt", COMBOS)
def test_matches_reference(rule, fmt, master):
    """Every (rule, format) built with every master over two steps, each flag set, shared and per-tensor rows."""
    for k, (name, flags) in enumerate(FLAG_SETS.items()):
        if name == "all":
            flags |= RULE_FLAGS[rule]
        call = make_call(rule, fmt, master, flags, seed=100 * k + len(master), misalign=k == 1)
        nat, ref = run_both(call, rule, flags, rows=k % 2 == 1)
        assert_same(nat, ref, f"{rule} {fmt} states, {master} masters, flags {name}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_sgd_without_momentum_keeps_no_state(fmt):
    """momentum 0: no state list at all (whatever format the caller keeps elsewhere), every master format."""
    for master in MASTERS:
        hyper = (0.0, 0.0, 0.3)
        call = make_call("sgd", fmt, master, MAXIMIZE, hyper=hyper, seed=7)
        assert call[2] == []
        nat, ref = run_both(call, "sgd", MAXIMIZE | SR_PARAM, hyper=hyper)
        assert_same(nat, ref, f"sgd without momentum, {master} masters")


@pytest.mark.parametrize("found", [1.0, math.nan, math.inf])
@pytest.mark.parametrize("fmt", FORMATS)
def test_found_inf_writes_nothing(fmt, found):
    for rule in sorted(r for r, f in COMBOS if f == fmt):
        flags = SR_PARAM | SR_STATE | RULE_FLAGS[rule]
        call = make_call(rule, fmt, "ulp8", flags, sizes=[100, CHUNK + 5], seed=11)
        before = [[t.clone() for t in lst] for lst in call[:3]]
        nat, ref = run_both(call, rule, flags, steps=1, found=found)
        assert_same(nat, before, f"{rule} {fmt}: skipped step")
        assert_same(ref, before, f"{rule} {fmt}: skipped step (reference)")


def test_random_streams_follow_the_list_index():
    """Tensor i of a call with rng_base b draws what tensor 0 of a call with rng_base b + i draws."""
    flags = SR_PARAM | SR_STATE | AMSGRAD
    for fmt in ("bf16", "q8"):
        sizes = [300, CHUNK + 3, 1000]
        params, masters, states, grads = make_call("adamw", fmt, "ulp8", flags, sizes=sizes, seed=12)
        whole = [[t.clone() for t in lst] for lst in (params, masters, states)]
        sc = step_scalars("adamw", 1)
        rng = torch.tensor([5, 6], dtype=torch.int64, device=DEV)
        native_optim(whole[0], grads, whole[1], whole[2], sc, None, rng, 5, "adamw", list(HYPER["adamw"]), flags)
        n = len(sizes)
        for i in range(n):
            single = [[params[i].clone()], [masters[i].clone()], [s.clone() for s in states[i::n]]]
            native_optim(single[0], [grads[i]], single[1], single[2], sc, None, rng, 5 + i, "adamw",
                         list(HYPER["adamw"]), flags)  # fmt: skip
            assert_bits_equal(single[0][0], whole[0][i], f"{fmt}: param of tensor {i}")
            assert_bits_equal(single[1][0], whole[1][i], f"{fmt}: correction of tensor {i}")
            for j, s in enumerate(single[2]):
                assert_bits_equal(s, whole[2][j * n + i], f"{fmt}: state tensor {j} of tensor {i}")


def test_many_tiny_tensors_one_call():
    gen = torch.Generator().manual_seed(13)
    sizes = [int(n) for n in torch.randint(0, 70, (500,), generator=gen)]
    for rule, fmt in (("lion", "q8"), ("adamw", "bf16"), ("sgd", "fp32")):  # each in COMBOS
        flags = SR_STATE | SR_PARAM
        call = make_call(rule, fmt, "none", flags, sizes=sizes, seed=14, misalign=True)
        nat, ref = run_both(call, rule, flags, rows=True)
        assert_same(nat, ref, f"{rule} {fmt}: 500 tiny tensors")


def test_cuda_graph_replay_equals_eager():
    """The table is written by the graph itself and the counter read on the device: replays are steps."""
    flags = SR_PARAM | SR_STATE | MAXIMIZE
    params, masters, states, grads = make_call("lion", "q8", "none", flags, sizes=[3, 5000, CHUNK + 9], seed=15)
    eager = [[t.clone() for t in lst] for lst in (params, masters, states)]
    sc = step_scalars("lion", 1)
    found = torch.zeros(1, device=DEV)
    rng = torch.tensor([5, 0], dtype=torch.int64, device=DEV)
    hyper = list(HYPER["lion"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on throwaway copies
        warm = [[t.clone() for t in lst] for lst in (params, masters, states)]
        native_optim(warm[0], grads, warm[1], warm[2], sc, found, rng, 0, "lion", hyper, flags)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rng[1:].add_(1)
        native_optim(params, grads, masters, states, sc, found, rng, 0, "lion", hyper, flags)
    for k in (1, 2, 3):
        graph.replay()
        r = torch.tensor([5, k], dtype=torch.int64, device=DEV)
        R.optim_(eager[0], grads, eager[1], eager[2], sc, found, r, 0, "lion", hyper, flags)
    torch.cuda.synchronize()
    assert_same([params, masters, states], eager, "graph replay")
    assert rng[1].item() == 3


def test_per_rule_ops_run_as_optim_on_cuda():
    """sgd_q8_ and lion_q8_ (fused now, no composition) and adamw_bf16_ through torch.ops and functional."""
    for op, rule, fmt, master in (("sgd_q8_", "sgd", "q8", "fp32"), ("lion_q8_", "lion", "q8", "remainder"),
                                  ("adamw_bf16_", "adamw", "bf16", "none")):  # fmt: skip
        flags = SR_STATE | SR_PARAM if op != "adamw_bf16_" else SR_STATE | SR_PARAM | AMSGRAD
        params, masters, states, grads = make_call(rule, fmt, master, flags, seed=16)
        sc = step_scalars(rule, 1)
        rng = torch.tensor([1, 2], dtype=torch.int64, device=DEV)
        n = len(params)
        if op == "adamw_bf16_":
            args = (params, grads, masters, states[:n], states[n : 2 * n], states[2 * n :], sc, None, rng, 0,
                    *HYPER[rule], True, False)  # fmt: skip
        elif op == "sgd_q8_":
            args = (params, grads, masters, states[:n], states[n:], sc, None, rng, 0, *HYPER[rule], False, False,
                    True, True)  # fmt: skip
        else:
            args = (params, grads, masters, states[:n], states[n:], sc, None, rng, 0, *HYPER[rule], False, True, True)
        ref = [[t.clone() for t in lst] for lst in (params, masters, states)]
        R.optim_(ref[0], grads, ref[1], ref[2], *to_optim(op, args)[4:])
        nat = [[t.clone() for t in lst] for lst in (params, masters, states)]
        ops_args = list(args)
        ops_args[0], ops_args[2] = nat[0], nat[1]
        if op == "adamw_bf16_":
            ops_args[3:6] = nat[2][:n], nat[2][n : 2 * n], nat[2][2 * n :]
        else:
            ops_args[3:5] = nat[2][:n], nat[2][n:]
        getattr(torch.ops.fastamp, op)(*ops_args)
        torch.cuda.synchronize()
        assert_same(nat, ref, f"torch.ops.fastamp.{op}")
    # and through the public wrapper, AUTO: the native kernel
    params, masters, states, grads = make_call("sgd", "q8", "none", 0, seed=17)
    ref = [[t.clone() for t in lst] for lst in (params, masters, states)]
    n = len(params)
    sc = step_scalars("sgd", 1)
    functional.sgd_q8_(params, grads, masters, states[:n], states[n:], sc, None, None, 0, momentum=0.9,
                       dampening=0.1, weight_decay=1e-2)  # fmt: skip
    R.optim_(ref[0], grads, ref[1], ref[2], sc, None, None, 0, "sgd", list(HYPER["sgd"]), 0)
    torch.cuda.synchronize()
    assert_same([params, masters, states], ref, "functional.sgd_q8_")


def _refusal(message, change, rule="adamw", fmt="q8", master="remainder", flags=0, rng=True, hyper=None, sc=None):
    """The native kernel refuses a call with ``change`` made to its lists, naming ``message``, and writes nothing."""
    call = list(make_call(rule, fmt, master, flags, sizes=[70, 33], seed=18))
    args = [call[0], call[3], call[1], call[2], sc if sc is not None else step_scalars(rule, 1), None,
            torch.tensor([1, 1], dtype=torch.int64, device=DEV) if rng else None, 0, rule,
            list(HYPER[rule] if hyper is None else hyper), flags]  # fmt: skip
    change(args)
    before = [[t.clone() for t in lst] for lst in (args[0], args[2], args[3])]
    with pytest.raises(RuntimeError, match=f"fastamp::optim_: {message}"):
        native_optim(*args)
    torch.cuda.synchronize()
    assert_same([args[0], args[2], args[3]], before, message)


def _set(lst_index, item, value):
    def change(args):
        args[lst_index][item] = value

    return change


def test_refusals_name_the_problem_and_change_nothing():
    def nothing(args):
        return None

    # states of adamw q8, 2 params: [m codes 0, m codes 1, m scales 0, m scales 1, v codes 0, ...]
    _refusal(r"states\[3\]: exp_avg_scales\[1\] must be 1-D with 2 scale bytes",
             _set(3, 3, torch.zeros(3, dtype=torch.uint8, device=DEV)))  # fmt: skip
    _refusal(r"states\[4\]: exp_avg_sq_codes\[0\] must be Byte like states\[0\]",
             _set(3, 4, torch.zeros(70, dtype=torch.int8, device=DEV)))  # fmt: skip
    _refusal(r"states\[0\]: exp_avg_codes\[0\] must be contiguous",
             _set(3, 0, torch.zeros(140, dtype=torch.uint8, device=DEV)[::2]))  # fmt: skip
    _refusal(r"states\[1\]: exp_avgs\[1\] has 70 elements but params\[1\] has 33",
             _set(3, 1, torch.zeros(70, device=DEV)), fmt="fp32")  # fmt: skip
    _refusal(r"states\[2\]: exp_avg_sqs\[0\] is on cpu", _set(3, 2, torch.zeros(70)), fmt="fp32")
    _refusal(r"SR_PARAM / SR_STATE need rng", nothing, flags=SR_STATE, rng=False)
    _refusal(r"int16 remainder masters need bfloat16 params: params\[0\] must be bfloat16",
             _set(0, 0, torch.zeros(70, device=DEV)))  # fmt: skip
    _refusal(r"int8 ulp8 masters need bfloat16 or float16 params", _set(0, 1, torch.zeros(33, device=DEV)),
             master="ulp8")  # fmt: skip
    _refusal(r"remainders\[1\] must be int16 like remainders\[0\]", _set(2, 1, torch.zeros(33, device=DEV)))
    _refusal(r"rule 'adamw' keeps 3 state\(s\) .*amsgrad needs 2 max_exp_avg_sq_codes, 2 max_exp_avg_sq_scales",
             lambda a: a.__setitem__(10, AMSGRAD))  # fmt: skip
    _refusal(r"expected 2 momentum_buffers \(", lambda a: a[3].pop(), rule="sgd", fmt="fp32")
    _refusal(r"masters\[0\] must be float32 .*got Int", _set(2, 0, torch.zeros(70, dtype=torch.int32, device=DEV)))
    _refusal(r"unknown rule 'adam'", lambda a: a.__setitem__(8, "adam"))
    for rule, fmt in ((r, f) for r in sorted(RULES) for f in FORMATS if (r, f) not in COMBOS):
        name = {"fp32": "float32", "bf16": "bfloat16", "q8": r"q8 \(uint8\)"}[fmt]
        _refusal(f"this build has no CUDA kernel of rule '{rule}' with {name} states", nothing, rule=rule, fmt=fmt)
    _refusal(r"rule 'lion' takes hyper \[beta1, beta2\], got 3 values", lambda a: a[9].append(0.5), rule="lion")
    _refusal(r"flags 4 are not a combination of rule 'adamw'", lambda a: a.__setitem__(10, NESTEROV))
    _refusal(r"step_scalars must be a contiguous float32 tensor of shape \[3\] or \[2, 3\]",
             nothing, rule="sgd", sc=step_scalars("adamw", 1))  # fmt: skip
    _refusal(r"grads\[1\] must be float32, float16 or bfloat16",
             _set(1, 1, torch.zeros(33, dtype=torch.float64, device=DEV)))  # fmt: skip


def test_opcheck():
    for rule, fmt, master, flags in (("adamw", "q8", "ulp8", AMSGRAD | SR_STATE), ("sgd", "q8", "fp32", NESTEROV),
                                     ("lion", "fp32", "remainder", SR_PARAM)):  # fmt: skip
        params, masters, states, grads = make_call(rule, fmt, master, flags, sizes=[5, 40], seed=19)
        torch.library.opcheck(
            torch.ops.fastamp.optim_.default,
            (params, grads, masters, states, step_scalars(rule, 1), torch.zeros(1, device=DEV),
             torch.tensor([1, 2], dtype=torch.int64, device=DEV), 0, rule, list(HYPER[rule]), flags),
        )  # fmt: skip
