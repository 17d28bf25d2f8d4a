"""Tests of ``fastamp.compare`` (the fastamp-compare main job): data, models, measurement, a tiny run."""

import csv
import math
import os
import warnings

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_tiny_end_to_end_run_writes_table_csv_and_png(tmp_path, capfd):
    regimes = "fp32,torch-amp-fp16,fastamp-scaler-fp16,fastamp-fp16,fastamp-bf16-sr,pure-fp16"
    args = ["--device", "cpu", "--size", "tiny", "--steps", "4", "--regimes", regimes, "--out", str(tmp_path)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = compare.main(args + ["--no-progress", "--note", "a test run"])
    # pure-fp16 trips two guards (the optimizer hook cast_model(fp16) installed for the process sees
    # torch's AdamW step fp16 params with no scaler and no master): recorded per regime, not warned
    assert not [w for w in caught if issubclass(w.category, fastamp.AmpPitfallWarning)]
    out, err = capfd.readouterr()
    assert "profiler_start" not in err and "profiler_stop" not in err and "USDT" not in err, err
    assert (
        "## gpt" in out and "## cnn (" in out and "## cnn-raw12" in out and "CPU note" in out and "peak memory" in out
    )
    # the machine line: what the CPU offers low precision, read from the machine
    assert "- cpu_features: " in out and "AVX512-BF16 " in out and "AMX-FP16 " in out
    assert "torch CPU kernels: " + torch.backends.cpu.get_cpu_capability() in out
    assert "- note: a test run" in out
    assert "## Loss scale" in out and "| regime | scaler | skipped steps | skipped at step |" in out
    assert "## Pitfall guards" in out
    assert "fastamp-fp16 final val loss" in out and "pure-fp16 (plain .to(fp16), no master weights" in out
    assert "cast_model" in out and "largest BatchNorm running_var" in out
    assert len(rows) == 3 * 6  # --regimes given: cnn-raw12 runs them all too
    for r in rows:
        assert not r["error"], r
        assert r["peak_mem_bytes"] > 0 and math.isfinite(r["peak_mem_bytes"])
        if r["regime"] == "fp32":
            assert r["convergence_pct"] == "100.0%" and r["speed_vs_fp32"] == "1.00x"
        if r["regime"].endswith("fp16") and not r["regime"].startswith("pure"):
            assert isinstance(r["skipped_steps"], int) and r["final_scale"] != "-"
            assert len(r["skipped_at"].split()) == r["skipped_steps"]
        else:
            assert r["skipped_steps"] == "-" and r["skipped_at"] == "-"
        assert r["guards"] == ("fp16_without_scaler fp16_without_master" if r["regime"] == "pure-fp16" else ""), r
    # fastamp keeps fp16 params + fp32 masters; measured, so it can be compared with fp32.
    gpt = {r["regime"]: r for r in rows if r["model"] == "gpt"}
    assert gpt["pure-fp16"]["peak_mem_bytes"] < gpt["fp32"]["peak_mem_bytes"]
    with open(tmp_path / "compare-cpu-curves.csv", newline="") as f:
        curves = list(csv.DictReader(f))
    assert len(curves) == 3 * 6 * 4
    assert {c["skipped"] for c in curves if c["regime"] == "fp32"} == {""}
    assert {c["skipped"] for c in curves if c["regime"] == "torch-amp-fp16"} <= {"0", "1"}
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


def _scaled_run(model_name, regime, steps=10, growth_interval=2):
    dev = torch.device("cpu")
    torch.manual_seed(0)
    if model_name == "gpt":
        data = compare.TextData(16, 4, dev)
        base = compare.TinyGPT(len(data.vocab), 16, 1, 16, 2)
    else:
        data = compare.ImageData(12, 8, dev, bits=12)
        base = compare.SmallCNN(4)
    return compare.train_regime(
        model_name, regime, base, data, dev, steps, 3e-3, 1.0, measure_memory=False, growth_interval=growth_interval
    )


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["gpt", "cnn-raw12"])
def test_loss_scale_moves_and_the_drop_in_scaler_follows_torch_exactly(model_name):
    torch_run = _scaled_run(model_name, "torch-amp-fp16")
    ours = _scaled_run(model_name, "fastamp-scaler-fp16")
    for r in (torch_run, ours):
        backoffs, growths = compare.scale_moves(r)
        assert backoffs >= 1 and growths >= 2, (r.regime, r.scales)
        assert r.init_scale == 2.0**16 and len(r.scales) == 10
        # every skipped step is a backoff (x0.5) and the optimizer's counter agrees with the list
        assert len(r.skipped_at) == backoffs == r.skipped_steps
        effect = [r.init_scale] + r.scales
        assert all(effect[i + 1] == effect[i] / 2 for i in r.skipped_at)
        assert all(effect[i + 1] in (effect[i], 2 * effect[i]) for i in range(10) if i not in r.skipped_at)
    # only the scaler differs: the same scales, skipped steps and losses, bit for bit
    assert ours.scales == torch_run.scales
    assert ours.skipped_at == torch_run.skipped_at
    assert ours.losses == torch_run.losses
    assert compare.scale_trajectories_match([torch_run, ours]) == {
        (model_name, "fastamp-scaler-fp16", "torch-amp-fp16"): True
    }
    lines = compare.scale_lines([torch_run, ours], 2)
    assert any("identical at all 10 steps" in v and "as required" in v for v in lines)


