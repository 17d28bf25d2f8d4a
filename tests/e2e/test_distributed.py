"""fastamp.Scaler(process_group=...) on torch.distributed: 2 gloo ranks on CPU.

One subprocess (``tests/e2e/_dist/worker.py``) spawns the 2 ranks, runs every scenario and the
single-process references, and saves the results; the tests here compare them. Scenarios:
DDP (overflow on rank 1 only, after the all-reduce and in the input), a no-group control,
ZeRO-style sharding (fastamp AdamW; torch SGD with an active global clip), a rank without
grads, dyadic grads for an exact norm, and FSDP2 (``fully_shard``) with torch AdamW and with
fastamp's AdamW (fp32 params; bf16 params with fp32 masters, int16 remainders, or ulp8
corrections beside q8 moments, all sharded like them).
"""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_dist"))
import worker  # noqa: E402
from tolerances import SUMSQ_RTOL  # noqa: E402

import fastamp  # noqa: E402

# slow: the tests share one ~35 s subprocess run of every scenario (the fixture below)
pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, worker.__file__, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loaded = {name: torch.load(out / f"{name}.pt", weights_only=False) for name in ("rank0", "rank1", "reference")}
    for who, scenarios in loaded.items():
        for name, res in scenarios.items():
            assert "error" not in res, f"{who}/{name} failed:\n{res['error']}"
    return loaded


def _bits_equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _skips(res):
    return {i for i, s in enumerate(res["skipped"]) if s}


# ----------------------------------------------------------------------------- (a) DDP


def test_ddp_overflow_on_one_rank_skips_on_both(results):
    r0, r1 = results["rank0"]["ddp"], results["rank1"]["ddp"]
    expected = set(worker.INJECT_AFTER_REDUCE) | set(worker.INJECT_IN_INPUT)
    assert _skips(r0) == expected
    assert _skips(r1) == expected
    assert r0["scales"] == r1["scales"]
    assert all(math.isfinite(s) and s > 0 for s in r0["scales"])


def test_ddp_params_bit_identical_across_ranks_and_to_one_process(results):
    r0, r1, ref = results["rank0"]["ddp"], results["rank1"]["ddp"], results["reference"]["ddp"]
    assert _bits_equal(r0["params"], r1["params"])
    # One process, the global batch as the ranks' two micro-batches, grads summed then halved
    # (DDP's reduction; halving is exact): bit for bit, scale trajectory included.
    assert _bits_equal(r0["params"], ref["params"])
    assert r0["scales"] == ref["scales"]
    assert _skips(ref) == _skips(r0)


