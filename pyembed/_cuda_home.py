"""Where the CUDA toolkit is (DESIGN §5). Used by setup.py (loaded by path, before the
package is built) and by the tests that run nvcc.

The nvcc on PATH may be a wrapper script whose parent folder has no libraries, so
torch's own guess (nvcc's grandparent) can miss ``lib64/libcudart.so`` and the link
fails with ``cannot find -lcudart``. The first candidate holding both wins.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional


def find_cuda_home() -> Optional[str]:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in filter(None, candidates):
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
            os.path.join(home, "lib64", "libcudart.so")
        ):
            return home
    return None
