"""``fastamp._C.<op>``, the direct call of the native list ops (csrc/direct_call.cpp).

``functional``'s native fast path calls the kernels through it instead of ``torch.ops`` (no
per-tensor IValue, vector copy or autograd-fallback visit). What it must keep:

* the same kernel, so bit-identical results to ``torch.ops.fastamp.<op>`` for every op (the
  optimizer ops as the one generic ``optim_``, each case a per-rule op's arguments mapped onto it);
* decline (``NotImplemented``) with nothing written whenever the dispatcher could do
  something else or the kernel refuses: tensor subclasses, dispatch modes, non-dense
  tensors, grad mode with a tensor that requires grad, non-tensor items, bad input;
* a mode (torch dispatch mode) still sees the op through ``functional``.
"""

import pytest
import torch
from helpers import assert_bits_equal, optim_args
from torch.utils._python_dispatch import TorchDispatchMode

from fastamp import functional
from fastamp.ops import registry

if not registry.NATIVE_LOADED:
    pytest.skip("fastamp._C is not built", allow_module_level=True)

from fastamp import _C  # noqa: E402

SIZES = [1, 7, 256, 16385, 3]


def _adamw_args(p_dtype=torch.float32, master=False, found=0.0):
    gen = torch.Generator().manual_seed(3)
    sizes = SIZES
    params = [torch.randn(k, generator=gen).to(p_dtype) for k in sizes]
    grads = [torch.randn(k, generator=gen).to(p_dtype) for k in sizes]
    masters = [p.float() for p in params] if master else []
    m = [torch.randn(k, generator=gen) * 0.1 for k in sizes]
    v = [torch.rand(k, generator=gen) * 0.1 for k in sizes]
    scalars = torch.tensor([1e-3, 0.9, 0.99, 0.5])
    return [params, grads, masters, m, v, [], scalars, torch.full((1,), found), 0.9, 0.999, 1e-8, False, False]


def _bf16_args(rem=True, rng=True):
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(k, generator=gen).bfloat16() for k in SIZES]
    grads = [torch.randn(k, generator=gen) for k in SIZES]
    rems = [torch.randint(-(2**15), 2**15, (k,), generator=gen, dtype=torch.int16) for k in SIZES] if rem else []
    m = [torch.randn(k, generator=gen).bfloat16() for k in SIZES]
    v = [torch.rand(k, generator=gen).bfloat16() for k in SIZES]
    rng_t = torch.tensor([7, 11], dtype=torch.int64) if rng else None
    scalars = torch.tensor([1e-3, 0.9, 0.99, 0.5])
    return [params, grads, rems, m, v, [], scalars, torch.zeros(1), rng_t, 5, 0.9, 0.999, 1e-8, False, False]


def _sgd_args(master=True):
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(k, generator=gen).bfloat16() for k in SIZES]
    grads = [torch.randn(k, generator=gen).bfloat16() for k in SIZES]
    masters = [p.float() for p in params] if master else []
    bufs = [torch.randn(k, generator=gen) for k in SIZES]
    return [params, grads, masters, bufs, torch.tensor([0.1, 0.5, 0.0]), None, None, 0, 0.9, 0.1, 0.01, True, False]


def _lion_args(master=True, rng=False, maximize=False):
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(k, generator=gen).bfloat16() for k in SIZES]
    grads = [torch.randn(k, generator=gen).half() for k in SIZES]
    masters = [p.float() for p in params] if master else []
    m = [torch.randn(k, generator=gen) * 0.1 for k in SIZES]
    rng_t = torch.tensor([9, 13], dtype=torch.int64) if rng else None
    scalars = torch.tensor([1e-3, 0.999, 0.5])
    return [params, grads, masters, m, scalars, torch.zeros(1), rng_t, 2, 0.9, 0.99, maximize]


def _q8_args(master="remainder", sr=True):
    from fastamp.reference import q8

    gen = torch.Generator().manual_seed(8)
    params = [torch.randn(k, generator=gen).bfloat16() for k in SIZES]
    grads = [torch.randn(k, generator=gen).bfloat16() for k in SIZES]
    masters = {
        "remainder": lambda: [torch.randint(-(2**15), 2**15, (k,), generator=gen, dtype=torch.int16) for k in SIZES],
        "ulp8": lambda: [torch.randint(-128, 128, (k,), generator=gen, dtype=torch.int8) for k in SIZES],
        "none": lambda: [],
    }[master]()
    codes = [[torch.randint(0, 256, (k,), generator=gen, dtype=torch.uint8) for k in SIZES] for _ in range(2)]
    scales = [[torch.randint(60, 130, (q8.num_blocks(k),), generator=gen, dtype=torch.uint8) for k in SIZES]
              for _ in range(2)]  # fmt: skip
    rng_t = torch.tensor([3, 9], dtype=torch.int64) if sr else None
    scalars = torch.tensor([1e-3, 0.9, 0.99, 0.5])
    return [params, grads, masters, codes[0], scales[0], codes[1], scales[1], scalars, torch.zeros(1), rng_t, 4,
            0.9, 0.999, 1e-8, False, sr and master != "remainder", sr]  # fmt: skip


