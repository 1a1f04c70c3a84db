"""Link our C++ extensions against the shared C++ runtime (used by setup.py, loaded by
path before the package is built, and by the tests' emulation build).

A toolchain whose g++ finds ``libstdc++.a`` before any ``libstdc++.so`` links a private
copy of the C++ runtime into the extension (seen on the H100 machine: /opt/gcc's g++ 13
wrapper, whose ``-B`` folder holds the archive). The process already runs torch's
``libstdc++.so.6``; the two copies number ``std::locale``'s facets differently, so the
first error message that formats an integer (``c10::str`` of an int64 ->
``std::ostream::_M_insert<long>`` in the private copy) calls a wrong virtual function and
segfaults. Naming the shared runtime before the driver's implicit ``-lstdc++`` resolves
every runtime symbol there, and no archive member is pulled in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

# Formats an integer through a stream: what a static runtime would copy in.
PROBE = "#include <sstream>\n#include <string>\nstd::string probe(long x) { std::ostringstream s; s << x; return s.str(); }\n"


def link_args(cxx: str | None = None) -> list[str]:
    """``["-l:libstdc++.so.6"]`` when the compiler (``$CXX``, else ``c++``, as
    torch.utils.cpp_extension picks it) links a shared object without a shared C++
    runtime, else []. Decided by linking a probe, not by reading search paths: which file
    ``-lstdc++`` finds depends on the order of the folders the driver passes."""
    if not sys.platform.startswith("linux"):
        return []
    cxx = cxx or os.environ.get("CXX") or "c++"
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(PROBE)
        try:
            built = subprocess.run([cxx, "-shared", "-fPIC", src, "-o", out], capture_output=True, timeout=300)
        except (OSError, subprocess.SubprocessError):
            return []  # no such compiler: the build itself reports that better
        if built.returncode != 0 or not os.path.exists(out):
            return []
        with open(out, "rb") as f:
            probe = f.read()
    # A shared runtime is named in the probe's .dynstr (DT_NEEDED); libc++ is left alone.
    return [] if b"libstdc++.so.6" in probe or b"libc++.so" in probe else ["-l:libstdc++.so.6"]
