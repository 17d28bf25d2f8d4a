"""Issue 12, items 2 and 9: lr schedules across a checkpoint resume, and cast_model with tied tensors."""

import warnings

import pytest
import torch
from torch import nn

import fastamp
from fastamp import schedule

# ---------------------------------------------------------------------------------------------
# 2. DeviceLR (and torch's schedulers on a tensor lr) across a checkpoint resume

STEPS, SAVE_AT = 14, 6
POISON = {1, 4, 5, 9}  # iterations whose grads get an inf: the scaler skips them
FN = schedule.warmup_cosine(3, 12, 0.1)


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _optimizer(kind, model, lr=0.05):
    if kind == "fastamp":
        return fastamp.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def _iteration(i, model, opt, scaler):
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    opt.zero_grad()
    scaler.scale((model(x) - y).square().mean()).backward()
    if i in POISON:
        model[0].bias.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()


def _lr(opt):
    return float(opt.param_groups[0]["lr"])


def _run(kind, start, stop, model, opt, scaler, sched, lrs):
    for i in range(start, stop):
        lrs.append(_lr(opt))
        _iteration(i, model, opt, scaler)
        sched.step()


def _checkpoint(tmp_path, **objs):
    path = tmp_path / "ckpt.pt"
    torch.save({k: v.state_dict() for k, v in objs.items()}, path)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("order", ["optimizer_first", "scheduler_first"])
@pytest.mark.parametrize("kind", ["fastamp", "torch"])
def test_device_lr_resumed_from_disk_follows_the_schedule_bit_for_bit(tmp_path, kind, order):
    model = _model(0)
    opt = _optimizer(kind, model)
    scaler = fastamp.Scaler(init_scale=2.0**8)
    sched = fastamp.DeviceLR(opt, FN, scaler)
    want = []
    _run(kind, 0, STEPS, model, opt, scaler, sched, want)
    # the schedule really moves over the resumed part (else a frozen lr could pass)
    assert len(set(want[SAVE_AT:])) > 4

    model = _model(0)
    opt = _optimizer(kind, model)
    scaler = fastamp.Scaler(init_scale=2.0**8)
    sched = fastamp.DeviceLR(opt, FN, scaler)
    got = []
    _run(kind, 0, SAVE_AT, model, opt, scaler, sched, got)
    ckpt = _checkpoint(tmp_path, model=model, opt=opt, sched=sched, scaler=scaler)
    del model, opt, scaler, sched

    # a new process: new model (other init), optimizer, scaler and scheduler, then the loads
    model = _model(1)
    model.load_state_dict(ckpt["model"])
    opt = _optimizer(kind, model)
    scaler = fastamp.Scaler(init_scale=2.0**8)
    scaler.load_state_dict(ckpt["scaler"])
    sched = fastamp.DeviceLR(opt, FN, scaler)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*DeviceLR")
        if order == "optimizer_first":  # torch's documented order
            opt.load_state_dict(ckpt["opt"])
            sched.load_state_dict(ckpt["sched"])
        else:
            sched.load_state_dict(ckpt["sched"])
            opt.load_state_dict(ckpt["opt"])
        _run(kind, SAVE_AT, STEPS, model, opt, scaler, sched, got)
    assert got == want
    assert opt.param_groups[0]["lr"] is sched.get_last_lr()[0]
    ref = _model(0)
    ref_opt = _optimizer(kind, ref)
    ref_scaler = fastamp.Scaler(init_scale=2.0**8)
    ref_sched = fastamp.DeviceLR(ref_opt, FN, ref_scaler)
    _run(kind, 0, STEPS, ref, ref_opt, ref_scaler, ref_sched, [])
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_device_lr_when_only_the_optimizer_is_loaded_continues_its_own_count_and_warns(tmp_path):
    model = _model(0)
    opt = _optimizer("fastamp", model)
    scaler = fastamp.Scaler(init_scale=2.0**8)
    sched = fastamp.DeviceLR(opt, FN, scaler)
    _run("fastamp", 0, SAVE_AT, model, opt, scaler, sched, [])
    ckpt = _checkpoint(tmp_path, model=model, opt=opt, scaler=scaler)

    model = _model(1)
    model.load_state_dict(ckpt["model"])
    opt = _optimizer("fastamp", model)
    scaler = fastamp.Scaler(init_scale=2.0**8)
    scaler.load_state_dict(ckpt["scaler"])
    sched = fastamp.DeviceLR(opt, FN, scaler)
    opt.load_state_dict(ckpt["opt"])  # ...and the user forgets sched.load_state_dict
    # the scheduler still drives the optimizer (a restarted schedule, not a frozen lr)
    assert opt.param_groups[0]["lr"] is sched.get_last_lr()[0]
    with pytest.warns(UserWarning, match="scheduler's state was not loaded"):
        _iteration(SAVE_AT, model, opt, scaler)  # applied: not in POISON
    sched.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per optimizer load
        lrs = []
        _run("fastamp", SAVE_AT + 1, SAVE_AT + 4, model, opt, scaler, sched, lrs)
    assert lrs == [float(0.05 * FN(torch.tensor(float(n)))) for n in (1, 2, 3)]


