"""Static checks of the CUDA kernels, no GPU needed: nvcc compiles csrc/cuda for sm_80
and sm_90, and ptxas reports no register spills for any kernel (DESIGN §6). The
per-kernel registers are written to build/ptxas_report.txt."""

import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch.utils import cpp_extension

import pyembed
from pyembed._cuda_home import find_cuda_home

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_HOME = find_cuda_home()
ARCHS = ("80", "90")


@pytest.fixture(scope="module")
def ptxas_report(tmp_path_factory, once_per_session):
    """(ptxas -v's report, {arch: PTX}, {arch: {kernel: SASS}} for SASS_KERNELS), compiled
    once a test session (every worker's)."""
    if CUDA_HOME is None:
        pytest.skip("no CUDA toolkit (nvcc + libcudart) on this machine")
    return once_per_session("nvcc", lambda: _compile(tmp_path_factory.mktemp("nvcc")))


def _compile(out_dir):
    includes = cpp_extension.include_paths("cpu") + [str(pathlib.Path(CUDA_HOME) / "include"), str(ROOT / "csrc")]
    # One nvcc per architecture, side by side, each to a cubin: the device code alone (the
    # build's host compile and cudafe++ add nothing to ptxas's report), and two processes
    # overlap where nvcc --threads=2 mostly did not (2 cores: 87 -> 59 s, the parsed report
    # the same). -keep leaves each architecture's PTX in its folder for the vector-width checks.
    nvcc = str(pathlib.Path(CUDA_HOME) / "bin" / "nvcc")
    procs = {}
    for arch in ARCHS:
        keep = out_dir / f"sm_{arch}"
        keep.mkdir()
        cmd = [nvcc, "-cubin", str(ROOT / "csrc" / "cuda" / "embedding_cuda.cu"),
               "-o", str(keep / "embedding_cuda.cubin"), "-keep", f"-keep-dir={keep}", "-O3", "-std=c++20",
               "-Xptxas", "-v", "-D_GLIBCXX_USE_CXX11_ABI=1",
               f"-I{sys.prefix}/include", *cpp_extension.COMMON_NVCC_FLAGS, *[f"-I{p}" for p in includes],
               "-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        procs[arch] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    reports = {arch: proc.communicate()[1] for arch, proc in procs.items()}
    for arch, proc in procs.items():
        assert proc.returncode == 0, reports[arch][-4000:]
    ptx = {arch: (out_dir / f"sm_{arch}" / "embedding_cuda.ptx").read_text() for arch in ARCHS}
    sass = {arch: _sass(out_dir / f"sm_{arch}" / "embedding_cuda.cubin", SASS_KERNELS) for arch in ARCHS}
    return "".join(reports.values()), ptx, sass


# Kernels whose SASS the tests read (by a fragment of the mangled name): chunk_kernel's
# fp32 and bf16 forms with 16-byte rows (int32 keys, no dropout), whose long-segment pieces
# (sum_piece) must issue a batch's loads before its adds.
SASS_KERNELS = ("chunk_kernelIiffLi4ELb0E", "chunk_kernelIiN3c108BFloat16EfLi8ELb0E")


def _sass(cubin, fragments):
    """{fragment: the SASS of the kernel whose mangled name holds it}, by the cuobjdump
    Triton ships (this toolkit has none), or {} without Triton."""
    try:
        import triton
    except ImportError:
        return {}
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    names = re.findall(r"Function : (\w+)", subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True,
                                                            text=True, check=True).stdout)
    found = {}
    for fragment in fragments:
        name = next(n for n in names if fragment in n)
        found[fragment] = subprocess.run([str(tool), "-sass", "-fun", name, str(cubin)], capture_output=True,
                                         text=True, check=True).stdout
    return found


def _kernels(report):
    """{(kernel, arch): [registers, spill_store_bytes, spill_load_bytes]} from ptxas -v;
    spills of functions a kernel calls (e.g. sincos' slow path) count as the kernel's."""
    found, current = {}, None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for 'sm_(\d+)'", line)
        if m:
            current = m.groups()
            found[current] = [0, 0, 0]
        elif current and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            found[current][1] += int(m.group(1))
            found[current][2] += int(m.group(2))
        elif current and (m := re.search(r"Used (\d+) registers", line)):
            found[current][0] = int(m.group(1))
    return found


