"""fastamp in Hugging Face transformers' ``Trainer`` on CPU: the README's recipe, run for real.

``Trainer(fp16=True, use_cpu=True)`` with ``fastamp.optim.AdamW`` and
``use_fastamp_scaler(trainer.accelerator)`` before ``train()``. The model is a tiny GPT-2
built from a config (no download); 12 optimizer steps of 2 accumulated micro-batches, an inf
planted in the first micro-batch of steps 3 and 8, growth every 2 clean steps, the Trainer's
default clip (``max_grad_norm=1.0``, which binds here) and a checkpoint at step 6. Reference
for the scale and the skips: the same Trainer with torch's ``GradScaler`` set up as Accelerate
sets it up on a GPU; for the resume: the uninterrupted run.
"""

import os

import pytest
import torch

# a model built from a config needs no hub; nothing here may reach the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

pytest.importorskip("transformers", reason="transformers is not installed (requirements-dev.txt pins it)")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from e2e._frameworks import assert_equal_optimizer_states, fresh_accelerate_state  # noqa: E402
from tolerances import NORM_RTOL  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import fastamp  # noqa: E402
from fastamp.integrations.accelerate import use_fastamp_scaler  # noqa: E402

STEPS = 12
ACCUMULATE = 2
SAVE_AT = 6
OVERFLOW_AT = (3, 8)  # optimizer steps (1-based) whose first micro-batch gets an inf
INIT_SCALE = 2.0**8  # low enough that nothing overflows by itself in 12 steps
GROWTH_INTERVAL = 2


@pytest.fixture(autouse=True)
def _quiet_and_fresh_accelerate_state():
    with fresh_accelerate_state():
        yield


def _model(seed=0):
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return GPT2LMHeadModel(config)


def _data():
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 64, (16,), generator=g) for _ in range(64)]
    return [{"input_ids": ids, "labels": ids} for ids in rows]