def _one_state_q8_args(rule, master=True, sr=True):
    from fastamp.reference import q8

    gen = torch.Generator().manual_seed(10)
    params = [torch.randn(k, generator=gen).bfloat16() for k in SIZES]
    grads = [torch.randn(k, generator=gen).bfloat16() for k in SIZES]
    masters = [torch.randint(-(2**15), 2**15, (k,), generator=gen, dtype=torch.int16) for k in SIZES] if master else []
    codes = [torch.randint(0, 256, (k,), generator=gen, dtype=torch.uint8) for k in SIZES]
    scales = [torch.randint(60, 130, (q8.num_blocks(k),), generator=gen, dtype=torch.uint8) for k in SIZES]
    rng_t = torch.tensor([3, 9], dtype=torch.int64) if sr else None
    head = [params, grads, masters, codes, scales]
    flags = [sr and not master, sr]
    if rule == "sgd":
        return head + [torch.tensor([0.1, 0.5, 0.0]), torch.zeros(1), rng_t, 4, 0.9, 0.1, 0.01, True, False, *flags]
    return head + [torch.tensor([1e-3, 0.999, 0.5]), torch.zeros(1), rng_t, 4, 0.9, 0.99, True, *flags]


def _unscale_args(stats=False):
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(k, generator=gen).to(dt) for k, dt in zip(SIZES, (torch.float32, torch.bfloat16) * 3)]
    grads[2][5] = float("inf")
    args = [grads, torch.zeros(1), torch.tensor([0.5]), True, True]
    if stats:
        args += [torch.zeros(len(grads), 3, dtype=torch.int64), torch.zeros(len(grads))]
    return args


# the per-rule ops' cases run as optim_ (helpers.optim_args); the others as themselves
PER_RULE = {
    "adamw_": [lambda: _adamw_args(), lambda: _adamw_args(torch.bfloat16, master=True), lambda: _adamw_args(found=1.0)],
    "adamw_bf16_": [lambda: _bf16_args(), lambda: _bf16_args(rem=False), lambda: _bf16_args(rng=False)],
    "sgd_": [lambda: _sgd_args(), lambda: _sgd_args(master=False)],
    "lion_": [lambda: _lion_args(), lambda: _lion_args(master=False, rng=True, maximize=True)],
    "adamw_q8_": [lambda: _q8_args(), lambda: _q8_args("ulp8"), lambda: _q8_args("none", sr=False)],
    "sgd_q8_": [lambda: _one_state_q8_args("sgd"), lambda: _one_state_q8_args("sgd", master=False, sr=False)],
    "lion_q8_": [lambda: _one_state_q8_args("lion"), lambda: _one_state_q8_args("lion", master=False)],
}
OTHER = {
    "unscale_check_": [lambda: _unscale_args()],
    "unscale_check_stats_": [lambda: _unscale_args(stats=True)],
}


def _as_optim(rule_op, make):
    return lambda: list(optim_args(rule_op, make()))


# case name -> (op of fastamp._C, argument makers)
CASES = {
    **{name: ("optim_", [_as_optim(name, m) for m in makers]) for name, makers in PER_RULE.items()},
    **{name: (name, makers) for name, makers in OTHER.items()},
}


def _clone(args):
    out = []
    for a in args:
        if isinstance(a, list):
            out.append([t.clone() if isinstance(t, torch.Tensor) else t for t in a])
        elif isinstance(a, torch.Tensor):
            out.append(a.clone())
        else:
            out.append(a)
    return out


def _tensors(args):
    for a in args:
        if isinstance(a, list):
            yield from (t for t in a if isinstance(t, torch.Tensor))
        elif isinstance(a, torch.Tensor):
            yield a


def _assert_same(got, want, what):
    for i, (a, b) in enumerate(zip(_tensors(got), _tensors(want))):
        if a.is_sparse:
            a, b = a.to_dense(), b.to_dense()
        if a.is_conj():
            a, b = a.resolve_conj(), b.resolve_conj()
        if a.device.type == "meta":
            continue
        assert_bits_equal(a, b, f"{what} tensor {i}")


@pytest.mark.parametrize("case", list(CASES))
def test_direct_call_is_bit_identical_to_torch_ops(case):
    op, makers = CASES[case]
    for make in makers:
        args = make()
        direct, dispatched = _clone(args), _clone(args)
        out = getattr(_C, op)(*direct)
        assert out is not NotImplemented
        ref = getattr(torch.ops.fastamp, op)(*dispatched)
        _assert_same(direct, dispatched, case)
        if op.startswith("unscale"):
            assert_bits_equal(out, ref, "sum of squares")
        else:
            assert out is None