def test_device_lr_takes_group_lr_back_after_a_manual_replacement():
    model = _model(0)
    opt = _optimizer("fastamp", model)
    sched = fastamp.DeviceLR(opt, FN)
    opt.param_groups[0]["lr"] = 0.5  # like torch's closed-form schedulers: the next step() decides
    sched.step()
    assert opt.param_groups[0]["lr"] is sched.get_last_lr()[0]
    assert _lr(opt) == float(0.05 * FN(torch.tensor(1.0)))


@pytest.mark.parametrize("order", ["optimizer_first", "scheduler_first"])
def test_torch_scheduler_on_fastamp_tensor_lr_resumes(tmp_path, order):
    # torch's schedulers fill group["lr"] in place if it is a tensor, looked up at each step:
    # they follow the optimizer's loaded groups. Guards that, with SkipAwareLR on top.
    def build(seed):
        model = _model(seed)
        opt = fastamp.optim.AdamW(model.parameters(), lr=torch.tensor(0.05))
        scaler = fastamp.Scaler(init_scale=2.0**8)
        inner = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(FN(torch.tensor(float(s)))))
        return model, opt, scaler, fastamp.SkipAwareLR(inner, scaler)

    model, opt, scaler, sched = build(0)
    want = []
    _run("fastamp", 0, STEPS, model, opt, scaler, sched, want)
    final = [p.detach().clone() for p in model.parameters()]

    model, opt, scaler, sched = build(0)
    got = []
    _run("fastamp", 0, SAVE_AT, model, opt, scaler, sched, got)
    ckpt = _checkpoint(tmp_path, model=model, opt=opt, sched=sched, scaler=scaler)
    model, opt, scaler, sched = build(1)
    model.load_state_dict(ckpt["model"])
    scaler.load_state_dict(ckpt["scaler"])
    loads = [(opt, "opt"), (sched, "sched")]
    for obj, key in loads if order == "optimizer_first" else loads[::-1]:
        obj.load_state_dict(ckpt[key])
    _run("fastamp", SAVE_AT, STEPS, model, opt, scaler, sched, got)
    assert got == want and len(set(want)) > 4
    for p, q in zip(model.parameters(), final):
        assert torch.equal(p, q)


def test_device_lr_load_state_dict_rejects_bad_input_and_changes_nothing():
    model = _model(0)
    opt = _optimizer("fastamp", model)
    sched = fastamp.DeviceLR(opt, FN)
    for _ in range(3):
        sched.step()
    before = (sched.state_dict(), _lr(opt))
    torch_state = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), lambda s: 1.0
    ).state_dict()
    bad = [
        ({"applied_steps": 2}, ValueError, "missing \\['base_lrs'\\]"),
        (torch_state, ValueError, "torch LRScheduler's state dict"),
        ({"applied_steps": 2, "base_lrs": [0.1, 0.2]}, ValueError, "2 base lrs for 1 param groups"),
        ({"applied_steps": 2.5, "base_lrs": [0.1]}, ValueError, "applied_steps must be an integer"),
        ({"applied_steps": -1, "base_lrs": [0.1]}, ValueError, "applied_steps must be an integer in"),
        ({"applied_steps": 2**24 + 1, "base_lrs": [0.1]}, ValueError, "fp32-exact"),
        ({"applied_steps": True, "base_lrs": [0.1]}, TypeError, "applied_steps must be an integer"),
        ({"applied_steps": 2, "base_lrs": [float("nan")]}, ValueError, "base_lrs\\[0\\] must be finite"),
        ({"applied_steps": 2, "base_lrs": ["0.1"]}, TypeError, "base_lrs\\[0\\] must be a real number"),
        ([2, [0.1]], TypeError, "expected a dict"),
    ]
    for state, exc, match in bad:
        with pytest.raises(exc, match=match):
            sched.load_state_dict(state)
        assert (sched.state_dict(), _lr(opt)) == before, state
    sched.load_state_dict({"applied_steps": torch.tensor(5), "base_lrs": [torch.tensor(0.1)]})
    assert sched.state_dict() == {"applied_steps": 5, "base_lrs": [pytest.approx(0.1)]}


