"""Tests of ``fastamp.compare`` (the fastamp-compare main job): data, models, measurement, a tiny run."""

import copy
import csv
import math
import os
import subprocess
import sys
import time
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
    args = ["--device", "cpu", "--size", "tiny", "--steps", "9", "--model", "cnn-raw12", "--out", str(tmp_path)]
    rows = compare.run(args + ["--no-progress", "--no-plot"]).rows
    assert [r["regime"] for r in rows] == list(compare.MODEL_REGIMES["cnn-raw12"])
    rows = compare.run(args + ["--no-progress", "--no-plot", "--full"]).rows
    assert [r["regime"] for r in rows] == list(compare.BN_DEMO_REGIMES)
    rows = compare.run(args + ["--no-progress", "--no-plot", "--regimes", "fp32,fastamp-bf16"]).rows
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


def test_training_state_per_param_is_measured_per_regime_and_projected_to_7b():
    data = compare.TextData(16, 4, torch.device("cpu"))
    torch.manual_seed(0)
    base = compare.TinyGPT(len(data.vocab), 16, 2, 64, 2)
    results = [
        compare.train_regime("gpt", reg, base, data, torch.device("cpu"), 3, 3e-3, 1.0)
        for reg in ("fp32", "fastamp-bf16-10B", "pure-bf16")
    ]
    per = {r.regime: r.state_bytes / r.n_params for r in results}
    # fp32: param + grad + two moments, 4 B each (+ the 0-dim step counts); pure bf16: 2 B each;
    # fastamp's 10-B config: bf16 param, grad, remainder and moments, and its fp32 LayerNorms at 16 B
    assert 16.0 < per["fp32"] < 16.01 and 8.0 < per["pure-bf16"] < 8.01, per
    assert 10.0 < per["fastamp-bf16-10B"] < 10.1, per
    rows = compare.summarise(results)
    from fastamp.compare.report import state_lines

    text = "\n".join(state_lines(rows, ["gpt"]))
    assert "7B-parameter projection" in text and "| fp32 | 16.00" in text and "| 112.0 |" in text, text


@pytest.mark.parametrize("clip", [1e-3, 0.0])  # a clip that binds every step (two backwards), and none
def test_the_release_row_reproduces_its_twin_bit_for_bit_without_holding_grads(clip):
    data = compare.TextData(16, 4, torch.device("cpu"))
    torch.manual_seed(0)
    base = compare.TinyGPT(len(data.vocab), 16, 2, 32, 2)
    twin, rel = (
        compare.train_regime("gpt", reg, base, data, torch.device("cpu"), 6, 3e-3, clip)
        for reg in ("fastamp-bf16-remainder", "fastamp-bf16-release")
    )
    assert rel.losses == twin.losses and len(rel.losses) == 6 and rel.losses[-1] < rel.losses[0]
    # no grad is alive after a released step: 2 bytes per param less (bf16 grads; the LayerNorms' fp32 ones 4)
    assert twin.state_bytes - rel.state_bytes >= 2 * rel.n_params
    line = next(v for v in compare.verdicts([twin, rel]) if "fastamp-bf16-release" in v)
    assert "bit-identical for 6 of 6 steps" in line and "MISMATCH" not in line


