"""The Triton kernels compiled ahead of time for sm_80 and sm_90 (no GPU needed), in the
specialisations the JIT builds for real arguments (tests/triton_aot.py): no register
spills anywhere, 128-bit global loads/stores in the forward when rows are a multiple of
16 bytes, and fp64 scalar parameters (DESIGN §6). Registers and shared memory go to
build/triton_report.txt."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="module")
def report(once_per_session):
    return once_per_session("triton_aot", _compile_every_specialisation)


def _triton_aot(*flags: str):
    """tests/triton_aot.py's JSON, run with ``flags`` by the real compiler (not the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_aot.py"), *flags], capture_output=True,
                          text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _compile_every_specialisation() -> dict:
    data = _triton_aot()
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "triton_report.txt").write_text(
        "\n".join(f"{k}: {v['registers']} regs, {v['shared']} B shared, {v['spill_bytes']} B spills" for k, v in
                  data.items()) + "\n")
    return data


def test_every_specialisation_compiles_for_sm80_and_sm90_without_spills(report):
    import triton_aot

    expected = set(triton_aot.sources())
    for arch in ("sm_80", "sm_90"):
        assert {k.rsplit(" ", 1)[0] for k in report if k.endswith(arch)} == expected
    spilling = {k: v["spill_bytes"] for k, v in report.items() if v["spill_bytes"]}
    assert not spilling, spilling


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_forward_uses_128_bit_global_accesses_on_16_byte_rows(report, arch):
    # d = 768 and 4096 rows are multiples of 16 bytes in every 2- and 4-byte dtype.
    wide = [k for k in report if k.startswith("forward") and k.endswith(arch) and "fp64" not in k
            and re.search(r"d=(768|4096) ", k)]
    assert len(wide) == 3 * 11 * 2 + 2  # dtypes x variants x d, plus int32 ids
    narrow = [k for k, v in report.items() if k in wide and not (v["v4_loads"] and v["v4_stores"])]
    assert not narrow, narrow


