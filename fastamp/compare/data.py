"""The data ``fastamp-compare`` trains on, generated here (no downloads), deterministic per step."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

_NOUNS = ["cat", "dog", "bird", "fox", "child", "farmer", "robot", "teacher", "horse", "baker"]
_VERBS = ["see", "like", "chase", "find", "follow", "help", "watch", "greet"]
_ADJS = ["small", "red", "quick", "lazy", "happy", "old", "bright", "quiet"]
_PLACES = ["in the garden", "near the river", "under the old tree", "on the hill", "by the gate"]
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _noun_phrase(rng: random.Random) -> tuple[str, bool]:
    plural = rng.random() < 0.4
    noun = rng.choice(_NOUNS) + ("s" if plural else "")
    adj = rng.choice(_ADJS) + " " if rng.random() < 0.5 else ""
    return f"the {adj}{noun}", plural


def synthetic_text(n_chars: int, seed: int = 0) -> str:
    """Text from a small grammar with agreement, attachment and arithmetic to learn.

    Subject-verb agreement ("the cats see" / "the cat sees"), optional adjectives and
    places, and sums ("three plus four is seven.") that need the operands to predict.
    """
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < n_chars:
        if rng.random() < 0.25:
            a, b = rng.randrange(10), rng.randrange(10)
            s = f"{_NUMBERS[a]} plus {_NUMBERS[b]} is {a + b}."
        else:
            subj, plural = _noun_phrase(rng)
            verb = rng.choice(_VERBS)
            verb = verb if plural else (verb + "es" if verb.endswith(("ch", "sh")) else verb + "s")
            obj, _ = _noun_phrase(rng)
            place = " " + rng.choice(_PLACES) if rng.random() < 0.4 else ""
            s = f"{subj} {verb} {obj}{place}."
        parts.append(s)
        total += len(s) + 1
    return " ".join(parts)[:n_chars]


class TextData:
    """Character-level next-token batches from :func:`synthetic_text`, deterministic per step."""

    def __init__(self, seq_len: int, batch: int, device: torch.device, seed: int = 0, n_chars: int = 200_000):
        text = synthetic_text(n_chars, seed)
        self.vocab = sorted(set(text))
        stoi = {c: i for i, c in enumerate(self.vocab)}
        data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(data))
        self.train, self.val = data[:split].to(device), data[split:].to(device)
        self.seq_len, self.batch, self.seed, self.device = seq_len, batch, seed, device

    def _batch(self, src: torch.Tensor, gen: torch.Generator, batch: int):
        idx = torch.randint(0, len(src) - self.seq_len - 1, (batch,), generator=gen)
        offs = torch.arange(self.seq_len + 1)
        rows = src[(idx[:, None] + offs[None, :]).to(src.device)]
        return rows[:, :-1], rows[:, 1:]

    def train_batch(self, step: int):
        return self._batch(self.train, torch.Generator().manual_seed(self.seed * 1_000_003 + step), self.batch)

    def val_batches(self, n: int = 8):
        gen = torch.Generator().manual_seed(self.seed + 12345)
        return [self._batch(self.val, gen, self.batch) for _ in range(n)]


class ImageData:
    """Synthetic 10-class colour images: a smooth per-class prototype, random contrast, shift and noise.

    ``bits=None``: normalised float pixels. ``bits=b``: the same images as raw b-bit sensor
    values, integers in [0, 2^b - 1] (mid-grey 2^(b-1), about 0.15 x 2^b per unit of the
    normalised image, clipped), stored as float32.
    """

    n_classes = 10

    def __init__(self, image: int, batch: int, device: torch.device, seed: int = 0, bits: int | None = None):
        gen = torch.Generator().manual_seed(seed + 7)
        low = torch.randn(self.n_classes, 3, 4, 4, generator=gen)
        self.protos = F.interpolate(low, size=(image, image), mode="bilinear", align_corners=False)
        self.image, self.batch, self.seed, self.device, self.bits = image, batch, seed, device, bits

    def _batch(self, gen: torch.Generator, batch: int):
        y = torch.randint(0, self.n_classes, (batch,), generator=gen)
        contrast = 0.5 + torch.rand(batch, 1, 1, 1, generator=gen)
        x = self.protos[y] * contrast
        shift = int(torch.randint(-2, 3, (1,), generator=gen))
        x = torch.roll(x, shifts=shift, dims=3)
        x = x + 1.5 * torch.randn(x.shape, generator=gen)
        if self.bits is not None:
            top = 2**self.bits - 1
            x = (0.5 * top + 0.15 * 2**self.bits * x).round().clamp(0, top)
        return x.to(self.device), y.to(self.device)

    def train_batch(self, step: int):
        return self._batch(torch.Generator().manual_seed(self.seed * 1_000_003 + step), self.batch)

    def val_batches(self, n: int = 8):
        gen = torch.Generator().manual_seed(self.seed + 12345)
        return [self._batch(gen, self.batch) for _ in range(n)]