def test_growth_interval_reaches_every_scaler():
    for regime in ("torch-amp-fp16", "fastamp-scaler-fp16", "fastamp-fp16", "half-fp16-fastamp"):
        _, scaler, _, _ = compare.build_regime(regime, compare.SmallCNN(4), 1e-3, torch.device("cpu"), 7)
        assert scaler.get_growth_interval() == 7 and scaler.get_scale() == 2.0**16, regime
    assert isinstance(
        compare.build_regime("fastamp-scaler-fp16", compare.SmallCNN(4), 1e-3, torch.device("cpu"))[1], fastamp.Scaler
    )
    assert "fastamp-scaler-fp16" in compare.MODEL_REGIMES["gpt"] and "torch-amp-fp16" in compare.MODEL_REGIMES["gpt"]
    assert compare.SIZES["small"]["growth_interval"] < compare.SIZES["small"]["steps"] // 4
    with pytest.raises(SystemExit, match="--growth-interval must be >= 0"):
        compare.main(["--growth-interval", "-1", "--device", "cpu"])


def test_scale_report_flags_a_drop_in_mismatch():
    R = compare.RegimeResult
    a = R("m", "torch-amp-fp16", init_scale=4.0, scales=[8.0, 4.0, 8.0], skipped_at=[1], losses=[1.0, 1.0, 1.0])
    b = R("m", "fastamp-scaler-fp16", init_scale=4.0, scales=[8.0, 8.0, 4.0], skipped_at=[2], losses=[1.0, 1.0, 2.0])
    c = R("m", "fastamp-fp16", init_scale=4.0, scales=[8.0, 4.0, 8.0], skipped_at=[1], losses=[1.0, 1.5, 1.0])
    assert compare.scale_moves(a) == (1, 2)
    assert compare.scale_trajectories_match([a, b, c]) == {("m", "fastamp-scaler-fp16", "torch-amp-fp16"): False}
    lines = compare.scale_lines([a, b, c], 1)
    bad = [v for v in lines if "fastamp-scaler-fp16 vs torch-amp-fp16" in v]
    assert len(bad) == 1 and "EXPECTED IDENTICAL" in bad[0] and "first 1 of 3 steps" in bad[0]
    assert "skipped steps differ: fastamp-scaler-fp16 2, torch-amp-fp16 1" in bad[0]
    ok = [v for v in lines if "fastamp-fp16 vs torch-amp-fp16" in v]
    assert len(ok) == 1 and "identical at all 3 steps" in ok[0] and "not required" in ok[0]
    assert any("| torch-amp-fp16 | torch.amp.GradScaler | 1 | 1 | 1 | 2 | 2^2 - 2^3 | 2^3 |" in v for v in lines)


def test_pitfall_warnings_are_recorded_by_key_and_other_warnings_pass():
    fired = []
    with pytest.warns(UserWarning, match="an ordinary warning"):
        with compare.pitfalls_recorded(fired):
            warnings.warn("fastamp [norm_in_low_precision]: BatchNorm in fp16", fastamp.AmpPitfallWarning, stacklevel=1)
            warnings.warn("fastamp [norm_in_low_precision]: again", fastamp.AmpPitfallWarning, stacklevel=1)
            warnings.warn("fastamp [scale_collapse]: below 1", fastamp.AmpPitfallWarning, stacklevel=1)
            warnings.warn("an ordinary warning", UserWarning, stacklevel=1)
    assert fired == ["norm_in_low_precision", "scale_collapse"]
    lines = compare.guard_lines([compare.RegimeResult("m", "pure-fp16", guards=fired), compare.RegimeResult("m", "x")])
    assert "- m/pure-fp16: `norm_in_low_precision`, `scale_collapse`" in lines
    assert any(v.startswith("- `scale_collapse`: the loss scale fell below 1") for v in lines)
    assert compare.guard_lines([compare.RegimeResult("m", "x")]) == [
        "No fastamp pitfall guard (AmpPitfallWarning) fired in any regime."
    ]


def test_profiler_lines_are_held_back_and_the_rest_passes(capfd):
    from fastamp.compare.memory import _profiler_noise_filtered

    with _profiler_noise_filtered():
        os.write(2, b"USDT:2026-12-01 08:27:48 6174:6174 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"something else went wrong\n")
        os.write(2, b"USDT:2026-12-01 08:27:48 6174:6174 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    meter = compare.CpuPeakMeter()
    meter.measure(lambda: torch.ones(100).sum())  # the real profiler, started and stopped
    err = capfd.readouterr().err
    assert err == "something else went wrong\n", err


def test_cpu_features_are_read_from_the_flags():
    feats = compare.cpu_features({"fpu", "avx2", "avx512f", "avx512_bf16"})
    assert feats == {
        "AMX": False,
        "AMX-BF16": False,
        "AMX-FP16": False,
        "AVX512-BF16": True,
        "AVX512-FP16": False,
        "AVX-512": True,
        "AVX2": True,
    }
    line = compare.cpu_features_line({"avx2", "amx_tile", "amx_bf16", "amx_fp16", "avx512_fp16"})
    assert "AMX yes" in line and "AMX-FP16 yes" in line and "AVX512-BF16 no" in line and "AVX-512 no" in line
    assert compare.cpu_features_line(set()).endswith("torch CPU kernels: " + torch.backends.cpu.get_cpu_capability())
    if os.path.exists("/proc/cpuinfo"):
        assert compare.cpu_flags() and all(isinstance(v, bool) for v in compare.cpu_features().values())
    assert compare.cpu_flags("/nonexistent/cpuinfo") is None
    note = compare.cpu_speed_note([], {"AVX512-BF16": True, "AMX-BF16": False})
    assert "(here: AVX512-BF16 yes, AMX-BF16 no)" in note and "no speed measured" in note
