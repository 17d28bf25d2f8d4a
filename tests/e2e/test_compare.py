"""Tests of ``fastamp.compare`` (the fastamp-compare main job): data, models, measurement, a tiny run."""

import csv
import math

import pytest
import torch
import torch.nn as nn

import fastamp
from fastamp import compare
from fastamp.optim import AdamW as FastAdamW


def test_synthetic_text_is_deterministic_and_structured():
    a, b = compare.synthetic_text(5000, seed=1), compare.synthetic_text(5000, seed=1)
    assert a == b and len(a) == 5000
    assert a != compare.synthetic_text(5000, seed=2)
    # agreement and arithmetic the model can learn
    assert " plus " in a and " is " in a
    for sent in a.split(". ")[:-1]:
        words = sent.split()
        if "plus" in words:
            x, y = compare._NUMBERS.index(words[0]), compare._NUMBERS.index(words[2])
            assert words[4].rstrip(".") == str(x + y)


def test_text_and_image_batches_are_deterministic_per_step():
    td = compare.TextData(16, 4, torch.device("cpu"))
    x1, y1 = td.train_batch(3)
    x2, y2 = td.train_batch(3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # next-token targets
    assert not torch.equal(td.train_batch(4)[0], x1)
    imd = compare.ImageData(12, 5, torch.device("cpu"))
    xi, yi = imd.train_batch(0)
    assert xi.shape == (5, 3, 12, 12) and yi.shape == (5,)
    assert torch.equal(xi, imd.train_batch(0)[0])
    raw = compare.ImageData(12, 64, torch.device("cpu"), bits=12).train_batch(0)[0]
    assert torch.equal(raw, raw.round()) and raw.min() >= 0 and raw.max() <= 4095
    assert 500 < raw.std() < 1500  # a conv over it has a variance far above fp16's 65504


def test_cnn_raw12_runs_the_batchnorm_regimes_unless_told_otherwise(tmp_path):
    args = ["--device", "cpu", "--size", "tiny", "--steps", "4", "--model", "cnn-raw12", "--out", str(tmp_path)]
    rows = compare.main(args + ["--no-progress", "--no-plot"])
    assert [r["regime"] for r in rows] == list(compare.BN_DEMO_REGIMES)
    rows = compare.main(args + ["--no-progress", "--no-plot", "--regimes", "fp32,fastamp-bf16"])
    assert [r["regime"] for r in rows] == ["fp32", "fastamp-bf16"]


def _norm_dtypes(model):
    norms = (nn.BatchNorm2d, nn.LayerNorm)
    kept = {p.dtype for m in model.modules() if isinstance(m, norms) for p in m.parameters(recurse=False)}
    kept |= {b.dtype for m in model.modules() if isinstance(m, norms) for b in m.buffers(recurse=False)}
    kept.discard(torch.long)  # num_batches_tracked
    other = {p.dtype for m in model.modules() if not isinstance(m, norms) for p in m.parameters(recurse=False)}
    return kept, other


@pytest.mark.parametrize(
    "regime, norm_dtype, other_dtype",
    [
        ("fastamp-fp16", torch.float32, torch.float16),  # cast_model keeps BatchNorm fp32
        ("fastamp-bf16-sr", torch.float32, torch.bfloat16),
        ("half-fp16-fastamp", torch.float16, torch.float16),  # model.half(): BatchNorm in fp16 too
        ("pure-fp16", torch.float16, torch.float16),
        ("torch-amp-fp16", torch.float32, torch.float32),
    ],
)
def test_regimes_cast_the_cnn_as_described(regime, norm_dtype, other_dtype):
    model = compare.SmallCNN(4)
    opt, scaler, autocast_dtype, in_dtype = compare.build_regime(regime, model, 1e-3, torch.device("cpu"))
    assert _norm_dtypes(model) == ({norm_dtype}, {other_dtype})
    assert (scaler is not None) == (regime in ("fastamp-fp16", "half-fp16-fastamp", "torch-amp-fp16"))
    assert isinstance(scaler, fastamp.Scaler) == regime.endswith(("fastamp", "fastamp-fp16"))
    assert (in_dtype is not None) == regime.startswith("pure")
    assert (autocast_dtype is None) == regime.startswith("pure")
    assert isinstance(opt, FastAdamW) == ("fastamp" in regime)


@pytest.mark.parametrize(
    "regime, state",
    [
        ("fastamp-bf16", {"master_param": torch.float32, "exp_avg": torch.float32}),
        ("fastamp-bf16-remainder", {"master_remainder": torch.int16, "exp_avg": torch.float32}),
        ("fastamp-bf16-sr", {"rng": torch.int64, "exp_avg": torch.float32}),
        ("fastamp-bf16-10B", {"master_remainder": torch.int16, "rng": torch.int64, "exp_avg": torch.bfloat16}),
    ],
)
def test_low_bit_rows_use_the_optimizer_state_they_name(regime, state):
    model = compare.TinyGPT(10, 8, 1, 16, 2)
    opt, scaler, autocast_dtype, _ = compare.build_regime(regime, model, 1e-3, torch.device("cpu"))
    assert scaler is None and autocast_dtype == torch.bfloat16
    model.head.weight.grad = torch.ones_like(model.head.weight)
    opt.step()
    st = opt.state[model.head.weight]
    for key, dt in state.items():
        assert st[key].dtype == dt, (key, st[key].dtype)
    masters = {"master_param", "master_remainder"} - set(state)
    assert not masters & set(st), set(st)


def test_bn_running_var_max_sees_an_overflow():
    model = compare.SmallCNN(4)
    assert compare.bn_running_var_max(compare.TinyGPT(10, 8, 1, 16, 2)) is None
    assert compare.bn_running_var_max(model) == 1.0
    model.half()
    model.net[1].running_var[0] = float("inf")
    assert compare.bn_running_var_max(model) == float("inf")


def test_live_bytes_counts_each_storage_once():
    t = torch.zeros(1000)
    view = t[10:20]
    assert compare.live_bytes(t, view, [t]) == 4000
    p = nn.Parameter(torch.zeros(100))
    p.grad = torch.zeros(100)
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(100)
    opt.step()
    # param + grad + exp_avg + exp_avg_sq (+ the 0-dim step counter)
    assert compare.live_bytes(p, opt) == 4 * 400 + opt.state[p]["step"].untyped_storage().nbytes()


def test_cpu_peak_meter_sees_temporaries():
    keep = torch.zeros(1000)
    meter = compare.CpuPeakMeter()

    def step():
        tmp = torch.ones(250_000)  # 1 MB, freed before the step returns
        return float(tmp.sum())

    meter.measure(step, keep)
    assert 4000 + 1_000_000 <= meter.peak < 4000 + 1_000_000 + 200_000


@pytest.mark.parametrize("kind", ["torch", "fastamp"])
def test_skipped_steps_are_counted_from_the_optimizer_step(kind):
    if kind == "torch":
        p = nn.Parameter(torch.ones(8))
        opt = torch.optim.AdamW([p], fused=True)
        scaler = torch.amp.GradScaler("cpu")
    else:
        p = nn.Parameter(torch.ones(8, dtype=torch.float16))
        opt = FastAdamW([p])
        scaler = fastamp.Scaler("cpu")
    scaler.scale(torch.ones(()))
    before = p.detach().clone()
    for i in range(3):
        p.grad = torch.full_like(p, float("inf") if i == 1 else 1.0)
        scaler.step(opt)
        scaler.update()
    assert 3 - compare._step_count(opt) == 1
    assert scaler.get_scale() == 2.0**15
    assert not torch.equal(p.detach(), before)


def test_lr_schedule_warms_up_and_decays():
    lrs = [compare._lr_at(s, 100, 1.0) for s in range(100)]
    assert lrs[0] < lrs[4] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1, abs=0.01)
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:]))


