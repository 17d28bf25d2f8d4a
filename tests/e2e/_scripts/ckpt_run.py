"""Train / checkpoint / resume for tests/e2e/test_checkpoint.py (each call is a fresh process).

``python ckpt_run.py full N OUT``        run steps 0..N-1, save the final state to OUT
``python ckpt_run.py save K OUT``        run steps 0..K-1, save a checkpoint to OUT
``python ckpt_run.py resume CKPT N OUT`` load CKPT with torch.load(weights_only=True), run to N, save to OUT
Every regime (fp32, bf16 + fp32 masters, fp16 + fp32 masters) runs in each call.
"""

import sys

import torch

import fastamp

REGIMES = {"fp32": torch.float32, "bf16_master": torch.bfloat16, "fp16_master": torch.float16}
OVERFLOW_STEPS = {3, 4, 11}  # skipped steps on both sides of the checkpoint


def build(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 6)).to(dtype)
    opt = fastamp.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    scaler = fastamp.Scaler(init_scale=2.0**8, growth_interval=3, hysteresis=2)
    return model, opt, scaler


def train(model, opt, scaler, start, stop, dtype):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 12, generator=g).to(dtype)
        y = torch.randn(8, 6, generator=g).to(dtype)
        opt.zero_grad()
        loss = (model(x).float() - y.float()).square().mean()
        scaler.scale(loss).backward()
        if step in OVERFLOW_STEPS:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.clip_grad_norm_(opt, 5.0)
        scaler.step(opt)
        scaler.update()


def state(model, opt, scaler):
    return {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}


def main(argv):
    torch.set_num_threads(1)
    mode = argv[1]
    out = {}
    ckpt = torch.load(argv[2], weights_only=True) if mode == "resume" else None
    for name, dtype in REGIMES.items():
        model, opt, scaler = build(dtype)
        if mode == "resume":
            c = ckpt[name]
            model.load_state_dict(c["model"])
            opt.load_state_dict(c["opt"])
            scaler.load_state_dict(c["scaler"])
            train(model, opt, scaler, c["step"], int(argv[3]), dtype)
        else:
            n = int(argv[2])
            train(model, opt, scaler, 0, n, dtype)
        out[name] = dict(state(model, opt, scaler), step=int(argv[-2]))
    torch.save(out, argv[-1])


if __name__ == "__main__":
    main(sys.argv)
