"""Moment storage formats of the fused optimizers: what a moment stores, and how it is made, checked and converted.

A moment ``key`` of a param (``"exp_avg"``, ``"exp_avg_sq"``) is stored in one format:

* :data:`FP32` / :data:`BF16`: one tensor ``state[key]`` shaped like the param;
* :data:`Q8`: 8-bit block-scaled codes (:mod:`fastamp.reference.q8`): ``state[key + "_q"]``
  uint8 shaped like the param and ``state[key + "_scale"]`` uint8 ``[ceil(n / 32)]`` (one byte
  per block of 32 elements of the flattened param); ``exp_avg_sq`` codes its square root. The
  key names are those of ``fastamp/reference/layout.py`` (and the design's state dict): a
  q8 state never holds a tensor under the plain key, so no tool mistakes codes for values.

DTensor params (FSDP2): the codes are a DTensor sharded like the param and the scales a
DTensor of :func:`scale_shape`, sharded like it too, so that each rank's kernel reads the codes
and scales of its own shard (see :func:`scale_shape` for the params q8 can shard).

The checks, the conversions between formats (a group's ``state_format`` changed, a state dict
of another format loaded), the fp32 export of ``state_dict(moment_format="fp32")`` and the
bytes per param all ask the format, so the rest of the optimizer does not assume that a
moment is one tensor shaped like its param.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastamp._dtensor import is_dtensor, local_of, sharded_like
from fastamp.optim.engine.checks import where_of

CODES = "_q"
SCALE = "_scale"


def scale_shape(p: Tensor) -> tuple[int, ...] | None:
    """The shape of a q8 moment's block scales for ``p``; None where q8 cannot keep ``p``'s moments.

    A plain param: ``(ceil(n / 32),)``, one byte per block of 32 of its flattened elements.

    A DTensor param (FSDP2): each rank's kernel quantises its local shard in blocks of 32 from
    the shard's first element, so the shards must start on the param's block boundaries for
    the blocks (and the bits, with ``state_rounding="nearest"``) to be those of one process:
    a replicated param keeps ``(ceil(n / 32),)``, replicated; a param sharded on dim 0 only
    (FSDP2's ``Shard(0)``, on any mesh dims) whose rows hold a multiple of 32 elements has
    scales ``(rows, row_numel // 32)`` sharded like it, so a row's scales stay with its codes
    when ``torch.distributed.checkpoint`` reshards both. Any other DTensor (sharded on another
    dim, rows of another length, a 0-dim or empty param): None, and it keeps fp32 moments.
    """
    from fastamp.reference.q8 import BLOCK, num_blocks

    if not is_dtensor(p):
        return (num_blocks(p.numel()),)
    from torch.distributed.tensor import Replicate, Shard

    placements = p.placements
    if all(type(pl) is Replicate for pl in placements):
        return (num_blocks(p.numel()),)
    if p.dim() == 0 or p.shape[0] == 0:
        return None
    if not all(type(pl) is Replicate or (type(pl) is Shard and pl.dim == 0) for pl in placements):
        return None
    row = p.numel() // p.shape[0]
    return (p.shape[0], row // BLOCK) if row % BLOCK == 0 else None


def _local_scale_shape(p: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of this rank's shard of scales of global ``shape`` (:func:`scale_shape`) for DTensor ``p``."""
    return (local_of(p).shape[0], shape[1]) if len(shape) == 2 else shape


class MomentFormat:
    """One storage format of a moment. Subclasses: :class:`Dense`, :class:`Q8Format`."""

    name = ""

    def keys(self, key: str) -> tuple[str, ...]:
        """The state keys that hold moment ``key``."""
        return (key,)

    def create(self, p: Tensor, key: str) -> dict[str, Tensor]:
        raise NotImplementedError

    def decode(self, st: dict[str, Any], key: str) -> Tensor:
        """The moment as fp32, shaped like the stored codes (exact: every format decodes exactly to fp32)."""
        raise NotImplementedError

    def encode(self, p: Tensor, key: str, value: Tensor) -> dict[str, Tensor]:
        """``value`` (any float dtype, shaped like ``p``) stored in this format, rounded to nearest-even."""
        raise NotImplementedError

    def bytes_per_element(self) -> float:
        raise NotImplementedError


class Dense(MomentFormat):
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = str(dtype).replace("torch.", "")

    def create(self, p: Tensor, key: str) -> dict[str, Tensor]:
        from fastamp.optim.formats.masters import state_zeros

        return {key: state_zeros(p, self.dtype)}

    def decode(self, st: dict[str, Any], key: str) -> Tensor:
        return st[key].float()

    def encode(self, p: Tensor, key: str, value: Tensor) -> dict[str, Tensor]:
        from fastamp.optim.formats.masters import state_copy

        return {key: state_copy(p, value, self.dtype)}

    def bytes_per_element(self) -> float:
        return torch.empty((), dtype=self.dtype).element_size()


class Q8Format(MomentFormat):
    name = "q8"

    def keys(self, key: str) -> tuple[str, ...]:
        return (key + CODES, key + SCALE)

    @staticmethod
    def _second(key: str) -> bool:
        return key.endswith("_sq")

    def create(self, p: Tensor, key: str) -> dict[str, Tensor]:
        from fastamp.reference import q8

        floor = q8.W_SCALE_MIN if self._second(key) else q8.M_SCALE_MIN
        if is_dtensor(p):
            from fastamp.optim.formats.masters import state_zeros

            shape = scale_shape(p)
            local = torch.full(_local_scale_shape(p, shape), floor, dtype=torch.uint8, device=local_of(p).device)
            return {key + CODES: state_zeros(p, torch.uint8), key + SCALE: sharded_like(p, local, shape)}
        return {
            key + CODES: torch.zeros(p.shape, dtype=torch.uint8, device=p.device),
            key + SCALE: torch.full((q8.num_blocks(p.numel()),), floor, dtype=torch.uint8, device=p.device),
        }

    def decode(self, st: dict[str, Any], key: str) -> Tensor:
        """The moment as fp32 (for DTensor codes: a DTensor like them, each rank decoding its shard)."""
        from fastamp.reference import q8

        dec = q8.q8_decode_v if self._second(key) else q8.q8_decode_m
        codes, scales = st[key + CODES], st[key + SCALE]
        if is_dtensor(codes):
            out = dec(local_of(codes), local_of(scales).reshape(-1))
            return sharded_like(codes, out, tuple(codes.shape))
        return dec(codes, scales)

    def encode(self, p: Tensor, key: str, value: Tensor) -> dict[str, Tensor]:
        if is_dtensor(p):  # each rank encodes its shard of value, sharded like p
            if not is_dtensor(value):
                raise TypeError(f"q8: the moment {key!r} of a DTensor param must be given as a DTensor")
            value = value.detach()
            if value.placements != p.placements:
                value = value.redistribute(p.device_mesh, p.placements)
            codes, scales = self.encode_rounded(key, local_of(value).reshape(local_of(p).shape))
            shape = scale_shape(p)
            return {
                key + CODES: sharded_like(p, codes.contiguous(), tuple(p.shape)),
                key + SCALE: sharded_like(p, scales.reshape(_local_scale_shape(p, shape)).contiguous(), shape),
            }
        codes, scales = self.encode_rounded(key, value.detach().reshape(p.shape))
        return {key + CODES: codes.contiguous(), key + SCALE: scales.contiguous()}

    def encode_rounded(self, key: str, value: Tensor, rand16: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(codes, scales)`` of ``value`` (shaped as the codes), stochastically rounded by ``rand16`` (None: nearest even)."""
        from fastamp.reference import q8

        enc = q8.q8_encode_v if self._second(key) else q8.q8_encode_m
        return enc(value.float().contiguous(), rand16)

    def bytes_per_element(self) -> float:
        return 1.0 + 1.0 / 32


FP32 = Dense(torch.float32)
BF16 = Dense(torch.bfloat16)
Q8 = Q8Format()
_DENSE = {torch.float32: FP32, torch.bfloat16: BF16}


def held(st: dict[str, Any], key: str) -> MomentFormat | None:
    """The format ``st`` holds moment ``key`` in now (None: absent; checked by :func:`check_held` first)."""
    t = st.get(key)
    if t is None:
        return Q8 if key + CODES in st else None
    return _DENSE.get(t.dtype) or Dense(t.dtype)


def check_held(opt: Any, gi: int, i: int, p: Tensor, st: dict[str, Any], key: str) -> None:
    """Refuse a stored moment no format can read for ``p`` (changes nothing), naming the param and the key.

    A floating tensor ``st[key]`` shaped like the param (any float dtype: converted at the
    step), or q8 codes ``st[key + "_q"]`` (uint8, the param's shape, contiguous) with their
    scales ``st[key + "_scale"]`` (uint8, :func:`scale_shape`, contiguous), all on the
    param's device, DTensors sharded like it for a DTensor param; not both.
    """
    ckey, skey = key + CODES, key + SCALE
    t = st.get(key)
    if ckey in st or skey in st:
        if t is not None:
            raise ValueError(
                f"{opt._NAME}: {where_of(gi, i, p)}: its state holds moment {key!r} twice, as {key!r} and as q8 "
                f"codes {ckey!r}; keep one (`del opt.state[p][{key!r}]` or the q8 pair)"
            )
        for k in (ckey, skey):
            if k not in st:
                raise ValueError(
                    f"{opt._NAME}: {where_of(gi, i, p)}: its state has {skey if k == ckey else ckey!r} but no "
                    f"{k!r} (q8 codes and scales go together); reset its state (`del opt.state[p]`) or load both"
                )
        shape = scale_shape(p)
        if shape is None:
            raise ValueError(
                f"{opt._NAME}: {where_of(gi, i, p)}: its state holds q8 codes {ckey!r}, but its shards do not start "
                "on blocks of 32 elements (see fastamp.optim.formats.moments.scale_shape); reset its state "
                "(`del opt.state[p]`) or load fp32 moments"
            )
        opt._check_state_tensor(gi, i, p, ckey, st[ckey], torch.uint8, contiguous=True)
        opt._check_state_tensor(gi, i, p, skey, st[skey], torch.uint8, shape, contiguous=True)
        for k in (ckey, skey):
            v = st[k]
            if is_dtensor(v) != is_dtensor(p) or (
                is_dtensor(p) and (v.placements != p.placements or v.device_mesh != p.device_mesh)
            ):
                raise ValueError(
                    f"{opt._NAME}: {where_of(gi, i, p)}: its state {k!r} is "
                    f"{_sharding(v)} but the param is {_sharding(p)}: q8 codes and scales are sharded like their param"
                )
        return
    if t is not None and not (
        type(t) is Tensor and t.shape == p.shape and t.device == p.device and t.is_floating_point()
    ):
        opt._check_state_tensor(gi, i, p, key, t, None)


def _sharding(t: Tensor) -> str:
    return f"a DTensor with placements {tuple(t.placements)}" if is_dtensor(t) else "a plain tensor"


def convert(p: Tensor, st: dict[str, Any], key: str, target: MomentFormat) -> None:
    """Store moment ``key`` of ``p`` in ``target``: create it when absent, convert it (through fp32) when held otherwise."""
    have = held(st, key)
    if have is None:
        st.update(target.create(p, key))
        return
    if have is target and (target is Q8 or st[key].is_contiguous()):  # q8 state is checked contiguous
        return
    value = have.decode(st, key)
    for k in have.keys(key):
        st.pop(k, None)
    st.update(target.encode(p, key, value))


def export_fp32(st: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """A copy of ``st`` with every q8 / bf16 moment of ``keys`` decoded to fp32 (torch.optim.AdamW's layout)."""
    out = dict(st)
    for key in keys:
        fmt = held(st, key)
        if fmt is None or fmt is FP32:
            continue
        value = fmt.decode(st, key)
        for k in fmt.keys(key):
            out.pop(k, None)
        out[key] = value.contiguous()
    return out
