"""The capture race (a graph captured while a loader thread makes CUDA calls) as a regression test
that can see the crash.

The crash: a step-graph capture, started mid-run for a new shape while adapters loaded on
background threads, was invalidated (``cudaErrorStreamCaptureInvalidated``) and the process
aborted ("terminate called without an active exception"). Loading pins host memory
(``torch.empty(..., pin_memory=True)`` is a ``cudaHostAlloc``), and a capture in CUDA's *global*
error mode (torch's default, which the old code used) is invalidated by such a call on any thread.

The fix, two parts (`loramux.engine.worker.cuda_graphs`, `ModelRunner.capture_graphs`):

1. every step graph is captured at engine start, before any loader thread exists; none while
   serving (`tests/test_engine_gpu.py::test_churn_with_graphs_loads_running_and_new_shapes_equals_eager`
   checks that no graph is captured after start);
2. captures use ``capture_error_mode="thread_local"``: CUDA calls other threads make cannot
   invalidate them.

Part 1 hides the race; the test here takes it away on purpose: `capture_safety_driver.py` captures
every graph again mid-run (the old code path) while a thread loads adapters through the real
registry in a loop, so only part 2 stands between the capture and the crash. Run with part 2
removed (``--without-fix``: captures in global mode), the driver must fail with the crash's
signature, which proves the test sees the crash; run as the code is, it must complete every capture
with loads inside them and then serve the eager engine's tokens from the new graphs.

Why a child process: the old failure aborts the process, which would take pytest down with it (and
a failed capture leaves CUDA state no later test should share).

The GPU tests run on the GPU machine: ``PYTHONPATH=. python -m pytest -m gpu
tests/test_capture_safety_gpu.py -q``. The CPU tests check the driver's plumbing (flags, the
wrapper that removes the fix, a ``--dry-run`` of the whole flow without CUDA) in CI.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import capture_safety_driver as driver

REPO = Path(__file__).resolve().parents[1]
DRIVER = Path(driver.__file__).resolve()
CHILD_TIMEOUT_S = 300  # a cold start compiles the Triton kernels; warm, a child takes well under a minute

# What the old failure prints: the loader's cudaHostAlloc refused (cudaErrorStreamCaptureUnsupported),
# the capture invalidated (cudaErrorStreamCaptureInvalidated), or the abort itself
CRASH_SIGNATURES = (
    "operation not permitted when stream is capturing",
    "operation failed due to a previous error during capture",
    "cudaErrorStreamCaptureInvalidated",
    "cudaErrorStreamCaptureUnsupported",
    "CUDA_ERROR_STREAM_CAPTURE",
    "terminate called without an active exception",
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@dataclass
class DriverRun:
    returncode: int
    output: str  # stdout then stderr
    result: dict | None  # the RESULT line's fields, when the driver got that far


def run_driver(workdir: Path, *flags: str, timeout: float = CHILD_TIMEOUT_S) -> DriverRun:
    """Run the driver in a child Python with this checkout first on its path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, str(DRIVER), "--workdir", str(workdir), *flags], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as timed_out:  # its output may come back as bytes, even with text=True
        output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part
                         for part in (timed_out.stdout, timed_out.stderr) if part)
        pytest.fail(f"the driver ran past {timeout} s (a hang is a failure too); its output:\n{output}")
    output = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith(driver.RESULT_PREFIX)]
    result = json.loads(lines[-1][len(driver.RESULT_PREFIX):]) if lines else None
    return DriverRun(done.returncode, output, result)


# --- GPU: the crash without the fix, none with it ----------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_capture_mid_run_without_the_fix_crashes(tmp_path):
    """Captures in global mode while the loader thread pins memory: the child must fail with the
    crash's signature, after reaching the mid-run capture (a failure before it proves nothing)."""
    run = run_driver(tmp_path, "--without-fix")
    assert driver.MARK_CAPTURING in run.output, f"the driver failed before the mid-run capture:\n{run.output}"
    crashed = run.returncode in (driver.EXIT_CAPTURE_FAILED, driver.EXIT_LOADER_FAILED) or run.returncode < 0
    assert crashed, (
        f"without the fix the mid-run capture should have crashed, but the driver exited {run.returncode} "
        f"(result: {run.result}); exit {driver.EXIT_NOT_EXERCISED} means no load ran inside a capture "
        f"(raise --hold-ms).\n{run.output}"
    )
    assert any(signature in run.output for signature in CRASH_SIGNATURES), run.output


