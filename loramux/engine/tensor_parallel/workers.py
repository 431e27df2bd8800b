"""The driver's handle on its tensor-parallel workers: start them, send them work, wait, stop them.

Ranks 1..N-1 are processes started here (torch.multiprocessing's spawn context: CUDA cannot be
forked). Each gets one pipe. Per call the driver sends every worker the same pickled
``(method, args)``: a step's packed inputs (a few lists of ints, as the driver's own runner
builds them), a KV-cache allocation, a graph capture; or each worker its own part of an adapter
for a slot. Calls that run a forward are answered ("done") once the worker's device has run
them (a thread of the worker's waits for that, so the worker goes on to the next call at once:
steps queue on every rank as they do on rank 0). The driver reads a step's answers before it
waits on that step's results: a collective with a dead peer would never finish, so the driver
must not wait on one. While it reads it watches each worker's process sentinel, so a worker that
dies fails the call at once with a `WorkerError` (its traceback when it had time to send one),
never a hang. The first failure is kept: every later call raises it, as the group cannot recover.

Pipes over nano-vllm's shared memory + events: the inputs of a step are a few KB, pickling them
costs microseconds next to a forward, and a pipe gives both ends end-of-file when the other dies
(a worker whose driver is gone exits at its next read).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import pickle
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed
import torch.multiprocessing

from loramux.engine.config import EngineConfig
from loramux.engine.tensor_parallel.group import destroy_group, free_port, init_group, rank_device

__all__ = ["WorkerError", "WorkerGroup"]

logger = logging.getLogger(__name__)

#: the longest a worker may take to answer a call (a first forward compiles; a capture takes a while)
REPLY_TIMEOUT_S = 600.0
#: how long a worker may take to start and join the process group
START_TIMEOUT_S = 600.0

#: the runner calls, as the errors name them
_CALLS = {
    "_forward_packed": "a forward", "_replay": "a decode-graph replay", "_allocate_kv_cache": "the KV-cache "
    "allocation", "_profile_peak_bytes": "memory profiling", "_capture_graphs": "the decode-graph capture",
}


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot continue (close it)."""


