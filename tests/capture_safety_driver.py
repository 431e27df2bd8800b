"""The capture race, replayed in a process of its own: a step-graph capture mid-run while a loader
thread pins host memory. `tests/test_capture_safety_gpu.py` runs it; it also runs by hand::

    PYTHONPATH=. python tests/capture_safety_driver.py --workdir /tmp/cs            # the code as it is
    PYTHONPATH=. python tests/capture_safety_driver.py --workdir /tmp/cs --without-fix
    PYTHONPATH=. python tests/capture_safety_driver.py --workdir /tmp/cs --dry-run  # CPU: plumbing only

What it does, in order:

1. builds a tiny graph engine (graphs captured at start, as always) and serves a batch with adapters;
2. starts a loader thread that loads adapters through the real `Registry` in a loop, each under a
   fresh name, so every load reads its file into newly pinned host memory (``torch.empty(...,
   pin_memory=True)``: a ``cudaHostAlloc``), and waits until it has loaded once;
3. while that thread keeps loading, captures every step graph again with the engine's own start-up
   entry point (`ModelRunner.capture_graphs`, a fresh `StepGraphs`: shapes it has never captured),
   ``--rounds`` times: the old code path, a capture mid-run while loads run. Each capture is held
   open ``--hold-ms`` before its forward runs, so loads land inside every one (deterministic);
4. stops the thread, serves the same batch from the new graphs and from an eager engine.

``--without-fix`` removes the fix: ``torch.cuda.graph``, which `loramux.engine.worker.cuda_graphs` calls to
capture, is replaced by a wrapper that passes ``capture_error_mode="global"`` (the old code's mode,
torch's default) whatever the code asks for. Both modes wrap it to count captures and to know when
one is under way, so the driver can tell how many loads ran inside a capture.

The last line of output is ``RESULT {json}``; the exit status says what happened (`EXIT_*`). The
old failure aborts the process ("terminate called without an active exception"), so run it as a
child, never inside a test process.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

EXIT_OK = 0
EXIT_UNEXPECTED = 1  # an exception outside the capture (a setup problem: read the traceback)
EXIT_USAGE = 2  # argparse's own status for a bad flag; also "no CUDA without --dry-run"
EXIT_CAPTURE_FAILED = 3  # a mid-run capture raised: the crash this driver looks for
EXIT_LOADER_FAILED = 4  # the loader thread's CUDA call failed (captures completed)
EXIT_NOT_EXERCISED = 5  # no load ran inside a capture, or no capture went through the wrapper
EXIT_WRONG_TOKENS = 6  # the graphs served other tokens than the eager engine

MARK_CAPTURING = "capturing mid-run while the loader thread pins host memory"
RESULT_PREFIX = "RESULT "

# The tiny engine: 2, 4, 8 and 16 tokens, each with a base and a LoRA graph (8 graphs)
ENGINE_OPTIONS = dict(max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16,
                      num_gpu_blocks_override=64)
PROMPTS = [[5, 9, 14, 3], [7, 7, 21, 40, 11, 2, 30], [12, 19], [8, 60, 33, 4, 4, 90]]
ADAPTER_OF_PROMPT = ["a", "b", None, "a"]
DRY_RUN_WINDOWS = 8  # stand-ins for the 8 graphs on the CPU


def positive_int(text: str) -> int:
    """argparse type: an int >= 1, refused with the value and what is allowed."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: an int >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {value}; allowed: an int >= 1")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="where the adapters are written")
    parser.add_argument("--without-fix", action="store_true",
                        help="capture in 'global' error mode, as the old code did (expect a crash)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU plumbing check: eager engine, unpinned loads, nothing captured")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="times every step graph is captured again mid-run (default 3)")
    parser.add_argument("--hold-ms", type=positive_int, default=20,
                        help="each capture is held open this long before its forward, so loads land "
                             "inside it (default 20)")
    parser.add_argument("--max-loads", type=positive_int, default=20_000,
                        help="the loader thread's most loads (each keeps ~8 KiB pinned; default 20000)")
    return parser.parse_args(argv)


