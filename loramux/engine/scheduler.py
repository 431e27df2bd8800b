"""Which sequences run in the next step, and how many of their tokens: continuous batching.

Every step mixes decodes and prefill chunks in one forward, within ``max_num_batched_tokens``:
first one token for each running sequence that is decoding, then the next chunk of each running
sequence still prefilling, then new sequences from the queue, first come first served, each
taking the KV blocks of its whole prompt (less what the prefix cache already holds) and the rest
of the token budget (a long prompt is prefilled over several steps).

KV blocks: admission is by free blocks, not by rows. When a decoding sequence needs a new block
and none is free, the newest running sequence is preempted: its blocks are freed and it goes back
to the front of the queue with the tokens it has; on readmission it is prefilled again
(recompute; the prefix cache usually still holds its blocks), so its output is unchanged and
nothing is lost or sent twice.

Adapters: a step holds at most ``max_loras`` distinct adapters, counting the ones the user pinned
to the GPU. A queued request whose adapter would exceed that waits, and from then on no request
behind it may start with any adapter (new or running) until it is admitted; base-model requests
and requests for pinned adapters still may, as they take no slot that could free up. Running adapters therefore drain as their requests end
(each has ``max_tokens``), a slot frees, and the oldest blocked request is admitted first: a
request whose adapter is not resident cannot be starved by a stream of requests for resident
ones.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from loramux.engine.block_manager import BlockManager
from loramux.engine.sequence import Sequence, SequenceStatus
from loramux.errors import CacheFullError, LoRAError

__all__ = ["Scheduler", "ScheduledBatch"]


@dataclass
class ScheduledBatch:
    """One step's work: ``(sequence, number of its tokens to compute)``, decodes first."""

    chunks: list[tuple[Sequence, int]]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)


class Scheduler:
    """Queue and running set of sequences whose adapters are loaded (or who need none).

    :param on_adapter_start: called with a sequence whose adapter has no running sequence yet,
        just before it is admitted (the engine puts the adapter in a GPU slot and pins it); if it
        raises a ``LoRAError`` the sequence fails instead.
    :param on_adapter_end: called with an adapter name when its last running sequence leaves.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int,
        on_adapter_start: Callable[[Sequence], None] = lambda seq: None,
        on_adapter_end: Callable[[str], None] = lambda name: None,
    ) -> None:
        assert max_num_batched_tokens >= max_num_seqs, "every running sequence must fit one decode token"
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.reserved_loras: set[str] = set()  # pinned by the user: hold a slot even when idle
        self.on_adapter_start = on_adapter_start
        self.on_adapter_end = on_adapter_end
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []
        self.adapter_refs: Counter[str] = Counter()  # running sequences per adapter
        self.failed: list[Sequence] = []  # failed at admission; the engine reports them
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def loras_in_use(self) -> set[str]:
        return set(self.adapter_refs) | self.reserved_loras

    # -- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        decodes, prefills = [], []
        for seq in list(self.running):  # decodes first: every running decode advances each step
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed != 1:
                continue  # preempted in this loop, or still prefilling
            while not self.blocks.can_append(seq):
                victim = self.running[-1]  # the newest; maybe seq itself
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.may_append(seq)
                decodes.append((seq, 1))
                budget -= 1
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
        return ScheduledBatch(decodes + prefills)

    def _admit(self, budget: int) -> list[Sequence]:
        admitted, blocked = [], False
        in_use = self.loras_in_use()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs or not self.blocks.can_allocate(seq):
                break  # capacity is first come first served
            name = seq.lora_name
            if name is not None:
                if name not in self.reserved_loras:  # a pinned adapter's requests never wait for a slot
                    if len(self.reserved_loras) >= self.max_loras:
                        self._fail(seq, CacheFullError(
                            f"all {self.max_loras} GPU slots hold pinned adapters "
                            f"({', '.join(sorted(self.reserved_loras))}).",
                            adapter=name,
                            fix="Remove a pinned adapter (remove_lora) or raise max_loras.",
                        ))
                        continue
                    if blocked or (name not in in_use and len(in_use) >= self.max_loras):
                        blocked = True  # hold back every adapter request behind the oldest blocked one
                        continue
                if not self._start(seq):
                    continue
                in_use.add(name)
            self.waiting.remove(seq)
            self.blocks.allocate(seq)
            seq.num_computed = seq.num_cached_tokens  # the prefix cache holds these tokens' K/V
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            budget -= min(seq.num_uncomputed, budget)
        return admitted

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it again; it is recomputed when readmitted."""
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _start(self, seq: Sequence) -> bool:
        name = seq.lora_name
        if self.adapter_refs[name] == 0:
            try:
                self.on_adapter_start(seq)
            except LoRAError as error:
                self._fail(seq, error)
                return False
        self.adapter_refs[name] += 1
        seq.adapter = None  # resident in a GPU slot now; the slot's pin keeps it
        return True

    def _fail(self, seq: Sequence, error: LoRAError) -> None:
        self.waiting.remove(seq)
        seq.fail(error)
        self.failed.append(seq)

    # -- after a step --------------------------------------------------------------------------

    def finish(self, seq: Sequence) -> None:
        """Release what ``seq`` holds (its blocks, its adapter reference); it is already finished."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.blocks.deallocate(seq)
        if seq in self.running:
            self.running.remove(seq)
            name = seq.lora_name
            if name is not None:
                self.adapter_refs[name] -= 1
                if self.adapter_refs[name] == 0:
                    del self.adapter_refs[name]
                    self.on_adapter_end(name)
