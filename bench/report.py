"""Benchmark output: the CSV (one row per case x provider, written case by case), a
markdown table and one PNG per mode. On a GPU, graph_ms is the GPU-only time (the call
captured in a CUDA graph and replayed: no host work) and graph_pct_of_copy its bandwidth
against a graphed copy of the same minimal bytes -- how far the kernels are from the
bytes floor."""

from __future__ import annotations

import csv
import math
from pathlib import Path

COLUMNS = [
    "timestamp", "device", "torch", "pyembed", "suite", "shape", "batch", "seq_len", "tokens", "mode", "dtype", "pos",
    "dist", "grad", "dropout", "provider", "status", "median_ms", "p20_ms", "p80_ms", "gbps", "pct_of_copy", "copy_ms",
    "min_bytes", "grad_bytes", "saved_bytes", "speedup_vs_eager", "speedup_vs_compile", "spread",
    "graph_ms", "graph_pct_of_copy", "step_peak_bytes", "timing", "note",
]


def append_csv(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)
    return path


INTS = {"batch", "seq_len", "tokens", "min_bytes", "grad_bytes", "saved_bytes", "step_peak_bytes"}
FLOATS = {"dropout", "median_ms", "p20_ms", "p80_ms", "gbps", "pct_of_copy", "copy_ms", "speedup_vs_eager",
          "speedup_vs_compile", "spread", "graph_ms", "graph_pct_of_copy"}


