"""Paged KV-cache bookkeeping: which cache blocks hold each sequence's tokens, and which full
blocks sequences with the same prefix (and the same adapter) share.

Modelled on nano-vllm's ``block_manager.py``: a plain class, a queue of free blocks, reference
counts for the blocks running sequences use, ``can_allocate / allocate / deallocate /
can_append / may_append``, and asserts on its invariants. It holds no tensors and is not
thread-safe: the scheduler owns it.

**The sequence protocol** (duck-typed; `loramux.engine.core.sequence.Sequence` implements it):

- ``seq.block_table: list[int]``: block ids in token order; filled and cleared here.
- ``seq.num_tokens: int``: prompt plus generated tokens, including the one the next step computes.
- ``seq.num_pending: int``: of those, the last ones whose ids the host does not know yet (sampled
  by a step still running: async scheduling); a block holding one is registered once it is known.
- ``seq.num_cached_tokens: int``: set by `allocate`: leading tokens whose K/V is already cached.
- ``seq.cache_salt: str | bytes | None``: the adapter's identity, a digest of its weights'
  content (never its name, so a reload under the same name shares nothing); None for the base model.
- ``seq.reads_prefix_cache: bool``: False for a sequence that must compute its whole prompt (it
  asks for prompt logprobs): it takes no hit, though the blocks it fills are cached for others.
- ``seq.block_token_ids(index, block_size) -> Sequence[int]``: the token ids of block ``index``.

**Prefix caching.** A full block is keyed by a hash of (its parent block's hash, its token ids,
the cache salt), so a key names the whole prefix. A hit also compares the stored parent, tokens
and salt, so a hash collision can cost a miss, never a wrong output. Freed blocks keep their key
and contents until reused: the free queue is an LRU (freed blocks join its end, allocation takes
from its front, a hit takes a block out of the middle), and a sequence's blocks are released
tail first, so a shared prefix outlives the tails behind it.

**When a block becomes hittable.** Only once its K/V is written by the end of the step being
scheduled: `cache_full_blocks` registers the full blocks a step's chunk completes, and
`may_append` does it for a decode (for a decode of a pending token, at the sequence's next
decode: a key is made of known ids). `allocate` registers nothing new, because with chunked
prefill a prompt's later blocks are written steps later and a sequence admitted meanwhile must
not read them. This relies on two things the engine guarantees: within one step every layer
writes the step's K/V before any query reads it (so a block written in this step may be hit by
a sequence admitted in it), and a sequence is never deallocated between `cache_full_blocks` and
the step that writes those blocks (preempt before scheduling it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass
from typing import Any

__all__ = ["Block", "BlockManager", "PrefixCacheStats", "blocks_needed", "hash_block"]

CacheSalt = str | bytes | None


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks of ``block_size`` tokens hold ``num_tokens`` tokens."""
    if num_tokens < 0 or block_size < 1:
        raise ValueError(f"blocks_needed: got num_tokens={num_tokens}, block_size={block_size}; "
                         "allowed: num_tokens >= 0 and block_size >= 1")
    return -(-num_tokens // block_size)


def _salt_bytes(salt: CacheSalt) -> bytes:
    if salt is None:
        return b"\x00"
    if isinstance(salt, str):
        salt = salt.encode()
        tag = b"\x01"
    elif isinstance(salt, bytes):
        tag = b"\x02"
    else:
        raise TypeError(f"cache_salt: got {type(salt).__name__}; allowed: str, bytes or None (base model)")
    return tag + len(salt).to_bytes(8, "little") + salt


def hash_block(parent: int | None, token_ids: TokenIds[int], cache_salt: CacheSalt) -> int:
    """The 128-bit key of a full block: its whole prefix (through ``parent``), tokens and adapter."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(16, "little"))
    h.update(_salt_bytes(cache_salt))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(eq=False, slots=True)
class Block:
    """One block of the paged KV cache; ``hash`` is None until the block is full and registered."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    parent_hash: int | None = None
    cache_salt: CacheSalt = None

    def holds(self, parent_hash: int | None, token_ids: tuple[int, ...], cache_salt: CacheSalt) -> bool:
        return (self.token_ids == token_ids and self.parent_hash == parent_hash
                and type(self.cache_salt) is type(cache_salt) and self.cache_salt == cache_salt)

    def reset(self) -> None:
        self.hash, self.token_ids, self.parent_hash, self.cache_salt = None, (), None, None


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and tokens found there (vLLM's metrics)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` tokens; ids below ``reserved_blocks`` never handed out.

    Block 0 is reserved by default: the padding tokens of a CUDA-graph step write their K/V there.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 reserved_blocks: int = 1) -> None:
        if block_size < 1:
            raise ValueError(f"BlockManager.block_size: got {block_size}; allowed: an int >= 1")
        if not 0 <= reserved_blocks < num_blocks:
            raise ValueError(f"BlockManager: got num_blocks={num_blocks}, reserved_blocks={reserved_blocks}; "
                             "need 0 <= reserved_blocks < num_blocks (give the KV cache more memory)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.reserved_blocks = reserved_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # an ordered set: front = next to reuse (least recently freed); O(1) removal on a hit
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(reserved_blocks, num_blocks))
        self.used_block_ids: set[int] = set()
        self.hash_to_block_id: dict[int, int] = {}
        self.stats = PrefixCacheStats()

    # -- gauges ------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - self.reserved_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks running sequences hold (the "KV cache usage" gauge)."""
        return len(self.used_block_ids) / self.num_usable_blocks

    # -- sequences -----------------------------------------------------------------------------

    def can_allocate(self, seq: Any) -> bool:
        """Whether `allocate` would succeed now (prefix hits on blocks in use cost no free block)."""
        return self.num_free_blocks >= self._free_blocks_needed(seq, self._prefix_hits(seq))

    def allocate(self, seq: Any) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached blocks of its prefix.

        Sets ``seq.block_table`` and ``seq.num_cached_tokens`` (a multiple of ``block_size``, and
        always less than ``seq.num_tokens``: the last token is computed, since its logits are sampled).
        """
        assert not seq.block_table, f"allocate: sequence already holds blocks {seq.block_table}"
        assert seq.num_tokens > 0, "allocate: sequence has no tokens"
        hits = self._prefix_hits(seq)
        need = self._free_blocks_needed(seq, hits)
        assert need <= self.num_free_blocks, (
            f"allocate: needs {need} free blocks, {self.num_free_blocks} free (check can_allocate first)")
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:  # cached but free: revive it
                del self.free_block_ids[block_id]
                self.used_block_ids.add(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(blocks_needed(seq.num_tokens, self.block_size) - len(hits)):
            seq.block_table.append(self._take_free_block())
        seq.num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching and seq.reads_prefix_cache:
            self.stats.queries += seq.num_tokens
            self.stats.hits += seq.num_cached_tokens
        self._check()

    def deallocate(self, seq: Any) -> None:
        """Release ``seq``'s blocks, tail first (finish or preemption); cached keys stay until reuse."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"deallocate: block {block_id} is not in use"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                assert block_id not in self.free_block_ids, f"block {block_id} freed twice"
                self.free_block_ids[block_id] = None
                if self.hash_to_block_id.get(block.hash) != block_id:  # uncached, or a duplicate:
                    # nothing worth keeping, so reuse it before any cached block
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table.clear()
        seq.num_cached_tokens = 0
        self._check()

    def can_append(self, seq: Any) -> bool:
        """Whether a free block is there for ``seq``'s last token if it starts a new block."""
        return self.num_free_blocks >= blocks_needed(seq.num_tokens, self.block_size) - len(seq.block_table)

    def may_append(self, seq: Any) -> None:
        """Before a decode step computes ``seq``'s last token: take a new block if that token
        starts one, and register the full blocks of known tokens (the one it fills, unless it is
        pending)."""
        assert seq.block_table, "may_append: sequence holds no blocks (allocate it first)"
        missing = blocks_needed(seq.num_tokens, self.block_size) - len(seq.block_table)
        assert 0 <= missing <= self.num_free_blocks, (
            f"may_append: needs {missing} blocks, {self.num_free_blocks} free (check can_append first)")
        for _ in range(missing):
            seq.block_table.append(self._take_free_block())
        self.cache_full_blocks(seq, seq.num_tokens - seq.num_pending)
        self._check()

    def cache_full_blocks(self, seq: Any, num_tokens: int) -> None:
        """Make ``seq``'s full blocks within its first ``num_tokens`` tokens hittable.

        Call it when scheduling a chunk, with the tokens computed once the step has run.
        """
        if not self.enable_prefix_caching:
            return
        assert num_tokens <= seq.num_tokens, f"cache_full_blocks: {num_tokens} > {seq.num_tokens} tokens"
        table, num_full = seq.block_table, num_tokens // self.block_size
        assert num_full <= len(table), f"cache_full_blocks: {num_full} full blocks, {len(table)} allocated"
        start = num_full  # registered blocks form a prefix of the table: find where it ends
        while start > 0 and self.blocks[table[start - 1]].hash is None:
            start -= 1
        parent = self.blocks[table[start - 1]].hash if start else None
        for index in range(start, num_full):
            block = self.blocks[table[index]]
            assert block.ref_count == 1, f"block {block.block_id} is shared but has no hash"
            tokens = tuple(seq.block_token_ids(index, self.block_size))
            block.hash = hash_block(parent, tokens, seq.cache_salt)
            block.token_ids, block.parent_hash, block.cache_salt = tokens, parent, seq.cache_salt
            self.hash_to_block_id[block.hash] = block.block_id  # a newer copy wins; the older ages out
            parent = block.hash

    # -- internals -----------------------------------------------------------------------------

    def _prefix_hits(self, seq: Any) -> list[int]:
        """Cached blocks holding ``seq``'s leading full blocks; never the last token's block."""
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return []
        hits, parent = [], None
        for index in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.block_token_ids(index, self.block_size))
            key = hash_block(parent, tokens, seq.cache_salt)
            block_id = self.hash_to_block_id.get(key)
            if block_id is None or not self.blocks[block_id].holds(parent, tokens, seq.cache_salt):
                break  # once one block misses, every later block does
            hits.append(block_id)
            parent = key
        return hits

    def _free_blocks_needed(self, seq: Any, hits: list[int]) -> int:
        revived = sum(1 for block_id in hits if self.blocks[block_id].ref_count == 0)
        return blocks_needed(seq.num_tokens, self.block_size) - len(hits) + revived

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0 and block_id not in self.used_block_ids, f"free block {block_id} in use"
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]  # evicted: its old contents are overwritten
        block.reset()
        block.ref_count = 1
        self.used_block_ids.add(block_id)
        return block_id

    def _check(self) -> None:
        assert len(self.free_block_ids) + len(self.used_block_ids) == self.num_usable_blocks, "a block leaked"

    def check_invariants(self) -> None:
        """Every invariant, in O(num_blocks): for tests and debugging, not the step loop."""
        self._check()
        assert not self.used_block_ids & set(self.free_block_ids), "a block is both free and used"
        assert all(b < self.reserved_blocks or (b in self.used_block_ids) == (self.blocks[b].ref_count > 0)
                   for b in range(self.num_blocks)), "a ref count disagrees with the used set"
        assert all(block.ref_count >= 0 for block in self.blocks)
        assert all(self.blocks[b].hash == h for h, b in self.hash_to_block_id.items()), "a stale key"
        assert all(b >= self.reserved_blocks for b in self.used_block_ids), "a reserved block was handed out"
