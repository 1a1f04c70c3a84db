"""Test set-up shared by every module.

TRITON_INTERPRET is read when triton is first imported, so it is set here, before any
test imports it: with no GPU, Triton kernels run on CPU tensors under the interpreter
(DESIGN §6).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
