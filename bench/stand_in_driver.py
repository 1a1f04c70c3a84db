"""A Triton driver that stands in for a GPU: Triton's real JIT compiles for sm_90 (ptxas
and all), but loading a binary names it by its bytes' hash and a launch is recorded, not
run. What it makes measurable without a GPU: which binary and arguments a launch gets
(tests/triton_launch_worker.py) and the host time around a launch (bench/triton_host.py).

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
        return run


def install() -> StandInDriver:
    driver = StandInDriver()
    triton.runtime.driver.set_active(driver)
    return driver
