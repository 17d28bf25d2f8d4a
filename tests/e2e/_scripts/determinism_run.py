"""Native CPU kernels at a given intra-op thread count: ``python determinism_run.py THREADS OUT``.

Large multi-tensor inputs (so the kernels split the work across threads): the sum of squares
and found_inf of ``unscale_check_``, and a few ``adamw_`` steps with bf16 params and fp32
masters, written to OUT for comparison across runs and thread counts.
"""

import sys

import torch

import fastamp
from fastamp import functional as F
from fastamp import reference


def main(threads: int, out: str) -> None:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    sizes = [1, 17, 4096, 300_001, 65_536, 1_000_003]
    grads = [torch.randn(n, generator=g) * 3 for n in sizes]
    grads_bf = [x.bfloat16() for x in grads]
    found = torch.zeros(())
    inv = torch.full((), 2.0**-7)
    res = {}
    res["sumsq_fp32"] = F.unscale_check_(grads, found, inv, write_back=False, compute_sumsq=True, backend="native")
    res["sumsq_bf16"] = F.unscale_check_(grads_bf, found, inv, write_back=False, compute_sumsq=True, backend="native")
    res["found"] = found.clone()
    params = [x.bfloat16() for x in grads]
    masters = [x.float() for x in params]
    m = [torch.zeros(n) for n in sizes]
    v = [torch.zeros(n) for n in sizes]
    for step in range(1, 4):
        sc = reference.adamw_step_scalars(1e-3, torch.full((), float(step)), 0.9, 0.999, 0.01, None)
        gs = [torch.randn(n, generator=g) for n in sizes]
        F.adamw_(params, gs, masters, m, v, [], sc, None, beta1=0.9, beta2=0.999, eps=1e-8, backend="native")
    res.update(params=params, masters=masters, m=m, v=v)
    # a whole Scaler + AdamW step through the public API
    ps = [torch.nn.Parameter(x.clone()) for x in params[:4]]
    opt = fastamp.optim.AdamW(ps, lr=1e-3)
    scaler = fastamp.Scaler(init_scale=2.0**10)
    for step in range(3):
        scaler.scale(torch.ones(()))
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 2**10).bfloat16()
        res[f"norm{step}"] = scaler.clip_grad_norm_(opt, 1.0).clone()
        scaler.step(opt)
        scaler.update()
    res["api_params"] = [p.detach() for p in ps]
    torch.save(res, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