def test_scalar_parameters_reach_the_kernel_as_fp64(report):
    # Compiled Triton types a Python float fp32; scale, the sinusoid's frequency step and
    # dropout's 1 / (1 - p) are annotated fp64 so an fp64 table gets them exactly (and fp32
    # ones round once).
    forwards = {k: v["float_params"] for k, v in report.items() if k.startswith("forward")}
    assert forwards and all(params == ["f64"] * 3 for params in forwards.values()), forwards
    for kernel, count in (("finish_segments", 2), ("few_tokens", 2), ("chunk", 1), ("batch_sum", 1)):
        # the gradient's scale (not in the last two), dropout's 1 / (1 - p)
        scales = {k: v["float_params"] for k, v in report.items() if k.startswith(kernel)}
        assert scales and all(params == ["f64"] * count for params in scales.values()), scales


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_few_tokens_gradient_writes_the_table_in_128_bit_stores(report, arch):
    # A short batch's backward writes every row of the (V, d) table in this one kernel.
    wide = [k for k in report if k.startswith("few_tokens") and k.endswith(arch) and "fp64" not in k
            and re.search(r"d=(768|4096) ", k)]
    # dtypes x d x (by_freq or not, by_freq without positions), plus int32 ids, plus dropout's (fp32, bf16)
    assert len(wide) == 3 * 2 * 3 + 1 + 2 * 2
    narrow = [k for k, v in report.items() if k in wide and not v["v4_stores"]]
    assert not narrow, narrow


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_finish_segments_writes_the_table_with_wide_streaming_stores(report, arch):
    # The dense gradient's last pass writes the (V, d) table once and reads its bounds
    # first: evict-first stores keep those bounds in L2 (kernels' _finish_segments_kernel).
    finishes = [k for k in report if k.startswith("finish_segments") and k.endswith(arch)]
    assert len(finishes) >= 20
    plain = [k for k in finishes if not report[k]["cs_stores"]]
    assert not plain, plain
    wide = [k for k in finishes if "fp64" not in k and re.search(r"d=(768|4096) ", k)]
    narrow = [k for k in wide if not report[k]["cs_v4_stores"]]
    assert wide and not narrow, narrow


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_finish_segments_writes_a_tile_of_untouched_rows_without_the_summing_code(report, arch):
    # Most tiles of a large table have no segment to sum -- rows unused, or used once and
    # written by the position programs (Llama-3 at 8x2048: 97% of the 4-row tiles); each
    # ran the whole summing code on masked loads -- ~356 SASS instructions a thread at
    # sm_90 to store 16 zeros, which left the kernel issue-bound on the H200. A
    # tile with no segment to sum takes its own branch: zeros stored, nothing loaded, in at
    # most 128 PTX instructions -- the summing code is several hundred (91 at most here:
    # d = 100, whose rows are not 16-byte multiples, stored element by element). So does a
    # program of four tiles with none to sum: all its rows' zeros at once (68 at most).
    finishes = [k for k in report if k.startswith("finish_segments") and k.endswith(arch)]
    assert len(finishes) >= 20
    branches = {k: report[k]["zero_tile_blocks"] for k in finishes}
    missing = [k for k, blocks in branches.items() if not blocks]
    assert not missing, missing
    heavy = {k: blocks for k, blocks in branches.items() if any(b["loads"] or b["instructions"] > 128 for b in blocks)}
    assert not heavy, heavy


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_a_four_tile_program_with_nothing_to_sum_stores_four_tiles_of_zeros_at_once(report, arch):
    # A large 2-byte table's programs take four tiles (kernels' finish_row_tiles): one
    # bounds round trip, then all their zeros -- at d = 768 / 4096 a tile's zeros are two
    # 16-byte stores a thread (32 bytes), the program's eight (128, as `cuda`'s blocks);
    # with dropout's half-height tiles one and four.
    four = [k for k in report if k.startswith("finish_segments row_tiles=4") and k.endswith(arch)
            and re.search(r"(bf16|fp16) d=(768|4096) ", k)]
    assert len(four) == 2 * 2 * 6 - 2  # dtypes x d x forms, fp16 without dropout
    stores = {k: sorted(b["stores"] for b in report[k]["zero_tile_blocks"]) for k in four}
    wrong = {k: counts for k, counts in stores.items() if counts != ([1, 4] if "dropout" in k else [2, 8])}
    assert not wrong, wrong


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_dense_gradients_rows_loop_copies_ahead_in_four_tile_programs_or_when_asked(report, arch):
    # kernels' finish_sum_stages: 2 or 3 stages pipeline the loop that sums a segment's rows
    # (cp.async into shared memory, a row or more ahead of its add) -- by default in a 2-byte
    # table's programs of four row tiles without dropout (three), else on request
    # (PYEMBED_TRITON_SUM_STAGES); otherwise (1) the loop is as written, with no copy and no
    # shared memory for it.
    finishes = [k for k in report if k.startswith("finish_segments") and k.endswith(arch)]
    asked = [k for k in finishes if re.search(r"sum_stages=[23] ", k)]
    four_tiles = [k for k in finishes if k.startswith("finish_segments row_tiles=4 ") and "dropout" not in k
                  and re.search(r"(bf16|fp16) d=", k)]
    assert len(asked) == 2 * 3 * 5 * 4 + 2  # stages x dtypes x d x forms, four-tile two-stage ones
    assert len(four_tiles) == 2 * 4 * 5  # dtypes x d x forms
    piped = asked + four_tiles
    assert not [k for k in piped if not report[k]["async_copies"]]
    assert not [k for k in finishes if k not in piped and report[k]["async_copies"]]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_optimizer_update_reads_and_writes_the_table_in_128_bit_accesses(report, arch):
    # The update is one pass over p and its state: at d = 768 / 4096 every row is 16-byte aligned.
    wide = [k for k in report if k.startswith("optimizer_update") and k.endswith(arch) and "fp64" not in k
            and re.search(r"d=(768|4096) ", k)]
    assert len(wide) == 2 * 2 * 4  # dtypes x d x rules
    narrow = [k for k, v in report.items() if k in wide and not (v["v4_loads"] and v["v4_stores"])]
    assert not narrow, narrow
    updates = {k: v["float_params"] for k, v in report.items() if k.startswith("optimizer_update")}
    assert all(params == ["f64"] * 9 for params in updates.values()), updates  # the host's scalars, exactly


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_segment_update_reads_and_writes_the_table_in_128_bit_accesses(report, arch):
    # The optimizer inside a dense backward (kernels' optimizer_backward) passes over p and
    # its state as optimizer_update does, with each row's segment summed first.
    wide = [k for k in report if k.startswith("segment_update") and k.endswith(arch) and "fp64" not in k
            and re.search(r"d=(768|4096) ", k)]
    assert len(wide) == 2 * 2 * 3 + 2  # dtypes x d x dense rules, plus dropout's (fp32, bf16)
    narrow = [k for k, v in report.items() if k in wide and not (v["v4_loads"] and v["v4_stores"])]
    assert not narrow, narrow
    scalars = {k: v["float_params"] for k, v in report.items() if k.startswith("segment_update")}
    assert all(params == ["f64"] * 11 for params in scalars.values()), scalars  # scale, dropout's, the rule's 9


