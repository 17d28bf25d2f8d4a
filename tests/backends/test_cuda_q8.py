"""Tier 2 on CUDA for ``adamw_q8_`` (8-bit block-scaled moments): the native CUDA kernel, ``optim_``'s
(csrc/cuda/optim.cuh) called with ``adamw_q8_``'s arguments (``reference.to_optim``).

Every tensor the op writes (params, fp32 masters, int16 remainders or int8 ulp8 corrections, codes
and scale bytes) is compared with ``fastamp.reference.adamw_q8_`` run on the same device, bit for bit
(NaN compared as NaN whatever its payload). The Triton kernel on the GPU is tested by
test_triton_q8.py (its ``cuda`` cases). Skipped without a
CUDA device; the kernel is compile-checked in tests/tools/test_cuda_compile.py and its registers in
test_cuda_ptxas.py. Run on a GPU machine after building with CUDA (benchmarks/gpu_check.sh).
"""

import math

import pytest
import torch
from helpers import assert_bits_equal, clone_lists, misaligned

from fastamp import backends, functional
from fastamp import reference as R
from fastamp.ops import registry
from fastamp.reference import q8
from fastamp.reference.optim import to_optim

pytestmark = pytest.mark.gpu(reason="needs a CUDA device (CUDA kernels are compile-checked in test_cuda_compile.py)")

DEV = "cuda"
OPS = torch.ops.fastamp


def native_adamw_q8(*args):
    """The native CUDA kernel of ``optim_`` called with ``adamw_q8_``'s arguments (reference.to_optim)."""
    OPS.optim_(*registry.coerce("optim_", to_optim("adamw_q8_", args)))


CHUNK = 65536  # csrc/cuda/launch_plan.h kChunkSize
BETAS = (0.9, 0.999)
EPS = 1e-8
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NAMES = ("params", "masters", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")
MODES = [("none", d) for d in DTYPES] + [("fp32", d) for d in DTYPES] + [("remainder", torch.bfloat16)]
MODES += [("ulp8", torch.bfloat16), ("ulp8", torch.float16)]
SIZES = [1, 31, 33, 1023, 4100, CHUNK + 37, 200003]


def _grad(n, gen, dtype, adversarial=True):
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    if adversarial and n >= 64:
        x[0:32] = 0.0  # a zero block
        x[32] = -0.0
        x[33] = 1e-40  # subnormal
        x[34] = -3e-39
        x[35] = 1e30  # squares to inf: a non-finite v block
        x[36] = 3e18  # saturating codes next to tiny ones
        x[40:45] = torch.tensor([1e-45, -1e-45, 2.0**-126, 6e4, -6e4])
    return x.to(dtype).to(DEV)


def _state(n, pdtype, master, gen):
    p32 = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-8, 8, (n,), generator=gen).float()
    if n >= 24:
        # the ulp8 / remainder edges: +-0, fp16 subnormals and the 2^-14 boundary, tiny values that round
        # to 0, the 16-bit maxima and what rounds past them, a bf16 tie, inf and NaN
        p32[:24] = torch.tensor([0.0, -0.0, 2.0**-14, -(2.0**-14) * 0.9999, 2.0**-17, 3e-8, -1e-9, 2.0**-25,
                                 65504.0, -65519.0, 65520.0, 1e-40, 3.389e38, -3.4e38, 1.0 + 2.0**-8, 1.5,
                                 math.inf, -math.inf, math.nan, 2.0**-24, -6.1e-5, 6.2e-5, 1e-3, -7.0])  # fmt: skip
    if master == "remainder":
        p, rem = R.split_master(p32)
        masters = [rem]
    elif master == "fp32":
        p, masters = p32.to(pdtype), [p32.clone()]
    elif master == "ulp8":
        p, corr = R.ulp8_encode(p32, pdtype, R.sr_random16(3, torch.tensor(9), 0, n, "cpu"))
        masters = [corr]
    else:
        p, masters = p32.to(pdtype), []
    nb = q8.num_blocks(n)
    cm = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    cv = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    sm = torch.randint(q8.M_SCALE_MIN, 140, (nb,), generator=gen, dtype=torch.uint8)
    sv = torch.randint(q8.W_SCALE_MIN, 150, (nb,), generator=gen, dtype=torch.uint8)
    return [t.to(DEV) for t in (p, *masters, cm, sm, cv, sv)], len(masters)


def _lists(per_param):
    out = [[], [], [], [], [], []]
    for tensors, has_master in per_param:
        out[0].append(tensors[0])
        if has_master:
            out[1].append(tensors[1])
        for k, t in zip(range(2, 6), tensors[1 + has_master :]):
            out[k].append(t)
    return out


def _scalars(step, rows=None, lr=1e-3):
    st = torch.tensor(float(step)) if rows is None else torch.arange(step, step + rows, dtype=torch.float32)
    return R.adamw_step_scalars(lr, st.to(DEV), *BETAS, 0.01, torch.tensor(0.5, device=DEV))