def test_device_lr_refuses_a_param_group_added_after_it():
    model = _model(0)
    opt = _optimizer("fastamp", model)
    sched = fastamp.DeviceLR(opt, FN)
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "lr": 0.1})
    with pytest.raises(ValueError, match="2 param groups, this scheduler was built for 1"):
        sched.step()
    assert int(sched.applied_steps) == 0


def test_skip_aware_lr_load_state_dict_rejects_bad_input_and_changes_nothing():
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = fastamp.Scaler()
    wrapped = fastamp.SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), scaler)
    good = wrapped.state_dict()["scheduler"]
    opt.step()
    wrapped.step()
    before = (wrapped.last_epoch, wrapped.skipped)
    for state in (
        {"scheduler": good, "skipped": -1},
        {"scheduler": good, "skipped": 1.5},
        {"skipped": 0},
        good,
    ):  # the last: the inner scheduler's dict
        with pytest.raises(ValueError, match="SkipAwareLR.load_state_dict"):
            wrapped.load_state_dict(state)
        assert (wrapped.last_epoch, wrapped.skipped) == before
    wrapped.load_state_dict({"scheduler": good, "skipped": torch.tensor(3)})
    assert (wrapped.last_epoch, wrapped.skipped) == (0, 3)


# ---------------------------------------------------------------------------------------------
# 9. cast_model and tied tensors


class TiedLM(nn.Module):
    """Embedding, a block, a norm and a head tied to the embedding (GPT-2 style)."""

    def __init__(self, tie="same"):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        if tie == "same":
            self.head.weight = self.emb.weight
        elif tie == "storage":
            self.head.weight = nn.Parameter(self.emb.weight.data)

    def forward(self, idx):
        return self.head(self.norm(torch.tanh(self.body(self.emb(idx)))))


def _lm_batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)


def _train_lm(model, opt, scaler, steps=3):
    idx, tgt = _lm_batch()
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(idx).float().flatten(0, 1), tgt.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss


def _assert_warned(seen, text):
    messages = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    assert any(text in m and "keep_fp32" in m for m in messages), messages


def test_tied_head_kept_fp32_keeps_the_embedding_fp32_too_and_trains():
    model = TiedLM("same")
    w = model.emb.weight
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fastamp.cast_model(model, torch.float16, keep_fp32=fastamp.DEFAULT_KEEP_FP32 + ("head",))
    assert model.head.weight is model.emb.weight is w and w.dtype == torch.float32
    _assert_warned(seen, "'emb' kept fp32 (parameter 'emb.weight' is tied to parameter 'head.weight')")
    assert model.body.weight.dtype == torch.float16 and model.norm.weight.dtype == torch.float32

    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2)
    before = w.detach().clone()
    loss = _train_lm(model, opt, fastamp.Scaler())
    assert torch.isfinite(loss) and not torch.equal(w, before)
    assert model.head.weight is model.emb.weight is w and w.dtype == torch.float32
    assert "master_param" not in opt.state[w]  # an fp32 param is its own master

    # naming both sides is the documented way to silence the warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastamp.cast_model(TiedLM("same"), torch.float16, keep_fp32=fastamp.DEFAULT_KEEP_FP32 + ("head", "emb"))


def test_tied_head_by_storage_kept_fp32_stays_one_memory_and_trains():
    model = TiedLM("storage")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fastamp.cast_model(model, torch.bfloat16, keep_fp32=fastamp.DEFAULT_KEEP_FP32 + ("head",))
    e, h = model.emb.weight, model.head.weight
    assert e is not h and e.dtype == h.dtype == torch.float32 and e.data_ptr() == h.data_ptr()
    _assert_warned(seen, "'emb' kept fp32")
    # torch updates two params over one memory one after the other: the memory stays shared
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = e.detach().clone()
    _train_lm(model, opt, fastamp.Scaler(enabled=False))
    assert e.data_ptr() == h.data_ptr() and torch.equal(e, h) and not torch.equal(e, before)


