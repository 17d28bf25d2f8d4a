"""Tier 2: the Triton kernel on 8-bit block-scaled moments (``adamw_q8_``) against the reference, byte for byte.

The Triton ``optim_`` (``fastamp.kernels.optim``, the one optimizer kernel, on ``adamw_q8_``'s
arguments mapped by ``fastamp.reference.optim.to_optim``) and ``fastamp.reference.adamw_q8_`` run
side by side over several steps on copies of the same state; every tensor the op writes (params, masters of every
kind: fp32, int16 remainders, int8 ulp8 corrections; codes and scale bytes) must be bit-identical
(NaN compared as NaN whatever its payload, as elsewhere). Under ``TRITON_INTERPRET=1`` (CI) that
holds for every input; on a GPU too, the kernel's sqrt and divisions being the IEEE ones
(tests/tools/test_triton_aot.py checks the PTX), so the same assertions run there
(``benchmarks/gpu_check.sh``). The interpreter is slow: sizes are the smallest that reach each edge
(a partial q8 block, a partial kernel block, a second chunk), with the kernel's own block and chunk.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from helpers import assert_bits_equal, clone_lists, misaligned  # noqa: E402

from fastamp import backends, functional  # noqa: E402
from fastamp import kernels as fk  # noqa: E402
from fastamp import reference as R  # noqa: E402
from fastamp.ops import registry
from fastamp.reference import q8  # noqa: E402

DEVICES = [d for d in ("cpu", "cuda") if fk.available(d)[0]]
if not DEVICES:
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

from fastamp.kernels import optim as toptim  # noqa: E402

from fastamp.reference.optim import to_optim  # noqa: E402

CHUNK, BLOCK = toptim.C.chunk_config()
BETAS = (0.9, 0.999)
EPS = 1e-8
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
NAMES = ("params", "masters", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")

# numpy, behind the interpreter, warns on inf*0 and friends; those values are the point here
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# (master kind, param dtype): every master kind with every param dtype it takes
MODES = [
    ("none", torch.float32),
    ("none", torch.float16),
    ("none", torch.bfloat16),
    ("fp32", torch.float32),
    ("fp32", torch.float16),
    ("fp32", torch.bfloat16),
    ("remainder", torch.bfloat16),
    ("ulp8", torch.bfloat16),
    ("ulp8", torch.float16),
]


def _triton_q8(*args):
    """The Triton ``optim_`` on ``adamw_q8_``'s arguments."""
    toptim.optim_(*to_optim("adamw_q8_", args))


def _mode_id(x):
    return _SHORT.get(x, x) if isinstance(x, torch.dtype) else x


def _grad(n, gen, dtype, adversarial):
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    if adversarial and n >= 64:
        x[0:32] = 0.0  # a zero block
        x[32] = -0.0
        x[33] = 1e-40  # subnormal
        x[34] = -3e-39
        x[35] = 1e30  # squares to inf: a non-finite v block
        x[36] = 3e18  # a huge v: codes at the top (saturating) of a block with tiny neighbours
        x[40:45] = torch.tensor([1e-45, -1e-45, 2.0**-126, 6e4, -6e4])
    return x.to(dtype)


def _masters32(n, gen, adversarial):
    p32 = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-8, 8, (n,), generator=gen).float()
    if adversarial and n >= 24:
        # the ulp8 / remainder edges: +-0, fp16 subnormals and the 2^-14 boundary, tiny values that
        # round to 0, the 16-bit maxima and what rounds past them, a bf16 tie, inf and NaN
        p32[:24] = torch.tensor([0.0, -0.0, 2.0**-14, -(2.0**-14) * 0.9999, 2.0**-17, 3e-8, -1e-9, 2.0**-25,
                                 65504.0, -65519.0, 65520.0, 1e-40, 3.389e38, -3.4e38, 1.0 + 2.0**-8, 1.5,
                                 math.inf, -math.inf, math.nan, 2.0**-24, -6.1e-5, 6.2e-5, 1e-3, -7.0])  # fmt: skip
    return p32


