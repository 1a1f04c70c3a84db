"""``python -m bench.targets RESULTS.csv [RESULTS.csv ...] [--profile profile.log]``: issues
#29 and #30's targets, and each case of a GPU benchmark's results.csv that bears on one, met
or not, with the figures -- what a GPU run answers, in one table (gpu-check's summary ends
with it). Every ratio is of two providers timed side by side in the run; a target whose
cases the run did not reach is listed as such, not as met. Several CSVs: one run's cases
split between calls (gpu-check's `--bench-args='--mode fwd'` in one, the other modes in the
next), read as one.

The bytes floor of a forward + backward (#30) is its own, not the benchmark's minimal
bytes: the backward writes the whole (V, d) gradient, not only the rows used. Its time is
those bytes at the bandwidth of the faster of the run's two copies of the case's minimal
bytes, L2 flushed (copy_ms) and graphed (graph_ms x graph_pct_of_copy): at 26f0ba6 on the
H200 the graphed copy was the slower, 1.1 GB in 410 us against 267 (Llama-3 fp32), and the
`cuda` forward reached 131% of it at GPT-2 -- no ceiling.

A ratio short of its bound by less than 2% is reported as such ("within 2%"), neither met
nor not: two medians of one run differ by that much from noise alone. A speed-up target of
a forward + backward that asks for less time than the case's bytes floor is reported as
"below the floor": no kernel can meet it (at 26f0ba6 compiled nn ops took Llama-3 fp32
8x2048 in 1.30x its floor, so 1.5x faster than them is 0.87x the floor)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from .cases import DTYPES, SHAPES
from .report import load_csv

BACKENDS = ("cuda", "triton")
TRAINING = ("gpt2", "llama2", "llama3")  # "every GPT-2/Llama shape"
ID_BYTES = 8  # the benchmark's ids are int64 (cases.make_ids)


def _by_case(rows: list[dict]) -> dict:
    """{case key: {provider: row}} of the rows measured (status ok, a median)."""
    cases = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("median_ms"):
            key = tuple(r[k] for k in ("shape", "batch", "seq_len", "mode", "dtype", "pos", "dist", "grad", "dropout"))
            cases.setdefault(key, {})[r["provider"]] = r
    return cases


def _training_sized(r: dict) -> bool:
    """An 8x2048 GPT-2/Llama case of the targets' form: uniform ids, a dense gradient, no dropout."""
    return ((r["batch"], r["seq_len"]) == (8, 2048) and r["shape"] in TRAINING and r["dist"] == "uniform"
            and r["grad"] == "dense" and not r.get("dropout"))


def _one_token(r: dict) -> bool:
    return (r["batch"], r["seq_len"]) == (1, 1) and r["grad"] == "dense" and not r.get("dropout")


def floor_ms(r: dict) -> float:
    """#30's bytes floor of a dense forward + backward row, in ms: the benchmark's minimal
    bytes with the whole gradient written, at the bandwidth of the run's faster copy."""
    vocab, dim = SHAPES[r["shape"]]
    row = dim * DTYPES[r["dtype"]].itemsize
    pos = r["seq_len"] * row if r["pos"] == "learned" else 0
    # min_bytes = 2 x (ids + rows used + positions + tokens' rows): the rows used, backed out
    used = r["min_bytes"] // 2 - r["tokens"] * ID_BYTES - pos - r["tokens"] * row
    floor_bytes = r["min_bytes"] + (vocab * row - used)
    copy_ms = min(r["copy_ms"], r["graph_pct_of_copy"] / 100 * r["graph_ms"])
    return copy_ms * floor_bytes / r["min_bytes"]


def format_ms(ms: float) -> str:
    """A time given in ms, in us below 1 ms (the unit the tables read in)."""
    return f"{ms * 1e3:.0f} us" if ms < 1 else f"{ms:.2f} ms"