class CaptureTracker:
    """Stands in for ``torch.cuda.graph``: records the error mode the code asks for, passes
    ``forced_mode`` instead when given, and knows when a capture is under way.

    :param real_graph: the context manager it wraps (``torch.cuda.graph``).
    :param forced_mode: ``"global"`` to remove the fix; None passes the code's own mode through.
    :param hold_seconds: how long each capture is held open, once begun, before the code's forward
        runs. A sleep is host work, nothing is captured, but the loader thread runs meanwhile: its
        loads land inside every capture however fast this host runs a tiny model's forward.
    """

    def __init__(self, real_graph: Callable, forced_mode: str | None = None, *, hold_seconds: float = 0.0) -> None:
        self.real_graph = real_graph
        self.forced_mode = forced_mode
        self.hold_seconds = hold_seconds
        self.requested_modes: list[str] = []
        self.entered = 0  # captures begun
        self.completed = 0  # captures whose end returned without error
        self.capturing = False  # a capture is under way (between begin and end)

    @contextlib.contextmanager
    def __call__(self, *args, **kwargs) -> Iterator[None]:
        self.requested_modes.append(kwargs.get("capture_error_mode", "global"))  # torch's default
        if self.forced_mode is not None:
            kwargs["capture_error_mode"] = self.forced_mode
        with self.real_graph(*args, **kwargs):
            self.entered += 1
            self.capturing = True
            try:
                time.sleep(self.hold_seconds)
                yield
            finally:
                self.capturing = False  # before the capture ends: what follows is no longer inside
        self.completed += 1


class PinningLoader(threading.Thread):
    """Loads the adapters in ``sources`` through a real `Registry`, round robin, each under a fresh
    name, until stopped: every load reads its file into new pinned host memory (held by the
    registry's CPU tier, so the host allocator's cache never hands a block back and each load is
    a ``cudaHostAlloc``), as a CPU tier filling up while the engine serves does.

    :param tracker: says when a capture is under way; a load that starts and ends inside the same
        capture counts in ``loads_inside_capture``.
    :param pin_memory: False on a dry run (pinning needs CUDA).
    """

    def __init__(self, sources: list[Path], tracker: CaptureTracker, *, pin_memory: bool, max_loads: int) -> None:
        from loramux.registry import LoRAConfig, Registry

        super().__init__(name="pinning-loader", daemon=True)
        self.sources = sources
        self.tracker = tracker
        self.max_loads = max_loads
        self.registry = Registry(LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=max_loads),
                                 resolvers=[], pin_memory=pin_memory)
        self.loaded_once = threading.Event()
        self.stop_requested = threading.Event()
        self.loads = 0
        self.loads_inside_capture = 0
        self.captures_with_a_load: set[int] = set()  # captures (numbered by tracker.entered) a load ran inside
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for n in itertools.count():
                if self.stop_requested.is_set() or n >= self.max_loads:
                    return
                name = f"pinned{n}"
                self.registry.register(name, self.sources[n % len(self.sources)])
                inside, capture = self.tracker.capturing, self.tracker.entered
                adapter = self.registry.get(name)  # reads the file into torch.empty(..., pin_memory=True)
                if inside and self.tracker.capturing and self.tracker.entered == capture:
                    self.loads_inside_capture += 1
                    self.captures_with_a_load.add(capture)
                if adapter.is_pinned != self.registry.pin_memory:
                    raise RuntimeError(f"adapter {name}: is_pinned={adapter.is_pinned}, but the registry's "
                                       f"pin_memory={self.registry.pin_memory}: the loads would not exercise pinning")
                self.loads += 1
                self.loaded_once.set()
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            self.error = error
            traceback.print_exc()
            self.loaded_once.set()  # do not leave the main thread waiting

    def stop(self, timeout: float = 60) -> None:
        self.stop_requested.set()
        self.join(timeout=timeout)


def write_adapters(workdir: Path) -> dict[str, Path]:
    """PEFT adapters "a" (attention) and "b" (every projection, r=4) for `tiny_llama`."""
    from conftest import save_peft_adapter, tiny_llama

    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "a": save_peft_adapter(tiny_llama(), workdir / "a", seed=21),
        "b": save_peft_adapter(tiny_llama(), workdir / "b", seed=22, r=4, lora_alpha=8, target_modules=projections),
    }


def greedy_tokens(llm, adapters: dict[str, Path]) -> list[list[int]]:
    from loramux import LoRARequest, SamplingParams

    ids = {"a": 1, "b": 2}
    requests = [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in ADAPTER_OF_PROMPT]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=requests, use_tqdm=False)
    for out in outputs:
        if out.error is not None:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
    return [out.outputs[0].token_ids for out in outputs]


def build_llm(*, cuda: bool, eager: bool):
    from conftest import tiny_llama

    from loramux.engine.llm import LLM

    model = tiny_llama().cuda() if cuda else tiny_llama()
    # compilation=False: the capture, not torch.compile, is under test, and compiling costs tens of seconds
    return LLM(model, enforce_eager=eager, compilation=False, **ENGINE_OPTIONS)