def _run_both(state, grads_per_step, sc_per_step, found_inf=None, sr_param=False, sr_codes=False, rng_base=3,
              maximize=False, betas=BETAS):  # fmt: skip
    nat, ref = clone_lists(state), clone_lists(state)
    for step, (grads, sc) in enumerate(zip(grads_per_step, sc_per_step)):
        rng = torch.tensor([11, step], device=DEV)
        for impl, st in ((native_adamw_q8, nat), (R.adamw_q8_, ref)):
            impl(st[0], grads, st[1], st[2], st[3], st[4], st[5], sc, found_inf, rng.clone(), rng_base, betas[0],
                 betas[1], EPS, maximize, sr_param, sr_codes)  # fmt: skip
    torch.cuda.synchronize()
    return nat, ref


def _assert_same(got, exp, what=""):
    for name, a, e in zip(NAMES, got, exp):
        assert len(a) == len(e), name
        for i, (x, y) in enumerate(zip(a, e)):
            assert_bits_equal(x, y, f"{what} {name}[{i}] (n={x.numel()})")


def test_adamw_q8_has_a_cuda_kernel():
    assert registry.NATIVE_LOADED, f"fastamp._C failed to load: {registry.NATIVE_ERROR}"
    assert registry.native_has_kernel("optim_", "cuda"), f"no CUDA kernel for optim_; build {registry.build_info()!r}"
    assert ("adamw_q8_", "cuda") in registry.AS_OPTIM  # the per-rule op runs as optim_ there
    assert backends.resolve("adamw_q8_", DEV) == "native"
    assert backends.resolve("optim_", DEV) == "native"


