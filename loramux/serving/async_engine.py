"""The bridge between asyncio request handlers and the engine's synchronous step loop.

The ``LLMEngine``'s step loop runs in one thread, the engine thread: it alone calls ``step``.
Handlers hand requests and aborts to a second thread, the intake thread, through a command queue
(so they reach the engine in order) and never wait on the engine themselves; ``add_request`` is
thread-safe and starts an adapter's resolution at once, so a request for a missing adapter is
answered even while a long step runs. The intake thread adds the engine requests of several HTTP
requests in turns of `ADD_TURN` (aborts and other commands first), so one request of 2,000
prompts delays another's start by one turn, not by 2,000 adds. The engine thread hands each step's outputs
back to the event loop, coalesced so that at most one delivery waits on the loop. (Adapter operations such as
``add_lora``, which block while an adapter loads and which the engine allows from any thread, run
in worker threads instead, so they never hold up the step loop.)

Outputs are cumulative (text and token ids so far), so a handler that reads slowly does not need
every one: a request keeps only its latest output, and a reader always sees the newest state.

Adapter events (``LLMEngine.add_event_listener``) come from whatever thread they happen in and
reach the loop with ``loop.call_soon_threadsafe``: "failed" fails the requests it names at once
(a 404/400 before any token of any request is needed), "ready" records the load on the group
(resolve + load time, the resolver), and "retired" resolves the future :meth:`AsyncEngine.retirement`
handed out for that handle.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loramux.engine.core.events import AdapterEvent
from loramux.engine.core.outputs import RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.registry import LoRARequest
from loramux.serving.engine_client import EngineClient, Prompt
from loramux.serving.errors import EngineDeadError

__all__ = ["AsyncEngine", "RequestGroup", "SubRequest"]

logger = logging.getLogger(__name__)

# With unfinished requests that produced nothing (all waiting for an adapter to load, say), the
# loop waits this long for a command instead of spinning on step().
_IDLE_STEP_WAIT_S = 0.005
# With no unfinished request, the loop sleeps until a command wakes it (this bounds a missed wake).
_IDLE_WAIT_S = 0.05
# Engine requests of one HTTP request added before the next HTTP request's turn.
ADD_TURN = 16


@dataclass(frozen=True)
class SubRequest:
    """One engine request: what ``LLMEngine.add_request`` takes."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    lora_request: LoRARequest | None = None
    api_request_id: str | None = None  # the HTTP request it belongs to (the engine takes them in turn)


class RequestGroup:
    """The engine requests behind one HTTP request (one per choice), watched together.

    Lives on the event loop: the engine thread never touches it directly.
    """

    def __init__(self, requests: Sequence[SubRequest]) -> None:
        self.requests = list(requests)
        self.latest: list[RequestOutput | None] = [None] * len(self.requests)  # per choice
        self.submitted_at = time.monotonic()
        self.first_output_at: float | None = None
        # latency metrics, measured as outputs reach the event loop
        self.first_token_at: list[float | None] = [None] * len(self.requests)
        self.last_token_at: list[float | None] = [None] * len(self.requests)
        self.inter_token_gaps: list[float] = []  # seconds between consecutive tokens, all choices
        self._tokens_seen = [0] * len(self.requests)
        self.adapter_event: AdapterEvent | None = None  # the engine's "ready" event for this group's adapter
        self._changed: set[int] = set()
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.released = False  # its handler let go: requests not added yet never will be

    @property
    def finished(self) -> bool:
        return all(output is not None and output.finished for output in self.latest)

    def _update(self, index: int, output: RequestOutput) -> None:
        now = time.monotonic()
        if self.first_output_at is None:
            self.first_output_at = now
        self._time_tokens(index, output, now)
        self.latest[index] = output
        self._changed.add(index)
        self._event.set()

    def _time_tokens(self, index: int, output: RequestOutput, now: float) -> None:
        """Record when a choice's tokens arrived; tokens arriving together split the gap evenly."""
        count = len(output.outputs[0].token_ids) if output.outputs else 0
        new = count - self._tokens_seen[index]
        if new <= 0:
            return
        if self.first_token_at[index] is None:
            self.first_token_at[index] = now
            new -= 1  # the first token has no gap before it
        if new > 0 and self.last_token_at[index] is not None:
            self.inter_token_gaps.extend([(now - self.last_token_at[index]) / new] * new)
        self.last_token_at[index] = now
        self._tokens_seen[index] = count

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._event.set()

    async def changes(self) -> list[int]:
        """Wait for new outputs; returns the indices of the choices that changed.

        :raises: what the engine raised for one of these requests (the whole group fails).
        """
        await self._event.wait()
        self._event.clear()
        if self._error is not None:
            raise self._error
        changed = sorted(self._changed)
        self._changed.clear()
        return changed