def test_cuda_kernels_compile_for_sm80_and_sm90_without_spills(ptxas_report):
    kernels = _kernels(ptxas_report[0])
    for arch in ARCHS:
        names = {k for k, a in kernels if a == arch}
        for family in ("embedding_forward_kernel", "sort_inputs_kernel", "segment_starts_kernel", "chunk_kernel",
                       "finish_segments_kernel", "finish_segments_dropout_kernel", "finish_segments_solo_kernel",
                       "batch_sum_kernel",
                       "few_tokens_gradient_kernel", "few_tokens_slots_kernel", "tile_rank_kernel",
                       "merge_tiles_kernel"):
            assert any(family in n for n in names), f"{family} not compiled for sm_{arch}"
    spilling = {k: v for k, v in kernels.items() if v[1] or v[2]}
    assert not spilling, f"kernels spill registers: {spilling}"
    lines = [f"{arch} {regs:4d} regs  {name}" for (name, arch), (regs, _, _) in sorted(kernels.items())]
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "ptxas_report.txt").write_text("\n".join(lines) + "\n")


def test_forward_without_sinusoid_or_dropout_keeps_full_occupancy(ptxas_report):
    # The forward is a template per positional mode and dropout, so the common call --
    # learned positions (or none), no dropout -- holds none of the sinusoid's or Philox's
    # registers: at most 32, 8 blocks of 256 threads per SM (52 when one kernel served every
    # mode: half the occupancy, which the bf16 forward's 74.7% DRAM throughput on an H100 showed).
    kernels = _kernels(ptxas_report[0])
    plain = {(name, arch): regs for (name, arch), (regs, _, _) in kernels.items()
             if "embedding_forward_kernel" in name and re.search(r"Li[01]ELb0E", name)}
    assert len(plain) == 2 * 4 * 2 * 2 * 2  # archs x dtypes x id types x vector widths x (none, learned)
    heavy = {kernel: regs for kernel, regs in plain.items() if regs > 32}
    assert not heavy, heavy


def test_extension_was_built_with_cuda_kernels():
    if CUDA_HOME is None or not torch.version.cuda:
        pytest.skip("no CUDA toolkit or a CPU-only torch: CUDA kernels are not built here")
    info = pyembed.build_info()
    assert info["cpu_built"] and info["cuda_built"], info
    assert "cuda" in pyembed.dispatch._registry


def _entry_body(ptx, name_fragment):
    """The PTX text of the first .entry whose mangled name contains name_fragment."""
    m = re.search(r"\.entry (\w*" + name_fragment + r"\w*)\((.*?)\n}\n", ptx, re.S)
    assert m, f"no kernel matching {name_fragment}"
    return m.group(0)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_moves_rows_with_128_bit_accesses(ptxas_report, arch):
    ptx = ptxas_report[1][arch]
    # fp32 rows with d % 4 == 0 (VEC=4) and bf16 rows with d % 8 == 0 (VEC=8): 16 bytes.
    for fragment in ("embedding_forward_kernelIfiLi4E", "embedding_forward_kernelIN3c108BFloat16EiLi8E"):
        body = _entry_body(ptx, fragment)
        assert re.search(r"ld\.global(\.nc)?\.v4\.", body), f"{fragment}: no 128-bit load"
        assert re.search(r"st\.global\.v4\.", body), f"{fragment}: no 128-bit store"
    scalar = _entry_body(ptx, "embedding_forward_kernelIfiLi1E")
    assert not re.search(r"\.v4\.", scalar)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_dense_backward_stores_every_pack_whole(ptxas_report, arch):
    """The dense backward's last kernel writes every row of the (V, d) gradient, and its
    learned positions' blocks the rows used by one token (those of 72-88% of the tokens at
    8x2048); the chunk pass writes the long segments' partial sums: 16 bytes per store on
    16-byte rows. nvcc 13 had split the one-token rows' stores into one per element
    (st.global.u16 x 8 for bf16, st.global.f32 x 4 for fp32) and float64 partials in two."""
    ptx = ptxas_report[1][arch]
    # a scalar store (cache qualifiers allowed, no vector width) at an offset into a pack
    element_store = re.compile(r"st\.global(\.(wb|cg|cs|wt))?\.(f32|f64|b16|u16|b32|u32)\s+\[%rd\d+\+\d+\]")
    fragments = [f"{kernel}{types}" for kernel in ("finish_segments_kernel", "finish_segments_dropout_kernel")
                 for types in ("IffLi4E", "IN3c108BFloat16EfLi8E", "IN3c104HalfEfLi8E", "IddLi2E")]
    fragments += [f"chunk_kernelIi{types}ELb{dropout}E" for types in ("ffLi4", "N3c108BFloat16EfLi8", "ddLi2")
                  for dropout in (0, 1)]
    for fragment in fragments:
        body = _entry_body(ptx, fragment)
        assert re.search(r"st\.global(\.wb)?\.v[24]\.", body), f"{fragment}: no 16-byte store"
        assert not element_store.search(body), f"{fragment}: a pack stored element by element"


