"""Per-tensor step scalars in every backend's optimizer kernels, against the reference.

``step_scalars`` of ``adamw_``, ``adamw_bf16_``, ``sgd_`` and ``lion_`` is either ``[k]`` (shared by every
tensor of the launch) or ``[n, k]`` (contiguous fp32, row ``i`` for tensor ``i``:
``reference.scalar_rows``). Every available backend (the C++ CPU kernels on each instruction
set, Triton under the interpreter, and on a GPU the CUDA kernels and Triton) runs launches of
many tensors of odd sizes (empty, 1, primes, several chunks so one tensor's rows must follow
it across chunks, one misaligned so Triton splits the launch, mixed dtypes where the op allows
them so launches are grouped) with rows that all differ, and must match the reference bit for
bit; ``[k]`` must equal ``[n, k]`` with identical rows; a set found_inf writes nothing; any
other shape, a non-contiguous or non-fp32 ``[n, k]``, or scalars on another device are refused
with a message naming both shapes, before anything is written.
"""

import math

import pytest
import torch
from helpers import assert_bits_equal, clone_lists, misaligned, native_cpu_isas

from fastamp import backends, functional
from fastamp import reference as R
from fastamp.ops import registry

CPU_CHUNK = 16384  # csrc/cpu/multi_tensor.h kChunkElems (Triton's interpreter chunk is 4096)
# empty, 1, primes, one past the CPU chunk, and one spanning three CPU chunks
SIZES = [0, 1, 2, 3, 5, 7, 13, 31, 97, 257, 1021, 4099, CPU_CHUNK + 1, 2 * CPU_CHUNK + 3]
N = len(SIZES)
MISALIGNED = 5  # index of the tensor passed as a view one element past an aligned address


def _backends():
    """``(backend, device, isa)`` of every backend that can run here (isa: the CPU kernels' path)."""
    out = []
    if registry.native_has_kernel("adamw_", "cpu"):
        out += [pytest.param(("native", "cpu", isa), id=f"native-cpu-{isa}") for isa in native_cpu_isas()]
    try:
        from fastamp import kernels as fk

        if fk.available("cpu")[0]:
            out.append(pytest.param(("triton", "cpu", None), id="triton-cpu"))
    except ImportError:
        pass
    gpu = pytest.mark.gpu(reason="needs a CUDA device")
    out += [pytest.param((b, "cuda", None), id=f"{b}-cuda", marks=gpu) for b in ("native", "triton")]
    return out


BACKENDS = _backends()


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    name, dev, isa = request.param
    if dev == "cuda" and not backends.available(name, dev)[0]:
        pytest.skip(f"{name} is not available on cuda here")
    if isa is not None:
        monkeypatch.setenv("FASTAMP_CPU_ISA", isa)
        assert torch.ops.fastamp.cpu_isa() == isa
    return name, dev


def _exact(backend) -> bool:
    """Bit-exact expected, except Triton on a GPU without correctly rounded sqrt/division."""
    name, dev = backend
    if name == "triton" and dev == "cuda":
        from fastamp.kernels import _common as C

        return C.HAS_RN
    return True


def _check(backend, got, want, what):
    if _exact(backend) or not got.is_floating_point():
        assert_bits_equal(got, want, what)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True, msg=what)


def _t(n, dtype, dev, gen, scale=1.0, i=0):
    x = (torch.randn(n, generator=gen) * scale).to(dtype).to(dev)
    return misaligned(x) if i == MISALIGNED and n > 0 else x


def _rows_differ(rows):
    n = rows.shape[0]
    for j in range(rows.shape[1]):
        col = rows[:, j].tolist()
        assert len(set(col)) == n, f"column {j} repeats: {col}"


