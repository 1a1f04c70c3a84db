"""Compile the Triton kernels ahead of time for NVIDIA targets, without a GPU, and print
a JSON report per (kernel, arch): registers, spills and shared memory (ptxas -v on the
generated PTX, with the ptxas Triton ships) and the widths of its global accesses.

Run by tests/test_triton_aot.py in a subprocess: it needs TRITON_INTERPRET unset (the
interpreter replaces @triton.jit functions with eager Python ones).
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pyembed.kernels import embedding as k

ARCHS = (80, 90)
D16 = [["tt.divisibility", 16]]  # 16-byte aligned pointers, d divisible by 16


def forward_source(dtype: str, pos_mode: int):
    sig = {"ids_ptr": "*i64", "weight_ptr": f"*{dtype}", "pos_weight_ptr": f"*{dtype}", "position_ids_ptr": "*i64",
           "out_ptr": f"*{dtype}", "num_tokens": "i64", "seq_len": "i64", "num_embeddings": "i64",
           "num_positions": "i64", "dim": "i32", "offset": "i64", "scale": "fp32", "neg_log_base_over_dim": "fp32",
           "POS_MODE": "constexpr", "HAS_POSITION_IDS": "constexpr", "COMPUTE_F64": "constexpr",
           "BLOCK_T": "constexpr", "BLOCK_D": "constexpr"}
    block_t, block_d = k._blocks(768, pos_mode)
    consts = {"POS_MODE": pos_mode, "HAS_POSITION_IDS": False, "COMPUTE_F64": False, "BLOCK_T": block_t,
              "BLOCK_D": block_d}
    attrs = {(i,): D16 for i in (0, 1, 2, 3, 4, 9)}
    return ASTSource(k._embedding_forward_kernel, sig, consts, attrs)


def segment_source(src: str, dst: str):
    sig = {"src_ptr": f"*{src}", "src_rows_ptr": "*i64", "begin_ptr": "*i64", "end_ptr": "*i64",
           "dst_ptr": f"*{dst}", "dst_rows_ptr": "*i64", "factors_ptr": "*fp32", "dim": "i32",
           "HAS_SRC_ROWS": "constexpr", "HAS_DST_ROWS": "constexpr", "HAS_FACTORS": "constexpr",
           "COMPUTE_F64": "constexpr", "BLOCK_D": "constexpr"}
    consts = {"HAS_SRC_ROWS": True, "HAS_DST_ROWS": True, "HAS_FACTORS": True, "COMPUTE_F64": False,
              "BLOCK_D": k._blocks(768)[1]}
    return ASTSource(k._segment_sum_kernel, sig, consts, {(i,): D16 for i in (0, 4, 7)})


def batch_source(dtype: str):
    sig = {"dout_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "batch": "i64", "seq_len": "i64", "offset": "i64",
           "dim": "i32", "COMPUTE_F64": "constexpr", "BLOCK_D": "constexpr"}
    return ASTSource(k._batch_sum_kernel, sig, {"COMPUTE_F64": False, "BLOCK_D": k._blocks(768)[1]},
                     {(i,): D16 for i in (0, 1, 5)})


SOURCES = {
    "forward fp32 learned": lambda: forward_source("fp32", 1),
    "forward bf16 learned": lambda: forward_source("bf16", 1),
    "forward fp16 sinusoidal": lambda: forward_source("fp16", 2),
    "segment_sum bf16->fp32 partials": lambda: segment_source("bf16", "fp32"),
    "segment_sum fp32->bf16 final": lambda: segment_source("fp32", "bf16"),
    "batch_sum fp32": lambda: batch_source("fp32"),
}


def ptxas_report(ptx: str, arch: int) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        target = re.search(r"\.target (sm_\w+)", ptx).group(1)  # sm_90a for Hopper
        proc = subprocess.run([ptxas, f"-arch={target}", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    info = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", info)
    smem = re.search(r"(\d+) bytes smem", info)
    return {"registers": int(regs.group(1)), "spill_bytes": sum(map(int, spills)),
            "ptxas_smem": int(smem.group(1)) if smem else 0}


def main():
    report = {}
    for name, make in SOURCES.items():
        for arch in ARCHS:
            compiled = triton.compile(make(), target=GPUTarget("cuda", arch, 32))
            ptx = compiled.asm["ptx"]
            entry = {"shared": compiled.metadata.shared, **ptxas_report(ptx, arch),
                     "v4_loads": len(re.findall(r"ld\.global[\.\w]*\.v4\.", ptx)),
                     "v4_stores": len(re.findall(r"st\.global[\.\w]*\.v4\.", ptx))}
            report[f"{name} sm_{arch}"] = entry
    json.dump(report, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
