import os

import torch

# Triton kernels are tested on CPU under the interpreter; the variable must be set before
# triton (or fastamp.kernels) is imported. On a GPU machine the real device is used.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
