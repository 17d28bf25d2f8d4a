"""Smoke test of benchmarks/bench_compiled_step.py (issue 21): a small run reports what it claims.

Not the measurement (benchmarks/results/bench_compiled_step-*.md is that): one row of 6
params, 3 calls each way, in the bench's own worker process. Checked: the CSV and the
markdown hold the row with every column, the times are positive, the compiled and eager
params agree bit for bit after the same steps, and a failing worker is reported as an
error row (exit status 1), not as a number.
"""

import csv
import os
import sys

BENCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks")
sys.path.insert(0, BENCH_DIR)

import bench_compiled_step  # noqa: E402


def test_a_small_run_writes_its_row(tmp_path):
    rc = bench_compiled_step.main(["--params", "6", "--calls", "3", "--out", str(tmp_path), "--tag", "t"])
    assert rc == 0
    with open(tmp_path / "bench_compiled_step-t.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1
    row = rows[0]
    assert row["params"] == "6" and row["provider"] == "fastamp"
    assert float(row["eager ms"]) > 0 and float(row["compiled ms"]) > 0 and float(row["compile s"]) > 0
    assert row["compiled == eager"] == "bit-identical"
    md = (tmp_path / "bench_compiled_step-t.md").read_text()
    assert "| 6 | fastamp |" in md and "compiled us per param" in md


def test_a_failing_worker_is_an_error_row(tmp_path):
    rc = bench_compiled_step.main(["--params", "-1", "--calls", "1", "--out", str(tmp_path), "--tag", "e"])
    assert rc == 1
    with open(tmp_path / "bench_compiled_step-e.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["error"] and not rows[0].get("compiled ms")
