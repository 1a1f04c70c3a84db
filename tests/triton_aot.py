"""Compile the Triton kernels ahead of time for NVIDIA targets, without a GPU, and print
a JSON report per (kernel, arch): registers, spills and shared memory (ptxas -v on the
generated PTX, with the ptxas Triton ships), the widths of its global accesses and the
PTX types of its scalar float parameters.

The signatures are the ones the JIT would build at run time for real arguments: every
pointer 16-byte aligned (torch allocations), an int argument equal to 1 a constant (so
a one-token sequence, seq_len == 1, is its own specialisation), d divisible by 16 or not,
int32 or int64 ids, with or without position_ids, every table dtype and positional mode,
and d in {8, 100, 768, 4096} -- so tile sizes are checked where they are really used.

Run by tests/test_triton_aot.py in a subprocess: it needs TRITON_INTERPRET unset (the
interpreter replaces @triton.jit functions with eager Python ones). Usage:
``python tests/triton_aot.py [--quick]`` (--quick: sm_90 only).

``python tests/triton_aot.py --inductor-copies`` instead compiles each kernel as Inductor
copies a user-defined kernel into a compiled graph's code (JSON: kernel -> "ok" or the
error). ``python tests/triton_aot.py --sass [NAME_PART ...]`` instead prints, per sm_90
specialisation whose name holds every NAME_PART (e.g. ``forward bf16 "learned d=4096"``),
its SASS instruction count (nvdisasm, shipped with Triton) with every subroutine call
counted at its callee's length: for a kernel without loops (the forward), about what one
thread executes -- the figure that showed the forward issue-bound.
"""

import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pyembed.kernels import embedding as k

ARCHS = (80, 90)
DIMS = (8, 100, 768, 4096)
TOKENS = 4096  # any count > 1 that is a multiple of 16, like a real batch
D16 = [["tt.divisibility", 16]]


def _int_arg(name, value, sig, consts, attrs, index):
    """What the JIT does with a Python int: 1 becomes a constant, a multiple of 16 gets
    the divisibility hint, and it is typed i32 when it fits."""
    if value == 1:
        sig[name], consts[name] = "constexpr", 1
        return
    sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
    if value % 16 == 0:
        attrs[(index,)] = D16


def _source(kernel, args: dict, constexprs: dict):
    """ASTSource for `kernel` called with `args` (name -> a pointer's Triton type string,
    or a Python int / float value) and constexprs."""
    sig, consts, attrs = {}, {}, {}
    params = {p.name: p for p in kernel.params}
    for index, (name, value) in enumerate(args.items()):
        if isinstance(value, str):  # a pointer: torch allocations are 16-byte aligned
            sig[name], attrs[(index,)] = value, D16
        elif isinstance(value, float):  # the JIT types a Python float fp32 unless annotated
            sig[name] = getattr(params[name], "annotation_type", "") or "fp32"
        else:
            _int_arg(name, value, sig, consts, attrs, index)
    for name, value in constexprs.items():
        sig[name], consts[name] = "constexpr", value
    return ASTSource(kernel, sig, consts, attrs)


# A pinned host allocation's address: what validate=True on a GPU passes as the error record.
ERROR_RECORD = 0x7F3A_2C00_0400


def forward_source(dtype, pos_mode, dim, *, position_ids=False, id_type="i64", seq_len=TOKENS, dropout=False,
                   check=True, tokens=TOKENS):
    """The forward kernel; check: the in-kernel range check (validate=True on a GPU, the
    default) or not (validate=False / "sync"); tokens past 2^31 take 64-bit slots."""
    block_t, block_d = k._blocks(dim, pos_mode, dropout)
    record_high, record_low = k.error_record_parts(ERROR_RECORD if check else 0)
    args = {"ids_ptr": f"*{id_type}", "weight_ptr": f"*{dtype}", "pos_weight_ptr": f"*{dtype}",
            "position_ids_ptr": "*i64", "dropout_key_ptr": "*i64", "out_ptr": f"*{dtype}", "num_tokens": tokens,
            "seq_len": seq_len, "num_embeddings": 50257, "num_positions": 2048, "dim": dim, "offset": 3,
            "scale": 27.7, "neg_log_base_over_dim": -0.012, "sinusoid_pair_offset": 0, "dropout_threshold": 429496730, "dropout_scale": 1.1,
            "error_record_high": record_high, "error_record_low": record_low}
    return _source(k._embedding_forward_kernel, args, {
        "POS_MODE": pos_mode, "HAS_POSITION_IDS": position_ids, "HAS_DROPOUT": dropout,
        "COMPUTE_F64": dtype == "fp64", "CHECK_RANGES": check, "WIDE_SLOTS": k.wide_slots(tokens, block_t),
        "BLOCK_T": block_t, "BLOCK_D": block_d})