def _speedup(name: str, over, key: str = "median_ms"):
    """What a case's providers give for ``name`` against the time ``over(providers)``:
    (text, over's time / name's time), or None where either is missing."""
    def measure(p):
        base = over(p)
        if base is None or not p.get(name, {}).get(key):
            return None
        t = p[name][key]
        return f"{base / t:.2f}x ({format_ms(t)} vs {format_ms(base)})", base / t
    return measure


def _time_of(name: str, key: str = "median_ms"):
    return lambda p: p.get(name, {}).get(key)


def _faster_nn_ops(p):
    times = [p[n]["median_ms"] for n in ("eager", "compile") if n in p]
    return min(times) if times else None


def _copy_share(p):
    r = p.get("pyembed-cuda")
    if r is None:
        return None
    graphed = f" (graphed {r['graph_pct_of_copy']:.0f}%)" if r.get("graph_pct_of_copy") else ""
    return f"{r['pct_of_copy']:.0f}%{graphed}", r["pct_of_copy"] / 100


def _floor_of(p):
    """The case's bytes floor (floor_ms, from the `cuda` row's graphed copy), or None."""
    r = p.get("pyembed-cuda")
    return floor_ms(r) if r is not None and r.get("graph_ms") and r.get("graph_pct_of_copy") else None


def _within_floor(p):
    """cuda's graphed time against the floor, with the anchor's beside it (#30: Inductor's
    compiled nn ops, non-deterministic)."""
    floor = _floor_of(p)
    if floor is None:
        return None
    r = p["pyembed-cuda"]
    anchor = p.get("compile", {}).get("graph_ms")
    beside = f"; compiled nn ops {anchor / floor:.2f}x" if anchor else ""
    graphed = f"{format_ms(r['graph_ms'])} graphed vs {format_ms(floor)}{beside}"
    return f"{r['graph_ms'] / floor:.2f}x the floor ({graphed})", floor / r["graph_ms"]


def _mode(mode: str, more=lambda r: True):
    return lambda r: r["mode"] == mode and more(r)


def specs() -> list[tuple]:
    """(issue, target, which rows' cases, measure(providers) -> (text, value) or None, bound,
    the provider whose time the target bounds where it is a forward + backward's speed-up that
    the bytes floor can put out of reach, else None): a case meets the target when value >= bound."""
    found = []
    for b in BACKENDS:
        found.append(("#29", f"forward >= 1.1x the faster of eager / compiled nn ops ({b})",
                      _mode("fwd", _training_sized), _speedup(f"pyembed-{b}", _faster_nn_ops), 1.1))
    found += [("#29", "forward >= 85% of a copy of its bytes (cuda)", _mode("fwd", _training_sized), _copy_share, 0.85),
              ("#29", "forward: triton within 1.15x of cuda", _mode("fwd", _training_sized),
               _speedup("pyembed-triton", _time_of("pyembed-cuda")), 1 / 1.15)]
    for b in BACKENDS:
        found.append(("#29", f"one-token forward no slower than eager ({b})", _mode("fwd", _one_token),
                      _speedup(f"pyembed-{b}", _time_of("eager")), 1.0))
    for b in BACKENDS:
        found.append(("#29", f"compiled pyembed >= compiled nn ops, every forward ({b})", _mode("fwd"),
                      _speedup(f"compile(pyembed-{b})", _time_of("compile")), 1.0))
    for mode in ("fwd", "fwd+bwd", "step"):
        for b in BACKENDS:
            found.append(("#29/#30", f"compiled pyembed no slower than eager pyembed, {mode} ({b})", _mode(mode),
                          _speedup(f"compile(pyembed-{b})", _time_of(f"pyembed-{b}")), 1.0))
    found += [("#30", "graphed forward + backward <= 1.3x its bytes floor (cuda)", _mode("fwd+bwd", _training_sized),
               _within_floor, 1 / 1.3),
              ("#30", "graphed forward + backward: triton within 1.15x of cuda", _mode("fwd+bwd", _training_sized),
               _speedup("pyembed-triton", _time_of("pyembed-cuda", "graph_ms"), "graph_ms"), 1 / 1.15)]
    for b in BACKENDS:
        found.append(("#30", f"forward + backward >= 1.5x the faster of eager / compiled nn ops ({b})",
                      _mode("fwd+bwd", _training_sized), _speedup(f"pyembed-{b}", _faster_nn_ops), 1.5,
                      f"pyembed-{b}"))
    for b in BACKENDS:
        found.append(("#30", f"compiled forward + backward >= 1.2x compiled nn ops ({b})",
                      _mode("fwd+bwd", _training_sized), _speedup(f"compile(pyembed-{b})", _time_of("compile")), 1.2,
                      f"compile(pyembed-{b})"))
    for b in BACKENDS:
        found.append(("#30", f"one-token forward + backward no slower than eager ({b})", _mode("fwd+bwd", _one_token),
                      _speedup(f"pyembed-{b}", _time_of("eager")), 1.0))
    return [spec if len(spec) == 6 else (*spec, None) for spec in found]


