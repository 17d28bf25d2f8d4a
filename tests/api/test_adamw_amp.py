"""fastamp.optim.AdamW under amp: grad_scale/found_inf, skipped steps, GradScaler and fastamp.Scaler end to end."""

import math
import os

import pytest
import torch
from helpers import cuda_syncs_raise, requires_cuda

import fastamp
from fastamp.optim import AdamW

CPU_BACKENDS = [b for b in fastamp.backends.BACKENDS if fastamp.backends.available(b, "optim_", "cpu")[0]]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _steps(backend, n, slow):
    # the Triton interpreter costs ~60 ms a step on CPU
    return slow if backend == "triton" and INTERPRETED else n


def _snapshot(opt, params):
    snap = [p.detach().clone() for p in params]
    for p in params:
        snap.extend(v.clone() for v in opt.state[p].values())
    return snap


def _assert_bit_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def _mixed_problem(generator):
    """Many tensors of every kind: fp32, bf16/fp16 with masters, fp16 without, amsgrad, two devices' worth of groups."""
    specs = [
        (torch.float32, (17,)),
        (torch.bfloat16, (5, 7)),
        (torch.float16, (33,)),
        (torch.float32, (1,)),
        (torch.bfloat16, (64,)),
        (torch.float16, (4, 4)),
    ]
    params = [torch.randn(s, generator=generator).to(dt).requires_grad_() for dt, s in specs]
    groups = [
        {"params": params[:3]},
        {"params": params[3:5], "amsgrad": True, "lr": 0.05},
        {"params": params[5:], "master_weights": False},
    ]
    return params, groups


def _grads(params, generator, scale=1.0):
    return [(torch.randn(p.shape, generator=generator) * scale).to(p.dtype) for p in params]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("flag", [1.0, 2.0, math.nan, -1.0])
@pytest.mark.parametrize("bad_value", [math.inf, -math.inf, math.nan, None])
def test_skipped_step_leaves_every_tensor_bit_identical(backend, flag, bad_value):
    if backend == "triton" and INTERPRETED and (flag != 2.0 or bad_value is not math.nan):
        pytest.skip("Triton interpreter: one combination is enough, the skip is one check")
    g = torch.Generator().manual_seed(0)
    params, groups = _mixed_problem(g)
    opt = AdamW(groups, lr=0.01, backend=backend)
    scale = torch.tensor(1024.0)
    for _ in range(2):
        for p, gr in zip(params, _grads(params, g, 1024.0)):
            p.grad = gr
        opt.grad_scale, opt.found_inf = scale, torch.tensor(0.0)
        opt.step()
        del opt.grad_scale, opt.found_inf
    before = _snapshot(opt, params)
    grads = _grads(params, g, 1024.0)
    if bad_value is not None:
        grads[4].view(-1)[9] = bad_value  # one element of one tensor among many
    for p, gr in zip(params, grads):
        p.grad = gr
    opt.grad_scale, opt.found_inf = scale, torch.tensor(flag)
    opt.step()
    _assert_bit_identical(_snapshot(opt, params), before)
    assert all(opt.state[p]["step"].item() == 2 for p in params)
    # and a clean step afterwards counts and moves everything
    grads = _grads(params, g, 1024.0)
    for p, gr in zip(params, grads):
        p.grad = gr
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    assert all(opt.state[p]["step"].item() == 3 for p in params)
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("clip_coef", [1.0, 0.25])
def test_grad_scale_unscales_in_registers_exactly(backend, clip_coef):
    # Power-of-two scale and clip coefficient: unscaling is exact, so driving the step with
    # scaled grads + grad_scale equals the step on the plain (clipped) grads, bit for bit,
    # and the scaled grads are not written back.
    g = torch.Generator().manual_seed(1)
    params_a, groups_a = _mixed_problem(g)
    params_b = [p.detach().clone().requires_grad_() for p in params_a]
    groups_b = [dict(gr, params=params_b[i : i + len(gr["params"])]) for gr, i in zip(groups_a, (0, 3, 5))]
    opt_a = AdamW(groups_a, lr=0.01, backend=backend)
    opt_b = AdamW(groups_b, lr=0.01, backend=backend)
    scale = 2.0**12
    for _ in range(_steps(backend, 5, 2)):
        grads = _grads(params_a, g)
        for p, q, gr in zip(params_a, params_b, grads):
            p.grad = (gr.float() * scale).to(gr.dtype)
            q.grad = (gr.float() * clip_coef).to(gr.dtype)
        scaled = [p.grad.clone() for p in params_a]
        opt_a.grad_scale = torch.tensor(scale / clip_coef)  # what fastamp.Scaler folds in
        opt_a.found_inf = torch.tensor(0.0)
        opt_a.step()
        opt_b.step()
        assert all(torch.equal(p.grad, s) for p, s in zip(params_a, scaled))
    _assert_bit_identical(_snapshot(opt_a, params_a), _snapshot(opt_b, params_b))


