"""Gradient release's check-pass ops on native CUDA: unscale_check_partials_ and sumsq_fold (csrc/cuda/amp.cu).

Skipped without a CUDA device. The partials of each grad, written one grad per call in any order
into its own slots, folded in the order the CUDA launch plan numbers the chunks (dtype group by
dtype group: fp32, fp16, bf16; list order within one), must give ``unscale_check_``'s sum of
squares bit for bit, and the same found_inf. Release vs the ordinary loop on CUDA, over whole
training runs, is in tests/api/test_release.py.
"""

import math

import pytest
import torch
from helpers import assert_bits_equal, misaligned

from fastamp import _release
from fastamp.ops import registry

pytestmark = pytest.mark.gpu(reason="needs a CUDA device (CUDA kernels are compile-checked in test_cuda_compile.py)")

DEV = "cuda"
CHUNK = 65536
RANK = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# around the vector widths, the block, the 64K chunk; a prime well over two chunks
SIZES = [0, 1, 3, 7, 9, 257, 4093, 65535, 65536, 65537, 131073, 300007]


@pytest.fixture(autouse=True)
def _needs_the_kernels():
    if not registry.native_has_kernel("unscale_check_partials_", "cuda"):
        pytest.skip(f"fastamp._C has no CUDA kernel of unscale_check_partials_ (build: {registry.build_info()!r})")


def _grads(seed, n_tensors=40, nonfinite_at=None):
    """Many grads of mixed dtypes and odd sizes, dtypes interleaved in list order; some misaligned."""
    g = torch.Generator().manual_seed(seed)
    dtypes = list(RANK)
    out = []
    for i in range(n_tensors):
        n = SIZES[int(torch.randint(len(SIZES), (1,), generator=g))]
        dt = dtypes[(i * 7 + seed) % 3]
        x = (torch.randn(n, generator=g) * 30.0).to(dt).to(DEV)
        if i % 5 == 3:
            x = misaligned(x)
        out.append(x)
    if nonfinite_at is not None:
        i, pos, value = nonfinite_at
        out[i][pos] = value
    return out


