"""The memory formats on DTensor params (FSDP2), on a one-rank mesh in this process (issue 22).

``state_format="q8"``:
Each rank's kernel quantises its local shard in blocks of 32 from the shard's first element;
q8 keeps the moments of a DTensor param whose shards start on the param's blocks (replicated,
or sharded on dim 0 with rows of a multiple of 32 elements) and gives the others fp32 moments
with a warning (``fastamp.optim.formats.moments.scale_shape``). On one rank the shard is the
whole param, so the run must equal the same optimizer over plain params bit for bit, random
bits included; ``tests/e2e/test_distributed.py`` runs two ranks against one process.

``master_weights="remainder"`` and ``"ulp8"``: the int16 remainders and int8 corrections are DTensors
sharded like the param; their conversions (to and from fp32 masters: a changed ``master_weights``, the
fp32 state dict) run per shard (``fastamp._dtensor.on_shards``), as their bit views do not shard.
"""

import pytest
import torch

from fastamp.optim import AdamW, Lion
from fastamp.optim.formats import moments

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

# (shape, placement, q8 on a DTensor): rows of 32 / 64 elements shard on dim 0; rows of 16 and a
# 1-D param sharded on dim 0 do not (fp32 moments); a replicated param of 400 (13 blocks, the last
# partial) does
PARAMS = [
    ((64, 32), Shard(0), True),
    ((8, 64), Shard(0), True),
    ((48, 16), Shard(0), False),
    ((4096,), Shard(0), False),
    ((40, 10), Replicate(), True),
]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{path}")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _pair(mesh, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(shape, generator=g).to(dtype) for shape, _, _ in PARAMS]
    plain = [torch.nn.Parameter(t.clone()) for t in base]
    sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [pl])) for t, (_, pl, _) in zip(base, PARAMS)]
    return plain, sharded


def _groups(params, q8_everywhere):
    """The q8 params in one group, the others in a second: q8 too where they fall back (DTensor), fp32 moments
    asked for (plain), so that both runs keep the same formats."""
    on = [p for p, (_, _, q) in zip(params, PARAMS) if q]
    off = [p for p, (_, _, q) in zip(params, PARAMS) if not q]
    return [{"params": on}, {"params": off, "state_format": "q8" if q8_everywhere else None}]


def _make(cls, params, q8_everywhere, second=None, **kw):
    """``second``: settings of the second group (the params q8 cannot shard) of this run only."""
    kw = {"lr": 1e-2, "state_format": "q8", "lowbit_min_numel": 0, "seed": 5, **kw}
    groups = _groups(params, q8_everywhere)
    groups[1].update(second or {})
    return cls(groups, **kw)


def _step(opts_params, step, mesh):
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(shape, generator=g).bfloat16() * (10.0 ** (step % 3 - 1)) for shape, _, _ in PARAMS]
    grads[1] = None if step % 2 else grads[1]  # one param misses every other step
    for opt, params, sharded in opts_params:
        for p, grad, (_, pl, _) in zip(params, grads, PARAMS):
            if grad is None:
                p.grad = None
            else:
                grad = grad.to(p.dtype)
                p.grad = distribute_tensor(grad.clone(), mesh, [pl]) if sharded else grad.clone()
        opt.step()


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_states_equal(o1, plain, o2, sharded):
    for p, q in zip(plain, sharded):
        assert torch.equal(p.detach(), _full(q.detach()))
        s1, s2 = o1.state[p], o2.state[q]
        assert set(s1) == set(s2)
        for k, v in s1.items():
            w = _full(s2[k])
            if k.endswith("_scale"):  # (rows, row / 32) on a DTensor sharded on dim 0: the same bytes
                w = w.reshape(-1)
            assert torch.equal(v, w), k


