"""Checkpoints: save at step k, resume in a new process, continue to n: bit-identical.

``tests/e2e/_scripts/ckpt_run.py`` trains fp32, bf16 + fp32 masters and fp16 + fp32 masters models
with fastamp.optim.AdamW, fastamp.Scaler (hysteresis 2, growth every 3) and a fused clip,
with overflow injected at steps 3, 4 and 11. The checkpoint is taken after step 3 (the
hysteresis tracker is mid-way, one overflow used), loaded with ``torch.load(weights_only=True)``
in a fresh process, and the run continued to step 20. Model, optimizer and scaler state must
equal the uninterrupted run's bit for bit. Also: torch.amp / torch.optim checkpoints load into
fastamp and back.
"""

import os
import subprocess
import sys

import pytest
import torch
from tolerances import ADAMW_VS_TORCH_ATOL, ADAMW_VS_TORCH_RTOL

import fastamp

SCRIPT = os.path.join(os.path.dirname(__file__), "_scripts", "ckpt_run.py")
K, N = 4, 20


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, SCRIPT, *map(str, args)], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    _run("full", N, d / "full.pt")
    _run("save", K, d / "ckpt.pt")
    _run("resume", d / "ckpt.pt", N, d / "resumed.pt")
    load = lambda name: torch.load(d / name, weights_only=True)  # noqa: E731
    return load("full.pt"), load("ckpt.pt"), load("resumed.pt")


def _assert_bitwise(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (path, a.keys(), b.keys())
        for k in a:
            _assert_bitwise(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


@pytest.mark.slow  # the ``runs`` fixture: fresh processes, ~30 s
@pytest.mark.parametrize("regime", ["fp32", "bf16_master", "fp16_master"])
def test_resume_in_a_new_process_is_bit_identical(runs, regime):
    full, ckpt, resumed = runs
    assert ckpt[regime]["step"] == K
    # the checkpoint really holds mid-run state: one overflow absorbed by hysteresis
    assert ckpt[regime]["scaler"]["_hysteresis_tracker"] == 1
    assert ckpt[regime]["scaler"]["skipped_steps"] == 1
    assert full[regime]["scaler"]["skipped_steps"] == 3
    if regime != "fp32":
        st = ckpt[regime]["opt"]["state"][0]
        assert st["master_param"].dtype == torch.float32 and st["exp_avg"].dtype == torch.float32
    _assert_bitwise(full[regime]["model"], resumed[regime]["model"], "model")
    _assert_bitwise(full[regime]["opt"], resumed[regime]["opt"], "opt")
    _assert_bitwise(full[regime]["scaler"], resumed[regime]["scaler"], "scaler")
    # and the run did move after the checkpoint
    assert not torch.equal(ckpt[regime]["model"]["0.weight"], full[regime]["model"]["0.weight"])


# ----------------------------------------------------------------------------- interop


def _scaler_trajectory(s, flags):
    out = []
    for bad in flags:
        p = torch.nn.Parameter(torch.ones(2))
        s.scale(torch.ones(()))
        p.grad = torch.full((2,), float("inf") if bad else 1.0)
        s.step(torch.optim.SGD([p], lr=0.1))
        s.update()
        out.append((s.get_scale(), s._get_growth_tracker()))
    return out


def test_torch_gradscaler_checkpoint_loads_into_fastamp_and_back(tmp_path):
    flags = [0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    t = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    _scaler_trajectory(t, flags[:5])
    torch.save(t.state_dict(), tmp_path / "t.pt")
    f = fastamp.Scaler(init_scale=1.0, growth_interval=100)
    f.load_state_dict(torch.load(tmp_path / "t.pt", weights_only=True))
    t2 = torch.amp.GradScaler("cpu")
    t2.load_state_dict(torch.load(tmp_path / "t.pt", weights_only=True))
    assert _scaler_trajectory(f, flags[5:]) == _scaler_trajectory(t2, flags[5:])
    # and back: fastamp's state dict (with its extra keys) loads into torch
    torch.save(f.state_dict(), tmp_path / "f.pt")
    t3 = torch.amp.GradScaler("cpu")
    t3.load_state_dict(torch.load(tmp_path / "f.pt", weights_only=True))
    assert (t3.get_scale(), t3._get_growth_tracker()) == (f.get_scale(), f._get_growth_tracker())
    assert _scaler_trajectory(t3, flags) == _scaler_trajectory(f, flags)


def _grads(params, step):
    g = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_torch_adamw_checkpoint_loads_into_fastamp_and_back(tmp_path):
    torch.manual_seed(0)
    init = [torch.randn(33, 5), torch.randn(7)]
    tp = [torch.nn.Parameter(x.clone()) for x in init]
    topt = torch.optim.AdamW(tp, lr=1e-2, weight_decay=0.1)
    for s in range(5):
        _grads(tp, s)
        topt.step()
    torch.save({"opt": topt.state_dict(), "params": [p.detach() for p in tp]}, tmp_path / "t.pt")
    ck = torch.load(tmp_path / "t.pt", weights_only=True)

    fp = [torch.nn.Parameter(x.clone()) for x in ck["params"]]
    fopt = fastamp.optim.AdamW(fp, lr=1.0)
    fopt.load_state_dict(ck["opt"])
    assert fopt.param_groups[0]["lr"] == 1e-2
    for s in range(5, 10):
        _grads(tp, s)
        _grads(fp, s)
        topt.step()
        fopt.step()
    for a, b in zip(fp, tp):
        torch.testing.assert_close(a, b, rtol=ADAMW_VS_TORCH_RTOL, atol=ADAMW_VS_TORCH_ATOL)

    # and back: fastamp (fp32 params) -> torch.optim.AdamW
    torch.save({"opt": fopt.state_dict(), "params": [p.detach() for p in fp]}, tmp_path / "f.pt")
    ck = torch.load(tmp_path / "f.pt", weights_only=True)
    tp2 = [torch.nn.Parameter(x.clone()) for x in ck["params"]]
    topt2 = torch.optim.AdamW(tp2, lr=1.0)
    topt2.load_state_dict(ck["opt"])
    for s in range(10, 15):
        _grads(tp2, s)
        _grads(fp, s)
        topt2.step()
        fopt.step()
    for a, b in zip(fp, tp2):
        torch.testing.assert_close(a, b, rtol=ADAMW_VS_TORCH_RTOL, atol=ADAMW_VS_TORCH_ATOL)
    assert float(topt2.state[tp2[0]]["step"]) == 15
