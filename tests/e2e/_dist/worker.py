"""2-rank torch.distributed (gloo, CPU) scenarios for tests/e2e/test_distributed.py.

Run as ``python tests/e2e/_dist/worker.py OUT_DIR``: spawns 2 ranks on a free loopback port;
each rank runs every scenario and saves its results to ``OUT_DIR/rank{r}.pt``; rank 0 then
runs the single-process references and saves them to ``OUT_DIR/reference.pt``. The test
process only compares. Everything runs with one intra-op thread so that a rank's local
forward/backward and the reference's are the same kernels in the same order.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastamp

WORLD = 2
STEPS = 50
LOCAL_BATCH = 4
INJECT_AFTER_REDUCE = (7, 23)  # steps where rank 1 alone gets an inf in a grad after the reduce
INJECT_IN_INPUT = (15,)  # steps where rank 1's input holds an inf (DDP's all-reduce spreads it)
SHARDED_INJECT = (10, 31)  # steps where one rank's own shard gets an inf
CONTROL_STEPS = 6
CONTROL_INJECT = 2
EXACT_NORM_CASES = 200


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + 97 * step + rank)
    x = torch.randn(LOCAL_BATCH, 16, generator=g)
    y = torch.randn(LOCAL_BATCH, 8, generator=g)
    return x, y


def loss_fn(model, x, y):
    dtype = next(model.parameters()).dtype
    return (model(x.to(dtype)).float() - y).square().mean()


def make_scaler(**kw) -> fastamp.Scaler:
    return fastamp.Scaler(init_scale=2.0**10, growth_interval=5, **kw)


def params_of(model) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().clone())
    return out


def poison(t: torch.Tensor, value=float("inf")) -> None:
    t.view(-1)[3] = value


# ----------------------------------------------------------------------------- DDP


def run_ddp(rank: int, use_group: bool, steps: int, inject_after: tuple, inject_input: tuple):
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = make_scaler(process_group=dist.group.WORLD if use_group else None)
    scales, skipped = [], []
    for step in range(steps):
        x, y = batch(step, rank)
        if step in inject_input and rank == 1:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(loss_fn(model, x, y)).backward()
        if step in inject_after and rank == 1:
            poison(next(model.parameters()).grad)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(scaler.last_step_skipped)
    return {"scales": scales, "skipped": skipped, "params": params_of(model.module)}


def run_ddp_reference(steps: int, inject_after: tuple, inject_input: tuple):
    """One process, the same global batch as two micro-batches: grads summed then halved, as DDP."""
    model = make_model()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = make_scaler()
    scales, skipped = [], []
    full_model = make_model()
    full_opt = fastamp.optim.AdamW(full_model.parameters(), lr=1e-2)
    full_scaler = make_scaler()
    for step in range(steps):
        opt.zero_grad()
        full_opt.zero_grad()
        xs, ys = [], []
        for r in range(WORLD):
            x, y = batch(step, r)
            if step in inject_input and r == 1:
                x[0, 0] = float("inf")
            scaler.scale(loss_fn(model, x, y)).backward()
            xs.append(x)
            ys.append(y)
        for p in model.parameters():
            p.grad.div_(WORLD)
        if step in inject_after:
            poison(next(model.parameters()).grad)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(scaler.last_step_skipped)
        # the whole global batch in one forward (a different summation order in backward)
        full_scaler.scale(loss_fn(full_model, torch.cat(xs), torch.cat(ys))).backward()
        if step in inject_after:
            poison(next(full_model.parameters()).grad)
        full_scaler.step(full_opt)
        full_scaler.update()
    return {
        "scales": scales,
        "skipped": skipped,
        "params": params_of(model),
        "full_batch_params": params_of(full_model),
    }


# ----------------------------------------------------------------------------- ZeRO-style


def run_sharded(rank: int, max_norm: float, steps: int, inject: tuple, opt_kind: str):
    """Each rank owns every other param (optimizer state, grads, update); owners broadcast."""
    model = make_model()
    params = list(model.parameters())
    owned = [p for i, p in enumerate(params) if i % WORLD == rank]
    if opt_kind == "adamw":
        opt = fastamp.optim.AdamW(owned, lr=1e-2)
    else:
        opt = torch.optim.SGD(owned, lr=0.05, momentum=0.9)
    scaler = make_scaler(process_group=dist.group.WORLD, sharded=True)
    scales, skipped, norms = [], [], []
    for step in range(steps):
        x, y = batch(step, rank)
        for p in params:
            p.grad = None
        scaler.scale(loss_fn(model, x, y)).backward()
        for i, p in enumerate(params):
            dist.all_reduce(p.grad)  # reduce-scatter, written as all-reduce + drop
            p.grad.div_(WORLD)
            if i % WORLD != rank:
                p.grad = None
        if step in inject:
            victim = step % WORLD  # the rank whose shard overflows alternates
            if rank == victim:
                poison(owned[0].grad, float("nan") if step == inject[-1] else float("inf"))
        norms.append(scaler.clip_grad_norm_(opt, max_norm).clone())
        scaler.step(opt)
        scaler.update()
        for i, p in enumerate(params):
            dist.broadcast(p.data, src=i % WORLD)
        scales.append(scaler.get_scale())
        skipped.append(scaler.last_step_skipped)
    return {"scales": scales, "skipped": skipped, "norms": torch.stack(norms), "params": params_of(model)}


def run_sharded_reference(max_norm: float, steps: int, inject: tuple, opt_kind: str):
    model = make_model()
    params = list(model.parameters())
    if opt_kind == "adamw":
        opt = fastamp.optim.AdamW(params, lr=1e-2)
    else:
        # one optimizer over every param: per-param maths is identical to the two shards'
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    scaler = make_scaler()
    scales, skipped, norms = [], [], []
    for step in range(steps):
        opt.zero_grad()
        for r in range(WORLD):
            x, y = batch(step, r)
            scaler.scale(loss_fn(model, x, y)).backward()
        for p in params:
            p.grad.div_(WORLD)
        if step in inject:
            victim = step % WORLD
            poison(params[victim].grad, float("nan") if step == inject[-1] else float("inf"))
        norms.append(scaler.clip_grad_norm_(opt, max_norm).clone())
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(scaler.last_step_skipped)
    return {"scales": scales, "skipped": skipped, "norms": torch.stack(norms), "params": params_of(model)}


def _correctly_rounded_fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def run_exact_norm(rank: int):
    """Dyadic grads (every square and partial sum exact): the sharded norm is the correctly
    rounded square root of the exact sum of squares, on every rank and every CPU.

    The expected norms are computed without torch: the sum of squares as an integer, its
    root with ``math.sqrt`` (IEEE, correctly rounded in fp64 on every x86-64) and then
    rounded to fp32, which for a square root is the correctly rounded fp32 value. Many cases,
    so that a sqrt that is wrong on a few percent of inputs (torch's fp32 sqrt: ~17% on an
    AMD EPYC, ~0.7% on a Xeon) is caught.
    """
    norms, expected = [], []
    for case in range(EXACT_NORM_CASES):
        g = torch.Generator().manual_seed(77 + case)
        sizes = (1000, 37, 513, 64) if case == 0 else tuple(torch.randint(1, 200, (4,), generator=g).tolist())
        ints = [torch.randint(-16, 17, (n,), generator=g) for n in sizes]
        shift = 0 if case == 0 else int(torch.randint(-6, 7, (), generator=g))
        unit = 2.0 ** (shift - 3)  # grads k * 2**(shift-3): squares and sums exact in fp32
        full = [k.float() * unit for k in ints]
        mine = [torch.nn.Parameter(torch.zeros_like(t)) for i, t in enumerate(full) if i % WORLD == rank]
        for p, t in zip(mine, [t for i, t in enumerate(full) if i % WORLD == rank]):
            p.grad = t * 2.0**10  # still scaled
        opt = torch.optim.SGD(mine, lr=0.1)
        scaler = make_scaler(process_group=dist.group.WORLD, sharded=True)
        scaler.scale(torch.ones(()))
        norms.append(scaler.clip_grad_norm_(opt, 1e9).clone())
        sum_k2 = sum(int(v) ** 2 for k in ints for v in k.tolist())  # < 2**53: exact as a double
        expected.append(_correctly_rounded_fp32(math.sqrt(sum_k2)) * unit)
    return {"norms": torch.stack(norms), "expected": torch.tensor(expected, dtype=torch.float32)}


def run_no_grad_rank(rank: int):
    """Rank 0 has no grads at all this step; rank 1 overflows: rank 0 still joins and skips."""
    p = torch.nn.Parameter(torch.ones(10))
    opt = fastamp.optim.AdamW([p], lr=0.1)
    scaler = make_scaler(process_group=dist.group.WORLD, sharded=True)
    scaler.scale(torch.ones(()))
    if rank == 1:
        p.grad = torch.ones(10)
        p.grad[4] = float("inf")
    norm = scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    return {"skipped": scaler.last_step_skipped, "scale": scaler.get_scale(), "norm_finite": bool(norm.isfinite())}


# ----------------------------------------------------------------------------- FSDP2


def _fsdp2_optimizer(params, opt_kind: str):
    if opt_kind == "torch":
        return torch.optim.AdamW(params, lr=1e-2)
    if opt_kind.startswith(("fastamp_q8", "fastamp_ulp8")):
        # q8 moments rounded to nearest. model[2].weight ([8, 32]: rows of 32, 4 per rank) keeps them
        # sharded; the shards of the others (rows of 16, 1-D) do not start on q8's blocks of 32: fp32
        # moments, with a warning (asked for as such in the one-process reference, "..._ref"). ulp8:
        # model[2].weight gets an ulp8 master (its correction rounded to nearest), the others (no q8)
        # a remainder, as ulp8 gives params without q8 moments
        ulp8, ref = opt_kind.startswith("fastamp_ulp8"), opt_kind.endswith("ref")
        params = list(params)
        rest = [p for i, p in enumerate(params) if i != 2]
        second = {"params": rest, "state_format": None if ref else "q8"}
        if ulp8 and ref:
            second["master_weights"] = "remainder"
        return fastamp.optim.AdamW(
            [{"params": [params[2]]}, second], lr=1e-2, state_format="q8", lowbit_min_numel=0,
            state_rounding="nearest", master_weights="ulp8" if ulp8 else None,
        )  # fmt: skip
    if opt_kind == "fastamp_remainder":
        return fastamp.optim.AdamW(params, lr=1e-2, master_weights="remainder")
    return fastamp.optim.AdamW(params, lr=1e-2)  # fp32 params: no master; bf16: fp32 masters


def run_fsdp2(rank: int, steps: int, inject: tuple, opt_kind: str = "torch", dtype=torch.float32):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:  # torch < 2.6
        return {"error": f"fully_shard unavailable: {e}"}
    model = make_model().to(dtype)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = _fsdp2_optimizer(model.parameters(), opt_kind)
    scaler = make_scaler(process_group=dist.group.WORLD, sharded=True)
    scales, skipped, norms = [], [], []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in range(steps):
            x, y = batch(step, rank)
            opt.zero_grad()
            scaler.scale(loss_fn(model, x, y)).backward()
            if step in inject and rank == 1:
                poison(next(model.parameters()).grad._local_tensor)
            norms.append(scaler.clip_grad_norm_(opt, 1e9).clone())
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            skipped.append(scaler.last_step_skipped)
    out = {"scales": scales, "skipped": skipped, "norms": torch.stack(norms), "params": params_of(model)}
    out["warnings"] = [str(w.message) for w in warned]
    if opt_kind.startswith(("fastamp_q8", "fastamp_ulp8")):
        # model[2].weight's q8 state: (type, dtype, local shape, global shape, placements) per key
        q = list(model.parameters())[2]
        out["q8_state"] = {
            k: (type(v).__name__, v.dtype, tuple(v._local_tensor.shape), tuple(v.shape), _placements(v))
            for k, v in opt.state[q].items()
            if k != "step"
        }
        out["q8_param"] = (tuple(q._local_tensor.shape), _placements(q))
    if opt_kind.startswith("fastamp"):
        # the optimizer state of each param: sharded like it (DTensor), local shards the same size
        first = next(model.parameters())
        state = opt.state[first]
        out["state"] = {
            k: (type(v).__name__, v.dtype, tuple(v._local_tensor.shape) if hasattr(v, "_local_tensor") else None)
            for k, v in state.items()
        }
        out["param_local_shape"] = tuple(first._local_tensor.shape)
        out["masters"] = _masters(opt, model, lambda t: t.full_tensor())
        out["master_states"] = _master_states(opt, model, _full_int)
        # the state dict round-trips into a new optimizer over the same sharded params
        again = _fsdp2_optimizer(model.parameters(), opt_kind)
        again.load_state_dict(opt.state_dict())
        out["reload_equal"] = all(
            type(v) is type(again.state[p][k]) and torch.equal(v, again.state[p][k])
            for p in model.parameters()
            for k, v in opt.state[p].items()
        )
    return out


def _placements(t) -> tuple[str, ...]:
    return tuple(f"{type(pl).__name__}({getattr(pl, 'dim', '')})" for pl in t.placements)


def _masters(opt, model, full) -> list[torch.Tensor]:
    return [full(opt.state[p]["master_param"]).clone() for p in model.parameters() if "master_param" in opt.state[p]]


def _full_int(t):
    """``t.full_tensor()``, gathered as int32 for int16 / int8 (gloo, like NCCL, has no int16 collectives)."""
    if t.dtype not in (torch.int16, torch.int8):
        return t.full_tensor()
    wide = type(t).from_local(
        t._local_tensor.to(torch.int32), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )
    return wide.full_tensor().to(t.dtype)


def _master_states(opt, model, full) -> list[tuple[str, torch.Tensor]]:
    """Each param's master state (fp32 master, int16 remainder or int8 ulp8 correction), whole."""
    out = []
    for p in model.parameters():
        for k in ("master_param", "master_remainder", "master_ulp8"):
            if k in opt.state[p]:
                out.append((k, full(opt.state[p][k]).clone()))
    return out


