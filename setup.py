"""Build for pyembed-kernels (import name ``pyembed``).

Metadata lives in pyproject.toml; this file adds what needs code: the package layout
(top-level ``kernels/`` installed as ``pyembed.kernels``) and, later, the ``pyembed._C``
extension.
"""

from setuptools import setup

setup(
    packages=["pyembed", "pyembed.kernels"],
    package_dir={"pyembed": "pyembed", "pyembed.kernels": "kernels"},
)