def test_amp_attributes_validated_before_anything_changes():
    p = torch.randn(4, requires_grad=True)
    opt = AdamW([p])
    p.grad = torch.ones(4)
    p0 = p.detach().clone()
    opt.found_inf = torch.zeros(2)
    with pytest.raises(ValueError, match="found_inf must be a 1-element tensor"):
        opt.step()
    opt.found_inf = "no"
    with pytest.raises(TypeError, match="found_inf must be a Tensor"):
        opt.step()
    del opt.found_inf
    opt.grad_scale = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(TypeError, match="grad_scale must be a floating point tensor"):
        opt.step()
    assert torch.equal(p, p0) and len(opt.state) == 0


# ---- end to end ------------------------------------------------------------------------------


def _model(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dtype)


def _batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


INJECT = {3, 4, 9, 17, 18, 19, 30}  # iterations whose grads get an inf (backoffs, incl. consecutive)


def _train(model, opt, scaler, amp_dtype, batches, clip=None, scaler_clip=False):
    losses, scales = [], []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=amp_dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if i in INJECT:
            model[0].weight.grad.view(-1)[5] = math.inf
        if clip is not None:
            if scaler_clip:
                scaler.clip_grad_norm_(opt, clip)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().float())
        scales.append(scaler.get_scale())
    return torch.stack(losses), scales


# The two runs' optimizers differ by a few fp32 ulps a step (tolerances.ADAMW_VS_TORCH_*), and
# that difference goes through an autocast forward in fp16/bf16, where it can flip a rounding.
# Measured over 40 steps: loss rel. diff <= 2.7e-5, param diff <= 6.1e-6 (fp16 autocast, no
# clip); 0 or 1 fp32 ulp otherwise. Budgets: one fp16 ulp for the loss, relative; 1e-4 for params.
LOSS_RTOL = 2.0**-10
PARAM_ATOL = 1e-4


@pytest.mark.slow  # ~30 s over its cases
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_torch_gradscaler_drives_ours_like_torch_fused(backend, amp_dtype, clip):
    if backend == "triton" and INTERPRETED and (amp_dtype is torch.bfloat16 or clip is not None):
        pytest.skip("Triton interpreter: one combination")
    batches = _batches(_steps(backend, 40, 12), seed=2)
    m1, m2 = _model(0), _model(0)
    o1 = AdamW(m1.parameters(), lr=3e-3, backend=backend)
    o2 = torch.optim.AdamW(m2.parameters(), lr=3e-3, fused=True)
    kw = dict(init_scale=2.0**10, growth_interval=3)
    l1, s1 = _train(m1, o1, torch.amp.GradScaler("cpu", **kw), amp_dtype, batches, clip)
    l2, s2 = _train(m2, o2, torch.amp.GradScaler("cpu", **kw), amp_dtype, batches, clip)
    assert s1 == s2
    assert min(s1) < 2.0**10 < max(s1), "the run should both back off and grow"
    torch.testing.assert_close(l1, l2, rtol=LOSS_RTOL, atol=0)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, atol=PARAM_ATOL, rtol=0)
        assert o1.state[p]["step"].item() == o2.state[q]["step"].item()