def test_same_regime_twice_is_bit_identical():
    data = compare.TextData(16, 4, torch.device("cpu"))
    torch.manual_seed(0)
    base = compare.TinyGPT(len(data.vocab), 16, 1, 16, 2)
    r1 = compare.train_regime(
        "gpt", "fastamp-bf16", base, data, torch.device("cpu"), 5, 3e-3, 1.0, measure_memory=False
    )
    r2 = compare.train_regime(
        "gpt", "fastamp-bf16", base, data, torch.device("cpu"), 5, 3e-3, 1.0, measure_memory=False
    )
    assert r1.losses == r2.losses and len(r1.losses) == 5
    assert r1.losses[-1] < r1.losses[0]


def test_tiny_end_to_end_run_writes_table_csv_and_png(tmp_path, capsys):
    regimes = "fp32,torch-amp-fp16,fastamp-fp16,fastamp-bf16-sr,pure-bf16"
    rows = compare.main(
        [
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--steps",
            "4",
            "--regimes",
            regimes,
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert (
        "## gpt" in out and "## cnn (" in out and "## cnn-raw12" in out and "CPU note" in out and "peak memory" in out
    )
    assert "fastamp-fp16 final val loss" in out and "pure-bf16 (plain .to(bf16), no master weights" in out
    assert "cast_model" in out and "largest BatchNorm running_var" in out
    assert len(rows) == 3 * 5  # --regimes given: cnn-raw12 runs them all too
    for r in rows:
        assert not r["error"], r
        assert r["peak_mem_bytes"] > 0 and math.isfinite(r["peak_mem_bytes"])
        if r["regime"] == "fp32":
            assert r["convergence_pct"] == "100.0%" and r["speed_vs_fp32"] == "1.00x"
        if r["regime"].endswith("fp16") and not r["regime"].startswith("pure"):
            assert isinstance(r["skipped_steps"], int) and r["final_scale"] != "-"
        else:
            assert r["skipped_steps"] == "-"
    # fastamp keeps fp16 params + fp32 masters; measured, so it can be compared with fp32.
    gpt = {r["regime"]: r for r in rows if r["model"] == "gpt"}
    assert gpt["pure-bf16"]["peak_mem_bytes"] < gpt["fp32"]["peak_mem_bytes"]
    with open(tmp_path / "compare-cpu-curves.csv", newline="") as f:
        curves = list(csv.DictReader(f))
    assert len(curves) == 3 * 5 * 4
    png = tmp_path / "compare-cpu.png"
    assert png.exists() and png.stat().st_size > 20_000


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit, match="unknown regime 'fp8'"):
        compare.main(["--regimes", "fp8", "--device", "cpu"])
    with pytest.raises(SystemExit, match="unknown --model"):
        compare.main(["--model", "resnet", "--device", "cpu"])
    with pytest.raises(SystemExit, match="at least 4"):
        compare.main(["--steps", "2", "--device", "cpu"])


def test_verdicts_flag_divergence_and_tolerance():
    R = compare.RegimeResult
    res = [
        R("m", "fp32", initial_loss=4.0, final_loss=2.0),
        R("m", "torch-amp-fp16", initial_loss=4.0, final_loss=2.0),
        R("m", "fastamp-fp16", initial_loss=4.0, final_loss=2.2),
        R("m", "torch-amp-bf16", initial_loss=4.0, final_loss=2.0),
        R("m", "fastamp-bf16", initial_loss=4.0, final_loss=2.01, losses=[4.0, 3.0, 2.4]),
        R("m", "fastamp-bf16-remainder", initial_loss=4.0, final_loss=2.01, losses=[4.0, 3.0, 2.5]),
        R("m", "pure-fp16", initial_loss=4.0, final_loss=float("nan"), nonfinite_losses=7, losses=[4.0, 3.0, math.nan]),
        R("m", "pure-bf16", initial_loss=4.0, final_loss=3.5),
    ]
    compare.summarise(res)
    lines = compare.verdicts(res)
    assert any("fastamp-fp16" in v and "OUTSIDE" in v for v in lines)
    assert any("fastamp-bf16" in v and "within" in v for v in lines)
    assert any("pure-fp16" in v and "diverged (7" in v and "first at step 2" in v for v in lines)
    assert any("bit-identical for 2 of 3 steps" in v for v in lines)
    assert not any("norm layers in fp16" in v for v in lines)
    res += [R("m", "half-fp16-fastamp", initial_loss=4.0, final_loss=2.21)]
    assert any("trained as well as cast_model" in v and "pure-fp16's failure" in v for v in compare.verdicts(res))
    res[-1] = R("m", "half-fp16-fastamp", initial_loss=4.0, final_loss=2.3)
    broke = [v for v in compare.verdicts(res) if "broke the model" in v]
    assert len(broke) == 1 and "running statistics" not in broke[0]
    res[-1] = R("m", "half-fp16-fastamp", initial_loss=4.0, final_loss=2.3, bn_var_max=math.inf)
    assert any(
        "broke the model" in v and "running statistics that evaluation uses overflowed" in v
        for v in compare.verdicts(res)
    )
    assert any("pure-bf16" in v and "stalls at 25.0%" in v for v in lines)
