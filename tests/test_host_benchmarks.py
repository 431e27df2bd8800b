"""The host-time benchmarks on the CPU: benchmarks/slot_churn.py times both GPU memory layouts under
churn (every placement evicts) at Llama-3.1-8B's wrapped-layer count, JSON and markdown written;
benchmarks/trace_host.py replays the many-adapters trace with the GPU's step as a sleep;
benchmarks/throughput.py's interleaved rounds keep the engine's scheduling mode; benchmarks/first_token.py
splits each scenario's first token into its steps' parts."""

from __future__ import annotations

import json

import pytest


def test_the_churn_benchmark_times_both_layouts(tmp_path):
    from benchmarks.slot_churn import main

    report = main(["--slots", "16", "--fleet", "20", "--placements", "5", "--profile", "4", "--out", str(tmp_path),
                   "--tag", "t"])
    assert json.loads((tmp_path / "slot_churn_t.json").read_text()) == report
    (regions, regions_result), (shared, shared_result) = report["layouts"].items()
    assert regions.startswith("one max-rank region per slot") and shared.startswith("rows shared by rank")
    for result in (regions_result, shared_result):
        assert result["layers"] == 130  # 32 x (qkv, o, gate_up, down) + embedding + LM head
        assert 0 < result["host_ms_p50"] <= result["synced_ms_p50"] + 1e-6
    assert regions_result["pool_rank_rows"] == 16 * 64 and shared_result["pool_rank_rows"] == int(7.3 * 16)
    assert f"| {shared} | 130 |" in (tmp_path / "slot_churn_t.md").read_text()
    # --profile: the functions with the most time of their own, per placement, in the JSON and the table
    profile = shared_result["profile"]
    assert len(profile) == 4 and all(row["own_ms"] > 0 and row["calls_per_placement"] > 0 for row in profile)
    assert [row["own_ms"] for row in profile] == sorted((row["own_ms"] for row in profile), reverse=True)
    assert f"| `{profile[0]['function']}` |" in (tmp_path / "slot_churn_t.md").read_text()


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
    # the GPU clock paces the steps (async scheduling hides the host work behind it: steps that
    # launch nothing are shorter, so the mean may be just under --gpu-ms)
    assert all(r["failed"] == 0 and r["steps"] > 0 and r["step_ms"] > 0.7 for r in results)
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


def test_the_replay_timeline_finds_the_graphs_preparation_layers_and_joins(tmp_path):
    """benchmarks/profile_step.py's reading of a decode replay (a chrome trace): two replays of two
    layers each, split by the GPU idling; the span before the first attention kernel, a layer's
    span, each projection's GEMM and how long after it the delta beside it ended."""
    from benchmarks.profile_step import replay_timeline

    def replay(t0: float, prep: float, late_o: float, beside=(True,) * 4) -> list[tuple[str, float, float]]:
        kernels, t = [("meta", t0, prep)], t0 + prep
        for _ in range(2):  # attention, then o / gate_up / down / qkv with a delta beside each (or some)
            kernels.append(("_paged_attention_kernel", t, 20.0))
            t += 20.0
            for (gemm_us, delta_end), delta in zip(((15.0, late_o), (90.0, -40.0), (45.0, -20.0), (21.0, 1.0)), beside):
                kernels.append(("nvjet_sm90_gemm", t, gemm_us))
                if delta:
                    kernels += [("_shrink_kernel", t, 5.0), ("_expand_kernel", t + gemm_us + delta_end - 3.0, 3.0)]
                t += gemm_us + max(delta_end, 0.0) + 2.0
        kernels.append(("_paged_attention_kernel", t, 20.0))
        return kernels

    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": dur}
              for n, ts, dur in replay(0.0, 270.0, 2.0) + replay(5000.0, 270.0, 4.0)]
    events.append({"ph": "X", "cat": "cpu_op", "name": "not a kernel", "ts": 1.0, "dur": 9999.0})
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = replay_timeline(path, min_kernels=10)
    assert summary["replays"] == 2
    assert summary["before_first_attention_us"] == 270.0
    assert summary["layer_us"] == pytest.approx(203.0)  # attention 20, o 19 or 21, gate_up 92, down 47, qkv 24
    assert summary["gate_up_gemm_us"] == 90.0 and summary["qkv_gemm_us"] == 21.0
    assert summary["o_delta_after_gemm_us"] == pytest.approx(3.0)  # the median of 2, 2, 4, 4
    assert summary["gate_up_delta_after_gemm_us"] == pytest.approx(-40.0)
    # adapters on q/k/v/o only (the graph variant that leaves the big GEMMs alone): two deltas a
    # layer, each paired with the GEMM it ran beside
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": dur}
        for n, ts, dur in replay(0.0, 270.0, 2.0, beside=(True, False, False, True))]}))
    summary = replay_timeline(path, min_kernels=10)
    assert summary["o_delta_after_gemm_us"] == pytest.approx(2.0) and summary["qkv_delta_after_gemm_us"] == 1.0
    assert "gate_up_delta_after_gemm_us" not in summary and "down_delta_after_gemm_us" not in summary