def run_fsdp2_reference(steps: int, inject: tuple, opt_kind: str = "torch", dtype=torch.float32):
    model = make_model().to(dtype)
    opt = _fsdp2_optimizer(model.parameters(), opt_kind)
    scaler = make_scaler()
    scales, skipped, norms = [], [], []
    for step in range(steps):
        opt.zero_grad()
        for r in range(WORLD):
            x, y = batch(step, r)
            scaler.scale(loss_fn(model, x, y)).backward()
        for p in model.parameters():
            p.grad.div_(WORLD)
        if step in inject:
            poison(next(model.parameters()).grad)
        norms.append(scaler.clip_grad_norm_(opt, 1e9).clone())
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(scaler.last_step_skipped)
    out = {"scales": scales, "skipped": skipped, "norms": torch.stack(norms), "params": params_of(model)}
    if opt_kind.startswith("fastamp"):
        out["masters"] = _masters(opt, model, lambda t: t)
        out["master_states"] = _master_states(opt, model, lambda t: t)
    return out


# ----------------------------------------------------------------------------- driver

SCENARIOS = {
    "ddp": lambda r: run_ddp(r, True, STEPS, INJECT_AFTER_REDUCE, INJECT_IN_INPUT),
    "ddp_no_group": lambda r: run_ddp(r, False, CONTROL_STEPS, (CONTROL_INJECT,), ()),
    "sharded_adamw": lambda r: run_sharded(r, 1e9, STEPS, SHARDED_INJECT, "adamw"),
    "sharded_sgd_clip": lambda r: run_sharded(r, 0.05, STEPS, SHARDED_INJECT, "sgd"),
    "exact_norm": run_exact_norm,
    "no_grad_rank": run_no_grad_rank,
    "fsdp2": lambda r: run_fsdp2(r, STEPS, INJECT_AFTER_REDUCE),
    "fsdp2_fastamp": lambda r: run_fsdp2(r, STEPS, INJECT_AFTER_REDUCE, "fastamp"),
    "fsdp2_fastamp_bf16": lambda r: run_fsdp2(r, STEPS, INJECT_AFTER_REDUCE, "fastamp", torch.bfloat16),
    "fsdp2_fastamp_remainder": lambda r: run_fsdp2(r, STEPS, INJECT_AFTER_REDUCE, "fastamp_remainder", torch.bfloat16),
    "fsdp2_fastamp_ulp8": lambda r: run_fsdp2(r, STEPS, INJECT_AFTER_REDUCE, "fastamp_ulp8", torch.bfloat16),
    "fsdp2_fastamp_q8": lambda r: run_fsdp2(r, STEPS, INJECT_AFTER_REDUCE, "fastamp_q8", torch.bfloat16),
}

