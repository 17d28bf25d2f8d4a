"""fastamp.cast_model: what stays fp32, the boundary casts, and fp16 training of a BatchNorm CNN."""

import math
import warnings

import pytest
import torch
from torch import nn

import fastamp
from fastamp.health import AmpPitfallWarning


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.seen = []

    def forward(self, x):
        return self.norm(self.lin(x))


def _record(seen, key):
    def hook(_mod, args):
        seen.setdefault(key, args[0].dtype)

    return hook


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.GroupNorm(2, 4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        Block(),
        nn.Linear(4, 3),
    )


def test_keeps_norms_fp32_and_casts_the_rest():
    m = _net()
    params_before = {n: p for n, p in m.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpPitfallWarning)
        out = fastamp.cast_model(m, torch.float16)
    assert out is m
    for n, p in m.named_parameters():
        assert p is params_before[n], "parameters keep their identity"
        want = torch.float32 if n.startswith(("1.", "2.", "5.norm")) else torch.float16
        assert p.dtype == want, (n, p.dtype)
    assert m[1].running_mean.dtype == torch.float32 and m[1].running_var.dtype == torch.float32
    assert m[1].num_batches_tracked.dtype == torch.int64

    seen = {}
    m[1].register_forward_pre_hook(_record(seen, "bn_in"))
    m[5].norm.register_forward_pre_hook(_record(seen, "ln_in"))
    m[5].lin.register_forward_pre_hook(_record(seen, "lin_in"))
    y = m(torch.randn(5, 2, 6, 6))  # fp32 input is cast to fp16 by the root hook
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    # the casting hooks run before hooks registered later, so kept modules see fp32, except
    # BatchNorm, whose kernel takes fp16 input with fp32 params and statistics directly
    assert seen == {"bn_in": torch.float16, "ln_in": torch.float32, "lin_in": torch.float16}
    y.float().sum().backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, n


def test_keep_by_name_instance_and_empty():
    m = _net()
    fastamp.cast_model(m, torch.bfloat16, keep_fp32=fastamp.DEFAULT_KEEP_FP32 + ("6", m[5].lin))
    assert m[6].weight.dtype == torch.float32 and m[5].lin.weight.dtype == torch.float32
    assert m[0].weight.dtype == torch.bfloat16
    seen = {}
    m[6].register_forward_pre_hook(_record(seen, "head_in"))
    # the kept head computes in fp32; its post-hook hands bf16 on, like every low-precision layer
    assert m(torch.randn(3, 2, 5, 5)).dtype == torch.bfloat16
    assert seen == {"head_in": torch.float32}
    with pytest.warns(AmpPitfallWarning, match="norm_in_low_precision"):
        fastamp.cast_model(_net(), torch.float16, keep_fp32=())


def test_errors():
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        fastamp.cast_model(_net(), torch.float32)
    with pytest.raises(ValueError, match="'nope'"):
        fastamp.cast_model(_net(), torch.float16, keep_fp32=("nope",))
    with pytest.raises(TypeError, match="keep_fp32 entries"):
        fastamp.cast_model(_net(), torch.float16, keep_fp32=(3,))


def test_batchnorm_in_low_precision_warns_once():
    m = _net().half()
    scaler = fastamp.Scaler()
    with pytest.warns(AmpPitfallWarning, match="norm_in_low_precision"):
        scaler.watch(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpPitfallWarning)
        scaler.watch(m)  # once per model


def test_masters_only_for_low_precision_params():
    m = fastamp.cast_model(_net(), torch.float16)
    opt = fastamp.optim.AdamW(m.parameters(), lr=1e-3)
    scaler = fastamp.Scaler()
    loss = m(torch.randn(4, 2, 5, 5)).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    for p in m.parameters():
        st = opt.state[p]
        assert ("master_param" in st) == (p.dtype == torch.float16)


# ---------------------------------------------------------------------------------------------
# A small CNN with BatchNorm, trained in fp16 with fastamp.Scaler + fastamp.optim.AdamW (fp32
# masters for every low-precision param in both variants). The inputs are raw 12-bit sensor
# values (0..4095, not normalised), so the first BatchNorm sees a per-channel variance around
# 1e6. fp32 statistics hold it; fp16 running_var (max 65504) overflows to inf at the first
# momentum update, and from then on the layer outputs a constant in eval mode.


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def _cnn_data(n=128):
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.rand(n, 3, 8, 8, generator=g) * 4095
    for c in range(3):  # class c brightens channel c; class 3 brightens none
        x[:, c] += (y == c)[:, None, None] * 1200
    return x, y


def _train(model, x, y, steps=12):
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = fastamp.Scaler()

    def eval_loss():
        model.eval()
        with torch.no_grad():
            out = model(x).float()
        model.train()
        return nn.functional.cross_entropy(out, y).item(), out

    eval_before, _ = eval_loss()
    train = []
    for s in range(steps):
        i = torch.arange(s * 32 % len(y), s * 32 % len(y) + 32)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[i]).float(), y[i])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        train.append(loss.item())
    eval_after, out = eval_loss()
    return train, eval_before, eval_after, out, int(scaler.skipped_steps)


def test_cnn_with_batchnorm_trains_in_fp16_with_cast_model_but_not_with_half():
    x, y = _cnn_data()
    chance = math.log(4)

    cast = fastamp.cast_model(_cnn(), torch.float16)
    train, before, after, out, skips = _train(cast, x, y)
    assert all(math.isfinite(v) for v in train) and torch.isfinite(out).all()
    assert sum(train[-4:]) / 4 < 0.75 * sum(train[:4]) / 4, train
    assert after < before - 0.15, (before, after)
    assert cast[1].running_var.dtype == torch.float32 and torch.isfinite(cast[1].running_var).all()
    assert skips == 0

    with pytest.warns(AmpPitfallWarning, match="norm_in_low_precision"):
        fastamp.Scaler().watch(half := _cnn().half())
    train_h, before_h, after_h, out_h, _ = _train(half, x.half(), y)
    # What really happens with .half(): training-mode forward normalises with the batch's own
    # statistics (computed in fp32 inside the kernel), so the training loss still falls...
    assert sum(train_h[-4:]) / 4 < sum(train_h[:4]) / 4
    # ...but the fp16 running variance overflowed, so in eval mode the first BatchNorm outputs
    # its bias whatever the input: every sample gets the same logits and the eval loss stays at
    # chance while the fp32-statistics model has learnt.
    assert torch.isinf(half[1].running_var).all()
    assert (out_h == out_h[0]).all()
    assert after_h > chance - 0.05 and after_h > after + 0.15, (after_h, after)
