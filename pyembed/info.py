"""``python -m pyembed.info``: what this installation can run."""

import torch

import pyembed


def main() -> None:
    print(f"pyembed {pyembed.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    for key, value in pyembed.build_info().items():
        print(f"  {key}: {value}")
    print(f"GPU visible: {torch.cuda.is_available()}")
    print(f"available backends: {pyembed.available_backends()}")


if __name__ == "__main__":
    main()