@pytest.mark.slow  # ~35 s over its cases
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_fastamp_scaler_and_ours_like_torch_gradscaler_and_fused(backend, amp_dtype, clip):
    if backend == "triton" and INTERPRETED and (amp_dtype is torch.bfloat16 or clip is None):
        pytest.skip("Triton interpreter: one combination")
    batches = _batches(_steps(backend, 40, 12), seed=3)
    m1, m2 = _model(1), _model(1)
    o1 = AdamW(m1.parameters(), lr=3e-3, backend=backend)
    o2 = torch.optim.AdamW(m2.parameters(), lr=3e-3, fused=True)
    kw = dict(init_scale=2.0**10, growth_interval=3)
    l1, s1 = _train(m1, o1, fastamp.Scaler("cpu", **kw), amp_dtype, batches, clip, scaler_clip=True)
    l2, s2 = _train(m2, o2, torch.amp.GradScaler("cpu", **kw), amp_dtype, batches, clip)
    assert s1 == s2
    assert min(s1) < 2.0**10 < max(s1)
    torch.testing.assert_close(l1, l2, rtol=LOSS_RTOL, atol=0)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, atol=PARAM_ATOL, rtol=0)
        assert o1.state[p]["step"].item() == o2.state[q]["step"].item()


@pytest.mark.parametrize("scaler_kind", ["torch", "fastamp"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_model_trains_with_masters(scaler_kind, dtype):
    # fp16/bf16 params: fp16 grads are accepted (unscaled in registers), the param always
    # equals its rounded master, skipped iterations change nothing, and the loss goes down.
    model = _model(2, dtype)
    opt = AdamW(model.parameters(), lr=1e-2)
    make = torch.amp.GradScaler if scaler_kind == "torch" else fastamp.Scaler
    scaler = make("cpu", init_scale=2.0**8, growth_interval=5)
    x = torch.randn(64, 16).to(dtype)
    y = torch.randn(64, 4)
    losses = []
    for i in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if i == 7:
            model[2].bias.grad[1] = math.nan
            before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        if i == 7:
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        losses.append(loss.item())
        for p in model.parameters():
            assert p.grad.dtype == dtype
            assert torch.equal(p, opt.state[p]["master_param"].to(dtype))
    assert losses[-1] < 0.7 * losses[0]
    assert all(opt.state[p]["step"].item() == 59 for p in model.parameters())


@requires_cuda
def test_cuda_step_does_not_sync():
    dev = torch.device("cuda")
    params = [
        torch.randn(s, device=dev, dtype=dt, requires_grad=True)
        for s, dt in [((64,), torch.bfloat16), ((5, 7), torch.float32)]
    ]
    opt = AdamW(params, lr=torch.tensor(1e-3))  # CPU tensor lr: copied without blocking
    for p in params:
        p.grad = torch.randn_like(p)
    opt.grad_scale = torch.tensor(1024.0, device=dev)
    opt.found_inf = torch.zeros((), device=dev)
    opt.step()  # creates the state
    with cuda_syncs_raise():
        for _ in range(3):
            opt.step()
    assert all(opt.state[p]["step"].item() == 4 for p in params)


@requires_cuda
def test_cuda_full_iteration_with_torch_gradscaler_does_not_sync():
    dev = torch.device("cuda")
    model = _model(3).to(dev)
    opt = AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    x, y = torch.randn(8, 16, device=dev), torch.randn(8, 4, device=dev)

    def iteration():
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    iteration()
    with cuda_syncs_raise():
        iteration()
