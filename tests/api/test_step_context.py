"""fastamp.optim.engine.context: what a step derives from a grad scaler's grad_scale / found_inf."""

import math

import pytest
import torch

from fastamp.optim.engine.context import StepContext, counts_after, grad_mul
from fastamp.reference import inv_scale

CPU = torch.device("cpu")


class _Opt:
    _NAME = "Opt"


@pytest.mark.parametrize("flag, applied", [(0.0, 1), (1.0, 0), (-2.0, 0), (math.inf, 0), (math.nan, 0)])
def test_a_step_counts_only_where_the_flag_is_zero(flag, applied):
    ctx = StepContext("Opt", torch.tensor(1024.0), torch.tensor([flag], dtype=torch.float64))
    assert ctx.found_inf_on(CPU).dtype == torch.float32 and ctx.found_inf_on(CPU).shape == ()
    assert ctx.increment_on(CPU).item() == applied and ctx.increment_on(CPU).dtype == torch.float32
    assert ctx.rng_delta_on(CPU).tolist() == [0, applied] and ctx.rng_delta_on(CPU).dtype == torch.int64
    # made once per device and shared by the step's launches
    assert ctx.increment_on(CPU) is ctx.increment_on(CPU) and ctx.rng_delta_on(CPU) is ctx.rng_delta_on(CPU)
    assert counts_after(torch.tensor([0.0, 5.0]), ctx.found_inf).tolist() == [applied, 5.0 + applied]


def test_without_a_scaler_every_step_counts():
    opt = _Opt()
    ctx = StepContext.of(opt)
    assert ctx.grad_scale is None and ctx.found_inf is None
    assert ctx.found_inf_on(CPU) is None and ctx.increment_on(CPU) is None
    assert ctx.rng_delta_on(CPU).tolist() == [0, 1]
    assert counts_after(torch.tensor([3.0]), None).tolist() == [4.0]


def test_the_adapter_reads_torchs_attributes_and_checks_them():
    opt = _Opt()
    opt.grad_scale, opt.found_inf = torch.tensor([[3.0]]), 0  # torch's GradScaler hands the int 0 for no grads
    ctx = StepContext.of(opt)
    assert ctx.grad_scale.shape == () and ctx.found_inf.item() == 0.0
    assert torch.equal(grad_mul(ctx.grad_scale, CPU), inv_scale(torch.tensor(3.0)))
    opt.grad_scale = torch.ones(2)
    with pytest.raises(ValueError, match="Opt: grad_scale must be a 1-element tensor"):
        StepContext.of(opt)
    opt.grad_scale, opt.found_inf = None, torch.zeros((), dtype=torch.int32)
    with pytest.raises(TypeError, match="Opt: found_inf must be a floating point tensor"):
        StepContext.of(opt)
    opt.found_inf = True
    with pytest.raises(TypeError, match="Opt: found_inf must be a Tensor or None, got bool"):
        StepContext.of(opt)