class AsyncEngine:
    """Runs an ``LLMEngine``'s step loop in its own thread and serves it to asyncio handlers.

    :param engine: an ``LLMEngine``, or another `EngineClient`.
    """

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._groups: dict[str, tuple[RequestGroup, int]] = {}  # request id -> (group, index); loop only
        self._pending: dict[str, RequestOutput] = {}  # request id -> latest output not yet on the loop
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None  # the step loop
        self._intake_thread: threading.Thread | None = None  # runs commands in order
        self._adding: deque[tuple[RequestGroup, int]] = deque()  # submitted, and how many are added; intake only
        self._wake = threading.Event()  # a command ran: the step loop may have work
        self._stopping = False
        self._retirements: dict[int, asyncio.Future] = {}  # handle id -> resolved when it retires; loop only
        self._listening = False

    # -- lifecycle (event loop) -----------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self.engine.lora_enabled:  # else no adapter events
            self.engine.add_event_listener(self._on_engine_event)
            self._listening = True
        self._thread = threading.Thread(target=self._run, name="loramux-engine", daemon=True)
        self._thread.start()
        self._intake_thread = threading.Thread(target=self._intake, name="loramux-intake", daemon=True)
        self._intake_thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (waiting handlers get an error) and join it."""
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(None)
        self._wake.set()
        self._intake_thread.join(timeout)
        self._thread.join(timeout)
        self._thread = self._intake_thread = None
        if self._listening:
            self.engine.remove_event_listener(self._on_engine_event)
            self._listening = False

    @property
    def in_flight(self) -> int:
        """Engine requests submitted and not finished."""
        return len(self._groups)

    @property
    def waiting(self) -> int:
        """Engine requests submitted that have produced no output yet (queued, or their adapter loading)."""
        return sum(1 for group, index in self._groups.values() if group.latest[index] is None)

    # -- requests (event loop) ------------------------------------------------------------------

    def submit(self, requests: Sequence[SubRequest]) -> RequestGroup:
        """Hand ``requests`` to the engine; read their outputs from the returned group.

        The caller must ``release`` the group when done with it, which aborts whatever has not
        finished: a client that goes away frees its sequences. Request ids must be unique.
        """
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead}")
        group = RequestGroup(requests)
        for index, request in enumerate(group.requests):
            self._groups[request.request_id] = (group, index)
        self._commands.put(lambda: self._adding.append((group, 0)))
        return group

    def release(self, group: RequestGroup) -> None:
        """Forget ``group``, aborting its unfinished requests in the engine."""
        group.released = True  # before the abort is queued: the intake thread adds no more of it
        unfinished = []
        for index, request in enumerate(group.requests):
            if self._groups.pop(request.request_id, None) is None:
                continue
            output = group.latest[index]
            if output is None or not output.finished:
                unfinished.append(request.request_id)
        if unfinished and self.dead is None:
            self._commands.put(lambda: self._abort(unfinished))

    def retirement(self, handle_id: int) -> asyncio.Future:
        """A future resolved (with the event) when the engine retires ``handle_id``: its name was
        rebound or unbound and its last request ended. Ask before the call that unbinds it."""
        future = self._retirements.get(handle_id)
        if future is None:
            future = self._retirements[handle_id] = asyncio.get_running_loop().create_future()
        return future

    def forget_retirement(self, handle_id: int) -> None:
        """Stop waiting for ``handle_id`` (it kept its name: a reload of the same content)."""
        future = self._retirements.pop(handle_id, None)
        if future is not None:
            future.cancel()

    # -- engine thread --------------------------------------------------------------------------

    def _on_engine_event(self, event: AdapterEvent) -> None:
        """An adapter event, in the engine's (or a loading) thread: hand it to the loop."""
        self._to_loop(self._deliver_event, event)

    def _add_turn(self) -> None:
        """Add the next `ADD_TURN` engine requests of the first HTTP request in line, which then
        goes to the back of the line if it has more (intake thread)."""
        group, start = self._adding.popleft()
        if group.released:  # its client went away (or it failed): the rest is never added
            return
        end = start + ADD_TURN
        for request in group.requests[start:end]:
            try:
                self.engine.add_request(request.request_id, request.prompt, request.params,
                                        lora_request=request.lora_request, api_request_id=request.api_request_id)
            except Exception as error:  # a bad prompt or parameter fails only this HTTP request
                self._to_loop(self._fail_request, request.request_id, error)
                self._abort([r.request_id for r in group.requests[:end] if r is not request])
                return
        if end < len(group.requests):
            self._adding.append((group, end))

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            try:
                self.engine.abort_request(request_id)
            except Exception:  # already finished or never added: nothing to free
                logger.debug("abort_request(%s) failed", request_id, exc_info=True)

    def _run(self) -> None:
        """The step loop: step while the engine has work, else sleep until a command arrives."""
        while not self._stopping:
            self._wake.clear()  # before looking: a command that lands after this wakes the wait
            if not self._engine_busy():
                self._wake.wait(_IDLE_WAIT_S)
                continue
            started = time.monotonic()
            try:
                outputs = self.engine.step()
            except BaseException as error:  # noqa: BLE001 - reported to every waiting handler
                logger.exception("The engine's step() raised; the server cannot generate any more")
                self.dead = error
                self._to_loop(self._fail_all, EngineDeadError(f"the engine stopped after an error: {error!r}"))
                return
            if outputs:
                self._publish(outputs)
            elif time.monotonic() - started < _IDLE_STEP_WAIT_S and not self.engine.has_scheduled_work():
                self._wake.wait(_IDLE_STEP_WAIT_S)  # every request waits for its adapter: no spinning

    def _engine_busy(self) -> bool:
        try:
            return bool(self.engine.has_unfinished_requests())
        except Exception:
            logger.exception("has_unfinished_requests() raised")
            return False

    def _intake(self) -> None:
        """Run commands (submits, aborts) in order, and between them add the submitted requests
        in turns, beside the step loop: ``add_request`` is thread-safe and starts an adapter's
        resolution at once, even while a step runs."""
        while True:
            try:  # a command first; with none waiting, the next turn of adds
                command = self._commands.get(block=not self._adding)
            except queue.Empty:
                command = self._add_turn
            if command is None or self._stopping:
                self._shutdown()
                return
            try:
                command()
            except Exception:
                logger.exception("An engine command raised")
            self._wake.set()

    def _shutdown(self) -> None:
        self._to_loop(self._fail_all, EngineDeadError("the server is shutting down"))

    def _to_loop(self, fn: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed in between: nobody is listening any more
                pass

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to the loop, coalesced: at most one delivery is ever queued.

        An engine that steps faster than the loop drains would otherwise queue callbacks without
        bound, delaying everything else on the loop (a client's disconnect among them). Outputs
        are cumulative, so keeping only each request's latest loses nothing.
        """
        with self._pending_lock:
            schedule = not self._pending
            for output in outputs:
                self._pending[output.request_id] = output
        if schedule:
            self._to_loop(self._deliver_pending)

    # -- delivery (event loop) ------------------------------------------------------------------

    def _deliver_pending(self) -> None:
        with self._pending_lock:
            outputs, self._pending = list(self._pending.values()), {}
        for output in outputs:
            entry = self._groups.get(output.request_id)
            if entry is not None:  # None: released (client gone) while this step ran
                group, index = entry
                group._update(index, output)

    def _deliver_event(self, event: AdapterEvent) -> None:
        if event.kind == "retired":
            future = self._retirements.pop(event.handle.id, None)
            if future is not None and not future.done():
                future.set_result(event)
            return
        for request_id in event.request_ids:
            entry = self._groups.get(request_id)
            if entry is None:
                continue
            group, _ = entry
            if event.kind == "failed":
                group._fail(event.error)
            elif group.adapter_event is None:
                group.adapter_event = event

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        entry = self._groups.get(request_id)
        if entry is not None:
            entry[0]._fail(error)

    def _fail_all(self, error: BaseException) -> None:
        for group, _ in list(self._groups.values()):
            group._fail(error)