@pytest.mark.parametrize("tie", ["same", "storage", "transposed"])
def test_tied_tensors_cast_together_stay_tied(tie):
    torch.manual_seed(0)
    width = 6 if tie == "transposed" else 4
    model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 4, bias=False))
    if tie == "same":
        model[2].weight = model[0].weight
    elif tie == "storage":
        model[2].weight = nn.Parameter(model[0].weight.data)
    else:  # decoder weight = encoder weight transposed, as a view of the same memory
        model[2].weight = nn.Parameter(model[0].weight.data.t())
    enc, dec = model[0].weight, model[2].weight
    want_dec = dec.detach().to(torch.bfloat16)
    fastamp.cast_model(model, torch.bfloat16, keep_fp32=())
    assert model[0].weight is enc and model[2].weight is dec
    assert enc.dtype == dec.dtype == torch.bfloat16
    assert torch.equal(dec, want_dec)
    assert dec.data_ptr() == (enc.data_ptr() if tie != "transposed" else enc.t().data_ptr())
    if tie == "transposed":
        assert dec.stride() == enc.t().stride()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, 4)
    for _ in range(2):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    assert torch.equal(dec, enc if tie != "transposed" else enc.t())


def test_buffer_shared_with_a_kept_module_stays_fp32_and_shared():
    class Scale(nn.Module):
        def __init__(self, table):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("table", table)

        def forward(self, x):
            return self.lin(x) * self.table

    table = torch.full((4,), 0.5)
    model = nn.Sequential(Scale(table), nn.Tanh(), Scale(table))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fastamp.cast_model(model, torch.float16, keep_fp32=("2",))
    assert model[0].table is model[2].table and model[0].table.dtype == torch.float32
    _assert_warned(seen, "'0' kept fp32 (buffer '0.table' is tied to buffer '2.table')")
    assert model[0].lin.weight.dtype == torch.float32  # '0' is kept as a whole
    assert model(torch.randn(2, 4)).dtype == torch.float16

    # both cast: one new buffer, still shared (today each module got its own copy)
    model = nn.Sequential(Scale(table), nn.Tanh(), Scale(table))
    fastamp.cast_model(model, torch.float16, keep_fp32=())
    assert model[0].table is model[2].table and model[0].table.dtype == torch.float16


def test_tie_errors_name_both_sides_and_change_nothing():
    class RootTied(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 4, bias=False)
            self.proj = self.head.weight  # a tensor of the model itself

        def forward(self, x):
            return self.head(x @ self.proj)

    model = RootTied()
    with pytest.raises(ValueError, match="parameter 'proj' of the model itself is tied to parameter 'head.weight'"):
        fastamp.cast_model(model, torch.float16, keep_fp32=("head",))
    assert model.proj.dtype == torch.float32 and not getattr(model, "_fastamp_cast_handles", [])

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(2, 4, bias=False))
    model[1].weight = nn.Parameter(model[0].weight.data.view(torch.float16))  # one memory, two dtypes
    w0 = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match="'0.weight' \\(torch.float32\\) and parameter '1.weight' \\(torch.float16\\)"):
        fastamp.cast_model(model, torch.bfloat16, keep_fp32=())
    assert model[0].weight.dtype == torch.float32 and torch.equal(model[0].weight, w0)
    assert model[0].bias.dtype == torch.float32  # nothing else was cast either


def test_lazy_meta_and_untied_models_cast_as_before():
    # guards for the tie analysis: placeholders and meta tensors hold no memory to tie
    lazy = nn.Sequential(nn.LazyLinear(4), nn.LayerNorm(4))
    fastamp.cast_model(lazy, torch.float16)
    assert lazy[0].weight.dtype == torch.float16 and lazy[1].weight.dtype == torch.float32
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    fastamp.cast_model(meta, torch.bfloat16)
    assert [p.dtype for p in meta.parameters()] == [torch.bfloat16] * 4 + [torch.float32] * 2
    # one flat memory holding a kept and a cast param that do not overlap is not a tie
    flat = torch.randn(20 + 4)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.LayerNorm(4, bias=False))
    model[0].weight = nn.Parameter(flat[:16].view(4, 4))
    model[1].weight = nn.Parameter(flat[20:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastamp.cast_model(model, torch.float16)
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
