"""A tensor-parallel worker process: build this rank's shard, then run what the driver sends.

The worker builds the same engine setup as the driver (same model, sharded for its rank, same
fused siblings and LoRA layers, same sizes) and a `ModelRunner` without a sampler, then loops:
read ``(method, args)`` from its pipe, run it, answer when asked. It runs forwards, allocates
its KV cache, captures its step graphs, and writes the adapter parts the driver sends into
its LoRA slots; it never schedules, loads adapters or samples. It exits on "shutdown", on
end-of-file (the driver is gone) or on an error, which it sends to the driver first.
"""

from __future__ import annotations

import pickle
import queue
import threading
import traceback

import torch

from loramux.engine.config import EngineConfig
from loramux.engine.adapters.lora_model import LoRAModelManager

__all__ = ["WorkerLoRAManager", "run_worker"]

#: what the driver may ask of a worker's runner (each runs on every rank, in the same order)
RUNNER_METHODS = frozenset({"_forward_packed", "_replay", "_allocate_kv_cache", "_profile_peak_bytes",
                            "_capture_graphs"})


class Answers:
    """The worker's messages to the driver, one at a time (the serving loop sends errors, a
    thread the answers): "done" once the device has run a call, so the loop goes on to the next
    call while the device works, as rank 0 does."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self._lock = threading.Lock()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def send(self, kind: str, detail=None) -> None:
        with self._lock:
            self.conn.send_bytes(pickle.dumps((kind, detail)))

    def done(self, device: torch.device) -> None:
        """Answer the call just queued on ``device`` once the device has run it (a CPU has)."""
        if device.type != "cuda":
            return self.send("done")
        if self._thread is None:
            self._thread = threading.Thread(target=self._answer_when_run, args=(device,), name="loramux-tp-answers",
                                            daemon=True)
            self._thread.start()
        event = torch.cuda.Event()
        event.record()
        self._events.put(event)

    def _answer_when_run(self, device: torch.device) -> None:
        torch.cuda.set_device(device)
        while True:
            self._events.get().synchronize()
            try:
                self.send("done")
            except OSError:  # the driver is gone; the serving loop sees it at its next read
                return


class WorkerLoRAManager(LoRAModelManager):
    """A worker's LoRA layers. The driver owns the slot table (what sits where, pins, LRU) and
    checks each step's slots; the worker only holds the weights it was sent, per slot."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._written: set[int] = set()

    def write_shards(self, slot: int, part: dict) -> None:
        """Put this rank's part of an adapter (module name -> weights) into ``slot``; the layers
        it has no weights for are cleared there."""
        self.pool.write(slot, part)
        self._written.add(slot)

    def clear_shards(self, slot: int) -> None:
        self.pool.clear(slot)
        self._written.discard(slot)

    def mark_used(self, slots) -> None:
        empty = [slot for slot in slots if slot not in self._written]
        assert not empty, f"slot(s) {empty} were never written on this worker (the driver's slot writes are lost)"


def run_worker(rank: int, size: int, init_method: str, config: EngineConfig, conn) -> None:
    """The worker process's entry point (see the module docstring)."""
    from loramux.engine.engine_setup import build_engine_setup
    from loramux.engine.worker.model_runner import ModelRunner
    from loramux.engine.tensor_parallel.group import destroy_group, init_group, rank_device

    answers = Answers(conn)
    try:
        device = torch.device(config.device) if config.device is not None else _default_device()
        if device.type == "cpu":  # the ranks share the host's cores: oversubscribed, they spin-wait
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        init_group(init_method, rank, size, rank_device(device, rank, size))
        setup = build_engine_setup(config, tp_rank=rank, worker_manager_class=WorkerLoRAManager)
        runner = ModelRunner(config, setup.model, sampler=None, lora_manager=setup.lora_manager)
        answers.send("ready")
        _serve(runner, setup.lora_manager, conn, answers)
    except BaseException:  # noqa: BLE001 -- the driver gets the traceback, then this process exits
        try:
            answers.send("error", traceback.format_exc())
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        destroy_group()


@torch.inference_mode()  # as the driver's steps: the graphs' static inputs are inference tensors
def _serve(runner, manager: WorkerLoRAManager | None, conn, answers: Answers) -> None:
    from loramux.engine.tensor_parallel.group import share_sampled

    while True:
        try:
            method, args, kwargs, reply, sampled = pickle.loads(conn.recv_bytes())
        except EOFError:  # the driver is gone
            return
        if method == "shutdown":
            return
        if method == "write_slot":
            manager.write_shards(*args)
        elif method == "clear_slot":
            manager.clear_shards(*args)
        elif method in RUNNER_METHODS:
            getattr(runner, method)(*args, **kwargs)
            if sampled:  # rank 0's tokens, for the next step's pending ones
                runner.last_tokens = share_sampled(torch.empty(sampled, dtype=torch.int64, device=runner.device))
        else:
            raise ValueError(f"unknown tensor-parallel call {method!r}")
        if reply:
            answers.done(runner.device)


def _default_device() -> torch.device:
    from loramux.engine.engine_setup import _default_device

    return _default_device()