@pytest.mark.parametrize(
    "cls,kw",
    [
        (AdamW, {"master_weights": True}),
        (AdamW, {"master_weights": False, "stochastic_rounding": True}),
        (Lion, {"master_weights": True, "lr": 1e-3}),
    ],
    ids=["adamw-fp32-masters", "adamw-sr", "lion"],
)
def test_q8_on_one_rank_equals_plain_params_bit_for_bit_and_keeps_state_sharded_like_the_param(mesh, cls, kw):
    plain, sharded = _pair(mesh)
    o1 = _make(cls, plain, False, **kw)
    o2 = _make(cls, sharded, True, **kw)
    with pytest.warns(UserWarning, match=r"do not start on q8's blocks of 32 elements.*keeps fp32 moments"):
        _step([(o1, plain, False), (o2, sharded, True)], 0, mesh)
    for step in range(1, 5):
        _step([(o1, plain, False), (o2, sharded, True)], step, mesh)
    _assert_states_equal(o1, plain, o2, sharded)
    for q, (shape, pl, q8) in zip(sharded, PARAMS):
        st = o2.state[q]
        key = "exp_avg"
        if not q8:
            assert type(st[key]) is DTensor and st[key].dtype == torch.float32 and key + "_q" not in st
            continue
        codes, scales = st[key + "_q"], st[key + "_scale"]
        assert type(codes) is DTensor and codes.dtype == torch.uint8 and codes.shape == q.shape
        assert type(scales) is DTensor and scales.placements == q.placements == codes.placements
        assert tuple(scales.shape) == moments.scale_shape(q)
        rows = shape[0] if isinstance(pl, Shard) else None
        assert tuple(scales.shape) == ((rows, shape[1] // 32) if rows else (-(-40 * 10 // 32),))


def test_state_dicts_native_and_fp32_round_trip_and_format_switch_on_dtensor(mesh, tmp_path):
    plain, sharded = _pair(mesh)
    o1 = _make(AdamW, plain, False, master_weights=True)
    o2 = _make(AdamW, sharded, True, master_weights=True)
    with pytest.warns(UserWarning):
        for step in range(3):
            _step([(o1, plain, False), (o2, sharded, True)], step, mesh)

    # native: a new optimizer over the same params loads the DTensor state as it is, and goes on as the original
    again = _make(AdamW, sharded, True, master_weights=True)
    again.load_state_dict(o2.state_dict())
    for q in sharded:
        for k, v in o2.state[q].items():
            w = again.state[q][k]
            assert type(v) is type(w) and torch.equal(_full(v), _full(w)), k
            if isinstance(v, DTensor):
                assert v.placements == w.placements and w._local_tensor.data_ptr() != v._local_tensor.data_ptr()

    # a dict whose DTensors come in another sharding (as torch.distributed.checkpoint may hand them over):
    # copied into the params' sharding, the same values
    sd = o2.state_dict()  # (its state entries are the optimizer's own dicts, as torch's: copied before the edit)
    sd["state"] = {
        i: {k: v.redistribute(mesh, [Replicate()]) if isinstance(v, DTensor) else v for k, v in st.items()}
        for i, st in sd["state"].items()
    }
    other = _make(AdamW, sharded, True, master_weights=True)
    other.load_state_dict(sd)
    for q in sharded:
        for k, v in o2.state[q].items():
            w = other.state[q][k]
            assert torch.equal(_full(v), _full(w)), k
            if isinstance(v, DTensor) and k.endswith(("_q", "_scale")):
                assert w.placements == q.placements, k

    # fp32 export: torch's layout, each moment a DTensor like its param, equal to the plain run's export
    e1, e2 = o1.state_dict(format="fp32"), o2.state_dict(format="fp32")
    for i, q in enumerate(p for g in o2.param_groups for p in g["params"]):  # state dict order: group by group
        for key in ("exp_avg", "exp_avg_sq"):
            v = e2["state"][i][key]
            assert type(v) is DTensor and v.dtype == torch.float32 and v.placements == q.placements
            assert torch.equal(v.full_tensor(), e1["state"][i][key])
            assert key + "_q" not in e2["state"][i]

    # ... and loaded back: re-encoded to q8 at the next step, as the plain run loaded from its own export
    r1 = _make(AdamW, plain, False, master_weights=True)
    r1.load_state_dict(e1)
    r2 = _make(AdamW, sharded, True, master_weights=True)
    r2.load_state_dict(e2)
    with pytest.warns(UserWarning):
        _step([(r1, plain, False), (r2, sharded, True)], 3, mesh)
    _assert_states_equal(r1, plain, r2, sharded)

    # the group's state_format switched off: q8 moments decoded to fp32 DTensors, as for plain params
    for o in (r1, r2):
        o.param_groups[0]["state_format"] = None
    _step([(r1, plain, False), (r2, sharded, True)], 4, mesh)
    _assert_states_equal(r1, plain, r2, sharded)
    assert all(type(r2.state[q]["exp_avg"]) is DTensor and "exp_avg_q" not in r2.state[q] for q in sharded)


def test_plain_q8_state_into_dtensor_params_and_q8_codes_q8_cannot_shard_are_refused(mesh):
    plain, sharded = _pair(mesh)
    o1 = _make(AdamW, plain, False, master_weights=True)
    _step([(o1, plain, False)], 0, mesh)
    o2 = _make(AdamW, sharded, True, master_weights=True)
    with pytest.raises(ValueError, match=r"'exp_avg_q' must be a torch.uint8 DTensor of shape \(64, 32\)"):
        o2.load_state_dict(o1.state_dict())
    assert len(o2.state) == 0

    # q8 state on a DTensor param whose shards q8 cannot keep (rows of 16): refused at the step
    sd = o2.state_dict()
    assert sd["state"] == {}
    o3 = _make(AdamW, sharded, True, master_weights=True)
    q = sharded[2]
    q.grad = distribute_tensor(torch.ones(q.shape, dtype=q.dtype), mesh, [Shard(0)])
    bad = {
        "step": torch.zeros(()),
        "exp_avg_q": distribute_tensor(torch.zeros(q.shape, dtype=torch.uint8), mesh, [Shard(0)]),
    }
    bad["exp_avg_scale"] = distribute_tensor(torch.zeros(24, dtype=torch.uint8), mesh, [Shard(0)])
    bad["exp_avg_sq"] = torch.zeros_like(q, dtype=torch.float32)
    o3.state[q] = bad
    before = q.detach().full_tensor().clone()
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"holds q8 codes 'exp_avg_q', but its shards"):
        o3.step()
    assert torch.equal(q.detach().full_tensor(), before)


@pytest.mark.parametrize("master", ["remainder", "ulp8"])
def test_remainder_and_ulp8_masters_on_dtensor_equal_plain_params_through_exports_and_switches(mesh, master):
    plain, sharded = _pair(mesh)
    kw = {"master_weights": master}
    # with ulp8, the params q8 cannot shard get remainders and fp32 moments: the plain run asks for those
    second = {"master_weights": "remainder"} if master == "ulp8" else None
    o1 = _make(AdamW, plain, False, second, **kw)
    o2 = _make(AdamW, sharded, True, **kw)
    with pytest.warns(UserWarning, match="keeps fp32 moments"):
        for step in range(3):
            _step([(o1, plain, False), (o2, sharded, True)], step, mesh)
    _assert_states_equal(o1, plain, o2, sharded)
    key = "master_ulp8" if master == "ulp8" else "master_remainder"
    st = o2.state[sharded[0]]
    assert type(st[key]) is DTensor and st[key].placements == sharded[0].placements
    assert any(bool(_full(o2.state[q].get(key, torch.zeros(1))).ne(0).any()) for q in sharded)

    # fp32 export: the exact master (join / decode per shard), a DTensor like the param
    e1, e2 = o1.state_dict(format="fp32"), o2.state_dict(format="fp32")
    for i, _ in enumerate(p for g in o2.param_groups for p in g["params"]):
        m1, m2 = e1["state"][i]["master_param"], e2["state"][i]["master_param"]
        assert type(m2) is DTensor and m2.dtype == torch.float32 and torch.equal(m2.full_tensor(), m1)

    # ... loaded back into the same mode: split / encoded per shard again, and the runs go on equal
    r1, r2 = _make(AdamW, plain, False, second, **kw), _make(AdamW, sharded, True, **kw)
    r1.load_state_dict(e1)
    r2.load_state_dict(e2)
    with pytest.warns(UserWarning):
        _step([(r1, plain, False), (r2, sharded, True)], 3, mesh)
    _assert_states_equal(r1, plain, r2, sharded)

    # the group switched to fp32 masters: the masters are joined / decoded per shard
    for o in (r1, r2):
        for g in o.param_groups:
            g["master_weights"] = True
    _step([(r1, plain, False), (r2, sharded, True)], 4, mesh)
    _assert_states_equal(r1, plain, r2, sharded)
    assert all(type(r2.state[q]["master_param"]) is DTensor and key not in r2.state[q] for q in sharded)