def _adamw_rows(dev):
    """[N, 4] rows from each tensor's own step count, every column different per row."""
    counts = torch.tensor([float(N - i) for i in range(N)], dtype=torch.float64)
    rows = R.adamw_step_scalars(1e-3, counts, 0.9, 0.999, 0.01, torch.tensor(2.0**-4))
    # per-row grad_mul (as if each tensor had its own clip) and weight decay
    rows[:, 2] = torch.tensor([1.0 - 1e-3 * 0.01 * (i + 1) for i in range(N)], dtype=torch.float64).float()
    rows[:, 3] = torch.tensor([2.0 ** -(i % 7) * (1 + i / 64) for i in range(N)]).float()
    _rows_differ(rows)
    return rows.contiguous().to(dev)


def _sgd_rows(dev):
    """[N, 3] rows: per-tensor lr and grad_mul, is_first set for some tensors only."""
    counts = torch.tensor([float(i % 3) for i in range(N)])
    rows = R.sgd_step_scalars(0.1, counts, torch.tensor(0.5))
    rows[:, 0] = torch.tensor([0.1 / (i + 1) for i in range(N)]).float()
    rows[:, 1] = torch.tensor([0.5 * (1 + i / 32) for i in range(N)]).float()
    for j in (0, 1):
        assert len(set(rows[:, j].tolist())) == N
    assert set(rows[:, 2].tolist()) == {0.0, 1.0}
    return rows.contiguous().to(dev)


def _lion_rows(dev):
    """[N, 3] rows: per-tensor lr, decay (each its own weight decay) and grad_mul, all different."""
    lr = torch.tensor([1e-3 * (1 + i / 8) for i in range(N)], dtype=torch.float64)
    decay = 1 - lr * torch.tensor([0.01 * (i + 1) for i in range(N)], dtype=torch.float64)
    grad_mul = torch.tensor([2.0 ** -(i % 5) * (1 + i / 64) for i in range(N)], dtype=torch.float64)
    rows = torch.stack((lr, decay, grad_mul), 1).float()
    _rows_differ(rows)
    return rows.contiguous().to(dev)


# ---- the cases: (op, reference args up to step_scalars, args after found_inf) ----


def _adamw_case(dev, dtype, master, amsgrad, maximize, grad_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gd = grad_dtype or dtype
    params = [_t(n, dtype, dev, gen, i=i) for i, n in enumerate(SIZES)]
    grads = [_t(n, gd, dev, gen, 3.0) for n in SIZES]
    masters = [p.float() for p in params] if master else []
    m = [_t(n, torch.float32, dev, gen, 0.1) for n in SIZES]
    v = [_t(n, torch.float32, dev, gen).abs() for n in SIZES]
    vmax = [x * 1.5 for x in v] if amsgrad else []
    return "adamw_", [params, grads, masters, m, v, vmax], (0.9, 0.999, 1e-8, amsgrad, maximize)


def _adamw_bf16_case(dev, rem, rng, bf16_moments, amsgrad, maximize, seed=0):
    gen = torch.Generator().manual_seed(seed)
    md = torch.bfloat16 if bf16_moments else torch.float32
    params = [_t(n, torch.bfloat16, dev, gen, i=i) for i, n in enumerate(SIZES)]
    # the grad dtype varies per tensor: the backends group the launch by it
    grads = [_t(n, (torch.float32, torch.float16, torch.bfloat16)[i % 3], dev, gen, 3.0) for i, n in enumerate(SIZES)]
    rems = (
        [torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int16).to(dev) for n in SIZES] if rem else []
    )
    m = [_t(n, md, dev, gen, 0.1) for n in SIZES]
    v = [_t(n, md, dev, gen).abs() for n in SIZES]
    vmax = [x * 1.5 for x in v] if amsgrad else []
    rng_t = torch.tensor([1234, 77], dtype=torch.int64, device=dev) if rng else None
    return "adamw_bf16_", [params, grads, rems, m, v, vmax], (rng_t, 3, 0.9, 0.999, 1e-8, amsgrad, maximize)