def test_ddp_vs_one_forward_over_the_global_batch_is_close_not_bitwise(results):
    # One forward of all 8 rows sums the batch inside one matmul backward: another summation
    # order than (rows 0-3) + (rows 4-7), so the grads differ in the last bits.
    r0, ref = results["rank0"]["ddp"], results["reference"]["ddp"]
    for a, b in zip(r0["params"], ref["full_batch_params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_without_process_group_an_after_reduce_overflow_splits_the_ranks(results):
    """Control: why the group matters. Rank 1 skips, rank 0 steps; scales and params diverge."""
    r0, r1 = results["rank0"]["ddp_no_group"], results["rank1"]["ddp_no_group"]
    assert _skips(r0) == set()
    assert _skips(r1) == {worker.CONTROL_INJECT}
    assert r0["scales"] != r1["scales"]
    assert not _bits_equal(r0["params"], r1["params"])


# ----------------------------------------------------------------------------- (b) ZeRO-style


@pytest.mark.parametrize("name", ["sharded_adamw", "sharded_sgd_clip"])
def test_sharded_overflow_on_one_shard_skips_on_every_rank(results, name):
    r0, r1, ref = results["rank0"][name], results["rank1"][name], results["reference"][name]
    expected = set(worker.SHARDED_INJECT)  # the victim alternates between rank 0 and rank 1
    assert {s % worker.WORLD for s in expected} == {0, 1}
    assert _skips(r0) == _skips(r1) == _skips(ref) == expected
    assert r0["scales"] == r1["scales"] == ref["scales"]
    assert _bits_equal(r0["params"], r1["params"])


@pytest.mark.parametrize("name", ["sharded_adamw", "sharded_sgd_clip"])
def test_sharded_global_norm_matches_one_process(results, name):
    r0, r1, ref = results["rank0"][name], results["rank1"][name], results["reference"][name]
    # identical on both ranks, bit for bit (NaN where a NaN was injected)
    assert torch.equal(r0["norms"].nan_to_num(-1.0), r1["norms"].nan_to_num(-1.0))
    assert torch.equal(r0["norms"].isnan(), ref["norms"].isnan())
    fin = torch.isfinite(ref["norms"])
    assert int(fin.sum()) >= worker.STEPS - len(worker.SHARDED_INJECT)
    # each rank's partial sum of squares is rounded to fp32 before the sum: a last-bit difference
    torch.testing.assert_close(r0["norms"][fin], ref["norms"][fin], rtol=SUMSQ_RTOL, atol=0)


def test_sharded_without_clipping_is_bit_identical_to_one_process(results):
    r0, ref = results["rank0"]["sharded_adamw"], results["reference"]["sharded_adamw"]
    assert _bits_equal(r0["params"], ref["params"])


def test_sharded_with_active_clipping_is_close_to_one_process(results):
    # The clip coefficient comes from the norm above (last-bit differences), so the params
    # agree to a few fp32 ulps, not bit for bit; the clip really was active.
    r0, ref = results["rank0"]["sharded_sgd_clip"], results["reference"]["sharded_sgd_clip"]
    fin = torch.isfinite(ref["norms"])
    assert bool((ref["norms"][fin] > 0.05).any())
    for a, b in zip(r0["params"], ref["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sharded_norm_exact_on_dyadic_grads(results):
    # the correctly rounded root of the exact sum of squares, computed without torch: the
    # same bits on every CPU (torch's own fp32 sqrt is not correctly rounded, by vendor)
    for r in ("rank0", "rank1"):
        res = results[r]["exact_norm"]
        got, want = res["norms"], res["expected"]
        assert got.shape == (worker.EXACT_NORM_CASES,) and got.dtype == torch.float32
        bad = (got != want).nonzero().flatten().tolist()
        assert not bad, (
            f"{r}: {len(bad)} of {got.numel()} norms differ, e.g. case {bad[0]}: {got[bad[0]]!r} vs {want[bad[0]]!r}"
        )


def test_rank_without_grads_joins_and_skips(results):
    for r in ("rank0", "rank1"):
        res = results[r]["no_grad_rank"]
        assert res["skipped"] is True
        assert res["scale"] == 2.0**9
        assert res["norm_finite"] is False


# ----------------------------------------------------------------------------- FSDP2


def test_fsdp2_fully_shard_with_fastamp_scaler(results):
    r0, r1, ref = results["rank0"]["fsdp2"], results["rank1"]["fsdp2"], results["reference"]["fsdp2"]
    assert _skips(r0) == _skips(r1) == _skips(ref) == set(worker.INJECT_AFTER_REDUCE)
    assert r0["scales"] == r1["scales"] == ref["scales"]
    assert _bits_equal(r0["params"], r1["params"])
    # FSDP2 reduce-scatters (g0 + g1) / 2 per shard, torch AdamW is elementwise, no clip is
    # active: bit-identical to one process. The norms differ in the last bit (partial sums).
    assert _bits_equal(r0["params"], ref["params"])
    fin = torch.isfinite(ref["norms"])
    torch.testing.assert_close(r0["norms"][fin], ref["norms"][fin], rtol=SUMSQ_RTOL, atol=0)


@pytest.mark.parametrize("name", ["fsdp2_fastamp", "fsdp2_fastamp_bf16"])
def test_fsdp2_fully_shard_with_fastamp_adamw(results, name):
    """fastamp.optim.AdamW on FSDP2's DTensor params: fp32 params, and bf16 params with fp32 masters."""
    r0, r1, ref = results["rank0"][name], results["rank1"][name], results["reference"][name]
    assert _skips(r0) == _skips(r1) == _skips(ref) == set(worker.INJECT_AFTER_REDUCE)
    assert r0["scales"] == r1["scales"] == ref["scales"]
    # AdamW is elementwise: each rank updates its shard exactly as one process updates the whole
    assert _bits_equal(r0["params"], r1["params"]) and _bits_equal(r0["params"], ref["params"])
    assert _bits_equal(r0["masters"], ref["masters"]) and len(r0["masters"]) == (4 if "bf16" in name else 0)
    # state is sharded like the param (a DTensor whose local shard has the param's local shape)
    local = r0["param_local_shape"]
    assert local[0] * worker.WORLD == r0["params"][0].shape[0]
    for key, (kind, dtype, shape) in r0["state"].items():
        if key == "step":
            assert kind == "Tensor"
        else:
            assert (kind, dtype, shape) == ("DTensor", torch.float32, local), key
    assert r0["reload_equal"] and r1["reload_equal"]


def test_fsdp2_q8_moments_are_sharded_like_the_param_and_bit_identical_to_one_process(results):
    """state_format="q8" (rounded to nearest) on FSDP2: each rank quantises its shard in the param's own blocks."""
    name = "fsdp2_fastamp_q8"
    r0, r1, ref = results["rank0"][name], results["rank1"][name], results["reference"][name]
    assert _skips(r0) == _skips(r1) == _skips(ref) == set(worker.INJECT_AFTER_REDUCE)
    assert r0["scales"] == r1["scales"] == ref["scales"]
    # model[2].weight's shards (4 rows of 32 each) are blocks of the whole param: the same codes and
    # scales as one process, so the same params and masters, bit for bit
    assert _bits_equal(r0["params"], r1["params"]) and _bits_equal(r0["params"], ref["params"])
    assert _bits_equal(r0["masters"], ref["masters"]) and len(r0["masters"]) == 4
    for r in (r0, r1):
        local, placements = r["q8_param"]
        assert local == (4, 32) and placements == ("Shard(0)",)
        assert r["q8_state"] == {
            "exp_avg_q": ("DTensor", torch.uint8, (4, 32), (8, 32), placements),
            "exp_avg_scale": ("DTensor", torch.uint8, (4, 1), (8, 1), placements),
            "exp_avg_sq_q": ("DTensor", torch.uint8, (4, 32), (8, 32), placements),
            "exp_avg_sq_scale": ("DTensor", torch.uint8, (4, 1), (8, 1), placements),
            "master_param": ("DTensor", torch.float32, (4, 32), (8, 32), placements),
        }
        # the other params (rows of 16, 1-D) keep fp32 moments, said once
        assert all(
            kind == "DTensor" and dtype == torch.float32 for k, (kind, dtype, _) in r["state"].items() if k != "step"
        )
        assert len(r["warnings"]) == 1 and "do not start on q8's blocks of 32 elements" in r["warnings"][0]
        assert r["reload_equal"]


@pytest.mark.parametrize("name", ["fsdp2_fastamp_remainder", "fsdp2_fastamp_ulp8"])
def test_fsdp2_remainder_and_ulp8_masters_are_sharded_and_bit_identical_to_one_process(results, name):
    """bf16 params with int16 remainders (exact masters), and with ulp8 corrections beside q8 moments (rounded
    to nearest; the params q8 cannot shard get remainders and fp32 moments, as one process asked for)."""
    r0, r1, ref = results["rank0"][name], results["rank1"][name], results["reference"][name]
    assert _skips(r0) == _skips(r1) == _skips(ref) == set(worker.INJECT_AFTER_REDUCE)
    assert r0["scales"] == r1["scales"] == ref["scales"]
    assert _bits_equal(r0["params"], r1["params"]) and _bits_equal(r0["params"], ref["params"])
    want = (
        ["master_remainder"] * 4
        if name.endswith("remainder")
        else ["master_remainder"] * 2 + ["master_ulp8"] + ["master_remainder"]
    )
    for r in (r0, ref):
        assert [k for k, _ in r["master_states"]] == want
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(r0["master_states"], ref["master_states"]))
    # the masters moved (a remainder or correction other than 0 somewhere), and are sharded like their param
    assert any(bool(t.ne(0).any()) for _, t in r0["master_states"])
    local = r0["param_local_shape"]
    kind, dtype, shape = r0["state"]["master_remainder"]
    assert (kind, dtype, shape) == ("DTensor", torch.int16, local)
    if name.endswith("ulp8"):
        assert r0["q8_state"]["master_ulp8"][:3] == ("DTensor", torch.int8, (4, 32))
    assert r0["reload_equal"] and r1["reload_equal"]
    # the optimizer's own writes to the shards are not taken for writes from outside (no re-sync warning)
    assert not [w for w in r0["warnings"] + r1["warnings"] if "written outside the optimizer" in w]


# ----------------------------------------------------------------------------- in-process


def test_process_group_validation():
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup"):
        fastamp.Scaler(process_group="world")
    with pytest.raises(ValueError, match="sharded=True needs a process_group"):
        fastamp.Scaler(sharded=True)
    with pytest.raises(TypeError, match="sharded must be a bool"):
        fastamp.Scaler(sharded="yes")
