"""What pyembed._C is built from, as a digest: setup.py compiles the digest of csrc/ into
the extension (``_C.source_digest``), and at import pyembed/_extension.py compares it with
the csrc/ beside a checkout's package, where an extension built in place
(``pip install -e .``) goes stale when a ``git pull`` or ``git checkout`` changes the C++
sources and nothing rebuilds it. Loaded by path by setup.py (the package is not built yet)
and by tests/gpu/gpu_prepare.py, so it imports nothing of pyembed or torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def digest(paths, root: Path) -> str:
    """sha256 over each file's path (from ``root``) and bytes, in path order."""
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def csrc_digest(root: Path) -> str:
    """The digest of every file under ``root``/csrc (~0.5 ms for its ~300 KB)."""
    root = Path(root)
    return digest((p for p in (root / "csrc").rglob("*") if p.is_file()), root)
