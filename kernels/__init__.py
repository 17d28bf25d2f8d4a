"""Triton kernels, installed as ``fastamp.kernels``.

Importing this package never imports Triton; :func:`available` and :func:`get_op` do, lazily.
The launchers check only what their launch tables rely on (``_guards.py``);
``fastamp.functional`` runs the user-facing checks of ``fastamp.ops.validate`` before it calls one.
Each op module (``amp.py``: the loss scaler's ops; ``optim.py``: the one optimizer kernel ``optim_``,
an update rule of ``rules.py`` x the formats of ``formats.py``, and the per-rule optimizer ops as
``optim_`` runs them) exposes functions with the same signatures as ``fastamp.reference``; each
registers its ``fastamp_triton`` ops (not the per-rule optimizer ops: no kernels of their own).
"""

from __future__ import annotations

import os
from typing import Callable

_OP_MODULES = {
    "unscale_check_": "amp",
    "update_scale_": "amp",
    "unscale_check_stats_": "amp",
    "optim_": "optim",
    # the per-rule optimizer ops: optim_ on their arguments (kernels/optim.py; no op of their own)
    "adamw_": "optim",
    "adamw_bf16_": "optim",
    "adamw_q8_": "optim",
    "sgd_": "optim",
    "sgd_q8_": "optim",
    "lion_": "optim",
    "lion_q8_": "optim",
}


def _triton_status() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as e:
        return False, f"triton is not importable ({type(e).__name__}: {e})"
    return True, f"triton {triton.__version__}"


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device_type: str) -> tuple[bool, str]:
    """Whether Triton kernels can run on ``device_type`` ('cuda', or 'cpu' under the interpreter)."""
    ok, why = _triton_status()
    if not ok:
        return ok, why
    if device_type == "cpu":
        if interpreted():
            return True, why + " (TRITON_INTERPRET=1)"
        return False, "Triton runs on CPU only under TRITON_INTERPRET=1"
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA device"
        if interpreted():
            return False, "TRITON_INTERPRET=1 is set: Triton would run on the host, not the GPU"
        return True, why
    return False, f"no Triton support for device type {device_type!r}"


def get_op(name: str) -> Callable | None:
    """The Triton implementation of ``name`` (signature as in ``fastamp.reference``), or None."""
    mod_name = _OP_MODULES.get(name)
    if mod_name is None or not _triton_status()[0]:
        return None
    import importlib

    try:
        mod = importlib.import_module(f"{__name__}.{mod_name}")
    except ModuleNotFoundError:
        return None
    return getattr(mod, name, None)