CLOSE = 0.98  # a value this close to its bound is within a run's noise


def targets(rows: list[dict]) -> list[tuple]:
    """(issue, target, case, measured, verdict) per target and case the run measured; a
    target none of whose cases it measured once, "not measured". verdict: met, not met,
    within 2%, or None (not measured)."""
    cases = list(_by_case(rows).values())
    found = []
    for issue, target, select, measure, bound, bounded in specs():
        hits = [(p, measure(p)) for p in cases if select(next(iter(p.values())))]
        hits = [(p, m) for p, m in hits if m is not None]
        for p, (text, value) in hits:
            verdict = "met" if value >= bound else "within 2%" if value >= CLOSE * bound else "not met"
            if verdict != "met" and bounded is not None:
                floor, asked = _floor_of(p), p[bounded]["median_ms"] * value / bound
                if floor is not None and asked < floor:
                    text += f"; {bound}x asks {format_ms(asked)}, below the bytes floor's {format_ms(floor)}"
                    verdict = "below the floor"
            found.append((issue, target, next(iter(p.values()))["label"], text, verdict))
        if not hits:
            found.append((issue, target, "-", "not measured in this run", None))
    return found


def host_targets(profile: str) -> list[str]:
    """profile.log's one-token host-time verdicts (tests/gpu/profile_workload.py prints them)."""
    return [line for line in profile.splitlines() if re.match(r"host 1x1 target .*\(target .*\)$", line)]


# A dense backward op's line of profile.log (tests/gpu/profile_workload.py's sort_case): the
# setting it ran with ("tile sort, 8 finish group": value 8 of the "finish group" setting;
# "CUB device sort": the "sort" setting's, in the runs that timed the sorts, up to
# 82eabd8), the case, and its median and graphed times.
_SETTING_LINE = re.compile(r"sort (?P<which>[^:]+): the `(?P<backend>\w+)` dense backward op, (?P<table>\d+x\d+) "
                           r"(?P<dtype>\w+) (?P<tokens>\d+x\d+)(?:, (?P<dist>\w+) ids)?: (?P<wall>[\d.]+) us, "
                           r"graphed (?P<graphed>[\d.]+) us")


def _setting_times(profile: str) -> dict:
    """{(backend, setting, table, dtype, tokens, dist): {value: graphed us}} from profile.log's
    dense backward op lines, in the order the profile ran them, for cases of two values or more."""
    cases: dict = {}
    for line in profile.splitlines():
        m = _SETTING_LINE.match(line)
        if m is None:
            continue
        which = m["which"]
        if "," in which:  # "tile sort, VALUE LABEL": setting_cases' VALUE of the setting LABEL
            value, setting = which.split(", ", 1)[1].split(" ", 1)
        else:  # a sort's name: the value of the sort setting
            setting, value = "sort", which
        case = (m["backend"], setting, m["table"], m["dtype"], m["tokens"], m["dist"] or "uniform")
        cases.setdefault(case, {})[value] = float(m["graphed"])
    return {case: times for case, times in cases.items() if len(times) >= 2}


