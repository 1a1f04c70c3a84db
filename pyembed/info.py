"""``python -m pyembed.info``: what this installation can run."""

import torch

import pyembed


def main() -> None:
    info = pyembed.build_info()
    print(f"pyembed {pyembed.__version__}: runs with torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"built against torch {info['torch_built_against']} (CUDA {info['cuda_version']})")
    for key, value in info.items():
        print(f"  {key}: {value}")
    print(f"GPU visible: {torch.cuda.is_available()}")
    print(f"available backends: {pyembed.available_backends()}")


if __name__ == "__main__":
    main()