def _layout(grads):
    """Each grad's slot count, and offsets in a layout unlike the launch order (reverse list order, gaps)."""
    counts = [-(-g.numel() // CHUNK) for g in grads]
    offsets = [0] * len(grads)
    at = 2
    for i in reversed(range(len(grads))):
        offsets[i] = at
        at += counts[i] + 1  # a gap slot after each grad: it must stay untouched
    return counts, offsets, at


def _plan_order(grads, counts, offsets):
    """The slots of the grads' partials in the order unscale_check_ numbers its chunks."""
    order = sorted(range(len(grads)), key=lambda i: (RANK[grads[i].dtype], i))
    return [offsets[i] + k for i in order for k in range(counts[i])]


def _ordinary(grads, inv):
    found = torch.zeros((), device=DEV)
    sumsq = torch.ops.fastamp.unscale_check_([g.clone() for g in grads], found, inv, False, True)
    return found, sumsq


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("inv_scale", [1.0, 2.0**-10, 3.0])
def test_partials_folded_in_plan_order_are_unscale_checks_sum_of_squares(seed, inv_scale):
    grads = _grads(seed)
    assert len({g.dtype for g in grads}) == 3 and any(-(-g.numel() // CHUNK) > 1 for g in grads)
    inv = torch.full((), inv_scale, device=DEV)
    want_found, want = _ordinary(grads, inv)
    counts, offsets, total = _layout(grads)
    index = _plan_order(grads, counts, offsets)
    # one grad per call, in reverse (as hooks run), then the whole list in one call: the same bits
    for calls in ([[i] for i in reversed(range(len(grads)))], [list(range(len(grads)))]):
        slots = torch.full((total,), math.nan, dtype=torch.float64, device=DEV)
        found = torch.zeros((), device=DEV)
        before = [g.clone() for g in grads]
        for call in calls:
            torch.ops.fastamp.unscale_check_partials_(
                [grads[i] for i in call], found, inv, slots, [offsets[i] for i in call]
            )
        for g, b in zip(grads, before):
            assert_bits_equal(g, b, "the grads are read only")
        got = torch.ops.fastamp.sumsq_fold(slots, torch.tensor(index, dtype=torch.int64, device=DEV))
        assert_bits_equal(got, want, f"{len(calls)} calls: folded partials")
        assert_bits_equal(found, want_found, f"{len(calls)} calls: found_inf")
        untouched = torch.ones(total, dtype=torch.bool)
        untouched[index] = False
        assert slots[untouched.to(DEV)].isnan().all(), "a slot outside the grads' partials was written"
    # another order of the same partials is another fold, not necessarily the same bits; list order (the CPU
    # kernel's) must differ from the plan's here, or the test would not tell them apart
    assert index != [offsets[i] + k for i in range(len(grads)) for k in range(counts[i])]


def test_the_release_layout_of_the_native_cuda_backend_folds_to_the_ordinary_sum():
    """_SumsqBackend('native', cuda): its counts, keys and sorted groups give unscale_check_'s order."""
    grads = _grads(5, n_tensors=24)
    inv = torch.full((), 0.5, device=DEV)
    want_found, want = _ordinary(grads, inv)
    impl = _release._SumsqBackend("native", torch.device(DEV))
    assert impl.sorted_groups
    counts = [impl.count(g.numel()) for g in grads]
    offsets = [sum(counts[:i]) for i in range(len(grads))]
    slots = torch.zeros(max(sum(counts), 1), dtype=torch.float64, device=DEV)
    found = torch.zeros((), device=DEV)
    for i in reversed(range(len(grads))):
        impl.partials_([grads[i]], found, inv, slots, [offsets[i]])
    groups: dict = {}
    for i, g in enumerate(grads):
        groups.setdefault(impl.group(impl.key(g)), []).append(i)
    index = [offsets[i] + k for _, members in sorted(groups.items()) for i in members for k in range(counts[i])]
    got = impl.fold(slots, torch.tensor(index, dtype=torch.int64, device=DEV), index)
    assert_bits_equal(got, want, "folded partials")
    assert_bits_equal(found, want_found, "found_inf")


@pytest.mark.parametrize("where", ["fp32 inf", "fp16 nan", "bf16 -inf", "unscale overflow"])
def test_partials_set_found_inf_as_unscale_check_does(where):
    dt, value, inv_scale = {
        "fp32 inf": (torch.float32, math.inf, 1.0),
        "fp16 nan": (torch.float16, math.nan, 1.0),
        "bf16 -inf": (torch.bfloat16, -math.inf, 1.0),
        "unscale overflow": (torch.float32, 3.0e38, 4.0),  # finite, overflows once unscaled
    }[where]
    grads = _grads(7, n_tensors=12)
    grads.insert(4, (torch.randn(CHUNK + 5) * 30.0).to(dt).to(DEV))
    grads[4][CHUNK + 1] = value  # in the grad's second chunk
    inv = torch.full((), inv_scale, device=DEV)
    want_found, want = _ordinary(grads, inv)
    assert float(want_found) == 1.0
    counts, offsets, total = _layout(grads)
    slots = torch.zeros(total, dtype=torch.float64, device=DEV)
    found = torch.zeros((), device=DEV)
    for k in reversed(range(len(grads))):
        torch.ops.fastamp.unscale_check_partials_([grads[k]], found, inv, slots, [offsets[k]])
    assert_bits_equal(found, want_found, where)
    index = torch.tensor(_plan_order(grads, counts, offsets), dtype=torch.int64, device=DEV)
    assert_bits_equal(torch.ops.fastamp.sumsq_fold(slots, index), want, f"{where}: the non-finite sum")


def test_the_ops_check_their_arguments_first_and_pass_opcheck():
    grads = [torch.randn(70000, device=DEV), torch.randn(3, device=DEV).half()]
    found, inv = torch.zeros((), device=DEV), torch.ones((), device=DEV)
    slots = torch.zeros(3, dtype=torch.float64, device=DEV)
    op, fold = torch.ops.fastamp.unscale_check_partials_, torch.ops.fastamp.sumsq_fold
    with pytest.raises(RuntimeError, match=r"offsets\[0\] = 2 leaves no room for the 2 partials of grads\[0\] in 3"):
        op(grads, found, inv, slots, [2, 0])
    with pytest.raises(RuntimeError, match=r"offsets\[1\] = -1 leaves no room"):
        op(grads, found, inv, slots, [0, -1])
    with pytest.raises(RuntimeError, match="offsets must have one entry per grad"):
        op(grads, found, inv, slots, [0])
    with pytest.raises(RuntimeError, match="partials must have dtype Double"):
        op(grads, found, inv, slots.float(), [0, 2])
    with pytest.raises(RuntimeError, match="partials must be a contiguous 1-D tensor"):
        op(grads, found, inv, torch.zeros(3, 2, dtype=torch.float64, device=DEV)[:, 0], [0, 2])
    with pytest.raises(RuntimeError, match="partials must be a CUDA tensor"):
        op(grads, found, inv, slots.cpu(), [0, 2])
    torch.cuda.synchronize()
    assert float(found) == 0.0 and not slots.any()  # refused before anything was written
    with pytest.raises(RuntimeError, match="index is on cpu but partials on cuda"):
        fold(slots, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="index must have dtype Long"):
        fold(slots, torch.tensor([0, 1], dtype=torch.int32, device=DEV))
    # out of range is read on the device: no host check, a NaN result
    assert math.isnan(float(fold(slots, torch.tensor([0, 3], device=DEV))))
    assert float(fold(slots, torch.tensor([], dtype=torch.int64, device=DEV))) == 0.0
    torch.library.opcheck(op, (grads, found, inv, slots, [0, 2]))
    torch.library.opcheck(fold, (slots, torch.tensor([2, 0, 1], device=DEV)))