def setting_comparisons(profile: str) -> list[str]:
    """profile.log's kernel settings timed against each other (its dense backward op lines), a
    line per setting and case: each value's graphed time in the order the profile ran them --
    the first the default where the setting has one value for all (`cuda`'s finish group) --
    and the fastest, as a ratio to the first's. What a GPU run settles: which variant a
    default should become (`cuda`'s finish_segments forms, PYEMBED_CUDA_FINISH_GROUP;
    `triton`'s sum stages)."""
    lines = []
    for (backend, setting, table, dtype, tokens, dist), times in _setting_times(profile).items():
        default, (fastest, best) = next(iter(times.values())), min(times.items(), key=lambda item: item[1])
        listed = ", ".join(f"{value} {us:.1f}" for value, us in times.items())
        lines.append(f"`{backend}` {setting}, {table} {dtype} {tokens}, {dist} ids: {listed} us graphed; "
                     f"fastest {fastest} ({best / default:.2f}x the first)")
    return lines


def setting_verdicts(profile: str, margin: float = 0.02) -> list[str]:
    """A line per setting of setting_comparisons: the values faster than the first by more than
    ``margin`` in every case it was timed in (their ratios to the first), or none -- the rule
    by which a GPU run settles a variant (one that wins everywhere becomes the default, one
    that never does goes)."""
    runs: dict = {}
    for (backend, setting, *_), times in _setting_times(profile).items():
        runs.setdefault((backend, setting), []).append(times)
    lines = []
    for (backend, setting), cases in runs.items():
        first = next(iter(cases[0]))
        ratios = {value: [times[value] / times[first] for times in cases] for value in cases[0]
                  if value != first and all(value in times for times in cases)}
        winners = {value: r for value, r in ratios.items() if max(r) < 1 - margin}
        said = ", ".join(f"{value} ({min(r):.2f}x-{max(r):.2f}x)"
                         for value, r in sorted(winners.items(), key=lambda item: max(item[1])))
        lines.append(f"`{backend}` {setting}, {len(cases)} case{'s' * (len(cases) > 1)}: "
                     + (f"faster than {first} by more than {margin:.0%} in every case: {said}" if winners else
                        f"no value faster than {first} by more than {margin:.0%} in every case"))
    return lines


def markdown(found: list[tuple], host: list[str] = (), settings: list[str] = (), settled: list[str] = ()) -> str:
    verdicts = [f[4] for f in found if f[4] is not None]
    beyond = verdicts.count("below the floor")
    lines = [f"Of {len(verdicts)} (target, case) pairs measured: {verdicts.count('met')} met, "
             f"{verdicts.count('within 2%')} within 2% of the target, {verdicts.count('not met')} not met"
             f"{f', {beyond} asking less than the bytes floor' if beyond else ''}; "
             f"{len(found) - len(verdicts)} targets not measured in this run.", "",
             "| issue | target | case | measured | |", "|---|---|---|---|---|"]
    lines += [f"| {issue} | {target} | {case} | {text} | "
              f"{'-' if verdict is None else '**not met**' if verdict == 'not met' else verdict} |"
              for issue, target, case, text, verdict in found]
    if host:
        lines += ["", "One-token host time (#29, profile.log):", ""] + [f"- {line}" for line in host]
    if settings:
        lines += ["", "Kernel settings timed against each other (profile.log, graphed; ratios to the first listed):",
                  ""]
        lines += [f"- {line}" for line in settings]
    if settled:
        lines += ["", "Each setting over its cases: the values faster than the first listed in every case (the "
                      "rule a GPU run settles a variant by):", ""] + [f"- {line}" for line in settled]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.targets", description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path, nargs="+", help="a GPU benchmark's results.csv (several: their cases together)")
    ap.add_argument("--profile", type=Path,
                    help="the same run's profile.log (one-token host time, kernel settings against each other)")
    args = ap.parse_args(argv)
    profile = args.profile.read_text() if args.profile else ""
    print(markdown(targets([row for path in args.csv for row in load_csv(path)]), host_targets(profile),
                   setting_comparisons(profile), setting_verdicts(profile)), end="")


if __name__ == "__main__":
    main()