@pytest.mark.slow
def test_tiny_end_to_end_run_writes_table_csv_and_png(tmp_path, capfd):
    regimes = "fp32,torch-amp-fp16,fastamp-scaler-fp16,fastamp-fp16,fastamp-bf16-sr,pure-fp16"
    args = ["--device", "cpu", "--size", "tiny", "--steps", "9", "--regimes", regimes, "--out", str(tmp_path)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = compare.run(args + ["--no-progress", "--note", "a test run"])
    rows = done.rows
    assert done.ok and str(tmp_path / "compare-cpu.png") in done.written
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
    assert "## Pitfall guards" in out and "## Training state per parameter, and a 7B-parameter projection" in out
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
    assert len(curves) == 3 * 6 * 9
    assert {c["skipped"] for c in curves if c["regime"] == "fp32"} == {""}
    assert {c["skipped"] for c in curves if c["regime"] == "torch-amp-fp16"} <= {"0", "1"}
    # every timed step's wall and CPU time (steps 0-6 set up and measure, 7 opens a block: not timed)
    assert {c["step"] for c in curves if c["step_cpu_ms"]} == {"8"} and all(
        float(c["step_wall_ms"]) > 0 for c in curves if c["step_cpu_ms"]
    )
    png = tmp_path / "compare-cpu.png"
    assert png.exists() and png.stat().st_size > 20_000


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit, match="unknown regime 'fp8'"):
        compare.main(["--regimes", "fp8", "--device", "cpu"])
    with pytest.raises(SystemExit, match="unknown --model"):
        compare.main(["--model", "resnet", "--device", "cpu"])
    with pytest.raises(SystemExit, match="at least 9"):
        compare.main(["--steps", "2", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--threads must be >= 0"):
        compare.main(["--threads", "-1", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--full and --regimes"):
        compare.main(["--full", "--regimes", "fp32", "--device", "cpu"])


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
    # the speed note states what was measured, and no longer explains speed from the flags
    note = compare.cpu_speed_note([], {"AVX512-BF16": True, "AMX-BF16": False})
    assert "no speed measured" in note and "AVX512" not in note and "emulated" not in note


# --- the job as a user runs it: exit code, missing extras, threads, load, progress, ETA ---

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A small, quick job: the transformer with two regimes, the tiny preset.
_QUICK = ["--size", "tiny", "--model", "gpt", "--regimes", "fp32,fastamp-bf16", "--steps", "9"]
# What pip's generated ``fastamp-compare`` script does with the entry point of pyproject.toml.
_CONSOLE_SCRIPT = "import sys; from fastamp.compare import main; sys.exit(main())"


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _script(code, args, tmp_path, **env):
    return subprocess.run(
        [sys.executable, "-c", code, *args, "--out", str(tmp_path)],
        capture_output=True, text=True, env=_env(**env), cwd=tmp_path, timeout=600,
    )  # fmt: skip


def test_console_script_exits_0_and_prints_the_thread_choice(tmp_path):
    with open(os.path.join(_ROOT, "pyproject.toml")) as f:
        assert 'fastamp-compare = "fastamp.compare:main"' in f.read()
    p = _script(_CONSOLE_SCRIPT, _QUICK + ["--no-plot"], tmp_path)
    assert p.returncode == 0, p.stderr
    # the result rows are returned to Python callers of run(), not dumped by sys.exit
    assert "{'model'" not in p.stderr and "'regime'" not in p.stderr, p.stderr
    assert "fastamp-compare: torch threads: 1 (one intra-op thread" in p.stderr
    assert "- torch_threads: 1: one intra-op thread" in p.stdout
    assert "- cpu: " in p.stdout and "torch threads 1," in p.stdout
    assert "- machine_load: " in p.stdout
    assert (tmp_path / "compare-cpu.md").exists() and not (tmp_path / "compare-cpu.png").exists()


# The job's other ways in, each a fresh interpreter (~5 s: torch's import and the job): the two missing extras in
# one process (their messages and fall-backs are independent: the progress bar and the plot), and ``python -m``
# on a terminal (its exit code and "wrote" line, and the progress line drawn there).


def test_missing_matplotlib_and_tqdm_are_reported_and_the_job_still_runs(tmp_path):
    blocked = "import sys; sys.modules['matplotlib'] = None; sys.modules['tqdm'] = None; "
    p = _script(blocked + _CONSOLE_SCRIPT.split("; ", 1)[1], _QUICK, tmp_path)
    assert p.returncode == 0, p.stderr
    # matplotlib
    assert "no plot: matplotlib is not installed" in p.stderr and "fastamp[compare]" in p.stderr
    wrote = next(line for line in p.stderr.splitlines() if "wrote" in line)
    assert ".png" not in wrote and "compare-cpu.md" in wrote
    assert "not written: the PNG" in p.stderr
    assert not (tmp_path / "compare-cpu.png").exists() and (tmp_path / "compare-cpu.csv").exists()
    # tqdm
    assert "no progress line: tqdm is not installed" in p.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs a pseudo-terminal (Linux)")
def test_python_m_runs_the_same_entry_and_redraws_one_progress_line_within_the_terminal_width(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    args = [sys.executable, "-m", "fastamp.compare", *_QUICK, "--no-plot", "--out", str(tmp_path)]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=slave, env=_env(COLUMNS="80"), cwd=tmp_path)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert p.wait(timeout=600) == 0
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    # python -m: the console script's entry (exit code 0 above, the files it wrote named)
    assert f"wrote {tmp_path}" in text, text[-4000:]
    lines = text.split("\n")
    bar_lines = [line for line in lines if "eta " in line]
    # one terminal line, redrawn in place with carriage returns, left on screen at the end
    assert len(bar_lines) == 1, lines
    frames = [f for f in bar_lines[0].split("\r") if f]
    assert len(frames) >= 2 and "eta" in frames[-1]
    assert max(len(f) for f in frames) <= 80, max(frames, key=len)


def test_eta_sums_each_regimes_steps_left_times_its_own_cost():
    assert compare.eta_seconds({"a": 10, "b": 5, "done": 0}, {"a": 0.1, "b": 2.0}) == pytest.approx(11.0)
    assert compare.eta_seconds({"a": 10, "b": 5}, {"a": 0.1}) is None  # b has steps left, no cost yet
    assert compare.eta_seconds({}, {}) == 0.0
    bar = compare.JobProgress({"fast": 4, "slow": 4}, enabled=False)
    bar.record("fast", 1.0, step=0)  # the first step (state set-up) counts only until a later one is timed
    bar.record("slow", 5.0, step=0)
    assert bar.eta() == pytest.approx(3 * 1.0 + 3 * 5.0)
    bar.record("fast", 0.1, step=1)
    bar.record("slow", 99.0, step=1, estimate=False)  # a profiled step: counted, but not a cost sample
    bar.record("slow", 2.0, step=2)
    assert bar.costs() == {"fast": pytest.approx(0.1), "slow": pytest.approx(2.0)}
    assert bar.eta() == pytest.approx(2 * 0.1 + 1 * 2.0)
    assert compare.progress.format_eta(None) == "?" and compare.progress.format_eta(151.4) == "2m31s"


def _snap(t, job, busy, idle, steal=0.0, loadavg=(0.1, 0.1, 0.1)):
    from fastamp.compare import load

    return load.Snapshot(t, job, load.CpuTimes(busy, idle, steal), loadavg)


def test_load_verdict_from_measured_cpu_times():
    from fastamp.compare import load

    # 10 s on 2 CPUs: the job used one, the other idled
    quiet = load.assess(None, _snap(0, 0, 0, 0), _snap(10, 10, 10.2, 9.8), nproc=2, threads=1)
    assert not quiet.under_load and quiet.banner() == "" and quiet.summary.startswith("not loaded")
    # two busy processes: the job had its thread on a CPU 2/3 of the time, others 1.33 CPUs
    busy = load.assess(None, _snap(0, 0, 0, 0), _snap(12, 8, 24, 0), nproc=2, threads=1)
    assert busy.under_load and busy.share == pytest.approx(8 / 12)
    assert any("had a CPU 67%" in r for r in busy.reasons)
    assert any("kept 1.33 of the 2 CPUs busy during the run" in r for r in busy.reasons)
    assert busy.banner().startswith("UNDER LOAD: ")
    # busy only just before the job started (the 0.5 s probe): reported, but the run itself was not loaded
    before = load.Interval(0.5, 0.0, 1.9, 0.0)
    burst = load.assess(before, _snap(0, 0, 0, 0), _snap(10, 10, 10, 10), nproc=2, threads=1)
    assert not burst.under_load and "1.90 in the 0.5 s before it" in burst.summary
    stolen = load.assess(None, _snap(0, 0, 0, 0), _snap(10, 10, 10, 8, steal=2), nproc=2, threads=1)
    assert stolen.under_load and any("steal" in r for r in stolen.reasons)
    # without /proc/stat (not Linux) only the job's own share is known
    none = load.assess(None, load.Snapshot(0, 0, None, None), load.Snapshot(10, 9.9, None, None), 2, 1)
    assert not none.under_load and "other processes" not in none.summary
    assert load.read_proc_stat("/nonexistent/stat") is None
    if os.path.exists("/proc/stat"):
        assert load.read_proc_stat().total > 0


@pytest.mark.slow
def test_a_run_under_load_says_so_in_the_report_and_on_the_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from fastamp.compare import load

    nproc = os.cpu_count() or 1
    t0 = time.perf_counter()

    def every_cpu_busy():  # other processes keep every CPU busy the whole time
        elapsed = time.perf_counter() - t0
        return load.CpuTimes(busy=nproc * elapsed + time.process_time(), idle=0.0, steal=0.0)

    monkeypatch.setattr(load, "read_proc_stat", every_cpu_busy)
    done = compare.run(_QUICK + ["--no-progress", "--out", str(tmp_path)])
    assert done.load.under_load and done.ok
    report = (tmp_path / "compare-cpu.md").read_text()
    assert report.splitlines()[2].startswith("**This run was under load**: ")
    assert f"other processes kept {nproc:.2f} of the {nproc} CPUs busy" in report
    meta = Image.open(tmp_path / "compare-cpu.png").text
    assert meta["Title"].startswith("UNDER LOAD: ") and "competed for the CPUs" in meta["Title"]
    assert meta["Description"].startswith("under load: ")
    monkeypatch.undo()
    quiet = compare.plots.plot_title("cpu", "abc", "today", compare.LoadVerdict(False, "not loaded: ..."))
    assert quiet == "fastamp-compare on cpu (abc, today)"


def test_threads_can_be_chosen_and_the_job_restores_torchs_count(tmp_path, capfd):
    before = torch.get_num_threads()
    done = compare.run(_QUICK + ["--no-progress", "--no-plot", "--threads", "2", "--out", str(tmp_path)])
    out, err = capfd.readouterr()
    assert done.threads == 2 and torch.get_num_threads() == before
    assert "fastamp-compare: torch threads: 2 (--threads)" in err and "- torch_threads: 2: --threads" in out
    # more than one thread: CPU time would add the threads' waits, so the table uses the wall clock
    assert all(r.clock == "wall" and r.step_ms == r.step_wall_ms for r in done.results)


def test_interleaved_regimes_train_as_they_do_alone(tmp_path):
    """The job advances every regime a block of steps at a time in turn; each must train exactly as it does alone."""
    regimes = ["fp32", "torch-amp-fp16", "fastamp-scaler-fp16", "fastamp-bf16-sr"]
    steps = 12  # the set-up block (steps 0-6), then one block of 5: an untimed step and 4 timed ones
    done = compare.run(
        ["--size", "tiny", "--model", "gpt", "--regimes", ",".join(regimes), "--steps", str(steps)]
        + ["--no-progress", "--no-plot", "--out", str(tmp_path)]
    )
    g = compare.SIZES["tiny"]["gpt"]
    dev = torch.device("cpu")
    data = compare.TextData(g["seq_len"], g["batch"], dev)
    torch.manual_seed(0)
    base = compare.TinyGPT(len(data.vocab), g["seq_len"], g["n_layer"], g["d_model"], g["n_head"])
    gi = compare.SIZES["tiny"]["growth_interval"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the job ran them: torch's fp32 reductions depend on the thread count
    try:
        alone = {
            r.regime: compare.train_regime("gpt", r.regime, base, data, dev, steps, 3e-3, 1.0, growth_interval=gi)
            for r in done.results
        }
    finally:
        torch.set_num_threads(threads)
    for r in done.results:
        assert r.losses == alone[r.regime].losses and r.scales == alone[r.regime].scales, r.regime
        assert r.timed_steps == 4 and r.clock == "cpu" and r.step_ms == r.step_cpu_ms > 0
        assert [step for step, _, _ in r.step_times] == [8, 9, 10, 11]  # step 7 opens the block, untimed
        cpu = sorted(c for _, _, c in r.step_times)
        assert r.step_cpu_ms == 1e3 * cpu[0]  # the lower quartile of 4: the nearest rank below
        assert r.op_profile is not None and r.op_profile.steps == 3 and r.op_profile.ops


def test_the_op_profile_names_what_took_the_time():
    a = torch.randn(384, 384)

    def step():
        for _ in range(10):
            (a @ a) / 3.0  # the product has about 400x the flops of the division

    # one thread and the least of 3 profiles, as the job takes them: on a loaded machine two threads wait for
    # each other in every op (a division then took as long as the product), and an op preempted by another
    # process only looks longer
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = compare.OpProfile.fastest([compare.profile_step(step, torch.device("cpu")) for _ in range(3)])
    finally:
        torch.set_num_threads(threads)
    assert p.ops[0][0] == "aten::mm" and 0.5 < p.share("aten::mm") <= 1, p.ops[:4]
    assert p.ops == sorted(p.ops, key=lambda x: -x[1])
    P = compare.OpProfile
    least = P.fastest(
        [P("cpu", [("a", 10.0), ("b", 3.0)]), P("cpu", [("a", 12.0)]), P("cpu", [("a", 500.0), ("b", 1.0)])]
    )
    assert least.ops == [("a", 10.0), ("b", 1.0)] and least.steps == 3  # a preempted op only looks longer
    R = compare.RegimeResult
    fp32 = R("cnn", "fp32", step_ms=5.0, op_profile=P("cpu", [("aten::convolution_backward", 2000.0), ("x", 3000.0)]))
    fp16 = R("cnn", "fastamp-fp16", step_ms=300.0,
             op_profile=P("cpu", [("aten::convolution_backward", 290000.0), ("x", 3000.0)]))  # fmt: skip
    bf16 = R("cnn", "fastamp-bf16", step_ms=4.0, op_profile=P("cpu", [("x", 4000.0)]))
    compare.summarise([fp32, fp16, bf16])
    from fastamp.compare.hotspots import dominant_ops, hotspot_table, slowdown_lines

    assert dominant_ops([fp32, fp16, bf16]) == {"aten::convolution_backward": ["cnn/fastamp-fp16"]}
    (line,) = slowdown_lines([fp32, fp16, bf16])
    assert "cnn/fastamp-fp16 (0.0167x" in line and "aten::convolution_backward took 290.00 ms" in line
    assert "(99% of its op time) against 2.00 ms in fp32's (40%)" in line and "100% of the extra time" in line
    assert "| fastamp-fp16 | 293.00 ms | aten::convolution_backward 99%, x 1% |" in hotspot_table([fp32, fp16], "cnn")
    note = compare.cpu_speed_note([fp32, fp16, bf16])
    assert "cnn: bf16 1.25x, fp16 0.017x" in note and "aten::convolution_backward in cnn/fastamp-fp16" in note


# regime -> (the master state key of a large bf16/fp16 tensor or None, that of a small one or None)
_Q8_MASTERS = {
    "fastamp-bf16-remainder-q8": ("master_remainder", "master_remainder"),
    "fastamp-bf16-ulp8-q8": ("master_ulp8", "master_remainder"),  # below lowbit_min_numel: the exact master
    "fastamp-bf16-sr-q8": (None, None),
    "fastamp-fp16-ulp8-q8": ("master_ulp8", "master_param"),
}


@pytest.mark.parametrize("regime", compare.Q8_REGIMES)
def test_the_q8_rows_keep_8_bit_moments_and_the_master_they_name_on_their_large_tensors(regime):
    model = compare.TinyGPT(64, 8, 1, 64, 2)  # the head, 64 x 64, reaches lowbit_min_numel (4,096)
    opt, scaler, autocast_dtype, _ = compare.build_regime(regime, model, 1e-3, torch.device("cpu"))
    dtype = compare.REGIME_INFO[regime][0]
    assert autocast_dtype == dtype and model.head.weight.dtype == dtype
    assert isinstance(scaler, fastamp.Scaler) if dtype == torch.float16 else scaler is None
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    if scaler is not None:  # grads set by hand: the step unscales them by 2^-16
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    big, small = opt.state[model.head.weight], opt.state[model.head.bias]
    assert big["exp_avg_q"].dtype == big["exp_avg_sq_scale"].dtype == torch.uint8 and "exp_avg" not in big, set(big)
    assert small["exp_avg"].dtype == torch.float32 and "exp_avg_q" not in small, set(small)
    masters = {"master_param", "master_remainder", "master_ulp8"}
    for st, key in zip((big, small), _Q8_MASTERS[regime]):
        assert masters & set(st) == ({key} if key else set()), set(st)
    assert ("rng" in big) and (big["rng"].dtype == torch.int64)  # stochastic q8 codes (and SR params)


def test_the_default_run_has_every_fastamp_config_and_torch_fp32_and_amp_on_the_gpt():
    fastamp_rows = [r for r in compare.REGIMES if r.startswith("fastamp")]
    assert set(compare.Q8_REGIMES) == set(_Q8_MASTERS) and set(compare.Q8_REGIMES) <= set(fastamp_rows)
    assert set(fastamp_rows) | {"fp32", "torch-amp-fp16", "torch-amp-bf16"} <= set(compare.MODEL_REGIMES["gpt"])
    assert not set(compare.Q8_REGIMES) & set(compare.FULL_MODEL_REGIMES["cnn"])  # the CNN's tensors are small
    with pytest.raises(SystemExit, match=r"unknown regime 'fastamp-bf16-q8' \(renamed: fastamp-bf16-ulp8-q8\)"):
        compare.main(["--regimes", "fastamp-bf16-q8", "--device", "cpu"])


def _layout_bytes(p, options):
    """``fastamp/reference/layout.py``'s bytes of ``p``, its grad and its AdamW state under a regime's options.

    AdamW's rules: q8 moments from ``lowbit_min_numel`` (4,096) elements, fp32 below; an fp32 param is its own
    master; below the threshold ulp8 falls back to the exact master (bf16 remainder, fp16 fp32); stochastic
    rounding keeps no master for bf16.
    """
    from fastamp.reference import layout

    n, bf16 = p.numel(), p.dtype == torch.bfloat16
    big = options.get("state_format") == "q8" and n >= 4096
    mw = options.get("master_weights")
    if p.dtype == torch.float32:
        master = "none"
    elif mw == "ulp8":
        master = "ulp8" if big else ("remainder" if bf16 else "fp32")
    elif mw == "remainder":
        master = "remainder" if bf16 else "fp32"
    else:
        master = "none" if bf16 and options.get("stochastic_rounding") else "fp32"
    size = p.element_size()
    return layout.state_bytes_per_param(master, "q8" if big else "fp32", numel=n, param_bytes=size, grad_bytes=size) * n


# issue 22's bytes per param (bf16 or fp16 params and grads, large tensors), to be met within 0.01
_Q8_BYTES = {
    "fastamp-bf16-remainder-q8": 8.06,
    "fastamp-bf16-ulp8-q8": 7.06,
    "fastamp-bf16-sr-q8": 6.06,
    "fastamp-fp16-ulp8-q8": 7.06,
}


@pytest.mark.parametrize("regime", compare.Q8_REGIMES)
def test_the_q8_rows_measure_the_bytes_per_param_layout_py_predicts(regime):
    data = compare.TextData(16, 4, torch.device("cpu"))
    torch.manual_seed(0)
    base = compare.TinyGPT(len(data.vocab), 16, 2, 64, 2)  # the CPU default's GPT: 8 of its 26 tensors >= 4,096
    r = compare.train_regime("gpt", regime, base, data, torch.device("cpu"), 3, 3e-3, 1.0, growth_interval=2)
    model = copy.deepcopy(base)
    compare.build_regime(regime, model, 3e-3, torch.device("cpu"))
    params = list(model.parameters())
    large = [p for p in params if p.numel() >= 4096]
    assert r.n_params == sum(p.numel() for p in params) and r.large_params == sum(p.numel() for p in large)
    options = compare.FASTAMP_OPTIONS[regime]
    whole = sum(_layout_bytes(p, options) for p in params) / r.n_params
    big = sum(_layout_bytes(p, options) for p in large) / r.large_params
    # measured: every live storage (+ the 0-dim step counts, the shared rng counter, the scaler: < 0.002 B/param)
    assert abs(r.state_bytes / r.n_params - whole) < 0.01, (r.state_bytes / r.n_params, whole)
    assert abs(r.large_state_bytes / r.large_params - big) < 0.01, (r.large_state_bytes / r.large_params, big)
    assert abs(big - _Q8_BYTES[regime]) < 0.01
    row = compare.summarise([r])[0]
    assert float(row["state_7b_gb"]) == pytest.approx(7 * float(row["large_state_bytes_per_param"]), abs=0.05)
    assert abs(float(row["state_7b_gb"]) - 7 * _Q8_BYTES[regime]) < 0.1


def test_the_q8_rows_and_torch_fp32_and_amp_are_in_the_7b_table_and_the_convergence_checks(tmp_path):
    regimes = ["fp32", "torch-amp-fp16", "torch-amp-bf16", *compare.Q8_REGIMES]
    args = ["--size", "tiny", "--model", "gpt", "--regimes", ",".join(regimes), "--steps", "9"]
    done = compare.run(args + ["--no-progress", "--no-plot", "--out", str(tmp_path)])
    assert done.ok and [r.regime for r in done.results] == regimes
    report = (tmp_path / "compare-cpu.md").read_text()
    table = report.split("## Training state per parameter, and a 7B-parameter projection")[1].split("## Where")[0]
    assert "projection" in table and "(measured)" in table
    for regime in ("fp32", "torch-amp-fp16", "torch-amp-bf16"):
        assert f"| {regime} | 16.0" in table and "| 112.0 |" in table, regime
    for regime, nbytes in _Q8_BYTES.items():
        line = next(v for v in table.splitlines() if v.startswith(f"| {regime} |"))
        gb = float(line.rstrip(" |").rsplit("|", 1)[1])  # from the tiny GPT's tensors >= 4,096 elements
        assert abs(gb - 7 * nbytes) < 0.1, line
        reference = "torch-amp-fp16" if regime.startswith("fastamp-fp16") else "torch-amp-bf16"
        assert f"- gpt: {regime} final val loss " in report and f" vs {reference} " in report, regime
    scales = report.split("## Loss scale")[1].split("## Pitfall")[0]
    assert "| fastamp-fp16-ulp8-q8 | fastamp.Scaler |" in scales