class WorkerGroup:
    """Ranks 1..N-1 of a tensor-parallel engine; this process joins the group as rank 0.

    :param config: the engine's config (``tensor_parallel_size`` = N); each worker builds its
        shard of the model from it.
    """

    def __init__(self, config: EngineConfig) -> None:
        if torch.distributed.is_initialized():  # before spawning anything
            raise RuntimeError(
                "a torch.distributed process group is already open in this process (another "
                "tensor-parallel engine?); close() that engine before starting another."
            )
        self.size = config.tensor_parallel_size
        from loramux.engine.engine_setup import _default_device

        device = torch.device(config.device) if config.device is not None else _default_device()
        self.device = rank_device(device, 0, self.size)
        self._lock = threading.Lock()  # one sender at a time (steps and slot writes from API threads)
        self._error: WorkerError | None = None
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list = []
        self._calls = 0  # calls sent that each worker answers, in order
        self._answered = [0] * (self.size - 1)  # per worker, the answers read
        self._in_group = False
        context = torch.multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        from loramux.engine.tensor_parallel.worker import run_worker

        worker_config = config.for_worker()  # pickled to each worker: no registry, no tokenizer
        try:
            for rank in range(1, self.size):
                ours, theirs = context.Pipe(duplex=True)
                process = context.Process(
                    target=run_worker, args=(rank, self.size, init_method, worker_config, theirs),
                    name=f"loramux-tp-rank{rank}", daemon=True,
                )
                self._conns.append(ours)
                process.start()
                self._procs.append(process)
                theirs.close()  # only the worker holds its end: its death is our end-of-file
            self._join_group(init_method)
            self._in_group = True
        except BaseException:
            self.shutdown(timeout=0.0)  # the workers may still be starting: they read no message yet
            raise

    def _join_group(self, init_method: str) -> None:
        """Join as rank 0, watching the workers: one that dies before joining fails this at once."""
        failure: list[BaseException] = []

        def join() -> None:
            try:
                init_group(init_method, 0, self.size, self.device)
            except BaseException as exc:  # re-raised in the caller's thread
                failure.append(exc)

        thread = threading.Thread(target=join, name="loramux-tp-rendezvous", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while thread.is_alive():
            thread.join(0.1)
            self._check_alive("start-up")
            if time.monotonic() > deadline:
                raise self._fail(f"the workers did not join the process group within {START_TIMEOUT_S:.0f} s")
        if failure:
            raise failure[0]
        if self.device.type == "cuda":  # init_group set it in the thread above; each thread has its own
            torch.cuda.set_device(self.device)

    # -- sending -----------------------------------------------------------------------------

    def call(self, method: str, *args, reply: bool = True, sampled: int = 0, **kwargs) -> int:
        """Send every worker ``method(*args, **kwargs)`` (a `ModelRunner` method). With ``reply``
        each worker answers once its device has run the call; returns the call's number, which
        `wait` takes (after this rank ran the same call). ``sampled``: the step samples that many
        tokens, which rank 0 then broadcasts (`share_sampled`) for the next step to read."""
        self._send([_message(method, *args, reply=reply, sampled=sampled, **kwargs)] * len(self._conns))
        if reply:
            self._calls += 1
        return self._calls

    def write_slot(self, slot: int, parts: list[dict]) -> None:
        """Each worker its part of an adapter: ``parts[rank - 1]`` maps module names to rank
        ``rank``'s weights (`AdapterWeightPool.shard`; layers it has no weights for are cleared
        in ``slot``)."""
        payloads = []
        for part in parts:
            own = {name: _owned(weights) for name, weights in part.items()}
            payloads.append(_message("write_slot", slot, own))
        self._send(payloads)

    def clear_slot(self, slot: int) -> None:
        self._send([_message("clear_slot", slot)] * len(self._conns))

    def _send(self, payloads: list[bytes]) -> None:
        with self._lock:
            self._check_alive("a send")
            for rank, (conn, payload) in enumerate(zip(self._conns, payloads), start=1):
                try:
                    conn.send_bytes(payload)
                except OSError as exc:
                    self._check_alive("a send")
                    raise self._fail(f"sending to tensor-parallel worker rank {rank} failed ({exc})") from exc

    # -- waiting -----------------------------------------------------------------------------

    def wait(self, what: str = "the step", through: int | None = None) -> None:
        """Read every worker's answers up to call number ``through`` (default: the last call
        sent), failing at once if one died. Answers come in call order, so a step's wait reads
        none of the steps queued after it."""
        what = _CALLS.get(what, what)
        if self._error is not None:
            raise self._error
        through = self._calls if through is None else through
        pending = {rank: conn for rank, conn in enumerate(self._conns, start=1) if self._answered[rank - 1] < through}
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while pending:
            sentinels = {self._procs[rank - 1].sentinel: rank for rank in pending}
            ready = multiprocessing.connection.wait(
                [*pending.values(), *sentinels], timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                raise self._fail(f"tensor-parallel workers {sorted(pending)} did not finish {what} "
                                 f"within {REPLY_TIMEOUT_S:.0f} s")
            for rank, conn in list(pending.items()):
                if conn in ready or self._procs[rank - 1].sentinel in ready:
                    self._read_reply(rank, conn, what)
                    self._answered[rank - 1] += 1
                    if self._answered[rank - 1] >= through:
                        del pending[rank]

    def after_local_failure(self, what: str) -> None:
        """Rank 0 failed during ``what`` after the workers were sent it. Raises `WorkerError` if a
        worker died (a collective fails when its peer goes; the death is the cause to report);
        otherwise the ranks are out of step, so every later call fails (the caller re-raises)."""
        what = _CALLS.get(what, what)
        multiprocessing.connection.wait([p.sentinel for p in self._procs], timeout=2.0)
        self._check_alive(what)
        self._fail(f"rank 0 failed during {what}, so the tensor-parallel ranks are out of step; "
                   "close the engine and start a new one")

    def wait_ready(self) -> None:
        """Wait until every worker has built its shard of the model (its first answer)."""
        self._calls += 1
        self.wait("building its shard of the model")

    def _read_reply(self, rank: int, conn, what: str) -> None:
        try:
            kind, detail = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            process = self._procs[rank - 1]
            process.join(1.0)
            raise self._fail(
                f"tensor-parallel worker rank {rank} (pid {process.pid}) died during {what} "
                f"(exit code {process.exitcode}); the engine cannot continue: close it and start a new one."
            ) from None
        if kind == "error":
            raise self._fail(f"tensor-parallel worker rank {rank} failed during {what}:\n{detail}")

    def _check_alive(self, what: str) -> None:
        if self._error is not None:
            raise self._error
        for rank, process in enumerate(self._procs, start=1):
            # the sentinel, not is_alive(): a killed process closes its pipes (and its sockets, so
            # a collective fails) a moment before waitpid reports it gone
            if multiprocessing.connection.wait([process.sentinel], timeout=0):
                process.join(1.0)  # for its exit code
                conn = self._conns[rank - 1]
                if conn.poll():  # it said why before it went
                    self._read_reply(rank, conn, what)
                raise self._fail(
                    f"tensor-parallel worker rank {rank} (pid {process.pid}) died during {what} (exit code "
                    f"{process.exitcode}); the engine cannot continue: close it and start a new one."
                )

    def _fail(self, message: str) -> WorkerError:
        if self._error is None:
            self._error = WorkerError(message)
        return self._error

    # -- stopping ----------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def shutdown(self, timeout: float = 10.0, *, release: Callable[[], None] | None = None) -> None:
        """Stop every worker (politely, within ``timeout`` seconds, then by force; at once after a
        failure, when they may be stuck in a collective) and leave the process group, calling
        ``release`` (rank 0's graphs and KV cache) once rank 0's collectives have stopped
        (`destroy_group`: an aborted group is left only after its graphs are). Idempotent."""
        if self._error is not None:
            timeout = 0.0
        message = _message("shutdown")
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:
                pass  # already gone
        deadline = time.monotonic() + timeout
        lost = self._error is not None  # a rank died: it will never shut its part of the group down
        for process in self._procs:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5.0)
                lost = True
            lost = lost or process.exitcode != 0
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if self._in_group:  # only ours: a later engine's group must outlive this one's finalizer
            self._in_group = False
            destroy_group(abort=lost, release=release)
        elif release is not None:
            release()


def _message(method: str, *args, reply: bool = False, sampled: int = 0, **kwargs) -> bytes:
    """A call as a worker reads it (`worker._serve`): ``(method, args, kwargs, reply, sampled)``."""
    return pickle.dumps((method, args, kwargs, reply, sampled))


def _owned(weights):
    """A copy of a weights view that pickles only its own elements (a view pickles its storage)."""
    from dataclasses import replace

    return replace(weights, lora_a=weights.lora_a.clone(memory_format=torch.contiguous_format),
                   lora_b=weights.lora_b.clone(memory_format=torch.contiguous_format))