def capture_mid_run(runner, rounds: int, *, dry_run: bool) -> None:
    """Capture every step graph again, ``rounds`` times, with the engine's start-up entry point (a
    fresh `StepGraphs`). A dry run captures nothing (no CUDA): it opens as many empty windows of
    the wrapped ``torch.cuda.graph`` instead (each held open as a capture is), so the counting of
    loads inside a capture is checked on the CPU too."""
    import torch

    for _ in range(rounds):
        if not dry_run:
            runner.capture_graphs()
            continue
        for _ in range(DRY_RUN_WINDOWS):
            with torch.cuda.graph(None, capture_error_mode="thread_local"):
                pass


def finish(status: int, result: dict) -> None:
    """Print the result line and leave at once: after a failed capture, tearing the process down
    (threads, CUDA objects) is what aborts, and the status must say what happened first."""
    result["exit_status"] = status
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # the kernel warm-up runs eager steps at start, no capture: skipped, it would only cost time
    os.environ.setdefault("LORAMUX_KERNEL_WARMUP", "0")
    import torch

    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        print("capture_safety_driver: this needs a CUDA GPU; pass --dry-run to check the plumbing on the CPU",
              file=sys.stderr)
        sys.exit(EXIT_USAGE)
    # small switch interval: the loader thread also runs during a capture's Python, not only in its hold
    sys.setswitchinterval(0.0005)
    real_graph = torch.cuda.graph if cuda else (lambda *args, **kwargs: contextlib.nullcontext())
    tracker = CaptureTracker(real_graph, "global" if args.without_fix else None, hold_seconds=args.hold_ms / 1000)
    torch.cuda.graph = tracker  # what loramux.engine.worker.cuda_graphs calls (it looks the name up at each capture)
    result: dict = {"without_fix": args.without_fix, "dry_run": args.dry_run, "rounds": args.rounds}
    args.workdir.mkdir(parents=True, exist_ok=True)
    adapters = write_adapters(args.workdir)
    llm = build_llm(cuda=cuda, eager=False)
    runner = llm.llm_engine.runner
    result["captures_at_start"] = tracker.completed
    greedy_tokens(llm, adapters)  # serving has started

    loader = PinningLoader(list(adapters.values()), tracker, pin_memory=cuda, max_loads=args.max_loads)
    loader.start()
    if not loader.loaded_once.wait(timeout=120) or loader.error is not None:
        raise RuntimeError(f"the loader thread did not load an adapter before any capture (error: {loader.error!r})")
    print(MARK_CAPTURING, flush=True)
    started = time.perf_counter()
    try:
        capture_mid_run(runner, args.rounds, dry_run=args.dry_run)
    except Exception:
        traceback.print_exc()
        loader.stop(timeout=10)  # its own CUDA error, if it met one, is printed by now
        result.update(loads=loader.loads, loads_inside_capture=loader.loads_inside_capture,
                      loader_error=repr(loader.error) if loader.error else None)
        finish(EXIT_CAPTURE_FAILED, result)
    loader.stop()
    result.update(
        capture_seconds=round(time.perf_counter() - started, 3), captures_mid_run=tracker.completed - result[
            "captures_at_start"], graphs=runner.num_graphs, loads=loader.loads,
        loads_inside_capture=loader.loads_inside_capture, loader_error=repr(loader.error) if loader.error else None,
        mid_run_captures_with_a_load=len(loader.captures_with_a_load - set(range(result["captures_at_start"] + 1))),
        requested_modes=sorted(set(tracker.requested_modes)),
    )
    if loader.error is not None:
        finish(EXIT_LOADER_FAILED, result)
    windows = args.rounds * (DRY_RUN_WINDOWS if args.dry_run else runner.num_graphs)
    # a real run proves the fix only if a load ran inside every capture; a dry run checks the
    # plumbing, and on a busy 2-core CI box a window may close before the loader thread is scheduled
    needed = 1 if args.dry_run else windows
    if result["captures_mid_run"] != windows or result["mid_run_captures_with_a_load"] < needed:
        print(f"not exercised: {windows} mid-run captures should have gone through the wrapper, "
              f"{'one' if args.dry_run else 'each'} with a load inside (raise --hold-ms)", flush=True)
        finish(EXIT_NOT_EXERCISED, result)

    result["tokens_graphs"] = greedy_tokens(llm, adapters)
    result["graph_steps"] = runner.graph_steps  # replays of the graphs captured mid-run
    llm.llm_engine.close()
    eager = build_llm(cuda=cuda, eager=True)
    result["tokens_eager"] = greedy_tokens(eager, adapters)
    eager.llm_engine.close()
    finish(EXIT_OK if result["tokens_graphs"] == result["tokens_eager"] else EXIT_WRONG_TOKENS, result)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_UNEXPECTED)
