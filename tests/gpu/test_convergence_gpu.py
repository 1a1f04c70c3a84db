"""tests/test_convergence.py on a GPU: the tiny LM trained 300 steps on CUDA tensors
with the reference backend and with each CUDA backend (cuda, triton), same tolerance.
One test per backend and mode, the reference's curve trained once a session (by whichever
worker asks first): at 26f0ba6 (H200) the two modes' tests, each training all three in
turn, took 77 and 40 s of the GPU test step's 217."""

import pytest
import torch

from pyembed import dispatch
from test_convergence import MODES, STEPS, assert_same_training, train_losses

CUDA_FAST = [b for b in dispatch.backends_for("cuda") if b != "reference"] if torch.cuda.is_available() else []


def deterministic_losses(mode: str, backend: str) -> list:
    # The rest of the model deterministic too (as far as CUDA allows), so only the input layer differs.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:  # a failure must not leave deterministic mode on for the tests after this one
        return train_losses(mode, backend, device="cuda").tolist()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("mode", MODES)
def test_training_on_gpu_matches_reference(mode, backend, once_per_session):
    assert backend in CUDA_FAST, f"the {backend} backend was not built (available: {CUDA_FAST})"
    expected = torch.tensor(once_per_session(f"reference-losses-gpu-{mode}",
                                             lambda: deterministic_losses(mode, "reference")), dtype=torch.float64)
    assert len(expected) == STEPS
    assert_same_training(torch.tensor(deterministic_losses(mode, backend), dtype=torch.float64), expected,
                         f"{mode} {backend} on GPU")