def _declines(op, args):
    before = _clone(args)
    assert getattr(_C, op)(*args) is NotImplemented
    _assert_same(args, before, f"{op} (declined: nothing written)")


class _Sub(torch.Tensor):
    pass


def test_declines_what_the_dispatcher_would_route_elsewhere():
    args = _adamw_args()
    # a tensor subclass anywhere
    args[1][2] = args[1][2].as_subclass(_Sub)
    _declines("optim_", list(optim_args("adamw_", args)))
    # a list item that is not a tensor
    args = _adamw_args()
    args[3][1] = 1.0
    _declines("optim_", list(optim_args("adamw_", args)))
    # sparse grad, conjugated view
    args = _unscale_args()
    args[0][1] = args[0][1].to_sparse()
    _declines("unscale_check_", args)
    args = _unscale_args()
    args[0][0] = torch.randn(3, dtype=torch.complex64).conj()
    _declines("unscale_check_", args)
    # a meta tensor (another device)
    args = _adamw_args()
    args[4][0] = torch.empty(SIZES[0], device="meta")
    _declines("optim_", list(optim_args("adamw_", args)))
    # a wrong argument type (flags a bool, the rule not a str, a hyperparameter not a number), a wrong
    # argument count
    for k, value in ((10, True), (8, 3), (9, [0.9, "0.1", 0.01])):
        args = list(optim_args("sgd_", _sgd_args()))
        args[k] = value
        _declines("optim_", args)
    assert _C.optim_(*optim_args("sgd_", _sgd_args())[:-1]) is NotImplemented


def test_declines_grad_mode_with_requires_grad_only():
    args = list(optim_args("adamw_", _adamw_args()))
    for p in args[0]:
        p.requires_grad_(True)
    with torch.enable_grad():
        _declines("optim_", args)
    with torch.no_grad():
        assert _C.optim_(*args) is None


@pytest.mark.parametrize(
    "op, break_it",
    [
        ("adamw_", lambda a: a[3].__setitem__(2, torch.zeros(SIZES[2], dtype=torch.float64))),  # exp_avg dtype
        ("adamw_", lambda a: a[4].__setitem__(1, torch.zeros(SIZES[1] + 1))),  # numel mismatch
        ("adamw_", lambda a: a[1].pop()),  # list length
        ("adamw_", lambda a: a.__setitem__(6, torch.ones(3))),  # step_scalars
        ("adamw_", lambda a: a[0].__setitem__(3, torch.zeros(16, 32).t()[:, :16].reshape(-1)[: SIZES[3]])),
        ("adamw_bf16_", lambda a: a[2].__setitem__(0, a[2][0].int())),  # remainder dtype
        ("sgd_", lambda a: a[3].__setitem__(4, torch.zeros(2 * SIZES[4])[::2])),  # non-contiguous buffer
        ("lion_", lambda a: a[3].__setitem__(1, a[3][1].half())),  # exp_avg dtype
        ("lion_", lambda a: a.__setitem__(4, torch.ones(4))),  # step_scalars
        ("adamw_q8_", lambda a: a[4].__setitem__(2, a[4][2][:-1].clone())),  # scales length
        ("sgd_q8_", lambda a: a[3].__setitem__(1, a[3][1].int())),  # codes dtype
        ("lion_q8_", lambda a: a[4].__setitem__(2, a[4][2][:-1].clone())),  # scales length
        ("unscale_check_", lambda a: a[0].__setitem__(1, a[0][1].double())),  # fp64 grad
        ("unscale_check_stats_", lambda a: a.__setitem__(5, torch.zeros(2, 3, dtype=torch.int64))),
    ],
)
def test_declines_bad_input_and_writes_nothing(op, break_it):
    """Each op's case broken (in its own argument list), then called as _C's op of it."""
    direct_op = CASES[op][0]
    args = (PER_RULE[op] if op in PER_RULE else OTHER[op])[0]()
    break_it(args)
    _declines(direct_op, list(optim_args(op, args)) if op in PER_RULE else args)


def test_functional_still_raises_the_clear_message():
    args = _adamw_args()
    args[3][2] = torch.zeros(SIZES[2], dtype=torch.float64)
    params = [p.clone() for p in args[0]]
    with pytest.raises(TypeError, match=r"exp_avgs\[2\]"):
        functional.adamw_(*args[:8], beta1=0.9, beta2=0.999, eps=1e-8, backend="native")
    for a, b in zip(args[0], params):
        assert_bits_equal(a, b, "params after a refused call")


class _Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_still_sees_the_op():
    args = _adamw_args()
    assert _C.optim_(*optim_args("adamw_", _clone(args))) is None
    with _Log() as log:
        assert _C.optim_(*optim_args("adamw_", _clone(args))) is NotImplemented
        functional.adamw_(*args[:8], beta1=0.9, beta2=0.999, eps=1e-8, backend="native")
    assert any("fastamp.optim_" in o for o in log.ops), log.ops