def _registers(operand: str, width: int = 1) -> set:
    """The registers an operand names: R5 -> {R5}; R5.64 or a 64-bit result -> {R5, R6}."""
    found = set()
    for number, wide in re.findall(r"\bR(\d+)(\.64)?\b", operand):
        found.update(f"R{int(number) + i}" for i in range(2 if wide else width))
    return found


def row_load_loops(sass: str) -> list[dict]:
    """Per innermost loop of the SASS that loads 16-byte rows (LDG.E.128) and adds floats:
    the row loads issued before its first FADD, and how many of its row loads take their
    address from an 8-byte load (a token index) of the same pass through the loop -- a chain
    of two round trips -- followed through the registers each instruction writes."""
    code = [(int(a, 16), op.strip()) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []  # (first, last) address of each loop: a branch back
    for at, op in code:
        back = re.search(r"\bBRA (0x[0-9a-f]+)", op)
        if back and int(back.group(1), 16) < at:
            loops.append((int(back.group(1), 16), at))
    found = []
    for start, end in loops:
        if any(start <= inner_start and inner_end < end for inner_start, inner_end in loops):
            continue  # holds an inner loop: the inner one is read
        body = [o for a, o in code if start <= a <= end]
        first_add = next((i for i, o in enumerate(body) if re.search(r"\bFADD\b", o)), None)
        if first_add is None or not any("LDG.E.128" in o for o in body):
            continue
        tainted, chained = set(), 0
        for o in body:
            o = re.sub(r"^@!?P\w+\s+", "", o)
            name, _, operands = o.partition(" ")
            parts = [x.strip() for x in operands.split(",")] if operands else []
            if name.startswith("LDG.E.128"):
                chained += bool(_registers(parts[1]) & tainted)
            if not parts or name.startswith(("ST", "BRA", "EXIT")) or not parts[0].startswith("R"):
                continue
            width = 4 if ".128" in name else 2 if (".64" in name or ".WIDE" in name) else 1
            sources = set().union(*(_registers(x) for x in parts[1:]))
            written = _registers(parts[0], width)
            if name.startswith("LDG.E.64") or sources & tainted:
                tainted |= written
            else:
                tainted -= written
        found.append({"rows_before_an_add": sum("LDG.E.128" in o for o in body[:first_add]), "chained": chained})
    return found


@pytest.mark.parametrize("arch", ARCHS)
def test_a_long_segments_piece_loads_a_batchs_rows_together_from_tokens_loaded_before(ptxas_report, arch):
    """chunk_kernel sums a long segment's piece 8 rows a batch, the next batch's 8 token
    indices loaded behind the rows: in every loop of it that loads rows, 8 row loads go out
    before the first add, and none takes its address from a token loaded in the same pass
    (one round trip a batch). Loading a batch's tokens then its rows chained each row to its
    token's load; under no launch bound ptxas issued each row's load after the previous
    row's add (sm_90 fp32: 1 to 4 rows before the first add)."""
    sass = ptxas_report[2].get(arch)
    if not sass:
        pytest.skip("no cuobjdump here (Triton ships it): the SASS is not read")
    for fragment in SASS_KERNELS:
        loops = row_load_loops(sass[fragment])
        assert loops and all(loop["rows_before_an_add"] >= 8 and loop["chained"] == 0 for loop in loops), (
            fragment, loops)


@pytest.mark.parametrize("arch", ARCHS)
def test_optimizer_update_moves_the_table_with_128_bit_accesses(ptxas_report, arch):
    """The optimizer inside the backward is one pass over p and its state (three (V, d)
    tables for Adam): 16 bytes per access on 16-byte rows, as torch's fused AdamW."""
    ptx = ptxas_report[1][arch]
    for fragment in ("optimizer_update_kernelIfLi1ELi4E", "optimizer_update_kernelIN3c108BFloat16ELi1ELi8E"):
        body = _entry_body(ptx, fragment)
        assert len(re.findall(r"ld\.global(\.nc)?\.v4\.", body)) >= 3, f"{fragment}: p, m, v not read 16 bytes wide"
        assert len(re.findall(r"st\.global\.v4\.", body)) >= 3, f"{fragment}: p, m, v not written 16 bytes wide"



@pytest.mark.parametrize("arch", ARCHS)
def test_optimizer_update_divides_and_roots_without_a_slow_path_in_float(ptxas_report, arch):
    """csrc/optim.h's quotient and root: in float the instructions Triton uses for `/` and
    tl.sqrt, not the IEEE div.rn / sqrt.rn, whose per-element slow-path branch serialised
    the elements and left the AdamW update instruction-bound (H200 at de2aee7: 47% of DRAM
    bandwidth). float64 tables keep the IEEE forms (their reference is float64 torch)."""
    ptx = ptxas_report[1][arch]
    for rule in (1, 2, 3):  # Adam(W), Adagrad, SparseAdam: the rules that divide and take roots
        for fragment in (f"optimizer_update_kernelIfLi{rule}ELi4E", f"optimizer_update_kernelIN3c108BFloat16ELi{rule}ELi8E",
                         f"optimizer_update_kernelIN3c104HalfELi{rule}ELi1E"):
            body = _entry_body(ptx, fragment)
            assert re.search(r"div\.full\.f32", body) and re.search(r"sqrt\.approx\.f32", body), fragment
            assert not re.search(r"(div|sqrt)\.rn\.f32", body), f"{fragment}: an IEEE division or root"
        double = _entry_body(ptx, f"optimizer_update_kernelIdLi{rule}ELi2E")
        assert re.search(r"div\.rn\.f64", double) and re.search(r"sqrt\.rn\.f64", double)

@pytest.mark.parametrize("arch", ARCHS)
def test_few_tokens_gradient_writes_rows_with_128_bit_accesses(ptxas_report, arch):
    """The one-kernel backward of a short batch writes the whole (V, d) table: it must
    move it as the finish kernel does, 16 bytes per access, with its few_rows rows of
    sums kept in registers (no spills: the test above) -- at most 64 of them, so an SM
    holds at least half the threads it can (8 bf16 rows of 8 sums took 95). Without dropout
    (Lb0E): with it, each row's Philox bits take their own registers (75 for fp32)."""
    ptx = ptxas_report[1][arch]
    registers = {name: regs for (name, a), (regs, _, _) in _kernels(ptxas_report[0]).items() if a == arch}
    for fragment in ("few_tokens_gradient_kernelIlffLi4ELb0E", "few_tokens_gradient_kernelIlN3c108BFloat16EfLi8ELb0E"):
        body = _entry_body(ptx, fragment)
        assert re.search(r"ld\.global(\.nc)?\.v4\.", body), f"{fragment}: no 128-bit load"
        assert re.search(r"st\.global\.v4\.", body), f"{fragment}: no 128-bit store"
        used = [regs for name, regs in registers.items() if fragment in name]
        assert used and max(used) <= 64, (fragment, used)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_two_byte_tables_sinusoid_takes_the_sfus_sine_and_cosine_a_wider_ones_sincos(ptxas_report, arch):
    # embedding_kernels.cuh's pair_sincos: for bf16 / fp16 tables the angle less whole turns,
    # then __sincosf (sin.approx / cos.approx: 688 -> 344 SASS instructions, sm_90, bf16 16-byte
    # rows); fp32 and fp64 tables keep sincosf / sincos (DESIGN §7's fp32 bound is tighter).
    ptx = ptxas_report[1][arch]
    for table in ("N3c108BFloat16E", "N3c104HalfE"):
        body = _entry_body(ptx, f"embedding_forward_kernelI{table}lLi8ELi2ELb0E")  # sinusoidal, no dropout
        assert re.search(r"\bsin\.approx\.", body) and re.search(r"\bcos\.approx\.", body), table
    for table in ("f", "d"):
        entries = re.findall(r"\.entry (\w*embedding_forward_kernelI" + table + r"lLi\d+ELi2E\w*)\(", ptx)
        assert entries, table
        for name in entries:
            assert not re.search(r"\b(?:sin|cos)\.approx\.", _entry_body(ptx, name)), name
