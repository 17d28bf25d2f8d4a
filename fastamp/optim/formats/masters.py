"""Master weights of fastamp's fused optimizers: which master a param gets (fp32 copy, int16
remainder, none with stochastic rounding), how state is created like its param, and the
bookkeeping that creates, converts and re-syncs masters (:class:`_MasterWeights`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from fastamp._dtensor import on_shards
from fastamp.optim.engine.checks import LOW_PRECISION_DTYPES

_MASTER_KEYS = ("master_param", "master_remainder", "master_ulp8")
_MASTER_KEY_OF = {"fp32": "master_param", "remainder": "master_remainder", "ulp8": "master_ulp8"}


def master_kind(master_weights: Any, dtype: torch.dtype, stochastic_rounding: bool = False) -> str:
    """How a param of ``dtype`` is stored under a group's ``master_weights`` / ``stochastic_rounding``.

    ``"fp32"``: an fp32 master in ``state["master_param"]``; ``"remainder"``: a bf16 param
    whose exact fp32 master is ``join_master(param, state["master_remainder"])`` (int16);
    ``"sr"``: a bf16 param without master, rounded stochastically; ``"none"``: updated in
    place (fp32 maths, rounded to nearest-even once per step).

    ``True``: fp32 masters for fp16/bf16 params. ``None``: the same, except that bf16 params
    go without a master when ``stochastic_rounding`` is on. ``"remainder"``: int16
    remainders for bf16 params, fp32 masters for fp16 params (an fp16 value is not the top
    half of an fp32 one). ``False``: no masters. An fp32 param is its own master under
    every setting (not an error, so one group may mix dtypes).
    """
    if dtype not in LOW_PRECISION_DTYPES:
        return "none"
    sr = bool(stochastic_rounding) and dtype == torch.bfloat16
    if master_weights is True:
        return "fp32"
    if master_weights == "ulp8":  # with q8 states (the optimizers keep it only for large params)
        return "ulp8"
    if isinstance(master_weights, str):  # "remainder"
        return "remainder" if dtype == torch.bfloat16 else "fp32"
    if master_weights is None and not sr:
        return "fp32"
    return "sr" if sr else "none"


def uses_master(master_weights: Any, dtype: torch.dtype, stochastic_rounding: bool = False) -> bool:
    """Whether a param of ``dtype`` keeps a master (fp32 copy, int16 remainder or int8 ulp8 correction)."""
    return master_kind(master_weights, dtype, stochastic_rounding) in ("fp32", "remainder", "ulp8")


def unkept_master_keys(p: Tensor, group: dict) -> tuple[str, ...]:
    """The saved master keys ``load_state_dict`` drops for ``p``: both, where the loading group keeps no master."""
    kind = master_kind(group.get("master_weights"), p.dtype, group.get("stochastic_rounding", False))
    return () if kind in ("fp32", "remainder", "ulp8") else ("master_param", "master_remainder", "master_ulp8")


def state_zeros(p: Tensor, dtype: torch.dtype) -> Tensor:
    """Contiguous zeros shaped like ``p``; a DTensor with ``p``'s mesh and placements for a DTensor ``p``."""
    return torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)


def fp32_zeros_like(p: Tensor) -> Tensor:
    return state_zeros(p, torch.float32)


def state_copy(p: Tensor, value: Tensor, dtype: torch.dtype) -> Tensor:
    """A contiguous ``dtype`` copy of ``value`` laid out like ``p`` (a DTensor like ``p`` for a DTensor ``p``)."""
    return torch.empty_like(p, dtype=dtype, memory_format=torch.contiguous_format).copy_(value)


def fp32_copy_of(p: Tensor) -> Tensor:
    """A contiguous fp32 copy of ``p`` (exact: fp16/bf16 values are fp32 values)."""
    return state_copy(p, p.detach(), torch.float32)


