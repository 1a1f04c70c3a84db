"""Link our C++ extensions against the shared C++ runtime (used by setup.py, loaded by
path before the package is built, and by the tests' emulation build).

A toolchain whose g++ finds only ``libstdc++.a`` links a private copy of the C++ runtime
into the extension (seen on the H100 machine: /opt/gcc's g++ 13 wrapper). The process
already runs torch's ``libstdc++.so.6``; the two copies number ``std::locale``'s facets
differently, so the first error message that formats an integer (``c10::str`` of an
int64 -> ``std::ostream::_M_insert<long>`` in the private copy) calls a wrong virtual
function and segfaults. Naming the shared runtime before the driver's implicit
``-lstdc++`` resolves every runtime symbol there, and no archive member is pulled in.
"""

from __future__ import annotations

import os
import subprocess


def link_args(cxx: str | None = None) -> list[str]:
    """``["-l:libstdc++.so.6"]`` when the compiler (``$CXX``, else ``c++``, as
    torch.utils.cpp_extension picks it) has no ``libstdc++.so`` of its own, else []."""
    cxx = cxx or os.environ.get("CXX") or "c++"
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []  # no such compiler: the build reports that better
    # g++ prints the bare name back when no search directory holds the file.
    return [] if os.path.isabs(found) and os.path.exists(found) else ["-l:libstdc++.so.6"]