def _sgd_case(dev, masters, momentum, nesterov, rng, maximize, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if masters == "remainder":
        pdt = [torch.bfloat16] * N
    else:
        # param dtypes vary per tensor: the backends group the launch by them
        pdt = [(torch.float32, torch.float16, torch.bfloat16)[i % 3] for i in range(N)]
    params = [_t(n, pdt[i], dev, gen, i=i) for i, n in enumerate(SIZES)]
    grads = [_t(n, torch.float32, dev, gen, 3.0) for n in SIZES]
    if masters == "fp32":
        ms = [p.float() for p in params]
    elif masters == "remainder":
        ms = [torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int16).to(dev) for n in SIZES]
    else:
        ms = []
    bufs = [_t(n, torch.float32, dev, gen) for n in SIZES] if momentum else []
    rng_t = torch.tensor([99, 5], dtype=torch.int64, device=dev) if rng else None
    return "sgd_", [params, grads, ms, bufs], (rng_t, 1, momentum, 0.1, 0.01, nesterov, maximize)


def _lion_case(dev, masters, rng, maximize, seed=0):
    op, (params, grads, ms, _), _ = _sgd_case(dev, masters, 0.0, False, rng, maximize, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    # some exp_avgs exactly zero so that c = beta1 * m + (1 - beta1) * g hits +-0 with a zero grad
    m = [_t(n, torch.float32, dev, gen) * (i % 2) for i, n in enumerate(SIZES)]
    rng_t = torch.tensor([99, 5], dtype=torch.int64, device=dev) if rng else None
    return "lion_", [params, grads, ms, m], (rng_t, 2, 0.9, 0.99, maximize)


ADAMW = [
    (torch.float32, False, False, False, None),
    (torch.float32, True, True, True, None),
    (torch.float16, True, False, True, None),
    (torch.float16, False, True, False, None),
    (torch.bfloat16, True, True, False, torch.float32),
    (torch.bfloat16, False, False, True, None),
]
ADAMW_BF16 = [  # remainders, rng, bf16 moments, amsgrad, maximize
    (True, False, False, False, False),
    (True, True, True, True, False),
    (False, True, False, False, True),
    (False, True, True, True, False),
    (False, False, True, False, False),
]
SGD = [  # masters, momentum, nesterov, rng, maximize
    ("none", 0.0, False, False, False),
    ("none", 0.9, True, True, False),
    ("fp32", 0.9, False, False, True),
    ("fp32", 0.0, False, False, False),
    ("remainder", 0.9, True, False, False),
    ("remainder", 0.9, False, False, True),
]

LION = [  # masters, rng, maximize
    ("none", False, False),
    ("none", True, True),
    ("fp32", False, True),
    ("remainder", False, False),
]


# (maker, its arguments after dev) of case number i; each maker seeds its own generator, so a case's
# tensors are the same whether or not the others are made
CASES = (
    [(_adamw_case, c) for c in ADAMW]
    + [(_adamw_bf16_case, c) for c in ADAMW_BF16]
    + [(_sgd_case, c) for c in SGD]
    + [(_lion_case, c) for c in LION]
)


def _make_case(dev, case):
    """(op, lists, rest) of case number ``case`` (only that one is made: the tensors cost time)."""
    make, args = CASES[case]
    return make(dev, *args)


CASE_IDS = (
    [f"adamw-{str(c[0])[6:]}-master{int(c[1])}-ams{int(c[2])}-max{int(c[3])}" for c in ADAMW]
    + [f"adamw_bf16-rem{int(c[0])}-rng{int(c[1])}-bf16m{int(c[2])}-ams{int(c[3])}-max{int(c[4])}" for c in ADAMW_BF16]
    + [f"sgd-{c[0]}-mom{c[1]}-nest{int(c[2])}-rng{int(c[3])}-max{int(c[4])}" for c in SGD]
    + [f"lion-{c[0]}-rng{int(c[1])}-max{int(c[2])}" for c in LION]
)
LION_0 = len(CASE_IDS) - len(LION)


def _rows_for(op, dev):
    return {"sgd_": _sgd_rows, "lion_": _lion_rows}.get(op, _adamw_rows)(dev)


def _case(backend, case):
    """(op, lists, rest) of case number ``case``; skipped where the backend has no kernel for the op yet."""
    name, dev = backend
    op, lists, rest = _make_case(dev, case)
    ok, why = backends.available(name, op, dev)
    if not ok:
        pytest.skip(why)
    return op, lists, rest


def _run(impl, op, lists, scalars, found_inf, rest):
    impl(*lists, scalars, found_inf, *rest)


def _functional(backend_name, op, lists, scalars, found_inf, rest):
    fn = getattr(functional, op)
    if op == "adamw_":
        b1, b2, eps, ams, mx = rest
        fn(*lists, scalars, found_inf, beta1=b1, beta2=b2, eps=eps, amsgrad=ams, maximize=mx, backend=backend_name)
    elif op == "adamw_bf16_":
        rng, base, b1, b2, eps, ams, mx = rest
        fn(*lists, scalars, found_inf, rng, base, beta1=b1, beta2=b2, eps=eps, amsgrad=ams, maximize=mx,
           backend=backend_name)  # fmt: skip
    elif op == "lion_":
        rng, base, b1, b2, mx = rest
        fn(*lists, scalars, found_inf, rng, base, beta1=b1, beta2=b2, maximize=mx, backend=backend_name)
    else:
        rng, base, mom, damp, wd, nest, mx = rest
        fn(*lists, scalars, found_inf, rng, base, momentum=mom, dampening=damp, weight_decay=wd, nesterov=nest,
           maximize=mx, backend=backend_name)  # fmt: skip


def _assert_lists(backend, got, want, what):
    for li, (ga, wa) in enumerate(zip(got, want)):
        for i, (g, w) in enumerate(zip(ga, wa)):
            _check(backend, g, w, f"{what}: list {li} tensor {i} (size {SIZES[i]})")


def _found_inf(dev, value):
    return torch.tensor([value], dtype=torch.float32, device=dev)


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_rows_match_the_reference(backend, case):
    """Each tensor is updated with its own row; every row differs; all written tensors bit-exact."""
    name, dev = backend
    op, lists, rest = _case(backend, case)
    rows = _rows_for(op, dev)
    want = clone_lists(lists)
    shared = clone_lists(lists)
    R.__dict__[op](*want, rows, _found_inf(dev, 0.0), *rest)
    _functional(name, op, lists, rows, _found_inf(dev, 0.0), rest)
    _assert_lists(backend, lists, want, f"{name} {op} [n, k]")
    # the rows mattered: the launch with row 0 shared gives another result for some tensor
    R.__dict__[op](*shared, rows[0].clone(), None, *rest)
    assert any(not torch.equal(a, b) for a, b in zip(shared[0], lists[0]))


DIRECT_CASES = (0, 4, 7, 9, 12, 15, LION_0 + 1, LION_0 + 3)


@pytest.mark.parametrize("case", DIRECT_CASES, ids=[CASE_IDS[i] for i in DIRECT_CASES])
def test_direct_op_reads_rows(backend, case):
    """The backend's op itself (no functional layer in front) reads ``[n, k]`` rows the same way."""
    name, dev = backend
    op, lists, rest = _case(backend, case)
    rows = _rows_for(op, dev)
    want = clone_lists(lists)
    R.__dict__[op](*want, rows, None, *rest)
    _run(backends.get_impl(op, name), op, lists, rows, None, rest)
    _assert_lists(backend, lists, want, f"{name} {op} direct")


SHARED_CASES = (1, 3, 6, 8, 11, 14, LION_0, LION_0 + 2)


@pytest.mark.parametrize("case", SHARED_CASES, ids=[CASE_IDS[i] for i in SHARED_CASES])
def test_shared_form_equals_identical_rows(backend, case):
    """``[k]`` and ``[n, k]`` whose rows are all that ``[k]`` give the same bits."""
    name, dev = backend
    op, lists, rest = _case(backend, case)
    one = _rows_for(op, dev)[3].clone()
    rows = one.expand(N, one.numel()).contiguous()
    other = clone_lists(lists)
    _functional(name, op, lists, one, None, rest)
    _functional(name, op, other, rows, None, rest)
    for li, (a, b) in enumerate(zip(lists, other)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bits_equal(x, y, f"list {li} tensor {i}")


@pytest.mark.parametrize("value", [1.0, math.nan])
@pytest.mark.parametrize("case", [1, 7, 13, LION_0 + 1], ids=[CASE_IDS[i] for i in (1, 7, 13, LION_0 + 1)])
def test_found_inf_writes_nothing_with_rows(backend, case, value):
    name, dev = backend
    op, lists, rest = _case(backend, case)
    before = clone_lists(lists)
    _functional(name, op, lists, _rows_for(op, dev), _found_inf(dev, value), rest)
    for li, (a, b) in enumerate(zip(lists, before)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bits_equal(x, y, f"list {li} tensor {i}")


def _bad_scalars(rows, dev):
    n, k = rows.shape
    out = {
        "n+1 rows": torch.ones(n + 1, k, device=dev),
        "n-1 rows": torch.ones(n - 1, k, device=dev),
        "k+1": torch.ones(k + 1, device=dev),
        "k-1": torch.ones(k - 1, device=dev),
        "flat n*k": rows.reshape(-1).clone(),
        "[1, k]": rows[:1].clone(),
        "[n, k, 1]": rows.unsqueeze(-1).clone(),
        "non-contiguous [n, k]": rows.t().contiguous().t(),
        "fp64 [n, k]": rows.double(),
        "fp16 [n, k]": rows.half(),
    }
    assert not out["non-contiguous [n, k]"].is_contiguous() and out["non-contiguous [n, k]"].shape == (n, k)
    if dev == "cuda":
        out["[n, k] on cpu"] = rows.cpu()
    elif torch.cuda.is_available():
        out["[n, k] on cuda"] = rows.cuda()
    return out


@pytest.mark.parametrize("op_case", [1, 7, 13, LION_0 + 2], ids=["adamw_", "adamw_bf16_", "sgd_", "lion_"])
def test_wrong_step_scalars_are_refused(backend, op_case):
    """Refused with a message naming both shapes, before anything is written: through
    ``fastamp.functional`` (ValueError) and by the backend's op itself (RuntimeError)."""
    name, dev = backend
    op, lists, rest = _case(backend, op_case)
    rows = _rows_for(op, dev)
    k = rows.shape[1]
    shapes = rf"\[{k}\] or \[{N}, {k}\]"
    before = clone_lists(lists)
    for what, bad in _bad_scalars(rows, dev).items():
        device_only = bad.device.type != dev
        with pytest.raises(ValueError, match="step_scalars is on" if device_only else shapes):
            _functional(name, op, lists, bad, None, rest)
        with pytest.raises(RuntimeError, match="step_scalars" if device_only else shapes):
            _run(backends.get_impl(op, name), op, lists, bad, None, rest)
        for li, (a, b) in enumerate(zip(lists, before)):
            for i, (x, y) in enumerate(zip(a, b)):
                assert_bits_equal(x, y, f"{what}: list {li} tensor {i}")


def test_one_tensor_takes_row_zero_of_a_1_by_k(backend):
    """n = 1: ``[1, k]`` is the per-tensor form (row 0), as the reference reads it."""
    name, dev = backend
    op, lists, rest = _make_case(dev, 1)
    lists = [lst[-1:] if lst else [] for lst in lists]
    row = _rows_for(op, dev)[5:6].clone()
    want = clone_lists(lists)
    R.__dict__[op](*want, row, None, *rest)
    _functional(name, op, lists, row, None, rest)
    _assert_lists(backend, lists, want, f"{name} {op} [1, k]")