@pytest.mark.parametrize("master,pdtype", MODES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
def test_matches_reference_over_steps(master, pdtype, sr):
    gen = torch.Generator().manual_seed(len(master) * 10 + pdtype.itemsize)
    state = _lists([_state(n, pdtype, master, gen) for n in SIZES])
    gdts = [DTYPES[i % 3] for i in range(len(SIZES))]
    grads = [[_grad(p.numel(), gen, gd) for p, gd in zip(state[0], gdts)] for _ in range(3)]
    nat, ref = _run_both(state, grads, [_scalars(s + 1) for s in range(3)], sr_param=sr, sr_codes=sr, maximize=sr)
    _assert_same(nat, ref, f"{master} {pdtype}")


def test_many_tensors_rows_misaligned_and_empty():
    gen = torch.Generator().manual_seed(3)
    sizes = [1, 2, 31, 32, 33, 63, 64, 65, 0, 257] * 6
    state = _lists([_state(n, DTYPES[i % 3], "fp32", gen) for i, n in enumerate(sizes)])
    state[0][4] = misaligned(state[0][4])  # the element-by-element path
    state[2][7] = misaligned(state[2][7])
    grads = [[_grad(n, gen, DTYPES[(i // 3) % 3], False) for i, n in enumerate(sizes)] for _ in range(2)]
    nat, ref = _run_both(state, grads, [_scalars(s + 1, rows=len(sizes)) for s in range(2)], sr_codes=True)
    _assert_same(nat, ref)


def test_every_code_and_scale_byte_decodes_as_the_reference():
    scales_m = [0, 1, 10, 11, 12, 60, 126, 127, 137, 200, 253, 254, 255]
    scales_w = [0, 5, 74, 75, 76, 100, 126, 138, 190, 191, 220, 254, 255]
    n = 256 * len(scales_m)
    codes = torch.arange(256, dtype=torch.uint8).repeat(len(scales_m))
    sm = torch.tensor(scales_m, dtype=torch.uint8).repeat_interleave(8)
    sv = torch.tensor(scales_w, dtype=torch.uint8).repeat_interleave(8)
    gen = torch.Generator().manual_seed(2)
    for shift, lr in ((0, 1e-3), (97, 0.0)):
        p = torch.randn(n, generator=gen)
        state = [[p], [], [codes.clone()], [sm.clone()], [codes.roll(shift).clone()], [sv.roll(24).clone()]]
        state = [[t.to(DEV) for t in lst] for lst in state]
        g = [[(torch.randn(n, generator=gen) * 1e-3).to(DEV)]]
        _assert_same(*_run_both(state, g, [_scalars(5, lr=lr)]), f"shift {shift}")
        zero = [[torch.zeros(n, device=DEV)]]
        _assert_same(*_run_both(state, zero, [_scalars(5, lr=lr)], betas=(1.0, 1.0), sr_codes=True), "identity")


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_nonfinite_grad_makes_nan_blocks(bad):
    gen = torch.Generator().manual_seed(4)
    state = _lists([_state(200, torch.bfloat16, "remainder", gen)])
    g = _grad(200, gen, torch.float32, False)
    g[70] = bad
    nat, ref = _run_both(state, [[g], [_grad(200, gen, torch.float32, False)]], [_scalars(1), _scalars(2)])
    _assert_same(nat, ref)
    assert int(nat[3][0][2]) == q8.NONFINITE_SCALE and int(nat[5][0][2]) == q8.NONFINITE_SCALE


@pytest.mark.parametrize("found", [1.0, math.nan, math.inf])
def test_found_inf_writes_nothing(found):
    gen = torch.Generator().manual_seed(6)
    state = _lists([_state(n, torch.bfloat16, "remainder", gen) for n in (100, CHUNK + 5)])
    before = clone_lists(state)
    grads = [_grad(p.numel(), gen, torch.float32) for p in state[0]]
    native_adamw_q8(state[0], grads, *state[1:], _scalars(2), torch.tensor([found], device=DEV),
                    torch.tensor([1, 1], device=DEV), 0, *BETAS, EPS, False, True, True)  # fmt: skip
    torch.cuda.synchronize()
    _assert_same(state, before, "skipped step")


@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_ulp8_sr_param_and_codes_separately_through_functional(pdtype):
    """ulp8 corrections rounded stochastically without the codes and the reverse, AUTO (the native kernel)."""
    gen = torch.Generator().manual_seed(7)
    for sr_param, sr_codes in ((True, False), (False, True)):
        state = _lists([_state(n, pdtype, "ulp8", gen) for n in (300, CHUNK + 3)])
        ref = clone_lists(state)
        grads = [_grad(p.numel(), gen, torch.bfloat16) for p in state[0]]
        rng = torch.tensor([1, 2], device=DEV)
        functional.adamw_q8_(state[0], grads, *state[1:], _scalars(1), None, rng, 0, beta1=0.9, beta2=0.999,
                             eps=1e-8, sr_param=sr_param, sr_codes=sr_codes)  # fmt: skip
        R.adamw_q8_(ref[0], grads, *ref[1:], _scalars(1), None, rng, 0, *BETAS, EPS, False, sr_param, sr_codes)
        torch.cuda.synchronize()
        _assert_same(state, ref, f"ulp8 sr_param={sr_param} sr_codes={sr_codes}")


def test_refusals_name_the_problem_and_change_nothing():
    gen = torch.Generator().manual_seed(8)
    # optim_'s states list: exp_avg codes, exp_avg scales, exp_avg_sq codes, exp_avg_sq scales (state[2:])
    cases = {
        "states\\[1\\]: exp_avg_scales\\[0\\] must be 1-D with 3 scale bytes": (
            3,
            torch.zeros(2, dtype=torch.uint8, device=DEV),
        ),
        "states\\[2\\]: exp_avg_sq_codes\\[0\\] must be Byte": (4, torch.zeros(70, dtype=torch.int8, device=DEV)),
        "states\\[0\\]: exp_avg_codes\\[0\\] must be contiguous": (
            2,
            torch.zeros(140, dtype=torch.uint8, device=DEV)[::2],
        ),
        "SR_PARAM / SR_STATE need rng": None,
        "int16 remainder masters need bfloat16 params": (0, torch.zeros(70, device=DEV)),
    }
    for message, change in cases.items():
        state = _lists([_state(70, torch.bfloat16, "remainder", gen)])
        if change is not None:
            state[change[0]][0] = change[1]
        before = clone_lists(state)
        with pytest.raises(RuntimeError, match=f"fastamp::optim_: {message}"):
            native_adamw_q8(state[0], [_grad(70, gen, torch.float32)], *state[1:], _scalars(1), None, None, 0, *BETAS,
                            EPS, False, False, change is None)  # fmt: skip
        _assert_same(state, before, message)


def test_cuda_graph_replay_equals_eager():
    """The launch table is written by the graph itself under capture: replays equal eager steps."""
    gen = torch.Generator().manual_seed(9)
    state = _lists([_state(n, torch.bfloat16, "none", gen) for n in (3, 5000, CHUNK + 9)])
    eager = clone_lists(state)
    grads = [_grad(p.numel(), gen, torch.bfloat16) for p in state[0]]
    sc = _scalars(1)
    found = torch.zeros(1, device=DEV)
    rng = torch.tensor([5, 0], device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = clone_lists(state)
        native_adamw_q8(warm[0], grads, *warm[1:], sc, found, rng, 0, *BETAS, EPS, False, True, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        native_adamw_q8(state[0], grads, *state[1:], sc, found, rng, 0, *BETAS, EPS, False, True, True)
    for _ in range(3):
        graph.replay()
        native_adamw_q8(eager[0], grads, *eager[1:], sc, found, rng, 0, *BETAS, EPS, False, True, True)
    torch.cuda.synchronize()
    _assert_same(state, eager, "graph replay")
