"""The host-time benchmarks on the CPU: benchmarks/slot_churn.py times both GPU memory layouts under
churn (every placement evicts) at Llama-3.1-8B's wrapped-layer count, JSON and markdown written;
benchmarks/trace_host.py replays the many-adapters trace with the GPU's step as a sleep."""

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


def test_the_trace_benchmark_reports_the_hosts_share_per_n():
    from benchmarks.trace_host import main

    results = main(["--adapters", "2,40", "--requests", "30", "--rate", "200", "--gpu-ms", "1", "--slots", "8",
                    "--gpu-lora-mb", "40"])
    assert [r["adapters"] for r in results] == [2, 40]
    assert all(r["failed"] == 0 and r["steps"] > 0 and r["step_ms"] > 1.0 for r in results)
    many = results[1]
    assert many["used"] > 8 and many["parts"]["placements"]["calls"] > 8  # more adapters than slots: churn
    assert many["parts"]["schedule"]["calls"] >= many["steps"]  # every step schedules; some compute nothing


def test_host_contentions_arena_and_loads_loaders_carve_from_the_arena(tmp_path):
    import threading
    import time

    from benchmarks.host_contention import loader, loader_memory

    for kind in ("arena", "loads"):
        memory = loader_memory(kind, tmp_path / kind, pinned=False)
        arena = memory[0].host_memory if kind == "loads" else memory
        before = arena.stats.allocations
        stop = threading.Event()
        thread = threading.Thread(target=loader, args=(kind, stop, 0, memory))
        thread.start()
        time.sleep(0.3)
        stop.set()
        thread.join()
        assert arena.stats.allocations > before and arena.stats.fallbacks == 0


def test_the_gil_benchmark_times_steps_beside_python_and_loads_per_switch_interval(tmp_path):
    import sys

    from benchmarks.loader_gil import main

    before = sys.getswitchinterval()
    report = main(["--switch-intervals", "0.005,0.0005", "--steps", "5", "--fleet", "8", "--gc-freeze",
                   "--json", str(tmp_path / "gil.json")])
    assert sys.getswitchinterval() == before  # put back
    assert json.loads((tmp_path / "gil.json").read_text()) == report
    rows = {(r["switch_interval_s"], r["beside"]): r for r in report["rows"]}
    assert set(rows) == {(i, b) for i in (0.005, 0.0005) for b in ("nothing", "python", "loads")}
    assert all(r["step_ms_median"] >= 5.0 for r in rows.values())  # the 5 ms "GPU" wait at least
    assert rows[0.005, "loads"]["their_work_per_s"] > 0 and report["load_thread_cpu_ms"] > 0