def _state(n, shape, pdtype, master, gen, adversarial=True, random_codes=True):
    """(param, [master], m codes, m scales, v codes, v scales) of one tensor, codes random (or zero)."""
    p32 = _masters32(n, gen, adversarial)
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
    if random_codes:
        # moments of any size: a block's scale, then its codes (decoded, then re-encoded)
        cm = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        cv = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        sm = torch.randint(q8.M_SCALE_MIN, 140, (nb,), generator=gen, dtype=torch.uint8)
        sv = torch.randint(q8.W_SCALE_MIN, 150, (nb,), generator=gen, dtype=torch.uint8)
    else:
        cm, cv = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
        sm = torch.full((nb,), q8.M_SCALE_MIN, dtype=torch.uint8)
        sv = torch.full((nb,), q8.W_SCALE_MIN, dtype=torch.uint8)
    return p.reshape(shape), [m.reshape(shape) for m in masters], cm.reshape(shape), sm, cv.reshape(shape), sv


def _lists(per_param, device):
    """[[params], [masters], [m codes], [m scales], [v codes], [v scales]] from per-param tuples."""
    out = [[], [], [], [], [], []]
    for p, masters, cm, sm, cv, sv in per_param:
        out[0].append(p.to(device))
        out[1].extend(m.to(device) for m in masters)
        for k, t in zip(range(2, 6), (cm, sm, cv, sv)):
            out[k].append(t.to(device))
    return out


def _scalars(step, device, lr=1e-3, wd=0.01, rows=None, grad_mul=0.5):
    st = torch.tensor(float(step)) if rows is None else torch.arange(step, step + rows, dtype=torch.float32)
    return R.adamw_step_scalars(lr, st.to(device), *BETAS, wd, torch.tensor(grad_mul, device=device))


def _run_both(state, grads_per_step, sc_per_step, found_inf=None, sr_param=False, sr_codes=False, rng_base=3,
              maximize=False, betas=BETAS, counter0=0):  # fmt: skip
    """Both implementations for every step on copies of ``state``; returns (triton's, the reference's)."""
    tri, ref = clone_lists(state), clone_lists(state)
    dev = state[0][0].device
    for step, (grads, sc) in enumerate(zip(grads_per_step, sc_per_step)):
        rng = torch.tensor([11, counter0 + step], device=dev)
        for impl, st in ((_triton_q8, tri), (R.adamw_q8_, ref)):
            impl(st[0], grads, st[1], st[2], st[3], st[4], st[5], sc, found_inf, rng.clone(), rng_base,
                 betas[0], betas[1], EPS, maximize, sr_param, sr_codes)  # fmt: skip
    return tri, ref


def _assert_same(got, exp, what=""):
    for name, a, e in zip(NAMES, got, exp):
        assert len(a) == len(e), name
        for i, (x, y) in enumerate(zip(a, e)):
            assert_bits_equal(x.cpu(), y.cpu(), f"{what} {name}[{i}]")


def _grads(tensors, gen, steps, dtype=torch.float32, adversarial=True):
    return [[_grad(t.numel(), gen, dtype, adversarial).reshape(t.shape).to(t.device) for t in tensors]
            for _ in range(steps)]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("master,pdtype", MODES, ids=_mode_id)
@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
def test_matches_reference_over_steps(device, master, pdtype, sr):
    """Every master kind, round-to-nearest or stochastic codes and param: a full kernel block and a
    partial one (partial q8 block), a 2-D tensor, a one-element tensor, adversarial grads and masters."""
    gen = torch.Generator().manual_seed(len(master) * 10 + pdtype.itemsize)
    per = [_state(BLOCK + 37, (BLOCK + 37,), pdtype, master, gen), _state(65, (5, 13), pdtype, master, gen),
           _state(1, (1,), pdtype, master, gen, adversarial=False)]  # fmt: skip
    state = _lists(per, device)
    grads = _grads(state[0], gen, 3)
    scs = [_scalars(s + 1, device) for s in range(3)]
    tri, ref = _run_both(state, grads, scs, sr_param=sr, sr_codes=sr, maximize=sr)
    _assert_same(tri, ref, f"{master} {pdtype}")
    # the steps changed the params, masters and codes (a check that cannot pass by writing nothing)
    for k in (0, 1, 2, 4):
        for x, y in zip(tri[k], state[k]):
            if x.numel() > 1:
                assert not torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{NAMES[k]} unchanged"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sr_param,sr_codes", [(True, False), (False, True)])
