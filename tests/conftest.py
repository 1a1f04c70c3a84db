"""Test set-up shared by every module.

TRITON_INTERPRET is read when triton is first imported, so it is set here, before any
test imports it: with no GPU, Triton kernels run on CPU tensors under the interpreter
(DESIGN §6).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI runs the same hypothesis examples every time (a red run must be reproducible);
# local runs explore new ones.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
