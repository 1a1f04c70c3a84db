"""The benchmark harness runs end to end on a tiny shape: every provider passes its
correctness gate, and the CSV has the documented columns."""

import csv

import torch

from bench import report, run
from bench.cases import Case
from bench.providers import Provider, eager_input_layer


def test_quick_suite_writes_csv_table_and_plots(tmp_path, capsys):
    rows = run.main(["--quick", "--out", str(tmp_path), "--budget", "0.05", "--min-reps", "3"])
    with (tmp_path / "results.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == report.COLUMNS
        written = list(reader)
    assert len(written) == len(rows) > 0
    for row in written:
        if row["provider"] == "compile" and row["grad"] == "sparse":
            assert row["status"] == "n/a"
        else:
            assert row["status"] == "ok", row
            assert float(row["median_ms"]) > 0 and float(row["pct_of_copy"]) > 0
    assert {r["provider"] for r in written} >= {"eager", "compile"}
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["bench_bwd.png", "bench_fwd.png", "bench_fwd_bwd.png"]
    assert "| tiny 2x16 fwd |" in capsys.readouterr().out


def test_gate_reports_a_wrong_provider_as_failed(tmp_path):
    case = Case("tiny", 2, 16, "fwd")
    wrong = Provider("off-by-scale", lambda ids, tables, scale, sparse: eager_input_layer(ids, tables, scale * 1.01, sparse))
    args = run.parse_args(["--budget", "0.01", "--min-reps", "2"])
    rows = run.run_case(case, torch.device("cpu"), [wrong], args)
    assert rows[0]["status"] == "FAILED" and "output differs" in rows[0]["note"]
    assert "median_ms" not in rows[0]
