"""``python -m pyembed.info``: what this installation can run, and why a backend cannot."""

import torch

import pyembed
from pyembed import dispatch


def main() -> None:
    info = pyembed.build_info()
    print(f"pyembed {pyembed.__version__}: runs with torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"built against torch {info['torch_built_against']} (CUDA {info['cuda_version']})")
    for key, value in info.items():
        print(f"  {key}: {value}")
    print(f"GPU visible: {torch.cuda.is_available()}")
    print(f"available backends: {pyembed.available_backends()}")
    for name in dispatch.BACKEND_NAMES:
        reason = dispatch.why_unavailable(name)
        if reason is not None:
            print(f"  {name}: unavailable: {reason}")


if __name__ == "__main__":
    main()
