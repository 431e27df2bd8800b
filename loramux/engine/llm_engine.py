"""`LLMEngine`: the step loop. Requests in, one forward per step for all of them, outputs out.

    engine = LLMEngine(enable_lora=True, max_loras=4)
    engine.add_request("a", "Hello", SamplingParams(max_tokens=32), LoRARequest("caps", 1, path))
    while engine.has_unfinished_requests():
        for output in engine.step(): ...

Each step: take the requests and aborts that arrived (``add_request`` and ``abort_request`` are
safe from any thread), collect the adapter loads that finished beside the loop, copy queued
requests' adapters into GPU slots, schedule, launch the model once and its sampling, then read
back the tokens of the step launched before (async scheduling: the host's work between steps
overlaps the GPU's), detokenize, check stops. A request naming an adapter that is not loaded waits
for its load while the others keep decoding; a failed load finishes only that request, with
``finish_reason="error"`` and the error. Adapter events ("ready", "failed", "retired") reach
listeners as they happen (:meth:`LLMEngine.add_event_listener`); the adapter's life from name to
handle to slot is in :mod:`loramux.engine.adapters.lifecycle`. Step listeners get each step's timings
by named point (:meth:`LLMEngine.add_step_listener`, :mod:`loramux.engine.core.instrumentation`).
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import weakref
from collections import deque

import torch

from loramux.engine.adapters.engine_api import EngineAdapterAPI
from loramux.engine.adapters.lifecycle import AdapterLifecycle
from loramux.engine.core.block_manager import BlockManager
from loramux.engine.config import EngineConfig
from loramux.engine.engine_setup import EngineSetup, build_engine_setup, close_engine_parts, num_kv_blocks
from loramux.engine.core.instrumentation import StepClock, StepListener
from loramux.engine.worker.model_runner import LaunchedStep, ModelRunner
from loramux.engine.core.outputs import RequestOutput
from loramux.engine.core.requests import PromptType, RequestProcessor
from loramux.engine.worker.sampler import Sampler
from loramux.engine.sampling_params import SamplingParams, StructuredOutputsParams
from loramux.engine.core.scheduler import Scheduler
from loramux.engine.process_tuning import prepare_process_for_serving
from loramux.engine.core.stats import RouterStats, read_router
from loramux.engine.core.structured_output import StructuredOutputs
from loramux.engine.core.sequence import Sequence, SequenceStatus
from loramux.errors import EngineClosedError
from loramux.registry import LoRARequest
from loramux.registry.page_locked_arena import PageLockedArena

__all__ = ["LLMEngine", "PromptType"]

logger = logging.getLogger(__name__)


class LLMEngine(EngineAdapterAPI):
    """Continuous batching over one base model with per-request LoRA adapters.

    Arguments are those of :class:`loramux.LLM` (see :mod:`loramux.engine.engine_setup` for the
    sizing defaults). ``add_request``, ``abort_request`` and the ``*_lora`` methods may be called
    from any thread; ``step`` from one thread at a time. The adapter methods are
    :class:`~loramux.engine.adapters.engine_api.EngineAdapterAPI`'s.
    """

    def __init__(self, model=None, *, config: EngineConfig | None = None, **kwargs) -> None:
        """``LLMEngine(model, **options)`` or ``LLMEngine(config=EngineConfig(...))``; the options are
        :class:`~loramux.engine.config.EngineConfig`'s fields (an unknown one is a TypeError)."""
        if config is None:
            config = EngineConfig.from_kwargs(model, **kwargs)
        elif model is not None or kwargs:
            raise TypeError(
                "LLMEngine takes either config=EngineConfig(...) or the model and options as keywords, "
                f"not both (got config and {', '.join(['model'] * (model is not None) + list(kwargs))})"
            )
        self.config = config
        owns_model = not isinstance(config.model, torch.nn.Module)  # a model passed in stays its owner's
        self.workers = None  # tensor parallelism: ranks 1..N-1, building their shards beside ours
        if torch.cuda.is_available() and str(config.device or "cuda").startswith("cuda"):
            gc.collect()  # an engine dropped before this one may hold device memory in reference cycles
        if config.tensor_parallel_size > 1:
            from loramux.engine.tensor_parallel.workers import WorkerGroup

            self.workers = WorkerGroup(config)
        runner = None
        try:
            setup: EngineSetup = build_engine_setup(config, workers=self.workers)
            self.setup = setup
            self.model = setup.model
            self.tokenizer = setup.tokenizer
            self.model_name = setup.model_name
            self.max_model_len = config.max_model_len
            self.vocab_size = setup.model.get_input_embeddings().weight.shape[0]  # [V, H], LoRA-wrapped or not
            self.lora_manager = setup.lora_manager
            self.registry = setup.registry
            self.eos_token_ids = setup.eos_token_ids
            if self.workers is not None:
                self.workers.wait_ready()
            sampler = Sampler(config.device, config.seed, setup.eos_token_ids)
            self.runner = runner = ModelRunner(config, setup.model, sampler=sampler, lora_manager=setup.lora_manager,
                                               workers=self.workers)
            num_blocks = num_kv_blocks(config, setup.model, self.runner.profile_peak_bytes)
            self.kv_cache = self.runner.allocate_kv_cache(num_blocks)
            if self.registry is not None and isinstance(self.registry.host_memory, PageLockedArena):
                self.registry.host_memory.wait()  # before any capture (a page-locking thread would break it)
            self.runner.capture_graphs()  # every step graph, now: none is captured while serving
            self.runner.warm_up_kernels()  # every other step's kernel shapes, now: none compiles while serving
        except BaseException:
            if self.workers is not None:  # healthy workers leave the group with us, stuck ones are
                # killed; our graphs are dropped before we leave (WorkerGroup.shutdown)
                self.workers.shutdown(release=runner.close if runner is not None else None)
            raise
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching)
        tokens = (num_blocks - 1) * config.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB); %.1f concurrent requests of "
            "max_model_len=%d", num_blocks, config.block_size, tokens, self.kv_cache.nbytes / 2**30,
            tokens / config.max_model_len, config.max_model_len,
        )
        self._lock = threading.Lock()  # guards the inbox and the request table
        self._step_lock = threading.RLock()  # one step, or one adapter operation, at a time
        self.clock = StepClock()  # the step's named timing points (add_step_listener)
        self.adapters: AdapterLifecycle | None = None
        if setup.lora_manager is not None:
            self.adapters = AdapterLifecycle(setup.registry, setup.lora_manager, lock=self._step_lock,
                                             validate=not setup.registry_validates, clock=self.clock)
        self.scheduler = Scheduler(config, self.block_manager, adapters=self.adapters, eos_token_ids=setup.eos_token_ids)
        self.structured_outputs = StructuredOutputs(setup.tokenizer, self.vocab_size, setup.eos_token_ids,
                                                    config.structured_output_limits)
        self.processor = RequestProcessor(
            tokenizer=setup.tokenizer, vocab_size=self.vocab_size, max_model_len=config.max_model_len,
            lora_enabled=setup.lora_manager is not None, structured_outputs=self.structured_outputs,
            device=config.device, model_name=self.model_name)
        self.async_scheduling = config.async_scheduling
        self._in_flight: LaunchedStep | None = None  # launched, its tokens not read back yet
        self._inbox: deque[tuple[str, object]] = deque()
        self._requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        # close() and garbage collection alike stop the loads and the workers and give the device
        # memory back; the finalizer holds the parts, not the engine, so `del engine` runs it
        self._closer = weakref.finalize(self, close_engine_parts, self.runner, self.adapters, self.structured_outputs,
                                       self.workers, setup.registry if setup.registry_validates else None,
                                       owns_model)
        for request in setup.lora_modules:
            self.add_lora(request)
        prepare_process_for_serving(freeze_gc=config.device.type == "cuda")  # the engine serves from now on

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def _check_open(self) -> None:
        if not self._closer.alive:
            raise EngineClosedError(
                f"this engine for {self.model_name!r} is closed: it holds no device memory and runs nothing.",
                fix="Build a new LLM or LLMEngine.",
            )

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        api_request_id: str | None = None,
    ) -> None:
        """Queue a request; it joins the batch at the next step (after its adapter loads).

        ``api_request_id`` names the API request it belongs to (the server's prompts and choices
        of one HTTP request); admission takes API requests in turn (None: a request of its own).

        :raises ValueError: a duplicate ``request_id``, an empty or too long prompt, a token id
            outside the vocabulary, a text prompt without a tokenizer, an adapter with LoRA
            disabled, or ``params.n > 1`` (one request is one sample).
        """
        self._check_open()
        seq = self.processor.sequence(str(request_id), prompt, params or SamplingParams(), lora_request, api_request_id,
                                     next(self._arrivals))
        with self._lock:
            if seq.request_id in self._requests:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            self._requests[seq.request_id] = seq
            if lora_request is not None:
                seq.status = SequenceStatus.LOADING_ADAPTER
            self._inbox.append(("add", seq))
        if lora_request is not None:  # resolving starts now, not at the next step: a failure is
            self.adapters.submit(seq)  # reported (an event) even while a step runs

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests; each finishes with ``finish_reason="abort"`` at the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            self._inbox.extend(("abort", str(i)) for i in ids)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self._requests)

    def router_stats(self) -> RouterStats:
        """Requests running and waiting (an adapter still loading counts as waiting), their
        adapters, the adapter slots and the KV cache in use: what an adapter-aware router reads."""
        with self._lock:
            seqs = list(self._requests.values())
        return read_router(seqs, self.block_manager, max_lora=self.lora_manager.num_slots if self.lora_manager is not None else 0)

    def compile_structured_output(self, spec: StructuredOutputsParams) -> None:
        """Compile ``spec`` now, in the caller's thread, within the engine's limits; a request
        with it then finds it compiled.

        :raises UnsupportedStructuredOutput: the format is not supported or over a limit.
        """
        self.structured_outputs.compile(spec)

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step: schedule -> execute -> update; return the requests that got a token or
        finished in it.

        With async scheduling (the default) a step launches its GPU work and then reads back the
        tokens of the step launched before it, so the host work
        between two steps (these tokens' bookkeeping, copying queued adapters into GPU slots,
        scheduling and building the next inputs) runs while the GPU computes: the tokens a call
        returns are those of the previous launch, and a request whose adapter this call copies
        is admitted in it. A running request whose sampling reads its earlier tokens on the host
        (penalties, structured outputs) makes the step read them back before scheduling, as
        without it; then the adapters are copied beside the step launched. On an engine at rest
        (nothing running, no step in flight) the adapters are copied before scheduling, as
        nothing computes beside them: a request whose adapter just loaded runs in the step that
        collects it. A step that has nothing to launch reads back the step in flight and copies
        adapters: the next one schedules what that freed.
        """
        clock = self.clock
        with self._step_lock, clock.step:
            self._check_open()
            touched: dict[str, Sequence] = {}
            self._drain_inbox(touched)
            if self.adapters is not None:
                idle = not self.scheduler.has_work()
                with clock["collect"]:
                    for seq in self.adapters.collect(0.05 if idle else 0.0, self.scheduler.add):
                        touched[seq.request_id] = seq
            previous, self._in_flight = self._in_flight, None
            if previous is not None and not self._overlaps():
                self._receive(previous, touched)  # the tokens first: this step's sampling reads them
                previous = None
            # admission below can take what this copies
            at_rest = previous is None and not self.scheduler.running
            if previous is not None:
                self._prefetch(beside_step=True)  # while the GPU computes the step in flight
            elif at_rest:  # nothing computes: no work to hide the copies behind, none they hold up
                self._prefetch(beside_step=False)
            with clock["schedule"]:
                scheduled = self.scheduler.schedule()
            for seq in scheduled.failed:
                touched[seq.request_id] = seq
            if len(scheduled):
                with clock["forward"]:
                    launched = self.runner.execute_model(scheduled)
                clock.launched(self.runner.last_step, scheduled)
                self.scheduler.update_from_launch(scheduled, launched.seqs)
                if previous is None:
                    self._prefetch(beside_step=True)  # beside the step just launched
                else:
                    self._receive(previous, touched)  # while the GPU computes the step just launched
                if self._overlaps():
                    self._in_flight = launched
                else:
                    self._receive(launched, touched)
            else:  # nothing runs until tokens arrive or adapters take slots: the next step schedules them
                if previous is not None:
                    self._receive(previous, touched)
                if not at_rest:
                    self._prefetch(beside_step=False)
            outputs = []
            for seq in touched.values():
                if seq.is_finished:
                    self._release(seq)
                outputs.append(seq.to_output())
            return outputs

    def _prefetch(self, *, beside_step: bool) -> None:
        """Copy the adapters of queued requests into free GPU slots ahead of their admission (the
        host work, milliseconds an adapter, hides while the GPU computes a step: beyond the first
        copy only while it does; with no step beside, every one that fits: see
        `AdapterLifecycle.prefetch`)."""
        if self.adapters is not None:
            computing = beside_step and self.config.device.type == "cuda"
            with self.clock["prefetch"]:
                failed = self.adapters.prefetch(self.scheduler.in_turn(), self.runner.computing if computing else None,
                                                idle=not beside_step)
            for handle, error in failed:  # only its queued requests fail (the next step reports them)
                self.scheduler.fail_waiting(handle, error)

    def _overlaps(self) -> bool:
        """Whether the next step may be launched before this one's tokens are read back."""
        return self.async_scheduling and not any(seq.needs_host_tokens for seq in self.scheduler.running)

    def _receive(self, step: LaunchedStep, touched: dict[str, Sequence]) -> None:
        """Read a launched step's tokens back (waiting for its GPU work) and hand them to the
        scheduler (`Scheduler.update_from_output`: appended, stops checked, finished ones released)."""
        with self.clock["receive"]:
            output = step.result()
            self.clock.received()
            for seq in self.scheduler.update_from_output(output):
                touched[seq.request_id] = seq
                if seq.is_finished:  # the scheduler released it
                    with self._lock:
                        self._requests.pop(seq.request_id, None)

    def has_scheduled_work(self) -> bool:
        """Whether a request is queued or running in the scheduler, so that the next `step` makes
        progress (requests whose adapter still loads are not: stepping for them only waits)."""
        return self.scheduler.has_work() or self._in_flight is not None

    def _release(self, seq: Sequence) -> None:
        """A finished request gives back what it holds (a no-op once done)."""
        self.scheduler.finish(seq)
        with self._lock:
            self._requests.pop(seq.request_id, None)

    def _drain_inbox(self, touched: dict[str, Sequence]) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, item in items:
            if kind == "add":
                seq: Sequence = item
                if seq.is_finished:  # aborted before it got here
                    continue
                if seq.lora_request is None:
                    self.scheduler.add(seq)
                # else: its load started in add_request; `collect` queues it when it ends
            else:
                with self._lock:
                    seq = self._requests.get(item)
                if seq is None or seq.is_finished:
                    continue
                if seq.status is SequenceStatus.LOADING_ADAPTER:
                    self.adapters.discard(seq)
                seq.finish("abort")
                self._release(seq)  # before scheduling: an aborted request is not admitted
                touched[seq.request_id] = seq

    # -- step timings --------------------------------------------------------------------------

    def add_step_listener(self, listener: StepListener) -> None:
        """Call ``listener(timings)`` after every step with its
        :class:`~loramux.engine.core.instrumentation.StepTimings`: wall time, seconds per named point
        (schedule, forward, receive, GPU-tier placement, ...), the forward launched and those
        read back. It runs on the stepping thread; an exception it raises leaves ``step``."""
        with self._step_lock:
            self.clock.add_listener(listener)

    def remove_step_listener(self, listener: StepListener) -> None:
        with self._step_lock:
            self.clock.remove_listener(listener)

    def close(self) -> None:
        """Stop loading, stop the tensor-parallel workers and the grammar compilers, and give the
        device memory back: the engine is done (``add_request`` and ``step`` raise
        `EngineClosedError` after). Idempotent; ``del`` of the last reference, or leaving a
        ``with`` block, does the same."""
        with self._step_lock:
            self._closer()
            self.kv_cache = None