def load_csv(path: Path) -> list[dict]:
    """The rows of a results.csv as run.main returns them (numbers as numbers, blanks
    absent): to redo the table and plots from a CSV measured elsewhere (a GPU machine)."""
    from .cases import Case

    def parse(k, v):
        return int(float(v)) if k in INTS else float(v) if k in FLOATS else v

    with Path(path).open(newline="") as f:
        rows = [{k: parse(k, v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    for row in rows:
        row["label"] = Case(row["shape"], row["batch"], row["seq_len"], row["mode"], row["dtype"], row["pos"],
                            row["dist"], row["grad"], row["dropout"]).label()
    return rows


def _cell(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    parts = [f"{row['median_ms']:.3g} ms"]
    speedups = [f"{row[k]:.2f}x" for k in ("speedup_vs_eager", "speedup_vs_compile") if row.get(k)]
    if row["provider"] not in ("eager", "compile") and speedups:
        parts.append(" / ".join(speedups))
    parts.append(f"{row['pct_of_copy']:.0f}% copy")
    if row.get("graph_ms"):
        parts.append(f"graphed {row['graph_ms']:.3g} ms, {row['graph_pct_of_copy']:.0f}% copy")
    if row.get("saved_bytes") is not None and row.get("dropout"):
        parts.append(f"{row['saved_bytes'] / 2**20:.2f} MiB saved")
    if row.get("step_peak_bytes") is not None:
        parts.append(f"peak +{row['step_peak_bytes'] / 2**20:.0f} MiB")
    return " · ".join(parts)


def markdown(rows: list[dict], providers: list[str]) -> str:
    """One line per case; a cell holds median time, speedup vs eager / vs compile, and
    effective bandwidth as a % of a plain copy of the same bytes."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    cells = {(r["label"], r["provider"]): _cell(r) for r in rows}
    lines = ["| case | " + " | ".join(providers) + " |", "|---" * (len(providers) + 1) + "|"]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(cells.get((label, p), "") for p in providers) + " |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> list[str]:
    """Per mode and pyembed provider: the geometric mean over cases of its speed-up (and
    the worst case), from rows measured side by side -- an eager pyembed provider against
    the faster of eager and compile, a compiled one (compile(pyembed-*)) against compile."""
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for provider in dict.fromkeys(r["provider"] for r in rows if "pyembed" in r["provider"]):
            compiled = provider.startswith("compile(")
            keys = ("speedup_vs_compile",) if compiled else ("speedup_vs_eager", "speedup_vs_compile")
            ratios = []
            for r in rows:
                if r["mode"] != mode or r["provider"] != provider or not r.get("median_ms"):
                    continue
                bests = [r[k] for k in keys if r.get(k)]
                if bests:
                    ratios.append((min(bests), r["label"]))  # vs the faster baseline
            if ratios:
                geomean = math.exp(sum(math.log(x) for x, _ in ratios) / len(ratios))
                worst = min(ratios)
                against = "compiled nn ops" if compiled else "the faster of eager/compile"
                over = (f"geometric mean of {len(ratios)} cases; lowest {worst[0]:.2f}x, {worst[1]}"
                        if len(ratios) > 1 else f"one case, {worst[1]}")
                lines.append(f"{mode:8s} {provider}: {geomean:.2f}x {against} ({over})")
    return lines


LEGEND = ("A cell: median time · the speed-up over eager / over compile (the torch.compile of the same nn-ops "
          "layer; above 1x is faster) · effective bandwidth as a % of a plain device copy of the same minimal "
          "bytes, timed in the same rounds (100% is the memory ceiling); on a GPU, \"graphed\": the GPU-only time of "
          "the call replayed from a CUDA graph (no host work) and its % of a graphed copy; \"peak +\": the GPU memory "
          "a training step allocates beyond the tables and optimizer state (the gradient among it); n/a: the provider "
          "cannot run the case. A step: forward, backward, torch's fused AdamW (fused=True, its fastest form, for "
          "every provider; SparseAdam for a sparse token table) and zero_grad. On a GPU, decoding-sized cases are "
          "timed as calls back to back, host time included, and training-sized ones by do_bench, the L2 flushed "
          "before each call (the CSV's timing column).")


def table(rows: list[dict], providers: list[str]) -> str:
    """results.md: the markdown table, its legend, then the summary lines."""
    return markdown(rows, providers) + "\n\n" + LEGEND + "\n\n" + "\n".join(summary(rows)) + "\n"


def plots(rows: list[dict], out: Path, meta: dict) -> list[Path]:
    """Per mode: median time vs tokens, per provider, one panel per shape (main grid only:
    fp32, learned positions, uniform ids, dense gradients)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # a canvas of its own: no global backend
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    main = [r for r in rows if r["status"] == "ok" and (r["dtype"], r["pos"], r["dist"], r["grad"], r["dropout"]) ==
            ("fp32", "learned", "uniform", "dense", 0.0)]
    paths = []
    for mode in dict.fromkeys(r["mode"] for r in main):
        shapes = list(dict.fromkeys(r["shape"] for r in main if r["mode"] == mode))
        fig = Figure(figsize=(5.5 * len(shapes), 4))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, len(shapes), squeeze=False)
        for ax, shape in zip(axes[0], shapes):
            for provider in dict.fromkeys(r["provider"] for r in main):
                pts = sorted((r["tokens"], r["median_ms"], r["p20_ms"], r["p80_ms"]) for r in main
                             if r["mode"] == mode and r["shape"] == shape and r["provider"] == provider)
                if pts:
                    x, y, lo, hi = zip(*pts)
                    ax.errorbar(x, y, yerr=[[a - b for a, b in zip(y, lo)], [b - a for a, b in zip(y, hi)]],
                                marker="o", capsize=3, label=provider)
            # A step is dominated by the optimizer's pass over the table, the same at every
            # token count: on a log axis the providers' gaps would look alike.
            ax.set(xscale="log", yscale="linear" if mode == "step" else "log", xlabel="tokens (batch x seq_len)",
                   ylabel="median ms (p20-p80)",
                   title=f"{shape}, {mode}, fp32, learned PE")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.suptitle(f"{meta['device']} · torch {meta['torch']} · {meta['timestamp']}", fontsize=8)
        fig.tight_layout()
        path = out / f"bench_{mode.replace('+', '_')}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def main(argv=None) -> None:
    """``python -m bench.report RESULTS.csv [--out DIR]``: the markdown table, the summary
    and the plots of a results.csv, e.g. one a GPU machine's ``make gpu-check`` wrote."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--out", type=Path, help="folder for the PNGs (default: the CSV's)")
    args = ap.parse_args(argv)
    rows = load_csv(args.csv)
    print(table(rows, list(dict.fromkeys(r["provider"] for r in rows))))
    first = rows[0]
    meta = {k: first.get(k, "") for k in ("device", "torch", "timestamp")}
    print("plots:", ", ".join(str(p) for p in plots(rows, args.out or args.csv.parent, meta)))


if __name__ == "__main__":
    main()