# The forward's dropout as the dense backward's kernels take it (kernels' DoutDropout): p = 0.1.
DROPOUT_ARGS = {"dropout_key_ptr": "*i64", "dropout_threshold": 429496730, "dropout_scale": 1.1}


def chunk_source(dtype, dim, *, key_type="i16", by_slot=False, partials=True, solo=False, dropout=False):
    """One pass over the sorted positions: segment bounds (by table row, or by slot for a
    sparse gradient) and the long segments' partial sums (partials=False: a backward of
    at most one chunk of tokens, where no segment can be long); solo: the one-token
    segments' tokens too (a dense gradient with learned positions, which write those rows);
    dropout: the partial sums read dout through the forward's mask.
    Keys: i16 for tables of fewer than 2^16 rows (the 50257 used here), i32 / i64 for larger ones."""
    acc = "fp64" if dtype == "fp64" else "fp32"
    args = {"sorted_ptr": f"*{key_type}", "scan_ptr": "*i64", "bounds_ptr": "*i64", "dout_ptr": f"*{dtype}",
            "order_ptr": "*i64", "partials_ptr": f"*{acc}", "n": TOKENS, "num_rows": 50257,
            "entries": min(TOKENS, 50257) if by_slot else 50257, "dim": dim, **DROPOUT_ARGS}
    return _source(k._chunk_kernel, args, {
        "BY_SLOT": by_slot, "HAS_PARTIALS": partials, "HAS_SOLO": solo, "HAS_DROPOUT": dropout,
        "COMPUTE_F64": acc == "fp64", "CHUNK": k.CHUNK_ROWS, "BLOCK_D": k._blocks(dim, dropout=dropout)[1]})


def _position_args(dtype, batch, seq_len):
    """The learned positions' gradient a table's last kernel may write too (kernels'
    _position_sums): 2048 positions, from offset 3."""
    return {"pos_out_ptr": f"*{dtype}", "pos_rows": 2048, "batch": batch, "seq_len": seq_len,
            "steps": min(seq_len, 2045), "offset": 3}


