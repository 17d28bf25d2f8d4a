"""Helpers shared by the test tiers: bit patterns and bit-for-bit comparison, state copies, grads.

Imported by name (``from helpers import ...``): pytest puts tests/ on sys.path (``pythonpath``
in pyproject.toml). Numeric budgets live in tolerances.py, markers and skips in conftest.py.
"""

import contextlib
import io

import pytest
import torch

# A test that needs a CUDA device: conftest.py skips ``gpu`` tests, with their reason, where there is none.
requires_cuda = pytest.mark.gpu

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---- bit patterns ----------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s raw bit pattern (floats viewed as the integer of their width; NaN payloads kept).

    Other dtypes are copied as they are; sparse tensors compare by their dense value.
    """
    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    if t.is_floating_point():
        return t.contiguous().view(_INT_OF_WIDTH[t.element_size()]).clone()
    return t.clone()


def canonical_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern with every NaN replaced by one canonical NaN (NaN payloads are not specified)."""
    if not t.is_floating_point():
        return t
    t = t.contiguous()
    as_int = _INT_OF_WIDTH[t.element_size()]
    canon = torch.full_like(t, float("nan")).view(as_int)
    return torch.where(torch.isnan(t), canon, t.view(as_int))


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bits (signed zeros by sign), except that any NaN equals any NaN;
    integer and bool tensors must be equal."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        what,
        actual.dtype,
        expected.dtype,
        actual.shape,
        expected.shape,
    )
    a, e = canonical_bits(actual), canonical_bits(expected)
    if not torch.equal(a, e):
        bad = (a != e).flatten().nonzero().flatten()[:5].tolist()
        flat_a, flat_e = actual.reshape(-1), expected.reshape(-1)
        raise AssertionError(
            f"{what}: {int((a != e).sum())} of {a.numel()} elements differ, first at {bad}: "
            f"{flat_a[bad].tolist()} vs expected {flat_e[bad].tolist()}"
        )


# ---- state -------------------------------------------------------------------------------------------


def clone_lists(state):
    """A deep copy of a kernel's tensor-list arguments (a list of lists of tensors)."""
    return [[t.clone() for t in lst] for lst in state]


def seeded_params(shapes, dtype=torch.bfloat16, seed=0, std=0.5):
    """Params of ``shapes`` (normal, ``std``) in ``dtype``, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * std).to(dtype)) for s in shapes]


def heavy_tailed_grads(params, step, scale=1.0):
    """Grads of step ``step`` for ``params``: normal times a log-normal spread (magnitudes over ~e^+-6)."""
    g = torch.Generator().manual_seed(100 + step)
    return [
        (torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g) * 2) * scale).to(p.dtype)
        for p in params
    ]


def master_of(opt, p):
    """The fp32 master value of ``p`` in ``opt``: joined remainder, fp32 master, or the param itself."""
    from fastamp import reference

    st = opt.state[p]
    if "master_remainder" in st:
        return reference.join_master(p.detach(), st["master_remainder"])
    return st["master_param"] if "master_param" in st else p.detach().float()


@contextlib.contextmanager
def num_threads(n: int):
    """torch's intra-op thread count set to ``n`` inside the block, restored after it."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_flushing_denormals(fn) -> None:
    """``fn()`` on a thread set to flush subnormals to zero (``torch.set_flush_denormal(True)``), then
    assert the thread still flushes (a kernel that changes the float mode must give it back).
    Skips where the CPU has no flush-to-zero mode."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        fn()
        still_flushing = float(torch.tensor([1e-39]) * 1.5) == 0.0
    finally:
        torch.set_flush_denormal(False)
    assert still_flushing, "the kernel left the thread without its flush-to-zero mode"


@contextlib.contextmanager
def cuda_syncs_raise():
    """Inside, any host sync with the GPU raises (``torch.cuda.set_sync_debug_mode("error")``); work queued before is finished first."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def state_snapshot(opt):
    """Every state entry of ``opt`` keyed by (param index over its groups, key), tensors cloned."""
    return {
        (i, k): t.clone() if isinstance(t, torch.Tensor) else t
        for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
        for k, t in opt.state[p].items()
    }


