"""benchmarks/slot_churn.py on the CPU: both GPU memory layouts timed under churn (every placement
evicts), Llama-3.1-8B's wrapped-layer count, JSON and markdown written."""

from __future__ import annotations

import json

import pytest


def test_the_churn_benchmark_times_both_layouts(tmp_path):
    from benchmarks.slot_churn import main

    report = main(["--slots", "16", "--fleet", "20", "--placements", "5", "--out", str(tmp_path), "--tag", "t"])
    assert json.loads((tmp_path / "slot_churn_t.json").read_text()) == report
    (regions, regions_result), (shared, shared_result) = report["layouts"].items()
    assert regions.startswith("one max-rank region per slot") and shared.startswith("rows shared by rank")
    for result in (regions_result, shared_result):
        assert result["layers"] == 130  # 32 x (qkv, o, gate_up, down) + embedding + LM head
        assert 0 < result["host_ms_p50"] <= result["synced_ms_p50"] + 1e-6
    assert regions_result["pool_rank_rows"] == 16 * 64 and shared_result["pool_rank_rows"] == int(7.3 * 16)
    assert f"| {shared} | 130 |" in (tmp_path / "slot_churn_t.md").read_text()


def test_a_fleet_no_larger_than_the_slots_is_refused(capsys):
    from benchmarks.slot_churn import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--slots", "8", "--fleet", "8"])
    assert "--fleet > --slots" in capsys.readouterr().err
