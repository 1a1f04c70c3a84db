"""tests/test_convergence.py on a GPU: the tiny LM trained 300 steps on CUDA tensors
with the reference backend and with each CUDA backend (cuda, triton), same tolerance."""

import pytest
import torch

from pyembed import dispatch
from test_convergence import MODES, STEPS, assert_same_training, train_losses

CUDA_FAST = [b for b in dispatch.backends_for("cuda") if b != "reference"] if torch.cuda.is_available() else []


@pytest.mark.parametrize("mode", MODES)
def test_training_on_gpu_matches_reference(mode):
    # The rest of the model deterministic too (as far as CUDA allows), so only the input layer differs.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:  # a failure must not leave deterministic mode on for the tests after this one
        expected = train_losses(mode, "reference", device="cuda")
        assert CUDA_FAST, "no CUDA backend was built"
        for backend in CUDA_FAST:
            assert_same_training(train_losses(mode, backend, device="cuda"), expected, f"{mode} {backend} on GPU")
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(expected) == STEPS