def test_the_update_kernels_leave_the_compiler_no_product_to_fuse_into_the_rules_sums(report):
    # optimizer_update, segment_update and position_update inline one rule (_apply_rule).
    # Where a sum in it takes a product, the backend may fuse the pair into an fma or not,
    # kernel by kernel: at 1b594a4 AdamW's v*beta2 + (1-beta2)*g*g fused one product in
    # segment_update and the other in optimizer_update (Triton 3.6, sm_90), and the fused
    # in-backward step's state differed from the two-op form's by a rounding on an H200.
    # Written as explicit fma, every kernel rounds the rule alike.
    updates = {k: v["fusable_rule_sums"] for k, v in report.items()
               if k.startswith(("optimizer_update", "segment_update", "position_update"))}
    assert len(updates) == 2 * 67
    fusable = {k: v for k, v in updates.items() if v}
    assert not fusable, fusable


def test_forward_divides_slots_in_32_bits_below_2_31_tokens(report):
    # The position-major slot -> (token, t) division: a 64-bit div/rem is a ~70-instruction
    # SASS subroutine, called per token a thread holds; with it (and bf16 rounded by hand)
    # the sm_90 bf16 learned forward at d = 4096 ran ~830 instructions per thread for 16
    # elements, ~300 without. Only a launch past 2^31 slots keeps 64-bit slots.
    forwards = {k: v["div64"] for k, v in report.items() if k.startswith("forward")}
    wide = {k: n for k, n in forwards.items() if "wide-slots" in k}
    assert wide and all(wide.values()), wide
    dividing = {k: n for k, n in forwards.items() if n and k not in wide}
    assert not dividing, dividing


def test_bf16_is_rounded_by_the_conversion_instruction_on_a_gpu(report):
    # cvt.rn.bf16x2.f32 rounds to nearest even, two elements per instruction; the rounding by
    # hand that Triton's interpreter needs (it truncates) costs a NaN test and ~5 integer
    # instructions per element, and must not reach a GPU kernel.
    by_hand = {k: v["nan_tests"] for k, v in report.items() if v["nan_tests"]}
    assert not by_hand, by_hand


def test_a_two_byte_tables_sinusoid_takes_the_sfus_sine_and_cosine_a_wider_ones_libdevices(report):
    # kernels' _sin_cos: for bf16 / fp16 outputs the angle less whole turns, then sin.approx
    # and cos.approx (sm_90 d = 4096 bf16: 856 -> 248 SASS instructions a thread); fp32 and
    # fp64 tables keep libdevice's accurate functions (DESIGN §7's fp32 bound is tighter).
    sinusoid = {k: v["sfu_sincos"] for k, v in report.items() if k.startswith("forward") and "sinusoidal" in k}
    two_byte = {k: n for k, n in sinusoid.items() if " bf16 " in k or " fp16 " in k}
    assert two_byte and all(two_byte.values()), two_byte
    wider = {k: n for k, n in sinusoid.items() if k not in two_byte}
    assert wider and not any(wider.values()), wider


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_tile_merge_issues_every_probe_of_a_search_step_before_comparing_any(report, arch):
    # kernels' _merge_tiles_kernel: each thread searches MAX_TILES x BLOCK / threads tiles a
    # step, a load each (16 at 4 warps). Left to its own register budget ptxas issued each
    # probe right behind the previous one's compare (1 in flight with Triton 3.6, 3 with
    # 3.8); given room (MERGE_OPTIONS' maxnreg) and no mask kept past the loads, all of them
    # leave first -- as the cuda backend's merge issues its 32.
    from pyembed.kernels import embedding as k

    probes = k.TILE_SORT_MAX_TILES * k.MERGE_BLOCK // 128
    found = {name: v["loads_before_a_compare"] for name, v in report.items()
             if name.startswith("merge_tiles") and name.endswith(arch)}
    assert len(found) == 3 and all(n == probes for n in found.values()), (probes, found)


def test_inductor_builds_every_kernel_as_it_copies_a_user_defined_one():
    # A compiled graph launches the Triton kernels as user-defined ones: Inductor copies each
    # kernel's source and its helpers' below its own imports and compiles that copy
    # (tests/triton_aot.py --inductor-copies). Every global name the copy loads must be
    # defined there -- a module under an alias Inductor does not import would fail only in a
    # compiled model on a GPU -- and the copy compiles for sm_90.
    found = _triton_aot("--inductor-copies")
    assert "_embedding_forward_kernel" in found and "_finish_segments_kernel" in found
    assert all(outcome == "ok" for outcome in found.values()), found