def assert_same_state(a, b) -> None:
    """Two :func:`state_snapshot` results hold the same keys and the same bits."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert_bits_equal(a[k], b[k], str(k))
        else:
            assert a[k] == b[k], k


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data pointer is one element past an aligned one."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:]
    out.copy_(t)
    return out


def set_grads(params, grads) -> None:
    """``p.grad`` = a private copy of the grad in the param's dtype (``None`` clears it)."""
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.detach().clone().to(p.dtype)


def save_load(obj):
    """``obj`` through torch.save / torch.load(weights_only=True), as a checkpoint goes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def native_cpu_isas() -> list:
    """The C++ CPU kernels' instruction-set paths this machine runs, best first ([] if not built)."""
    from fastamp.ops import registry

    if not registry.native_has_kernel("unscale_check_", "cpu"):
        return []
    order = ("scalar", "avx2", "avx512")
    best = torch.ops.fastamp.cpu_isa()
    return [i for i in order if order.index(i) <= order.index(best)][::-1]


def each_isa(monkeypatch):
    """Each instruction-set path of :func:`native_cpu_isas`, set in turn as the ``isa`` fixture sets one.

    For the tests whose reference costs far more than the kernel: the reference is computed once and
    compared with every path, instead of once per ``isa`` parameter."""
    isas = native_cpu_isas()
    assert isas, "the native CPU kernels are not built"
    for name in isas:
        monkeypatch.setenv("FASTAMP_CPU_ISA", name)
        assert torch.ops.fastamp.cpu_isa() == name
        yield name


# the real backends every compile test that claims eager's bits runs through (inductor's cases are long)
COMPILE_BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


def spy_optim(monkeypatch, record):
    """Call ``record(params, grads, masters, states, step_scalars, found_inf, rng, rng_base, rule=, hyper=, flags=)``
    at every launch of fastamp's optimizers (each one ``optim_``, through ``fastamp.functional._optim_launch``),
    then run it."""
    from fastamp import functional

    real = functional._optim_launch

    def spy(args, backend, table=None):
        record(*args[:8], rule=args[8], hyper=args[9], flags=args[10])
        return real(args, backend, table)

    monkeypatch.setattr(functional, "_optim_launch", spy)


def spy_kernels(monkeypatch, wrap):
    """Route every native/Triton/torch kernel a fastamp op reaches through ``wrap(op, backend, impl)``.

    Two places hand out kernels: ``backends.get_impl`` (every backend) and, for the native
    backend in eager mode, the direct calls of ``fastamp.functional`` (``fastamp._C.<op>``,
    which skip the dispatcher); a test that watches which kernels run must watch both.
    """
    from fastamp import backends, functional

    real = backends.get_impl
    monkeypatch.setattr(backends, "get_impl", lambda op, backend: wrap(op, backend, real(op, backend)))
    direct = functional._DIRECT
    monkeypatch.setattr(functional, "_DIRECT", {op: wrap(op, "native", fn) for op, fn in direct.items()})


# ---- the generic optimizer op ----------------------------------------------------------------------


def optim_args(op: str, args) -> tuple:
    """``op``'s positional arguments as ``optim_`` takes them (the schema's types): ``op`` a per-rule
    optimizer op (``adamw_``, ``adamw_bf16_``, ``adamw_q8_``, ``sgd_``, ``sgd_q8_``, ``lion_``, ``lion_q8_``),
    mapped by :func:`fastamp.reference.optim.to_optim`."""
    from fastamp.ops import registry
    from fastamp.reference.optim import to_optim

    return registry.coerce("optim_", to_optim(op, tuple(args)))


def native_optim(op: str):
    """``torch.ops.fastamp.optim_`` taking ``op``'s positional arguments (see :func:`optim_args`)."""
    return lambda *args: torch.ops.fastamp.optim_(*optim_args(op, args))