@pytest.mark.parametrize("compare_sync", [False, True])
def test_throughputs_rounds_keep_the_engines_scheduling_mode(compare_sync, monkeypatch):
    """`--no-async-scheduling` builds a synchronous engine: the interleaved rounds run it so (and,
    with `--compare-sync`, synchronously again), and leave it so."""
    from types import SimpleNamespace

    from conftest import tiny_llama

    from benchmarks import throughput
    from loramux.engine.llm_engine import LLMEngine

    engine = LLMEngine(tiny_llama(), max_loras=1, max_lora_rank=8, max_num_seqs=2, max_model_len=32,
                       async_scheduling=False)
    modes = []

    def run_workload(engine, prompts, loras, output_len):
        modes.append(engine.async_scheduling)
        return dict.fromkeys(throughput.ROUND_KEYS, 1.0)

    monkeypatch.setattr(throughput, "run_workload", run_workload)
    monkeypatch.setattr(throughput, "warm_up", lambda engine, loras, vocab: None)
    args = SimpleNamespace(adapters=[1], repeats=1, output_len=2, compare_sync=compare_sync)
    result = throughput.interleaved_runs(engine, [[1, 2]], {"q/v": ["a"]}, args)
    assert modes == [False] * (4 if compare_sync else 2)  # base and one workload, per mode
    assert engine.async_scheduling is False
    assert ("base, sync" in result["summary"]) is compare_sync


def test_the_cold_reads_benchmark_reads_every_file_at_each_concurrency(tmp_path):
    """Every file is read (the makespan's bandwidth counts all their bytes) at each concurrency,
    every round; a bad size is refused before anything is written."""
    from benchmarks.cold_reads import main

    out = tmp_path / "cold_reads.json"
    result = main(["--files", "5", "--mb", "0.5", "--concurrency", "1,3", "--repeats", "2",
                   "--dir", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert set(result["rounds"]) == {"1", "3"} and all(len(r) == 2 for r in result["rounds"].values())
    for rounds in result["rounds"].values():
        for r in rounds:
            assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["makespan_ms"] * 1.001
            assert abs(r["GBps"] - 5 * 500_000 / (r["makespan_ms"] * 1e-3) / 1e9) < 1e-9
    assert list(tmp_path.iterdir()) == [out]  # the files went with their temp dir
    with pytest.raises(SystemExit):
        main(["--files", "0", "--dir", str(tmp_path)])


def test_the_first_token_benchmark_splits_each_scenario_into_its_steps_parts(tmp_path, capsys):
    """On the embedded model, every slot taken: only the adapter in host memory and the cold one
    take a slot (an eviction and a slot write in their steps), only the cold one reads its files
    (its steps wait in collect); JSON and markdown written."""
    from benchmarks.first_token import SCENARIOS, main

    path = main(["--slots", "3", "--repeats", "1", "--prompt-len", "16", "--out", str(tmp_path), "--tag", "t"])
    report = json.loads(path.read_text())
    assert list(report["runs"]) == list(SCENARIOS) and all(len(runs) == 1 for runs in report["runs"].values())

    def spent(name, part):
        return sum(step.get(part, 0.0) for step in report["runs"][name][0]["steps"])

    for name in SCENARIOS:
        assert report["ttft_ms_median"][name] > 0 and spent(name, "forward") > 0
        placed = name in ("adapter in host memory", "cold adapter")
        assert (spent(name, "lora.slot_write") > 0) == placed and (spent(name, "lora.make_room") > 0) == placed
    assert spent("cold adapter", "collect") > spent("adapter in host memory", "collect")
    text = (tmp_path / "first_token_t.md").read_text()
    assert text.startswith("**CPU") and "| adapter in host memory |" in text and "lora.slot_write" in text
    with pytest.raises(SystemExit):  # too few slots to keep the resident adapter resident
        main(["--slots", "2"])
    assert "--slots 2: must be >= 3" in capsys.readouterr().err