def test_param_and_code_rounding_separately_and_chunks(device, sr_param, sr_codes):
    """One stochastic rounding without the other, over a second chunk (a program boundary)."""
    gen = torch.Generator().manual_seed(5)
    per = [_state(CHUNK + 70, (CHUNK + 70,), torch.bfloat16, "none", gen),
           _state(300, (300,), torch.float16, "ulp8", gen)]  # fmt: skip
    for master in ("none", "ulp8"):
        sel = [p for p in per if (len(p[1]) > 0) == (master == "ulp8")]
        state = _lists(sel, device)
        grads = _grads(state[0], gen, 2, torch.bfloat16)
        scs = [_scalars(s + 1, device) for s in range(2)]
        tri, ref = _run_both(state, grads, scs, sr_param=sr_param, sr_codes=sr_codes)
        _assert_same(tri, ref, master)


@pytest.mark.parametrize("device", DEVICES)
def test_many_tensors_mixed_dtypes_rows_and_alignment(device):
    """Many small tensors of every (param, grad) dtype pair in one call (one launch per group), per-tensor
    step scalars, a misaligned view (the unaligned kernel), a strided grad and an empty tensor."""
    gen = torch.Generator().manual_seed(3)
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    per, gdts = [], []
    for i, n in enumerate([1, 2, 31, 32, 33, 63, 64, 65, 100, 0, 7, 40]):
        per.append(_state(n, (n,), dtypes[i % 3], "fp32", gen, adversarial=False))
        gdts.append(dtypes[(i // 3) % 3])
    state = _lists(per, device)
    state[2][4] = misaligned(state[2][4])  # m codes of tensor 4 one byte off: its launch is the unaligned one
    grads = [[_grad(p.numel(), gen, gd, False).to(device) for p, gd in zip(state[0], gdts)] for _ in range(2)]
    wide = torch.randn(100, 2, generator=gen).to(device)
    for g in grads:
        g[8] = wide[:, 1]  # strided
    scs = [_scalars(s + 1, device, rows=len(per)) for s in range(2)]
    tri, ref = _run_both(state, grads, scs, sr_codes=True, rng_base=7)
    _assert_same(tri, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_every_code_and_scale_byte_decodes_as_the_reference(device):
    """All 256 m codes and 256 w codes under many scale bytes (0xFF: NaN blocks; below S_MIN; the top).

    The update reads every decoded m and v and the re-encoded codes read them again, so a decode
    that differs in any bit shows in a param (fp32, no master) or a code.
    """
    scales_m = [0, 1, 10, 11, 12, 60, 126, 127, 137, 200, 253, 254, 255]
    scales_w = [0, 5, 74, 75, 76, 100, 126, 138, 190, 191, 220, 254, 255]
    n = 256 * len(scales_m)
    codes = torch.arange(256, dtype=torch.uint8).repeat(len(scales_m))
    sm = torch.tensor(scales_m, dtype=torch.uint8).repeat_interleave(8)
    sv = torch.tensor(scales_w, dtype=torch.uint8).repeat_interleave(8)
    gen = torch.Generator().manual_seed(2)
    for shift, lr in ((0, 1e-3), (97, 0.0)):  # the m and v codes of one element differ
        p = torch.randn(n, generator=gen)
        state = [[p], [], [codes.clone()], [sm.clone()], [codes.roll(shift).clone()], [sv.roll(3 * 8).clone()]]
        state = [[t.to(device) for t in lst] for lst in state]
        g = [[(torch.randn(n, generator=gen) * 1e-3).to(device)]]
        tri, ref = _run_both(state, g, [_scalars(5, device, lr=lr)])
        _assert_same(tri, ref, f"shift {shift} lr {lr}")
        # beta1 = beta2 = 1: the moments pass through unchanged (m + 0 * diff, v * 1 + 0)
        zero = [[torch.zeros(n, device=device)]]
        tri, ref = _run_both(state, zero, [_scalars(5, device, lr=lr)], betas=(1.0, 1.0), sr_codes=True)
        _assert_same(tri, ref, f"identity shift {shift} lr {lr}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_nonfinite_grad_makes_nan_blocks(device, bad):
    gen = torch.Generator().manual_seed(4)
    state = _lists([_state(200, (200,), torch.bfloat16, "ulp8", gen)], device)
    g = _grad(200, gen, torch.float32, False)
    g[70] = bad
    grads = [[g.to(device)], [_grad(200, gen, torch.float32, False).to(device)]]
    tri, ref = _run_both(state, grads, [_scalars(1, device), _scalars(2, device)])
    _assert_same(tri, ref)
    assert tri[3][0][2] == q8.NONFINITE_SCALE and tri[5][0][2] == q8.NONFINITE_SCALE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta1", [0.3, 1.0, 0.0])
def test_lerp_branches_and_betas(device, beta1):
    gen = torch.Generator().manual_seed(1)
    state = _lists([_state(300, (300,), torch.float32, "fp32", gen)], device)
    tri, ref = _run_both(state, _grads(state[0], gen, 2), [_scalars(s + 1, device) for s in range(2)],
                         betas=(beta1, 0.5))  # fmt: skip
    _assert_same(tri, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("found", [1.0, math.nan, math.inf, 0.0])
def test_found_inf_skip_writes_nothing(device, found):
    """A non-zero (or NaN) found_inf changes no byte of any stream, every master kind; 0 runs the step."""
    gen = torch.Generator().manual_seed(6)
    for master, pdtype in (("remainder", torch.bfloat16), ("ulp8", torch.float16), ("none", torch.bfloat16)):
        state = _lists([_state(100, (100,), pdtype, master, gen)], device)
        before, ref = clone_lists(state), clone_lists(state)
        fi = torch.tensor([found], device=device)
        grads = _grads(state[0], gen, 1)[0]
        rng = torch.tensor([1, 1], device=device)
        for impl, st in ((_triton_q8, state), (R.adamw_q8_, ref)):
            impl(st[0], grads, *st[1:], _scalars(2, device), fi, rng, 0, *BETAS, EPS, False, True, True)
        _assert_same(state, ref, f"found_inf {found}, {master}")
        if found != 0.0:
            _assert_same(state, before, f"skipped step, {master}")
        else:
            assert not torch.equal(state[2][0], before[2][0])


@pytest.mark.parametrize("device", DEVICES)
def test_random_streams_follow_the_tensor(device):
    """Random bits come from (seed, counter, rng_base + index in the call, element): a tensor gets the same
    bytes alone as in a call with others, in another launch group, and other bytes with another counter."""
    gen = torch.Generator().manual_seed(31)
    per = [_state(70, (70,), torch.bfloat16, "none", gen), _state(BLOCK + 7, (BLOCK + 7,), torch.bfloat16, "none", gen)]
    state = _lists(per, device)
    g = [[_grad(70, gen, torch.float16, False).to(device), _grad(BLOCK + 7, gen, torch.float32, False).to(device)]]
    tri, ref = _run_both(state, g, [_scalars(1, device)], sr_param=True, sr_codes=True, rng_base=10)
    _assert_same(tri, ref)
    alone = [[lst[1]] if lst else [] for lst in clone_lists(state)]
    tri1, _ = _run_both(alone, [[g[0][1]]], [_scalars(1, device)], sr_param=True, sr_codes=True, rng_base=11)
    for k in (0, 2, 4):
        assert_bits_equal(tri1[k][0], tri[k][1], f"{NAMES[k]}: tensor 1 alone with rng_base 11")
    tri2, _ = _run_both(alone, [[g[0][1]]], [_scalars(1, device)], sr_param=True, sr_codes=True, rng_base=11,
                        counter0=5)  # fmt: skip
    for k in (0, 2, 4):
        assert not torch.equal(tri2[k][0].view(torch.uint8), tri1[k][0].view(torch.uint8)), "counter must matter"


# ---------------------------------------------------------------- registration, dispatch, refusals


def test_opcheck():
    dev = DEVICES[0]
    gen = torch.Generator().manual_seed(8)
    state = _lists([_state(40, (40,), torch.bfloat16, "ulp8", gen), _state(5, (5,), torch.bfloat16, "ulp8", gen)], dev)
    grads = [torch.randn(40, generator=gen).to(dev), torch.randn(5, generator=gen).to(dev)]
    args = (state[0], grads, *state[1:], _scalars(2, dev), torch.zeros(1, device=dev),
            torch.tensor([3, 4], device=dev), 2, 0.9, 0.999, 1e-8, False, True, True)  # fmt: skip
    torch.library.opcheck(
        torch.ops.fastamp_triton.optim_.default, registry.coerce("optim_", to_optim("adamw_q8_", args))
    )


def test_reachable_through_functional_and_auto():
    """functional.adamw_q8_ reaches the Triton kernel (backend='triton'; AUTO on a GPU without the native
    CUDA kernel)."""
    dev = DEVICES[0]
    assert backends.get_impl("optim_", "triton") is toptim.optim_
    assert backends.get_impl("adamw_q8_", "triton") is toptim.adamw_q8_
    assert registry.schema(registry.TRITON_NS, "adamw_q8_").arguments[-1].name == "sr_codes"
    gen = torch.Generator().manual_seed(9)
    state = _lists([_state(90, (9, 10), torch.bfloat16, "ulp8", gen)], dev)
    grads = [_grad(90, gen, torch.bfloat16, True).reshape(9, 10).to(dev)]
    tri, ref = clone_lists(state), clone_lists(state)
    rng = torch.tensor([1, 2], device=dev)
    for st, backend in ((tri, "triton"), (ref, "torch")):
        functional.adamw_q8_(*st[:1], grads, *st[1:], _scalars(1, dev), None, rng, 0, beta1=0.9, beta2=0.999,
                             eps=1e-8, sr_param=True, sr_codes=True, backend=backend)  # fmt: skip
    _assert_same(tri, ref)
    if torch.cuda.is_available() and not registry.native_has_kernel("adamw_q8_", "cuda"):
        assert backends.resolve("adamw_q8_", "cuda") == "triton"


def test_native_cuda_refusal_is_named():
    """An explicit backend that cannot run adamw_q8_ raises BackendUnavailableError with the reason."""
    if registry.native_has_kernel("adamw_q8_", "cuda"):
        pytest.skip("this build has the CUDA kernel of adamw_q8_")
    ok, why = backends.available("native", "adamw_q8_", "cuda")
    assert not ok and ("no cuda kernel for adamw_q8_" in why or "not built" in why), why
    with pytest.raises(backends.BackendUnavailableError, match="backend 'native' was requested for adamw_q8_"):
        backends.resolve("adamw_q8_", "cuda", "native")


def test_launcher_guards_refuse_and_change_nothing():
    dev = DEVICES[0]
    gen = torch.Generator().manual_seed(12)
    cases = {
        "exp_avg_scales\\[0\\] must be a contiguous strided tensor .* with 3 elements": lambda st: st[3].__setitem__(
            0, torch.zeros(2, dtype=torch.uint8, device=dev)
        ),
        "exp_avg_sq_codes\\[0\\] must be a contiguous": lambda st: st[4].__setitem__(
            0, torch.zeros(140, dtype=torch.uint8, device=dev)[::2]
        ),
        "params\\[0\\] must be": lambda st: st[0].__setitem__(0, st[0][0].float()),  # int16 remainders need bf16
        "SR_PARAM / SR_STATE need rng": None,  # sr_codes without rng
    }
    for message, mutate in cases.items():
        state = _lists([_state(70, (70,), torch.bfloat16, "remainder", gen)], dev)
        if mutate is not None:
            mutate(state)
        before = clone_lists(state)
        with pytest.raises(RuntimeError, match=f"fastamp_triton::optim_: {message}"):
            _triton_q8(state[0], [torch.zeros(70, device=dev)], *state[1:], _scalars(1, dev), None,
                       None if mutate is None else torch.tensor([1, 2], device=dev), 0, *BETAS, EPS, False,
                       False, mutate is None)  # fmt: skip
        _assert_same(state, before, message)
