"""Tier 2: the Triton generic optimizer kernel (``kernels/optim.py``) on the combinations no per-rule op took.

``optim_`` is one kernel for every update rule x master format x state format
(``kernels/rules.py`` x ``kernels/formats.py``), so combinations that no per-rule kernel had come
with it: q8 states for SGD and Lion (fused, no composition with the codec), ulp8 masters for SGD
and Lion, ulp8 masters with fp32 and bf16 states, SR_PARAM without SR_STATE and the reverse, AMSGRAD
with q8 states, bf16 states under fp32 and fp16 params. Each case runs the kernel and
:func:`fastamp.reference.optim_` side by side over steps on copies of one state and compares every
byte written (bit-exact under ``TRITON_INTERPRET=1``; on a GPU AdamW's sqrt/division are the IEEE ones,
checked in the PTX by tests/tools/test_triton_aot.py). The rule x format matrix of every backend is
tests/backends/test_optim_matrix.py; this file holds what is Triton's own.
"""

import itertools

import pytest
import torch

pytest.importorskip("triton")

from helpers import assert_bits_equal, clone_lists  # noqa: E402

from fastamp import kernels as fk  # noqa: E402
from fastamp import reference as R  # noqa: E402

DEVICES = [d for d in ("cpu", "cuda") if fk.available(d)[0]]
if not DEVICES:
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

from fastamp.kernels import optim as toptim  # noqa: E402

from fastamp.reference import optim as RO  # noqa: E402

CHUNK, BLOCK = toptim.C.chunk_config()
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HYPER = {"adamw": [0.9, 0.999, 1e-8], "sgd": [0.9, 0.1, 0.01], "lion": [0.9, 0.99]}
# each rule's own flag on (AMSGRAD: a third state; NESTEROV), and maximize
RULE_FLAGS = {"adamw": RO.AMSGRAD | RO.MAXIMIZE, "sgd": RO.NESTEROV | RO.MAXIMIZE, "lion": RO.MAXIMIZE}
MASTER_DTYPE = {"none": None, "fp32": F32, "remainder": torch.int16, "ulp8": torch.int8}
SR = {"none": 0, "param": RO.SR_PARAM, "state": RO.SR_STATE, "both": RO.SR_PARAM | RO.SR_STATE}
# a partial q8 block alone, a full kernel block and a partial one (a partial q8 block), one element
SIZES = [37, BLOCK + 45, 1]

