"""Stand-ins for the names the documentation's examples leave to the reader.

The README writes ``MyModel()``, ``loader``, ``loss_fn`` ... where a user puts their own;
tests/e2e/test_docs_examples.py gives an example exactly the stand-ins it uses and nothing else
(no ``torch``, no ``fastamp``): a missing import in an example still fails.
"""

from __future__ import annotations


def _classifier_data(batches: int):
    import torch

    g = torch.Generator().manual_seed(0)
    n = 8 * batches
    data = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def _my_model():
    import torch

    class MyModel(torch.nn.Sequential):
        """A small classifier: 16 features in, 4 logits out."""

        def __init__(self):
            super().__init__(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    return MyModel


def _loss_fn():
    import torch

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.float(), target)

    return loss_fn


def _hf_model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))


def _hf_dataset():
    import torch

    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 64, (16,), generator=g) for _ in range(16)]
    return [{"input_ids": ids, "labels": ids} for ids in rows]


# name -> (what it stands for, how to make it)
PLACEHOLDERS = {
    "MyModel": ("the user's model class (nn.Module)", _my_model),
    "loader": ("the user's DataLoader of (inputs, targets)", lambda: _classifier_data(8)),
    "data": ("the user's DataLoader of (inputs, targets)", lambda: _classifier_data(4)),
    "loss_fn": ("the user's loss function (logits, targets) -> loss", _loss_fn),
    "model": ("a transformers model that returns a loss (HF Trainer examples)", _hf_model),
    "train_dataset": ("a transformers training dataset (HF Trainer examples)", _hf_dataset),
}


def make(names) -> dict:
    return {name: PLACEHOLDERS[name][1]() for name in names}
