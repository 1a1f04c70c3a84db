"""A Triton driver that stands in for a GPU: Triton's real JIT compiles for sm_90 (ptxas
and all), but loading a binary names it by its bytes' hash and a launch is recorded, not
run. What it makes measurable without a GPU: which binary and arguments a launch gets
(tests/triton_launch_worker.py) and the host time around a launch (bench/triton_host.py).
A launch goes through Triton's own launcher object where this Triton's has the layout
known here (3.8's CudaLauncher, whose Python -- scratch allocation, argument annotations
-- is ~2.5 us a launch on the development VM): only its C part, the argument parsing and
cuLaunchKernelEx, is the stand-in's; elsewhere the whole launcher is.

Standalone (no pyembed import): the worker loads it by path from an installed copy's venv.
``install()`` must run before anything compiles a kernel; TRITON_INTERPRET must be unset.
"""

import hashlib

import torch
import triton
from triton.backends.compiler import GPUTarget

launches = []  # (grid, stream, binary, args) of each launch, when recording


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return 1, int(hashlib.sha1(kernel).hexdigest()[:12], 16), 32, 0, 1024  # module, function, regs, ...

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}


class StandInDriver:
    utils = _Utils()
    stream = 7
    record = True  # False: launches cost what a call of the launcher costs, nothing kept

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return self.stream

    def get_active_torch_device(self):
        return torch.device("cpu")

    def launcher_cls(self, src, metadata):
        driver = self

        def run(grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
                *args):
            if enter_hook is not None:  # as Triton's C launcher: hooks get the launch metadata
                enter_hook(launch_metadata)
            if driver.record:
                launches.append(((grid_0, grid_1, grid_2), stream, function, args))
            if exit_hook is not None:
                exit_hook(launch_metadata)

        launcher = _triton_launcher(src, metadata, run)
        return run if launcher is None else launcher


def _triton_launcher(src, metadata, run):
    """Triton's CudaLauncher for the kernel with its C launch replaced by ``run`` (given the
    same arguments as the stand-in's launcher), or None where that class is not 3.8's:
    its __call__ ends in ``launch(grid, stream, function, cooperative, pdl, metadata,
    launch metadata, hooks, scratch, profile scratch, annotations, signature, args)``. Its
    constructor's C helpers (argument annotations, the packed signature), which only the C
    launch reads, are stood in for while it runs: the driver's C module needs libcuda."""
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return None
    names = set(nvidia.CudaLauncher.__call__.__code__.co_names)
    if not {"arg_annotations", "kernel_signature", "launch_pdl"} <= names or not hasattr(nvidia, "PyKernelArg"):
        return None

    def launch(grid_0, grid_1, grid_2, stream, function, cooperative, pdl, packed_metadata, launch_metadata,
               enter_hook, exit_hook, global_scratch, profile_scratch, annotations, signature, args):
        run(grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)

    stand_ins = {"PyKernelArg": lambda nested_tuple, type: (nested_tuple, type), "ARG_CONSTEXPR": 0, "ARG_KERNEL": 1,
                 "ARG_TUPLE": 2}
    saved = {name: getattr(nvidia, name, None) for name in stand_ins}
    _Utils.launch = staticmethod(launch)  # what CudaLauncher.__init__ takes as its C launch
    _Utils.build_signature_metadata = staticmethod(lambda signature: bytes(len(signature)))
    try:
        for name, value in stand_ins.items():
            if saved[name] is None:
                setattr(nvidia, name, value)
        launcher = nvidia.CudaLauncher(src, metadata)
    finally:
        del _Utils.launch, _Utils.build_signature_metadata
        for name, value in saved.items():
            setattr(nvidia, name, value)
    return launcher if launcher.launch is launch else None


def install() -> StandInDriver:
    driver = StandInDriver()
    triton.runtime.driver.set_active(driver)
    return driver