# numpy, behind the interpreter, warns on inf*0 and friends
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _state(rule, master, fmt, pdt, flags, sizes, device, gen):
    """``[params, grads, masters, states]`` of ``optim_`` (q8 codes and scale bytes random)."""
    params, masters, states = [], [], []
    for n in sizes:
        p32 = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-6, 6, (n,), generator=gen).float()
        if n >= 8:
            p32[:4] = torch.tensor([0.0, -0.0, 1e-40, 2.0**-14])
        if master == "remainder":
            p, m = R.split_master(p32)
            masters.append(m)
        elif master == "ulp8":
            p, c = R.ulp8_encode(p32, pdt, R.sr_random16(3, torch.tensor(9), 0, n, "cpu"))
            masters.append(c)
        elif master == "fp32":
            p = p32.to(pdt)
            masters.append(p32.clone())
        else:
            p = p32.to(pdt)
        params.append(p)
    grads = [(torch.randn(n, generator=gen) * 3.0).to(F16) for n in sizes]
    for d in RO.RULES[rule].states(HYPER[rule], flags):
        if fmt == "q8":
            states += [torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8) for n in sizes]
            low = 11 if d.q8_code == "m" else 75  # q8.M_SCALE_MIN, W_SCALE_MIN
            states += [torch.randint(low, 140, (-(-n // 32),), generator=gen, dtype=torch.uint8) for n in sizes]
        else:
            dt = F32 if fmt == "fp32" else BF16
            states += [(torch.rand(n, generator=gen) * 0.01).to(dt) for n in sizes]
    return [[t.to(device) for t in lst] for lst in (params, grads, masters, states)]


def _scalars(rule, step, device):
    dev = torch.device(device)
    if rule == "adamw":
        return R.adamw_step_scalars(1e-3, torch.tensor(float(step), device=dev), 0.9, 0.999, 0.01,
                                    torch.tensor(0.5, device=dev))  # fmt: skip
    if rule == "sgd":
        return R.sgd_step_scalars(0.05, torch.tensor(step - 1, device=dev), torch.tensor(0.25, device=dev))
    return R.lion_step_scalars(1e-3, 0.1, torch.tensor(0.5, device=dev), dev)


def _run_both(rule, state, flags, steps=2, rng_base=3, found=0.0):
    """Both implementations for ``steps`` steps on copies of ``state``: (Triton's, the reference's)."""
    tri, ref = clone_lists(state), clone_lists(state)
    dev = state[0][0].device
    for step in range(1, steps + 1):
        rng = torch.tensor([7, 100 + step], device=dev)
        fi = torch.tensor([found], device=dev)
        for impl, st in ((toptim.optim_, tri), (RO.optim_, ref)):
            impl(*st, _scalars(rule, step, dev), fi, rng.clone(), rng_base, rule, HYPER[rule], flags)
    return tri, ref


def _assert_same(got, exp, what):
    for name, a, e in zip(("params", "grads", "masters", "states"), got, exp):
        for i, (x, y) in enumerate(zip(a, e)):
            assert_bits_equal(x.cpu(), y.cpu(), f"{what}: {name}[{i}]")


def _cases():
    """Every rule x master format x state format, the param dtype and the SR flags rotating over them."""
    out = []
    for i, (rule, master, fmt) in enumerate(
        itertools.product(("adamw", "sgd", "lion"), MASTER_DTYPE, ("fp32", "bf16", "q8"))
    ):
        pdts = {"remainder": (BF16,), "ulp8": (BF16, F16)}.get(master, (BF16, F16, F32))
        pdt = pdts[i % len(pdts)]
        sr = tuple(SR)[i % len(SR)]
        out.append(pytest.param(rule, master, fmt, pdt, sr, id=f"{rule}-{master}-{fmt}-{str(pdt)[6:]}-sr_{sr}"))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule, master, fmt, pdt, sr", _cases())
def test_every_rule_master_and_state_format(device, rule, master, fmt, pdt, sr):
    gen = torch.Generator().manual_seed(sum(map(ord, rule + master + fmt)))
    flags = RULE_FLAGS[rule] | SR[sr]
    state = _state(rule, master, fmt, pdt, flags, SIZES, device, gen)
    tri, ref = _run_both(rule, state, flags)
    _assert_same(tri, ref, f"{rule} {master} {fmt} {pdt} sr={sr}")
    # the steps changed the params and the states (a check that cannot pass by writing nothing)
    for k in (0, 3):
        assert any(
            not torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)) for x, y in zip(tri[k], state[k])
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("master, pdt", [("none", BF16), ("ulp8", F16), ("ulp8", BF16)])
@pytest.mark.parametrize("fmt", ["bf16", "q8"])
def test_sr_param_and_sr_state_draw_apart(device, master, pdt, fmt):
    """SR_PARAM alone rounds the param (or the ulp8 correction) stochastically and the states to nearest
    even, SR_STATE alone the reverse: each equals the reference, and differs from the run with both
    exactly in what it leaves to nearest even."""
    gen = torch.Generator().manual_seed(5)
    state = _state("adamw", master, fmt, pdt, RO.AMSGRAD, [BLOCK + 45], device, gen)
    runs = {}
    for sr in ("param", "state", "both"):
        flags = RO.AMSGRAD | SR[sr]
        runs[sr], ref = _run_both("adamw", state, flags, steps=1)
        _assert_same(runs[sr], ref, f"sr={sr}")

    def same(a, b, k):
        return all(torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)) for x, y in zip(a[k], b[k]))

    rounded = 2 if master == "ulp8" else 0  # what SR_PARAM rounds: the correction, or the param
    assert same(runs["param"], runs["both"], rounded) and not same(runs["param"], runs["both"], 3)
    assert same(runs["state"], runs["both"], 3) and not same(runs["state"], runs["both"], rounded)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("master, pdt", [("none", F32), ("fp32", F16), ("remainder", BF16), ("ulp8", BF16)])
def test_amsgrad_with_q8_states(device, master, pdt):
    """AMSGRAD on q8 states: a third state (max_exp_avg_sq, a v code), every master kind, over a second
    chunk, skipped steps writing nothing; stochastic codes."""
    gen = torch.Generator().manual_seed(7)
    flags = RO.AMSGRAD | RO.SR_STATE | RO.SR_PARAM
    state = _state("adamw", master, "q8", pdt, flags, [CHUNK + 70, 33], device, gen)
    assert len(state[3]) == 3 * 2 * 2  # three states, codes and scales, two tensors
    tri, ref = _run_both("adamw", state, flags, steps=3)
    _assert_same(tri, ref, f"amsgrad q8 {master}")
    skipped, _ = _run_both("adamw", state, flags, steps=1, found=1.0)
    _assert_same(skipped, state, "a skipped step")