class _MasterWeights:
    """The master-weight bookkeeping of :class:`~fastamp.optim.engine.base.FusedOptimizer` (see its doc)."""

    def _kind(self, group: dict[str, Any], p: Tensor) -> str:
        kind = master_kind(group["master_weights"], p.dtype, group["stochastic_rounding"])
        if kind == "ulp8" and not self._q8(group, p):
            # a param below lowbit_min_numel keeps dense states: it gets the exact master of
            # 'remainder' (a few bytes at these sizes), as the ulp8 configs were measured
            return "remainder" if p.dtype == torch.bfloat16 else "fp32"
        return kind

    @torch.no_grad()
    def reset_master_weights(self) -> None:
        """Re-sync every master to its param (call after changing params outside the optimizer).

        fp32 masters become copies of the params; remainders and ulp8 corrections become 0 (master == param).
        Needed after writes that bypass autograd version counters (``param.data.copy_``);
        other in-place writes are detected for remainder masters at the next step.
        """
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                if "master_param" in st:
                    st["master_param"].copy_(p.detach())
                for key in ("master_remainder", "master_ulp8"):
                    if key in st:
                        st[key].zero_()
                        self._param_versions[id(p)] = p._version
        self._plan = None

    def _init_master(self, p: Tensor, st: dict[str, Any], kind: str) -> None:
        """Create the master of ``kind`` for ``p``, or convert the one ``st`` holds (exactly where the
        target can hold it: an ulp8 correction is a rounding of the master it is made from)."""
        from fastamp import reference

        want = _MASTER_KEY_OF.get(kind)
        if want is None:
            for k in _MASTER_KEYS:
                st.pop(k, None)
            return
        if want not in st:
            master = None  # the exact fp32 value of the held master, None: the param itself
            if "master_param" in st:
                master = st["master_param"]
            elif "master_remainder" in st and p.dtype == torch.bfloat16:
                master = on_shards(reference.join_master, p.detach(), st["master_remainder"])
            elif "master_ulp8" in st and p.dtype in (torch.bfloat16, torch.float16):
                master = on_shards(reference.ulp8_decode, p.detach(), st["master_ulp8"])
            if kind == "fp32":
                st["master_param"] = fp32_copy_of(p) if master is None else master.contiguous()
            elif kind == "remainder":
                if master is None:
                    st["master_remainder"] = state_zeros(p, torch.int16)
                else:
                    hi, rem = on_shards(reference.split_master, master.contiguous())
                    p.copy_(hi)
                    if id(p) in self._param_versions:  # our own write: not a foreign one to re-sync after
                        self._param_versions[id(p)] = p._version
                    st["master_remainder"] = rem.contiguous()
            else:  # ulp8
                if master is None:
                    st["master_ulp8"] = state_zeros(p, torch.int8)
                else:
                    hi, corr = on_shards(lambda m: reference.ulp8_encode(m, p.dtype), master.contiguous())
                    p.copy_(hi)
                    if id(p) in self._param_versions:  # our own write: not a foreign one to re-sync after
                        self._param_versions[id(p)] = p._version
                    st["master_ulp8"] = corr.contiguous()
        for k in _MASTER_KEYS:
            if k != want:
                st.pop(k, None)

    def _resync_if_written(self, p: Tensor, st: dict[str, Any], where: str) -> None:
        seen = self._param_versions.get(id(p))
        if seen is not None and p._version != seen:
            key = "master_ulp8" if "master_ulp8" in st else "master_remainder"
            mode = "'ulp8'" if key == "master_ulp8" else "'remainder'"
            warnings.warn(
                f"{self._NAME}: {where} ({p.dtype}, master_weights={mode}) was written outside the optimizer "
                f"since its last step; its master is re-synced to the param ({key} := 0). Call "
                "reset_master_weights() after such writes to silence this.",
                stacklevel=3,
            )
            st[key].zero_()

    def _rng_ids(self) -> dict[int, int]:
        """The random-bit tensor id of every param: :meth:`_bf16_ids` for bf16 params, and
        ``2^24 +`` its index among all the optimizer's params for the others (q8 moments of fp32 and
        fp16 params round stochastically too); the two ranges never meet, so adding a non-bf16
        param changes no bf16 param's bits."""
        ids = self._bf16_ids()
        k = 0
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in ids:
                    ids[id(p)] = (1 << 24) + k
                k += 1
        return ids

    def _bf16_ids(self) -> dict[int, int]:
        """Stochastic-rounding tensor id of each bf16 param: its index among the optimizer's bf16 params.

        Stable across runs and data-parallel ranks (param order), and fp32/fp16 params in
        between do not split a launch.
        """
        ids: dict[int, int] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype == torch.bfloat16 and id(p) not in ids:
                    ids[id(p)] = len(ids)
        return ids