@pytest.mark.gpu
@needs_cuda
def test_capture_mid_run_with_the_fix_completes_and_matches_eager(tmp_path):
    """The code as it is: every mid-run capture completes with loads running inside it, and the
    graphs captured then serve the eager engine's greedy tokens, adapters included."""
    run = run_driver(tmp_path)
    assert run.returncode == driver.EXIT_OK, f"exit {run.returncode}, result {run.result}:\n{run.output}"
    result = run.result
    assert result["requested_modes"] == ["thread_local"], result  # the fix is in the code
    assert result["captures_at_start"] == result["graphs"] == 8, result
    assert result["captures_mid_run"] == result["rounds"] * result["graphs"], result
    assert result["mid_run_captures_with_a_load"] == result["captures_mid_run"], result  # loads inside each one
    assert result["loader_error"] is None, result
    assert result["graph_steps"] > 0, result  # the tokens below came from the graphs captured mid-run
    assert result["tokens_graphs"] == result["tokens_eager"], result


# --- CPU: the driver's plumbing ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rounds", "0"], "argument --rounds: got 0; allowed: an int >= 1"),
        (["--max-loads", "many"], "argument --max-loads: got 'many'; allowed: an int >= 1"),
        (["--mode", "global"], "unrecognized arguments: --mode global"),
    ],
)
def test_driver_refuses_a_bad_flag_with_the_value_and_what_is_allowed(tmp_path, flags, message):
    run = run_driver(tmp_path, *flags, timeout=60)
    assert run.returncode == driver.EXIT_USAGE and message in run.output, run.output
    assert run.result is None


def test_driver_refuses_to_run_without_cuda_unless_a_dry_run(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the driver runs for real there")
    run = run_driver(tmp_path, timeout=120)
    assert run.returncode == driver.EXIT_USAGE, run.output
    assert "needs a CUDA GPU; pass --dry-run" in run.output


def test_dry_run_loads_inside_capture_windows_and_serves_the_eager_tokens(tmp_path):
    """The whole flow on the CPU: real adapters, the real registry loading in a thread (unpinned:
    no CUDA), the tracker's windows standing in for captures, the engine's tokens compared."""
    run = run_driver(tmp_path, "--dry-run", "--rounds", "2", timeout=180)
    assert run.returncode == driver.EXIT_OK, run.output
    result = run.result
    assert result["dry_run"] and not result["without_fix"]
    assert result["captures_mid_run"] == 2 * driver.DRY_RUN_WINDOWS, result
    # thread timing on a busy 2-core CI box: the plumbing needs loads inside windows, not in each
    assert result["mid_run_captures_with_a_load"] >= 1, result
    assert 1 <= result["loads_inside_capture"] <= result["loads"], result
    assert result["requested_modes"] == ["thread_local"] and result["loader_error"] is None, result
    assert result["tokens_graphs"] == result["tokens_eager"] and len(result["tokens_eager"]) == len(driver.PROMPTS)


def _recording_graph(calls: list[dict]):
    """A stand-in for torch.cuda.graph that records the keywords it is given."""

    @contextlib.contextmanager
    def graph(*args, **kwargs):
        calls.append(kwargs)
        yield

    return graph


def test_tracker_without_the_fix_forces_global_mode_and_marks_the_capture():
    calls: list[dict] = []
    tracker = driver.CaptureTracker(_recording_graph(calls), forced_mode="global")
    assert not tracker.capturing
    with tracker("graph", pool="pool", capture_error_mode="thread_local"):
        assert tracker.capturing and tracker.entered == 1 and tracker.completed == 0
    assert calls == [{"pool": "pool", "capture_error_mode": "global"}]
    assert tracker.requested_modes == ["thread_local"]  # what the code asked for
    assert not tracker.capturing and tracker.completed == 1


def test_tracker_with_the_fix_passes_the_mode_through_and_counts_only_completed_captures():
    calls: list[dict] = []
    tracker = driver.CaptureTracker(_recording_graph(calls))
    with pytest.raises(RuntimeError, match="invalidated"):
        with tracker("graph", capture_error_mode="thread_local"):
            raise RuntimeError("capture invalidated")
    assert calls == [{"capture_error_mode": "thread_local"}]
    assert tracker.entered == 1 and tracker.completed == 0 and not tracker.capturing
    with tracker("graph"):  # no mode given: torch's default, global
        pass
    assert tracker.requested_modes == ["thread_local", "global"] and tracker.completed == 1


def test_the_engine_captures_through_the_call_the_driver_replaces():
    """The driver removes the fix by replacing ``torch.cuda.graph``; if the engine captured some
    other way, ``--without-fix`` would silently test nothing (the GPU test would then see no crash)."""
    from loramux.engine.worker import cuda_graphs

    source = inspect.getsource(cuda_graphs.StepGraphs._capture)
    assert "torch.cuda.graph(" in source, "StepGraphs._capture no longer calls torch.cuda.graph: update the driver"
    assert 'capture_error_mode="thread_local"' in source, "the fix (thread_local captures) is gone"