REFERENCES = {
    "ddp": lambda: run_ddp_reference(STEPS, INJECT_AFTER_REDUCE, INJECT_IN_INPUT),
    "sharded_adamw": lambda: run_sharded_reference(1e9, STEPS, SHARDED_INJECT, "adamw"),
    "sharded_sgd_clip": lambda: run_sharded_reference(0.05, STEPS, SHARDED_INJECT, "sgd"),
    "fsdp2": lambda: run_fsdp2_reference(STEPS, INJECT_AFTER_REDUCE),
    "fsdp2_fastamp": lambda: run_fsdp2_reference(STEPS, INJECT_AFTER_REDUCE, "fastamp"),
    "fsdp2_fastamp_bf16": lambda: run_fsdp2_reference(STEPS, INJECT_AFTER_REDUCE, "fastamp", torch.bfloat16),
    "fsdp2_fastamp_q8": lambda: run_fsdp2_reference(STEPS, INJECT_AFTER_REDUCE, "fastamp_q8_ref", torch.bfloat16),
    "fsdp2_fastamp_remainder": lambda: run_fsdp2_reference(
        STEPS, INJECT_AFTER_REDUCE, "fastamp_remainder", torch.bfloat16
    ),
    "fsdp2_fastamp_ulp8": lambda: run_fsdp2_reference(STEPS, INJECT_AFTER_REDUCE, "fastamp_ulp8_ref", torch.bfloat16),
}


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    for name, fn in SCENARIOS.items():
        try:
            results[name] = fn(rank)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    if rank == 0:
        refs = {}
        for name, fn in REFERENCES.items():
            try:
                refs[name] = fn()
            except Exception:
                refs[name] = {"error": traceback.format_exc()}
        torch.save(refs, os.path.join(out_dir, "reference.pt"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(_rank_main, args=(_free_port(), sys.argv[1]), nprocs=WORLD, join=True)
