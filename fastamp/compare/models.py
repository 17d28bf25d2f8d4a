"""The models ``fastamp-compare`` trains: a GPT-style transformer and a CNN with BatchNorm."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.n_head))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style decoder: embeddings, pre-LN causal attention blocks, final LayerNorm, LM head."""

    def __init__(self, vocab: int, seq_len: int, n_layer: int, d_model: int, n_head: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear):
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


class SmallCNN(nn.Module):
    """conv-BN-ReLU x2, pool, conv-BN-ReLU x2, global pool, linear."""

    def __init__(self, width: int, n_classes: int = 10):
        super().__init__()
        w = width

        def cbr(cin, cout):
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        self.net = nn.Sequential(
            *cbr(3, w), *cbr(w, w), nn.MaxPool2d(2), *cbr(w, 2 * w), *cbr(2 * w, 2 * w), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(2 * w, n_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @staticmethod
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), y)


def bn_running_var_max(model: nn.Module) -> float | None:
    """Largest BatchNorm ``running_var`` entry of ``model`` (inf or nan when the statistics broke); None without BN."""
    vals = [
        m.running_var.detach().float().max()
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_var is not None and m.running_var.numel()
    ]
    if not vals:
        return None
    v = torch.stack(vals)
    return float(v.max()) if not torch.isnan(v).any() else float("nan")
