"""Which sequences run in the next step, and how many of their tokens: continuous batching.

Every step mixes decodes and prefill chunks in one forward, within ``max_num_batched_tokens``:
first one token for each running sequence that is decoding, then the next chunk of each running
sequence still prefilling, then new sequences from the queue, each taking the KV blocks of its
whole prompt (less what the prefix cache already holds) and the rest of the token budget (a long
prompt is prefilled over several steps).

The queue is taken in turns by API request (``Sequence.api_request_id``; the prompts and ``n``
choices of one HTTP request share it), round robin across steps: one sequence of each request in
turn, the request admitted least recently first (one never admitted before all others, oldest
first), each request's own sequences first come first served (`Scheduler.in_turn`). So a request
of 2,000 prompts holds up a request arriving after it by at most one sequence, not by its whole
queue, even when a single row frees at a time. Sequences without an API request are each their
own (first come first served, as ``LLM.generate`` adds them).

A step that several API requests share carries at most ``max_shared_prefill_tokens`` prompt
tokens beside its decodes. On a CPU a step's time grows with every token it carries, so a request
decoding beside another's prompts would take their time too: the CPU's default (8) keeps a
shared step within a small multiple of a lone decode. On a GPU a step carries thousands of tokens
for about the time of one, and the default is no bound.

KV blocks: admission is by free blocks, not by rows. When a decoding sequence needs a new block
and none is free, the newest running sequence is preempted: its blocks are freed and it goes back
to the front of the queue with the tokens it has; on readmission it is prefilled again
(recompute; the prefix cache usually still holds its blocks), so its output is unchanged and
nothing is lost or sent twice.

Adapters: the scheduler tells `AdapterUses` (the adapters' owner, `AdapterLifecycle`, in an
engine) as sequences are queued, run, stop and finish, and asks it what it may admit. A sequence
holds a reference to its adapter handle from the moment it is queued with it until it finishes
(the owner keeps the handle pinned in the CPU tier while referenced); a running sequence or a
user pin (``pin_lora``) also needs the handle's GPU slot, held from the first such use to the
last. At zero references the handle is released: its slot stays resident as a cache (evictable),
its CPU-tier pin goes, and a handle whose name was rebound or unbound retires.

Loading overlaps compute: a request's adapter is resolved and read into the CPU tier from the
moment it arrives (bounded by the tier's budget: when the tier is full of adapters in use, it
waits for room, oldest first), and the adapters of the oldest queued requests are copied into
free GPU slots (a side CUDA stream) while the GPU computes a step, as many as fit beside the
adapters in use (and ``max_loras`` less those, when set), never into a slot in use. Admission itself
copies nothing (`Fit.COPYING`): a request whose adapter has room but no slot yet is passed over
until the copy beside the step has put it there, so no step waits on the host work of placing
adapters (placements at admission made the slowest steps of a many-adapter trace). So a request
whose adapter is in host memory runs from the step after its copy was queued, while the copy may
still run (the step's forward waits for it on the GPU, not the host); a request whose adapter is
still loading from disk (cold) is not in the queue until it loaded, so it holds up no request
behind it. What admission below guarantees, with that:

- FIFO among blocked adapters: the first request in turn whose adapter needs a slot is admitted
  first, and nothing behind it takes a slot before it (base-model and pinned-adapter requests aside).
- Bounded wait: a blocked request waits at most until some slots' current requests end (each
  has ``max_tokens``). The scheduler counts the slots that will free by themselves (adapters
  with no queued request); for every blocked adapter beyond those it marks one in-slot adapter
  *draining* (the one with the fewest queued requests): its new requests wait until its running
  ones end and the slot frees. So a stream of requests for a running adapter cannot hold a slot
  forever, and the k-th blocked adapter waits for at most k slots to drain.
- Full batches: a queued request for an adapter already in a slot, and not draining, is admitted
  past a blocked one (it takes no slot). Holding every request behind the oldest blocked one
  instead makes waves of small batches, and a burst over more adapters than slots then runs at
  a fraction of the throughput of a few adapters.
- Slots stay busy: a slot freed by a finished adapter is refilled by the next queued adapter,
  whose weights are usually already there (prefetched).

The distinct adapters of a step are bounded by memory, not by a count: they are those whose rows
fit the GPU adapter pool together, beside the ones the user pinned (`AdapterPlacement`); an
explicit ``max_loras`` caps their number too.

Async scheduling: the engine schedules a step before the last one's tokens are read back, so a
running sequence may end in a token the host does not know yet (``seq.num_pending``). It decodes
that token like any other (the device fills in its id), unless it reaches ``max_tokens`` or
``max_model_len``: then it finishes once the token arrives and is not scheduled again. A
preempted sequence is readmitted only once its pending token has arrived.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterator

from loramux.engine.adapters.uses import AdapterUses, Fit
from loramux.engine.core.block_manager import BlockManager
from loramux.engine.config import EngineConfig
from loramux.engine.core.sequence import Sequence, SequenceStatus
from loramux.engine.core.step_outputs import ModelRunnerOutput, SchedulerOutput
from loramux.errors import CacheFullError, LoRAError
from loramux.registry import AdapterHandle

__all__ = ["Scheduler"]


class Scheduler:
    """Queue and running set of sequences whose adapters are loaded (or who need none).

    :param config: the engine's resolved config: ``max_num_seqs``, ``max_num_batched_tokens``,
        ``max_model_len`` (a sequence whose pending tokens reach it is not scheduled again) and
        ``max_shared_prefill_tokens`` (prompt tokens a step carries beside its decodes while the
        running and queued sequences belong to more than one API request; None: no bound).
    :param block_manager: the KV blocks.
    :param adapters: who uses each adapter, and whether a queued one may run (`AdapterUses`,
        with the engine's tiers behind it: `AdapterLifecycle`); default: counts alone, for
        ``config.lora_slots`` slots.
    :param eos_token_ids: the tokens that end a request (unless it ignores them).
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, *, adapters: AdapterUses | None = None,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.blocks = block_manager
        self.adapters = adapters if adapters is not None else AdapterUses(config.lora_slots)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.max_shared_prefill_tokens = config.max_shared_prefill_tokens
        self.eos_token_ids = eos_token_ids
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []
        self._failed: list[Sequence] = []  # failed since the last schedule: in its output
        self.draining: set[int] = set()  # in-slot handle ids whose new requests wait for the slot to free
        self._last_admitted: dict[str, int] = {}  # API request -> when it last had a sequence admitted
        self._admissions = itertools.count()
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; it references its adapter handle (if any) until it finishes."""
        if seq.handle is not None:
            self.adapters.reference(seq.handle)
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.lora_slot = -1
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def in_turn(self) -> Iterator[Sequence]:
        """The queue in admission order: one sequence of each API request in turn (round robin),
        the request admitted least recently first, each one's sequences by arrival."""
        by_request: dict[str, list[Sequence]] = {}
        for seq in self.waiting:  # by arrival
            by_request.setdefault(_api_request(seq), []).append(seq)
        # forget the requests with nothing queued: a turn is kept only while one waits for it
        self._last_admitted = {key: self._last_admitted[key] for key in by_request if key in self._last_admitted}
        order = sorted(by_request, key=lambda key: self._last_admitted.get(key, -1))  # stable: by arrival
        return (seq for round_ in itertools.zip_longest(*(by_request[key] for key in order)) for seq in round_
                if seq is not None)

    # -- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step's chunks (see the module docstring); nothing changes on the sequences'
        computed tokens until `update_from_launch`."""
        budget = self.max_num_batched_tokens
        decodes, prefills = [], []
        for seq in list(self.running):  # decodes first: every running decode advances each step
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed != 1:
                continue  # preempted in this loop, or still prefilling
            if seq.will_finish(self.max_model_len):
                continue  # its last token is sampled already (pending): it finishes when that arrives
            while not self.blocks.can_append(seq):
                victim = self.running[-1]  # the newest; maybe seq itself
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.may_append(seq)
                decodes.append((seq, 1))
                budget -= 1
        if self.max_shared_prefill_tokens is not None and self._shared():
            budget = min(budget, self.max_shared_prefill_tokens)
        for seq in self.running:
            if seq.num_uncomputed > 1 and budget > 0:
                n = min(seq.num_uncomputed, budget)
                prefills.append((seq, n))
                budget -= n
        for seq in self._admit(budget):
            n = min(seq.num_uncomputed, budget)
            prefills.append((seq, n))
            budget -= n
        for seq, n in prefills:  # blocks this step fills become hittable (decodes: in may_append)
            self.blocks.cache_full_blocks(seq, seq.num_computed + n)
        failed, self._failed = self._failed, []
        return SchedulerOutput(decodes + prefills, failed)

    def _shared(self) -> bool:
        """Whether the running and queued sequences belong to more than one API request (those
        without one, as ``LLM.generate`` adds them, count as none)."""
        requests = {seq.api_request_id for seq in self.running} | {seq.api_request_id for seq in self.waiting}
        return len(requests - {None}) > 1

    def _admit(self, budget: int) -> list[Sequence]:
        admitted, blocked = [], False
        adapters = self.adapters
        in_slots = adapters.in_slots()
        pinned = adapters.pinned()
        self.draining &= in_slots  # an adapter whose slot freed drains no more
        self._mark_draining(in_slots, pinned)
        for seq in self.in_turn():
            if (budget <= 0 or len(self.running) >= self.max_num_seqs or seq.num_pending
                    or not self.blocks.can_allocate(seq)):
                break  # capacity goes in turn; a preempted sequence needs its last token
            handle = seq.handle
            if handle is not None:
                if handle.id not in pinned:  # a pinned adapter's requests never wait for a slot
                    if adapters.max_loras is not None and len(pinned) >= adapters.max_loras:
                        self._fail(seq, CacheFullError(
                            f"all {adapters.max_loras} GPU slots hold pinned adapters ({self._names(pinned)}).",
                            adapter=handle.name,
                            fix="Remove a pinned adapter (remove_lora) or raise max_loras.",
                        ))
                        continue
                    if handle.id in in_slots:
                        if blocked and handle.id in self.draining:
                            continue  # its slot frees for the older blocked request first
                    elif blocked:
                        continue  # FIFO among requests that need a slot
                    else:
                        fit = adapters.fit(handle, in_slots, pinned)
                        if fit is Fit.NEVER:  # waiting would never end
                            self._fail(seq, CacheFullError(
                                f"the adapters pinned to the GPU ({self._names(pinned)}) leave no room for its "
                                "weights.",
                                adapter=handle.name,
                                fix="Remove a pinned adapter (remove_lora), or raise max_gpu_lora_bytes "
                                    "(--max-gpu-lora-bytes).",
                            ))
                            continue
                        if fit is Fit.NO_ROOM:
                            blocked = True
                            continue
                        if fit is Fit.COPYING:
                            continue  # room for it: copied into a slot beside this step, admitted next
                if not self._start(seq):
                    continue
                in_slots.add(handle.id)
            self.waiting.remove(seq)
            self._last_admitted[_api_request(seq)] = next(self._admissions)
            self.blocks.allocate(seq)
            seq.num_computed = seq.num_cached_tokens  # the prefix cache holds these tokens' K/V
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            budget -= min(seq.num_uncomputed, budget)
        return admitted

    def _names(self, handle_ids: set[int]) -> str:
        return ", ".join(sorted(self.adapters.name(i) for i in handle_ids))

    def _mark_draining(self, in_slots: set[int], pinned: set[int]) -> None:
        """With no room for the oldest blocked adapter, mark as many in-slot adapters draining as
        queued adapters would find no slot otherwise: a slot frees by itself when its adapter has
        no queued request (or drains already). Room for it marks nothing: it takes it now."""
        queued = Counter(seq.handle.id for seq in self.waiting if seq.handle is not None)
        waiting = [seq.handle for seq in self.waiting
                   if seq.handle is not None and seq.handle.id not in in_slots and seq.handle.id not in pinned]
        if not waiting or self.adapters.has_room(waiting[0], in_slots):  # the oldest first
            return
        blocked = len({handle.id for handle in waiting})
        freeing = sum(1 for i in in_slots - pinned if i in self.draining or i not in queued)
        candidates = sorted((i for i in in_slots - pinned - self.draining if i in queued),
                            key=lambda i: (queued[i], self.adapters.running(i)))
        self.draining.update(candidates[: max(0, blocked - freeing)])

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it again; it is recomputed when readmitted."""
        self._stop(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)  # it keeps its reference to its adapter

    def _start(self, seq: Sequence) -> bool:
        """``seq`` is about to run: its handle needs its GPU slot (the first running use gets it)."""
        try:
            seq.lora_slot = self.adapters.start(seq.handle)
        except LoRAError as error:
            self._fail(seq, error)
            return False
        return True

    def fail_waiting(self, handle: AdapterHandle, error: LoRAError) -> None:
        """Fail every queued sequence of ``handle`` with ``error`` (its adapter could not be placed);
        the next `schedule`'s output reports them."""
        for seq in [seq for seq in self.waiting if seq.handle is not None and seq.handle.id == handle.id]:
            self._fail(seq, error)

    def _fail(self, seq: Sequence, error: LoRAError) -> None:
        self.waiting.remove(seq)
        self._unreference(seq)
        seq.fail(error)
        self._failed.append(seq)

    # -- after a step --------------------------------------------------------------------------

    def update_from_launch(self, scheduled: SchedulerOutput, sampled: list[Sequence]) -> None:
        """The step of ``scheduled`` was launched: its tokens count as computed, and each sequence
        in ``sampled`` (row order) has a token pending in that row until `update_from_output`."""
        for seq, n in scheduled.chunks:
            seq.num_computed += n
        for row, seq in enumerate(sampled):
            seq.expect_token(row)

    def update_from_output(self, output: ModelRunnerOutput) -> list[Sequence]:
        """A launched step's tokens, read back: append each to its sequence (one that finished
        meanwhile, by a stop or an abort, drops it) and release those that finish now, so the
        next schedule does not count them. Returns the sequences that got a token."""
        updated = []
        logprobs = output.logprobs
        for row, (seq, token) in enumerate(zip(output.seqs, output.token_ids)):
            if seq.is_finished:
                continue
            if logprobs is not None and logprobs[row] is not None:
                seq.output_logprobs.append(logprobs[row])
            seq.append_token(token, self.eos_token_ids, self.max_model_len)
            updated.append(seq)
            if seq.is_finished:
                self.finish(seq)
        return updated

    def finish(self, seq: Sequence) -> None:
        """Release what ``seq`` holds (its blocks, its adapter reference); it is already finished.
        A sequence the scheduler does not hold (aborted while its adapter loaded) is a no-op.
        Its full blocks of computed tokens stay hittable (with async scheduling the one its last
        decode filled was not registered yet)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.blocks.cache_full_blocks(seq, min(seq.num_computed, seq.num_tokens))
            self._stop(seq)
        else:
            return
        self._unreference(seq)

    def _stop(self, seq: Sequence) -> None:
        """Take ``seq`` out of the running set: its blocks, and its use of its adapter's slot."""
        if seq.block_table:
            self.blocks.deallocate(seq)
        self.running.remove(seq)
        seq.lora_slot = -1
        if seq.handle is not None:
            self.adapters.stop(seq.handle)

    def _unreference(self, seq: Sequence) -> None:
        if seq.handle is not None:
            self.adapters.unreference(seq.handle)


def _api_request(seq: Sequence) -> str:
    """The API request ``seq`` takes turns as: its own request id when it has none."""
    return seq.request_id if seq.api_request_id is None else seq.api_request_id
