"""The Triton launchers' guards: what their launch tables rely on, checked cheaply.

``fastamp.ops.validate`` holds the user-facing checks (``fastamp.functional`` runs them before
it calls a launcher). A launcher called directly (``torch.ops.fastamp_triton.*``) still must
not hand its kernels a table of pointers to the wrong memory, so it checks device, dtype,
element count and contiguity here: terse messages, no second copy of those of ``fastamp.ops.validate``.
"""

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
F32 = (torch.float32,)


def guard(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise RuntimeError(f"fastamp_triton::{op}: {what} (fastamp.functional explains bad arguments)")


def guard_lists(op: str, device: torch.device, numels, lists) -> None:
    """Each ``(name, tensors, dtypes, contiguous)`` or ``(name, tensors, dtypes, contiguous, count)``
    of ``lists``: one strided tensor per param on ``device``, of ``dtypes``, with the param's element
    count (``numels``; ``count(numel)`` elements where given: q8 scale bytes), contiguous when the
    kernel reads it through the table as it is."""
    for name, tensors, dtypes, contiguous, *count in lists:
        guard(len(tensors) == len(numels), op, f"{len(tensors)} {name} for {len(numels)} params")
        for i, t in enumerate(tensors):
            want = count[0](numels[i]) if count else numels[i]
            ok = t.device == device and t.layout == torch.strided and t.dtype in dtypes and t.numel() == want
            if not ok or (contiguous and not t.is_contiguous()):
                guard(
                    False,
                    op,
                    f"{name}[{i}] must be a {'contiguous ' if contiguous else ''}strided tensor of {dtypes} with "
                    f"{want} elements on {device}, got {t.dtype} {t.layout} {tuple(t.shape)} on {t.device}",
                )


def guard_scalars(op: str, device: torch.device, step_scalars, n: int, count: int, found_inf, rng) -> int:
    """The optimizer launchers' device scalars: the step scalars, shared (``[count]`` floats) or one
    row per tensor (``[n, count]``, contiguous fp32), a 1-element found_inf, an int64 rng. Returns
    the step-scalar row stride: 0 (shared) or ``count``."""
    shape = tuple(step_scalars.shape)
    shared = shape == (count,) and step_scalars.is_floating_point()
    rows = shape == (n, count) and step_scalars.dtype == torch.float32 and step_scalars.is_contiguous()
    guard(
        (shared or rows) and step_scalars.device == device,
        op,
        f"step_scalars must hold {count} floats, shape [{count}] or [{n}, {count}] (contiguous fp32 rows), "
        f"on {device}, got {step_scalars.dtype} {shape} on {step_scalars.device}",
    )
    guard(found_inf is None or (found_inf.numel() == 1 and found_inf.device == device), op, "found_inf")
    guard(rng is None or (rng.dtype == torch.int64 and rng.numel() >= 2 and rng.device == device), op, "rng")
    return 0 if shared else count