class _Probe(TrainerCallback):
    """Plants the infs and records, per optimizer step, what the run did.

    ``scales``: the scale after each step's update; ``applied``: whether the step changed any
    param; ``norms``: the norm of the unscaled grads, computed here in fp64 from the still
    scaled grads the fused clip leaves in place (fastamp's scaler only); ``micro_batches``: the
    backward passes seen.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.scales, self.applied, self.norms = [], [], []
        self.micro_batches = 0
        self._plant = False
        self._before = None
        weight = trainer.model.transformer.h[0].mlp.c_fc.weight
        weight.register_hook(self._grad_hook)

    def _grad_hook(self, grad):
        self.micro_batches += 1
        if self._plant:
            self._plant = False
            grad = grad.clone()
            grad.view(-1)[3] = float("inf")
        return grad

    def on_step_begin(self, args, state, control, **kwargs):
        self._plant = state.global_step + 1 in OVERFLOW_AT

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        params = [p for p in self.trainer.model.parameters()]
        self._before = [p.detach().clone() for p in params]
        scaler = self.trainer.accelerator.scaler
        if isinstance(scaler, fastamp.Scaler):
            scale = scaler.get_scale()
            sumsq = sum(p.grad.double().div(scale).square().sum() for p in params if p.grad is not None)
            self.norms.append(float(sumsq.sqrt()))

    def on_optimizer_step(self, args, state, control, **kwargs):
        after = list(self.trainer.model.parameters())
        self.applied.append(any(not torch.equal(a, b) for a, b in zip(after, self._before)))

    def on_step_end(self, args, state, control, **kwargs):
        self.scales.append(self.trainer.accelerator.scaler.get_scale())


def _trainer(out_dir, scaler="fastamp", seed=0):
    args = TrainingArguments(
        output_dir=str(out_dir),
        fp16=True,
        use_cpu=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=SAVE_AT,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    model = _model(seed)
    optimizer = fastamp.optim.AdamW(model.parameters(), lr=args.learning_rate)
    trainer = Trainer(model=model, args=args, train_dataset=_data(), optimizers=(optimizer, None))
    if scaler == "fastamp":
        use_fastamp_scaler(trainer.accelerator, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    else:
        # what Accelerate builds for fp16 on a GPU (autocast in the prepared forward, torch's
        # GradScaler); on CPU it builds neither
        trainer.accelerator.native_amp = True
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    probe = _Probe(trainer)
    trainer.add_callback(probe)
    return trainer, probe


def _step_logs(trainer):
    return [h for h in trainer.state.log_history if "grad_norm" in h]


def test_trainer_fp16_with_fastamp_scaler_and_adamw_resumes_bit_exactly(tmp_path):
    full, probe = _trainer(tmp_path / "full")
    scaler = full.accelerator.scaler
    full.train()
    logs = _step_logs(full)

    # the fastamp scaler drove every step, once per optimizer step (not per micro-batch)
    assert isinstance(scaler, fastamp.Scaler) and full.accelerator.scaler is scaler
    assert probe.micro_batches == STEPS * ACCUMULATE
    assert len(probe.scales) == len(logs) == STEPS
    # an inf in the first of two accumulated micro-batches skips that step, and only that step
    skipped = [step for step, applied in enumerate(probe.applied, 1) if not applied]
    assert skipped == list(OVERFLOW_AT)
    assert int(scaler.skipped_steps) == len(OVERFLOW_AT)
    # backoff at each overflow, growth after every 2 clean steps
    want, scale, clean = [], INIT_SCALE, 0
    for step in range(1, STEPS + 1):
        if step in OVERFLOW_AT:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == GROWTH_INTERVAL:
                scale, clean = scale * 2, 0
        want.append(scale)
    assert probe.scales == want

    # grad_norm logged every step: the pre-clip norm of the unscaled grads, non-finite on a
    # skipped step; the clip binds (norm > max_grad_norm) on some applied steps
    for step, (log, norm) in enumerate(zip(logs, probe.norms), 1):
        if step in OVERFLOW_AT:
            assert not torch.isfinite(torch.tensor(log["grad_norm"])), log
        else:
            assert log["grad_norm"] == pytest.approx(norm, rel=NORM_RTOL), (step, log, norm)
    assert max(log["grad_norm"] for step, log in enumerate(logs, 1) if step not in OVERFLOW_AT) > 1.0
    # the lr schedule does not advance on a skipped step (step_was_skipped of fastamp's wrapper)
    lrs = [log["learning_rate"] for log in logs]
    for step in OVERFLOW_AT:
        assert lrs[step] == lrs[step - 1]

    # against Accelerate's torch GradScaler path: the same scale trajectory and skips
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch_run, torch_probe = _trainer(tmp_path / "torch", scaler="torch")
    torch_run.train()
    assert torch_probe.scales == probe.scales
    assert torch_probe.applied == probe.applied

    # resume from the step-6 checkpoint in a fresh Trainer over a differently initialised model
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed, resumed_probe = _trainer(tmp_path / "resumed", seed=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{SAVE_AT}"))
    assert resumed_probe.scales == probe.scales[SAVE_AT:]
    assert resumed_probe.applied == probe.applied[SAVE_AT:]
    for name, value in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    assert_equal_optimizer_states(full.optimizer.state_dict(), resumed.optimizer.state_dict())
    assert resumed.accelerator.scaler.state_dict() == scaler.state_dict()  # plain numbers: scale, trackers, skips
    # the resumed Trainer's history holds the checkpoint's first 6 steps, then its own
    resumed_logs = [log for log in _step_logs(resumed) if log["step"] > SAVE_AT]
    assert len(resumed_logs) == STEPS - SAVE_AT
    for got, want_log in zip(resumed_logs, logs[SAVE_AT:]):
        for key in ("loss", "grad_norm", "learning_rate", "step"):
            assert got[key] == want_log[key], (key, got, want_log)
