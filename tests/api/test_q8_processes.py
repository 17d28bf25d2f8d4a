"""The 8-bit state across processes (issue 22): the same seed gives the same bits in two processes,
and a checkpoint resumed in a new process continues bit for bit.

Each run is a fresh ``python`` process (nothing of this process's RNG, caches or plans carries
over) covering every master kind in turn: a small model of bf16 params, AdamW with q8 moments rounded stochastically, and the
masters of every kind the q8 path has (``ulp8``, ``remainder``, none with stochastic rounding),
grads drawn from a seeded generator per step. One run does 6 steps; another does 3, saves
``opt.state_dict()`` and the params with ``torch.save``; a third process loads them with
``weights_only=True`` into a fresh optimizer and does the last 3. Params and every state tensor
must be bit-identical to the 6-step run's.
"""

import os
import subprocess
import sys

import torch
from helpers import assert_bits_equal

MASTERS = ("ulp8", "remainder", "none")
SCRIPT = r"""
import sys, torch, fastamp
mode, out, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
first, last = {"full": (0, 6), "head": (0, 3), "tail": (3, 6)}[mode]
saved = torch.load(ckpt, weights_only=True) if mode == "tail" else None
result = {}
for master in MASTERS:
    torch.manual_seed(0)
    shapes = [(64, 130), (4099,), (7,)]  # q8 with a partial block, q8 one element past a block, dense (small)
    params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in shapes]
    kw = dict(state_format="q8", state_rounding="stochastic", seed=1234, lr=3e-3, weight_decay=0.1)
    if master == "none":
        kw.update(master_weights=False, stochastic_rounding=True)
    else:
        kw.update(master_weights=master)
    opt = fastamp.optim.AdamW(params, **kw)
    if saved is not None:
        with torch.no_grad():
            for p, v in zip(params, saved[master]["params"]):
                p.copy_(v)
        opt.load_state_dict(saved[master]["opt"])
    for step in range(first, last):
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        opt.step()
    result[master] = {"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}
torch.save(result, ckpt if mode == "head" else out)
""".replace("MASTERS", repr(MASTERS))


def _run(tmp_path, mode, out, ckpt):
    env = dict(os.environ, PYTHONHASHSEED={"full": "1", "head": "2", "tail": "3"}[mode])  # set dict/set order apart
    subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(out), str(ckpt)],
        check=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k], f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


def _assert_same_bits(a, b):
    ta, tb = dict(_tensors(a)), dict(_tensors(b))
    assert ta.keys() == tb.keys()
    assert any("exp_avg_q" in k for k in ta)  # the q8 state is there, not only dense moments
    for k in ta:
        assert_bits_equal(ta[k], tb[k], k)


def test_same_seed_two_processes_agree_and_resume_in_a_new_process_is_bit_exact(tmp_path):
    _run(tmp_path, "full", tmp_path / "a.pt", tmp_path / "unused")
    _run(tmp_path, "full", tmp_path / "b.pt", tmp_path / "unused")
    _run(tmp_path, "head", tmp_path / "unused", tmp_path / "ckpt.pt")
    _run(tmp_path, "tail", tmp_path / "c.pt", tmp_path / "ckpt.pt")
    a, b, c, head = (torch.load(tmp_path / f, weights_only=True) for f in ("a.pt", "b.pt", "c.pt", "ckpt.pt"))
    for master in MASTERS:
        _assert_same_bits(a[master], b[master])  # two processes, same seed
        _assert_same_bits(a[master], c[master])  # 3 steps, checkpoint, 3 steps in a new process
        # the tail moved the params (a resume that did nothing would not be caught otherwise)
        assert not torch.equal(head[master]["params"][0], c[master]["params"][0]), master