def finish_source(dtype, dim, *, divide, partials=True, positions=True, solo=None, dropout=False, row_tiles=1,
                  sum_stages=1):
    """One pass over a dense gradient's rows (with scale_grad_by_freq's division or not;
    partials=False: a backward of at most one chunk of tokens), and the learned positions'
    (positions=False: none, or by position_ids), which write the one-token rows too unless
    solo=False (a position past the table: validate=False); dropout: dout read through the
    forward's mask; row_tiles tiles a program (kernels' finish_row_tiles); sum_stages: the
    rows' loop pipelined (kernels' finish_sum_stages)."""
    acc = "fp64" if dtype == "fp64" else "fp32"
    block_r, block_d = k._segment_blocks(dim, torch.float64 if dtype == "fp64" else torch.float32, dropout)
    args = {"dout_ptr": f"*{dtype}", "order_ptr": "*i64", "partials_ptr": f"*{acc}", "bounds_ptr": "*i64",
            "out_ptr": f"*{dtype}", "scale": 27.7, "num_segments": 50257, "entries": 50257, "dim": dim,
            "table_programs": -(-50257 // block_r),
            **_position_args(dtype, 8, 512), **DROPOUT_ARGS}
    return _source(k._finish_segments_kernel, args, {
        "DIVIDE_BY_COUNT": divide, "ZERO_EMPTY": True, "HAS_PARTIALS": partials, "HAS_POSITIONS": positions,
        "HAS_SOLO": positions if solo is None else solo, "HAS_DROPOUT": dropout, "COMPUTE_F64": acc == "fp64",
        "CHUNK": k.CHUNK_ROWS, "SUM_STAGES": sum_stages, "ROW_TILES": row_tiles, "BLOCK_R": block_r,
        "BLOCK_D": block_d})


def few_tokens_source(dtype, dim, *, divide, id_type="i64", positions=True, dropout=False):
    """A dense gradient of at most FEW_TOKENS tokens: one pass over the table's rows, and
    the learned positions' (positions=False: none, or by position_ids); dropout: dout read
    through the forward's mask."""
    block_r, block_d = k._blocks(max(dim, 4) if dropout else dim)  # as kernels' dense_gradient
    args = {"keys_ptr": f"*{id_type}", "dout_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "scale": 27.7, "n": 7,
            "num_rows": 50257, "skip": 3, "dim": dim, "table_programs": -(-50257 // block_r),
            **_position_args(dtype, 1, 7), **DROPOUT_ARGS}
    return _source(k._few_tokens_gradient_kernel, args, {
        "DIVIDE_BY_COUNT": divide, "HAS_POSITIONS": positions, "HAS_DROPOUT": dropout, "COMPUTE_F64": dtype == "fp64",
        "FEW": k.FEW_TOKENS, "BLOCK_R": block_r, "BLOCK_D": block_d})


def few_slots_source(dtype, dim, *, divide, dropout=False):
    """A sparse gradient's rows (touched rows, the sparse backward) of at most FEW_TOKENS
    tokens: every slot's sums in one tile, BLOCK_D columns of them per program; dropout:
    dout read through the forward's mask."""
    block_d = max(min(k._blocks(dim)[1], k.TILE_ELEMENTS // k.FEW_TOKENS), 4 if dropout else 1)
    args = {"keys_ptr": "*i64", "dout_ptr": f"*{dtype}", "rows_ptr": "*i64", "values_ptr": f"*{dtype}",
            "scale": 27.7, "n": 7, "slots": 7, "num_rows": 50257, "skip": 3, "dim": dim, **DROPOUT_ARGS}
    return _source(k._few_tokens_slots_kernel, args, {
        "DIVIDE_BY_COUNT": divide, "HAS_DROPOUT": dropout, "COMPUTE_F64": dtype == "fp64", "FEW": k.FEW_TOKENS,
        "BLOCK_D": block_d})


def bounds_source(kernel, key_type="i16"):
    """The sort's inputs (int64 ids in, key_type keys out, the bounds' starting values:
    zeros, then -1 for the slots' keys) and the segment starts of a sparse gradient (on
    key_type sorted keys)."""
    if kernel == "inputs":
        return _source(k._sort_inputs_kernel, {"keys_ptr": "*i64", "out_ptr": f"*{key_type}", "bounds_ptr": "*i64",
                                               "n": TOKENS, "num_zeros": 2 * TOKENS, "num_bounds": 3 * TOKENS,
                                               "num_rows": 50257, "skip": 3},
                       {"BLOCK": k.BOUNDS_BLOCK})
    return _source(k._segment_starts_kernel, {"sorted_ptr": f"*{key_type}", "starts_ptr": "*i64", "n": TOKENS,
                                              "num_rows": 50257}, {"BLOCK": k.BOUNDS_BLOCK})


def tile_sort_source(kernel, key_type="i16", id_type="i64", one_tile=False):
    """The tile sort's two kernels at the GPU's blocks (kernels.tile_sort): the ranks within
    tiles (int64 or int32 ids in; words out, or with one tile the key_type keys and tokens;
    the bounds' starting values) and the merge of the tiles (words in, key_type keys out)."""
    if kernel == "rank":
        return _source(k._tile_rank_kernel, {
            "keys_ptr": f"*{id_type}", "words_ptr": "*i32", "sorted_ptr": f"*{key_type}", "order_ptr": "*i64",
            "bounds_ptr": "*i64", "n": TOKENS, "rank_programs": TOKENS // k.RANK_ROWS, "num_zeros": 2 * TOKENS,
            "num_bounds": 3 * TOKENS, "num_rows": 50257, "skip": 3},
            {"ONE_TILE": one_tile, "TILE": k.TILE_SORT_TILE, "ROWS": k.RANK_ROWS, "COLUMNS": k.RANK_COLUMNS,
             "BLOCK": k.BOUNDS_BLOCK})
    return _source(k._merge_tiles_kernel, {"words_ptr": "*i32", "sorted_ptr": f"*{key_type}", "order_ptr": "*i64",
                                           "n": TOKENS},
                   {"TILE": k.TILE_SORT_TILE, "MAX_TILES": k.TILE_SORT_MAX_TILES, "BLOCK": k.MERGE_BLOCK})


def batch_source(dtype, dim, dropout=False):
    """The learned positions' gradient alone (a frozen token table), one row per program."""
    args = {"dout_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "rows": 2048, "batch": 8, "seq_len": 512,
            "steps": 512, "offset": 3, "dim": dim, **DROPOUT_ARGS}
    return _source(k._batch_sum_kernel, args, {"HAS_DROPOUT": dropout, "COMPUTE_F64": dtype == "fp64", "BLOCK_R": 1,
                                               "BLOCK_D": k._blocks(dim, dropout=dropout)[1]})


# (rule, its flags): SGD with momentum, AdamW, Adagrad, SparseAdam -- the rule's longest path.
UPDATE_RULES = {"sgd": (0, {"NESTEROV": True, "HAS_STATE1": True, "HAS_STATE2": False}),
                "adamw": (1, {"DECOUPLED": True, "HAS_STATE1": True, "HAS_STATE2": True}),
                "adagrad": (2, {"HAS_STATE1": True, "HAS_STATE2": False}),
                "sparse_adam": (3, {"HAS_STATE1": True, "HAS_STATE2": True})}


def update_source(dtype, dim, rule):
    """The optimizer inside the backward: every table row (dense rules) or the touched rows (SparseAdam)."""
    code, flags = UPDATE_RULES[rule]
    block_d = k._blocks(dim)[1]
    args = {"param_ptr": f"*{dtype}", "state1_ptr": f"*{dtype}", "state2_ptr": f"*{dtype}", "rows_ptr": "*i64",
            "values_ptr": f"*{dtype}", "num_rows": 50257, "touched": TOKENS, "dim": dim,
            **{name: 0.5 for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "dampening",
                                      "bias_correction1", "bias_correction2_sqrt")}}
    return _source(k._optimizer_update_kernel, args, {
        "RULE": code, "DECOUPLED": False, "NESTEROV": False, "MAXIMIZE": False, "FIRST": False,
        "ALL_ROWS": code != 3, **flags, "COMPUTE_F64": dtype == "fp64",
        "BLOCK_R": max(1, k.TILE_ELEMENTS // 2 // block_d), "BLOCK_D": block_d})


def segment_update_source(dtype, dim, rule, *, divide=False, dropout=False):
    """The optimizer inside the backward for a dense token table past FEW_TOKENS tokens:
    each table row's segment summed (a long one from its pieces) and the rule applied to
    the row (kernels' optimizer_backward: its blocks)."""
    code, flags = UPDATE_RULES[rule]
    acc = "fp64" if dtype == "fp64" else "fp32"
    block_r, block_d = k.segment_update_blocks(dim, torch.float64 if dtype == "fp64" else torch.float32, dropout)
    args = {"dout_ptr": f"*{dtype}", "order_ptr": "*i64", "partials_ptr": f"*{acc}", "bounds_ptr": "*i64",
            "param_ptr": f"*{dtype}", "state1_ptr": f"*{dtype}", "state2_ptr": f"*{dtype}", "scale": 27.7,
            "num_rows": 50257, "dim": dim, **DROPOUT_ARGS,
            **{name: 0.5 for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "dampening",
                                      "bias_correction1", "bias_correction2_sqrt")}}
    return _source(k._segment_update_kernel, args, {
        "DIVIDE_BY_COUNT": divide, "HAS_PARTIALS": True, "HAS_DROPOUT": dropout, "RULE": code, "DECOUPLED": False,
        "NESTEROV": False, "MAXIMIZE": False, "FIRST": False, **flags, "ALL_ROWS": True,
        "COMPUTE_F64": acc == "fp64", "CHUNK": k.CHUNK_ROWS, "BLOCK_R": block_r, "BLOCK_D": block_d})


def position_update_source(dtype, dim, rule, *, dropout=False):
    """The optimizer inside the backward for the learned positions: each row's batch sum
    and the rule applied to it (kernels' position_update), one row per program."""
    code, flags = UPDATE_RULES[rule]
    args = {"dout_ptr": f"*{dtype}", "param_ptr": f"*{dtype}", "state1_ptr": f"*{dtype}", "state2_ptr": f"*{dtype}",
            "rows": 2048, "batch": 8, "seq_len": 512, "steps": 512, "offset": 3, "dim": dim, **DROPOUT_ARGS,
            **{name: 0.5 for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "dampening",
                                      "bias_correction1", "bias_correction2_sqrt")}}
    return _source(k._position_update_kernel, args, {
        "HAS_DROPOUT": dropout, "RULE": code, "DECOUPLED": False, "NESTEROV": False, "MAXIMIZE": False,
        "FIRST": False, **flags, "COMPUTE_F64": dtype == "fp64", "BLOCK_D": k._blocks(dim, dropout=dropout)[1]})


def sources():
    """{name: (factory, args)}: every specialisation the launchers can produce that
    matters for registers (the id dtype only for one mode: it changes one load)."""
    out = {}
    variants = [("none", 0, {}), ("learned", 1, {}), ("learned position_ids", 1, {"position_ids": True}),
                ("learned seq_len=1", 1, {"seq_len": 1}), ("sinusoidal", 2, {}),
                ("sinusoidal position_ids", 2, {"position_ids": True}), ("sinusoidal seq_len=1", 2, {"seq_len": 1}),
                ("learned dropout", 1, {"dropout": True}), ("sinusoidal dropout", 2, {"dropout": True}),
                ("learned unchecked", 1, {"check": False}),
                ("sinusoidal position_ids unchecked", 2, {"position_ids": True, "check": False})]
    for dtype, (vname, mode, kw), dim in itertools.product(("fp32", "fp16", "bf16"), variants, DIMS):
        out[f"forward {dtype} {vname} d={dim}"] = (forward_source, (dtype, mode, dim), kw)
    for dim in DIMS:
        out[f"forward fp32 learned int32-ids d={dim}"] = (forward_source, ("fp32", 1, dim), {"id_type": "i32"})
    for mode, vname in ((1, "learned"), (2, "sinusoidal")):
        out[f"forward fp64 {vname} d=768"] = (forward_source, ("fp64", mode, 768), {})
    for dtype in ("fp32", "bf16"):  # 2^31 + 2^20 tokens: 64-bit slots (an H200 holds 8 GB of int32 ids)
        out[f"forward {dtype} learned wide-slots d=8"] = (forward_source, (dtype, 1, 8), {"tokens": 2**31 + 2**20,
                                                                                         "id_type": "i32"})
    # The backward's tiles also at d = 64: BLOCK_D 16-64 is where Triton 3.6 once failed to
    # compile finish_segments (a layout-pass error), which d = 8 and 100 did not show.
    for dtype, dim in itertools.product(("fp32", "fp16", "bf16", "fp64"), DIMS + (64,)):
        out[f"chunk {dtype} d={dim}"] = (chunk_source, (dtype, dim), {"solo": True})
        out[f"finish_segments {dtype} d={dim}"] = (finish_source, (dtype, dim), {"divide": False})
        out[f"finish_segments {dtype} by_freq d={dim}"] = (finish_source, (dtype, dim), {"divide": True})
        out[f"batch_sum {dtype} d={dim}"] = (batch_source, (dtype, dim), {})
        out[f"few_tokens {dtype} d={dim}"] = (few_tokens_source, (dtype, dim), {"divide": False})
        out[f"few_tokens {dtype} by_freq d={dim}"] = (few_tokens_source, (dtype, dim), {"divide": True})
        # Without the positions' programs: a table without learned positions, or by position_ids.
        out[f"finish_segments no-positions {dtype} d={dim}"] = (finish_source, (dtype, dim), {
            "divide": False, "positions": False})
        out[f"finish_segments positions-past-the-table {dtype} d={dim}"] = (finish_source, (dtype, dim), {
            "divide": False, "solo": False})
        out[f"few_tokens no-positions {dtype} by_freq d={dim}"] = (few_tokens_source, (dtype, dim), {
            "divide": True, "positions": False})
        out[f"few_slots {dtype} d={dim}"] = (few_slots_source, (dtype, dim), {"divide": False})
        out[f"few_slots {dtype} by_freq d={dim}"] = (few_slots_source, (dtype, dim), {"divide": True})
        if dtype != "fp16":  # the forward's dropout applied as dout is read: each kernel's longest form
            out[f"chunk dropout {dtype} d={dim}"] = (chunk_source, (dtype, dim), {"solo": True, "dropout": True})
            out[f"finish_segments dropout {dtype} by_freq d={dim}"] = (finish_source, (dtype, dim), {
                "divide": True, "dropout": True})
            out[f"few_tokens dropout {dtype} by_freq d={dim}"] = (few_tokens_source, (dtype, dim), {
                "divide": True, "dropout": True})
            out[f"batch_sum dropout {dtype} d={dim}"] = (batch_source, (dtype, dim), {"dropout": True})
            out[f"few_slots dropout {dtype} by_freq d={dim}"] = (few_slots_source, (dtype, dim), {
                "divide": True, "dropout": True})
    out["few_tokens fp32 int32-ids d=768"] = (few_tokens_source, ("fp32", 768), {"divide": False, "id_type": "i32"})
    # Four tiles a program: a 2-byte table of 16-byte rows and 2^16 rows or more
    # (finish_row_tiles), in each form, its rows' loop pipelined but with dropout (three
    # stages: finish_sum_stages); and PYEMBED_TRITON_ROW_TILES's other settings.
    for dtype, dim in itertools.product(("fp16", "bf16"), (8, 64, 768, 4096)):
        for form, kwargs in (("", {}), ("by_freq ", {"divide": True}), ("no-positions ", {"positions": False}),
                             ("positions-past-the-table ", {"solo": False}), ("short ", {"partials": False}),
                             ("dropout by_freq ", {"divide": True, "dropout": True})):
            if dtype == "fp16" and "dropout" in kwargs:
                continue  # as above
            out[f"finish_segments row_tiles=4 {form}{dtype} d={dim}"] = (finish_source, (dtype, dim), {
                "divide": False, **kwargs, "row_tiles": 4, "sum_stages": 1 if "dropout" in kwargs else 3})
    for dtype, row_tiles in (("fp32", 2), ("fp32", 4), ("bf16", 2)):
        out[f"finish_segments row_tiles={row_tiles} {dtype} d=4096"] = (finish_source, (dtype, 4096), {
            "divide": False, "row_tiles": row_tiles})
    # PYEMBED_TRITON_SUM_STAGES (finish_sum_stages): the rows' loop pipelined, in every
    # form it applies to (not dropout, not float64); at four tiles a program, the settings
    # other than its default three.
    for stages, dtype, dim in itertools.product((2, 3), ("fp32", "fp16", "bf16"), DIMS + (64,)):
        for form, kwargs in (("", {}), ("by_freq ", {"divide": True}), ("no-positions ", {"positions": False}),
                             ("positions-past-the-table ", {"solo": False})):
            out[f"finish_segments sum_stages={stages} {form}{dtype} d={dim}"] = (finish_source, (dtype, dim), {
                "divide": False, **kwargs, "sum_stages": stages})
    for stages, dtype in itertools.product((1, 2), ("fp16", "bf16")):
        out[f"finish_segments sum_stages={stages} row_tiles=4 {dtype} d=4096"] = (finish_source, (dtype, 4096), {
            "divide": False, "row_tiles": 4, "sum_stages": stages})
    # A backward of at most CHUNK_ROWS tokens has no partials. Not at d = 100: for bf16 on
    # sm_80 ptxas spills 40 B there (the direct loop's scalar loads; the same before the
    # column-tile form of finish_segments), in a launch of at most 128 tokens.
    for dtype, dim in itertools.product(("fp32", "bf16"), (8, 64, 768, 4096)):
        out[f"chunk short {dtype} d={dim}"] = (chunk_source, (dtype, dim), {"partials": False})
        out[f"finish_segments short {dtype} d={dim}"] = (finish_source, (dtype, dim), {"divide": False,
                                                                                       "partials": False})
    for key_type in ("i16", "i32", "i64"):
        out[f"sort_inputs {key_type}"] = (bounds_source, ("inputs", key_type), {})
        out[f"segment_starts {key_type}"] = (bounds_source, ("starts", key_type), {})
        out[f"chunk by_slot fp32 {key_type} d=768"] = (chunk_source, ("fp32", 768), {"key_type": key_type,
                                                                                      "by_slot": True})
        out[f"tile_rank {key_type}"] = (tile_sort_source, ("rank", key_type), {})
        out[f"tile_rank one-tile {key_type}"] = (tile_sort_source, ("rank", key_type), {"one_tile": True})
        out[f"merge_tiles {key_type}"] = (tile_sort_source, ("merge", key_type), {})
    out["tile_rank int32-ids"] = (tile_sort_source, ("rank", "i16", "i32"), {})
    out["chunk by_slot dropout bf16 d=768"] = (chunk_source, ("bf16", 768), {"by_slot": True, "dropout": True})
    for dtype, dim, rule in itertools.product(("fp32", "bf16"), (100, 768, 4096), UPDATE_RULES):
        out[f"optimizer_update {rule} {dtype} d={dim}"] = (update_source, (dtype, dim, rule), {})
    out["optimizer_update adamw fp64 d=768"] = (update_source, ("fp64", 768, "adamw"), {})
    for dtype, dim, rule in itertools.product(("fp32", "bf16"), (100, 768, 4096), ("sgd", "adamw", "adagrad")):
        out[f"segment_update {rule} {dtype} d={dim}"] = (segment_update_source, (dtype, dim, rule), {})
    for dtype in ("fp32", "bf16"):
        out[f"segment_update adamw dropout {dtype} by_freq d=768"] = (segment_update_source, (dtype, 768, "adamw"),
                                                                      {"divide": True, "dropout": True})
    out["segment_update adamw fp64 d=768"] = (segment_update_source, ("fp64", 768, "adamw"), {})
    for dtype, dim, rule in itertools.product(("fp32", "bf16"), (100, 768, 4096), ("sgd", "adamw", "adagrad")):
        out[f"position_update {rule} {dtype} d={dim}"] = (position_update_source, (dtype, dim, rule), {})
    for dtype in ("fp32", "bf16"):
        out[f"position_update adamw dropout {dtype} d=768"] = (position_update_source, (dtype, 768, "adamw"),
                                                               {"dropout": True})
    out["position_update adamw fp64 d=768"] = (position_update_source, ("fp64", 768, "adamw"), {})
    return out


def _triton_tool(name: str) -> str:
    """A binary Triton ships for NVIDIA (ptxas, nvdisasm): the versions its compiler uses."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


# The compile options a kernel's launch gives beside its constexprs (kernels.launch.LAUNCH_OPTIONS).
LAUNCH_OPTIONS = {"_merge_tiles_kernel": k.MERGE_OPTIONS}


def _compile(name: str, arch: int):
    factory, args, kwargs = sources()[name]
    source = factory(*args, **kwargs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=LAUNCH_OPTIONS.get(source.fn.__name__))


def ptxas_report(ptx: str) -> dict:
    ptxas = _triton_tool("ptxas")
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


def fusable_rule_sums(llir: str) -> list[str]:
    """The sums in kernels' _apply_rule (the optimizer's rule, inlined into each update
    kernel) that take a product's result (through vector element moves): pairs the NVPTX
    backend may fuse into one fma -- or not, as each kernel's code falls -- so two kernels
    with the same rule could round its state differently. As "line:column" of the rule."""
    lines, first = inspect.getsourcelines(k._apply_rule.fn)
    where = {m.group(1): (int(m.group(2)), int(m.group(3)))
             for m in re.finditer(r"^(!\d+) = !DILocation\(line: (\d+), column: (\d+)", llir, re.M)}
    defs, sums = {}, []
    for m in re.finditer(r"^\s*(%\S+) = (?:tail call \S+ @llvm\.\S+\(|)(\w+) ([^!\n]*)(?:!dbg (!\d+))?", llir, re.M):
        name, op, rest, dbg = m.groups()
        defs[name] = (op, re.findall(r"%[\w.]+", rest))
        row, col = where.get(dbg, (0, 0))
        if op in ("fadd", "fsub") and first <= row < first + len(lines):
            sums.append((name, f"{row - first}:{col}"))

    def source(value):  # through extractelement / insertelement / shufflevector to the arithmetic
        while value in defs and defs[value][0] in ("extractelement", "insertelement", "shufflevector", "bitcast"):
            value = defs[value][1][0]
        return defs.get(value, ("", []))[0]

    return sorted({at for name, at in sums if any(source(v) == "fmul" for v in defs[name][1])})


def zero_tile_blocks(ptx: str) -> list[dict]:
    """Each basic block of ``ptx`` that stores only a register that is always 0 (a tile of
    zeros): its instruction count, global loads and stores -- what a tile, or a program
    of several, that only writes zeros runs (kernels' _finish_segments_kernel)."""
    body = ptx.split(".entry", 1)[1]
    code = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+(%\w+)?", re.M)  # opcode, first operand
    defined = {}
    for op, dest in code.findall(body):
        if dest and not op.startswith(("st.", "bra", "setp")):
            defined.setdefault(dest, []).append(op)
    zeros = {r for r in re.findall(r"mov\.b(?:16|32|64)\s+(%\w+), 0;", body) if len(defined.get(r, ())) == 1}
    found = []
    for block in re.split(r"^\$L__BB\d+_\d+:.*$", body, flags=re.M):
        stored = re.findall(r"st\.global[\.\w]*\s+\[[^\]]*\],\s*\{\s*(%\w+)(?:,\s*\1)*\s*\}", block)
        if stored and any(r in zeros for r in stored):
            found.append({"instructions": len(code.findall(block)), "loads": len(re.findall(r"ld\.global", block)),
                          "stores": len(stored)})
    return found


def _sass(cubin: bytes) -> str:
    """A compiled kernel's SASS, by the nvdisasm Triton ships."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([_triton_tool("nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout


def loads_before_a_compare(cubin: bytes) -> int:
    """In the kernel's first loop (SASS, nvdisasm): the global loads issued before the first
    unsigned compare -- for _merge_tiles_kernel, how many of a thread's probes of a search
    step are in flight before it compares any (a probe compared right after its load: 1)."""
    sass = _sass(cubin)
    label = next(m.group(1) for m in re.finditer(r"^(\.L_x_\d+):", sass, re.M)
                 if re.search(rf"BRA `\({re.escape(m.group(1))}\)", sass[m.end():]))
    body = sass.split(f"{label}:", 1)[1].split(f"BRA `({label})", 1)[0]
    found = re.search(r"ISETP\.\w+\.U32", body)
    return len(re.findall(r"\bLDG\b", body[:found.start() if found else len(body)]))


def compile_one(job):
    name, arch = job
    compiled = _compile(name, arch)
    ptx = compiled.asm["ptx"]
    updates = name.startswith(("optimizer_update", "segment_update", "position_update"))
    params = re.search(r"\.entry \w+\((.*?)\)", ptx, re.S).group(1)
    return f"{name} sm_{arch}", {
        "shared": compiled.metadata.shared, **ptxas_report(ptx),
        "v4_loads": len(re.findall(r"ld\.global[\.\w]*\.v4\.", ptx)),
        "v4_stores": len(re.findall(r"st\.global[\.\w]*\.v4\.", ptx)),
        # Streaming (evict-first) stores: st.global.cs, and those 128 bits wide.
        "cs_stores": len(re.findall(r"st\.global\.cs\.", ptx)),
        "cs_v4_stores": len(re.findall(r"st\.global\.cs\.v4\.", ptx)),
        # Loads copied ahead into shared memory: a loop Triton pipelined (num_stages).
        "async_copies": len(re.findall(r"cp\.async\.c[ag]\.", ptx)),
        "float_params": re.findall(r"\.param \.(f32|f64)", params),
        # A 64-bit division or remainder: a ~70-instruction subroutine per value in SASS.
        "div64": len(re.findall(r"\b(?:div|rem)\.[su]64\b", ptx)),
        # bf16 rounded by hand (kernels' _rounded, for the interpreter): a NaN test per element.
        "nan_tests": len(re.findall(r"setp\.nan\.", ptx)),
        # The SFU's sine and cosine (kernels' _sin_cos for 2-byte tables).
        "sfu_sincos": len(re.findall(r"\b(?:sin|cos)\.approx\.", ptx)),
        "zero_tile_blocks": zero_tile_blocks(ptx),
        "loads_before_a_compare": loads_before_a_compare(compiled.asm["cubin"]) if name.startswith("merge") else None,
        "fusable_rule_sums": fusable_rule_sums(compiled.asm["llir"]) if updates else []}


def sass_instructions(name: str, arch: int = 90) -> int:
    """SASS instructions of `name`'s body, each CALL counted as its subroutine's length
    (a 64-bit division is one: ~70 instructions)."""
    sass = _sass(_compile(name, arch).asm["cubin"])
    lengths, current, calls = {}, None, []
    for line in sass.splitlines():
        if line.startswith(".text.") or line.startswith("$__internal"):  # the kernel, then its subroutines
            current = line.split(".text.")[-1].rstrip(":")
            lengths[current] = 0
        elif current and re.match(r"\s+/\*[0-9a-f]{4}\*/", line):
            lengths[current] += 1
            if "CALL.REL" in line:
                calls.append(re.search(r"`\((\S+)\)", line).group(1))
    return next(iter(lengths.values())) + sum(lengths[callee] for callee in calls)


def inductor_copies() -> dict:
    """{kernel: "ok" or the error}: each Triton kernel as torch.compile's Inductor builds a
    user-defined one -- the kernel's source and its helpers', copied by Inductor
    (user_defined_triton_kernel_transitive_closure_source_code) below Inductor's own
    imports into a module of its own -- with every global name its functions load defined
    there (whichever constexpr branch loads it: Triton resolves a name only in the branch it
    compiles), and compiled for sm_90 in the first specialisation of sources() that launches
    it. Names that copy cannot carry (a module imported under an alias Inductor does not
    import, a helper it does not copy) fail here, not in a compiled model on a GPU
    (kernels/embedding.py's `libdevice` is one Inductor imports)."""
    import builtins
    import dis
    import importlib.util

    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    first = {}  # kernel name -> the first specialisation that launches it
    for name, (factory, args, kwargs) in sources().items():
        first.setdefault(factory(*args, **kwargs).fn.__name__, name)
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kernel_name, name in first.items():
            original = getattr(k, kernel_name)
            path = os.path.join(tmp, f"{kernel_name}.py")
            with open(path, "w") as f:
                f.write(TritonKernel.gen_common_triton_imports() + "\n@triton.jit\n"
                        + user_defined_triton_kernel_transitive_closure_source_code(original))
            try:
                spec = importlib.util.spec_from_file_location(kernel_name, path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                functions = [v.fn for v in vars(module).values() if isinstance(v, triton.runtime.jit.JITFunction)]
                missing = sorted({i.argval for fn in functions for i in dis.Bytecode(fn) if i.opname == "LOAD_GLOBAL"}
                                 - set(vars(module)) - set(vars(builtins)))
                if missing:
                    raise NameError(f"not defined in Inductor's copy: {missing}")
                setattr(k, kernel_name, getattr(module, kernel_name))
                _compile(name, 90)
                found[kernel_name] = "ok"
            except Exception as error:  # noqa: BLE001 - every kernel's outcome is reported
                found[kernel_name] = f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
            finally:
                setattr(k, kernel_name, original)
    return found


def main():
    if "--inductor-copies" in sys.argv:
        json.dump(inductor_copies(), sys.stdout, indent=1)
        return
    if "--sass" in sys.argv:
        parts = sys.argv[sys.argv.index("--sass") + 1:]
        for name in sources():
            if all(part in name for part in parts):
                print(f"{name} sm_90: {sass_instructions(name)} SASS instructions")
        return
    archs = (90,) if "--quick" in sys.argv else ARCHS
    jobs = [(name, arch) for name in sources() for arch in archs]
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        report = dict(pool.map(compile_one, jobs, chunksize=4))
    json.dump(report, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
