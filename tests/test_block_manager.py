"""BlockManager: paged KV blocks, reference counts, adapter-aware prefix caching, LRU eviction."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from loramux.engine.core.block_manager import BlockManager, blocks_needed, hash_block
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.core.sequence import Sequence

BS = 4  # block size


@dataclass(eq=False)
class FakeSeq:
    """The sequence protocol, and nothing else."""

    token_ids: list[int]
    cache_salt: str | bytes | None = None
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_pending: int = 0
    reads_prefix_cache: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def block_token_ids(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size:(index + 1) * block_size]


def admit(bm: BlockManager, seq: FakeSeq) -> FakeSeq:
    """Allocate and compute the whole prompt in one step (what a scheduler without chunking does)."""
    bm.allocate(seq)
    bm.cache_full_blocks(seq, seq.num_tokens)
    return seq


def test_sizes():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match=r"block_size=0.*block_size >= 1"):
        blocks_needed(3, 0)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, bf16, 16 tokens: 2 * 30 * 16 * 3 * 64 * 2 bytes
    from transformers import LlamaConfig

    from loramux.engine.worker.kv_cache import PagedKVCache

    smollm = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    assert PagedKVCache.block_bytes(smollm, 16, torch.bfloat16) == 368_640
    assert PagedKVCache.block_bytes(smollm, 16, torch.float32) == 2 * 368_640


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match=r"block_size: got 0"):
        BlockManager(8, 0)
    with pytest.raises(ValueError, match=r"num_blocks=1, reserved_blocks=1.*more memory"):
        BlockManager(1, BS)
    with pytest.raises(TypeError, match=r"cache_salt: got int"):
        hash_block(None, [1, 2], 7)


def test_allocate_takes_free_blocks_and_never_the_reserved_ones():
    bm = BlockManager(6, BS, reserved_blocks=2)
    assert bm.num_free_blocks == 4 and bm.usage == 0
    seq = admit(bm, FakeSeq(list(range(10))))
    assert seq.block_table == [2, 3, 4] and seq.num_cached_tokens == 0
    assert bm.num_free_blocks == 1 and bm.usage == 0.75
    bm.deallocate(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 4 and bm.usage == 0
    bm.check_invariants()


def test_same_prompt_shares_full_blocks_but_computes_the_last_token():
    bm = BlockManager(16, BS)
    a = admit(bm, FakeSeq(list(range(3 * BS))))
    b = admit(bm, FakeSeq(list(range(3 * BS))))
    # every block hits, but the last token's block is recomputed in a fresh block
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 2 * BS < b.num_tokens
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    c = admit(bm, FakeSeq(list(range(2 * BS)) + [99]))  # a partial last block is never shared
    assert c.block_table[:2] == a.block_table[:2] and c.num_cached_tokens == 2 * BS
    assert bm.blocks[a.block_table[0]].ref_count == 3
    for seq in (a, b, c):
        bm.deallocate(seq)
    assert bm.num_free_blocks == 15 and not bm.used_block_ids
    bm.check_invariants()


@pytest.mark.parametrize("salts", [(None, "sha256:aaa"), ("sha256:aaa", "sha256:bbb"),
                                   (b"\x01digest", b"\x02digest"), ("abc", b"abc")],
                         ids=["base-vs-adapter", "two-adapters", "reload-same-name", "str-vs-bytes"])
def test_different_adapters_never_share(salts):
    bm = BlockManager(16, BS)
    prompt = list(range(3 * BS))
    a = admit(bm, FakeSeq(prompt, cache_salt=salts[0]))
    b = admit(bm, FakeSeq(prompt, cache_salt=salts[1]))
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    same = admit(bm, FakeSeq(prompt, cache_salt=salts[1]))
    assert same.num_cached_tokens == 2 * BS and same.block_table[:2] == b.block_table[:2]


def test_the_key_covers_prefix_tokens_and_adapter():
    tokens = [1, 2, 3, 4]
    keys = {hash_block(parent, tokens, salt) for parent in (None, 0, 1) for salt in (None, "a", b"a", "b")}
    assert len(keys) == 12 and hash_block(None, tokens, "a") == hash_block(None, (1, 2, 3, 4), "a")
    assert hash_block(None, [1, 2, 3, 5], "a") != hash_block(None, tokens, "a")


@pytest.mark.parametrize("field_, value", [("token_ids", (7, 7, 7, 7)), ("parent_hash", 12345),
                                           ("cache_salt", "other")])
def test_a_hash_collision_is_a_miss_not_a_wrong_hit(field_, value):
    bm = BlockManager(8, BS)
    a = admit(bm, FakeSeq(list(range(3 * BS))))
    setattr(bm.blocks[a.block_table[1]], field_, value)  # as if another block had the same key
    assert admit(bm, FakeSeq(list(range(3 * BS)))).num_cached_tokens == BS


def test_a_recomputed_duplicate_replaces_the_cached_copy():
    bm = BlockManager(8, BS)
    a = admit(bm, FakeSeq(list(range(2 * BS))))
    b = admit(bm, FakeSeq(list(range(2 * BS))))  # recomputes a's last block into a new block
    assert bm.hash_to_block_id[bm.blocks[b.block_table[1]].hash] == b.block_table[1]
    stale = a.block_table[1]
    bm.deallocate(a)  # a's copy is a stale duplicate now: first in line for reuse
    assert next(iter(bm.free_block_ids)) == stale


def test_a_freed_cached_block_is_revived_by_a_hit():
    bm = BlockManager(8, BS)
    a = admit(bm, FakeSeq(list(range(2 * BS + 1))))
    first_two = a.block_table[:2]
    bm.deallocate(a)
    assert bm.num_free_blocks == 7 and set(first_two) <= set(bm.free_block_ids)
    b = FakeSeq(list(range(2 * BS + 1)))
    assert bm.can_allocate(b)
    admit(bm, b)
    assert b.block_table[:2] == first_two and b.num_cached_tokens == 2 * BS
    assert [bm.blocks[i].ref_count for i in first_two] == [1, 1]
    assert bm.num_free_blocks == 4 and not set(first_two) & set(bm.free_block_ids)
    bm.check_invariants()


def test_lru_reuses_the_least_recently_freed_cached_block_first():
    bm = BlockManager(7, BS)  # 6 usable
    a = admit(bm, FakeSeq(list(range(2 * BS))))  # blocks 1, 2
    b = admit(bm, FakeSeq(list(range(100, 100 + 2 * BS))))  # blocks 3, 4
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    keys = [bm.blocks[i].hash for i in a_blocks + b_blocks]
    bm.deallocate(a)  # tail first: the queue ends ..., 2, 1
    bm.deallocate(b)  # ..., 2, 1, 4, 3
    assert list(bm.free_block_ids) == [5, 6, a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    c = admit(bm, FakeSeq(list(range(200, 200 + 3 * BS))))  # uncached blocks first, then a's tail
    assert c.block_table == [5, 6, a_blocks[1]]
    cached = [key in bm.hash_to_block_id for key in keys]
    assert cached == [True, False, True, True]  # a's tail was evicted, its first block and b survive
    d = admit(bm, FakeSeq(list(range(2 * BS)) + [1]))
    assert d.num_cached_tokens == BS and d.block_table == [a_blocks[0], b_blocks[1], b_blocks[0]]
    bm.check_invariants()


def test_unhashed_blocks_are_reused_before_cached_ones():
    bm = BlockManager(5, BS)
    a = admit(bm, FakeSeq(list(range(BS + 1))))  # block 1 cached, block 2 partial
    bm.deallocate(a)
    assert list(bm.free_block_ids) == [2, 3, 4, 1]


def test_may_append_allocates_at_boundaries_and_hashes_full_blocks():
    bm = BlockManager(8, BS)
    seq = admit(bm, FakeSeq([1, 2, 3, 4, 5]))
    assert len(seq.block_table) == 2 and bm.blocks[seq.block_table[1]].hash is None
    for token in (6, 7, 8, 9):
        seq.token_ids.append(token)  # the token the next step computes
        table_before = list(seq.block_table)
        assert bm.can_append(seq)
        bm.may_append(seq)
        if seq.num_tokens == 8:
            assert seq.block_table == table_before and bm.blocks[seq.block_table[1]].hash is not None
        elif seq.num_tokens == 9:
            assert seq.block_table[:2] == table_before and len(seq.block_table) == 3
        else:
            assert seq.block_table == table_before and bm.blocks[seq.block_table[1]].hash is None
        bm.check_invariants()
    # the generated tokens 6, 7, 8 completed block 1: a later prompt hits it
    later = admit(bm, FakeSeq([1, 2, 3, 4, 5, 6, 7, 8, 42]))
    assert later.block_table[:2] == seq.block_table[:2] and later.num_cached_tokens == 2 * BS


def test_chunked_prefill_blocks_are_hittable_only_once_scheduled():
    bm = BlockManager(16, BS)
    prompt = list(range(4 * BS))
    a = FakeSeq(prompt)
    bm.allocate(a)
    bm.cache_full_blocks(a, BS + 2)  # the first chunk writes block 0 and part of block 1
    assert admit(bm, FakeSeq(prompt)).num_cached_tokens == BS
    bm.cache_full_blocks(a, 3 * BS)
    assert admit(bm, FakeSeq(prompt)).num_cached_tokens == 3 * BS
    bm.check_invariants()


def test_a_sequence_that_must_compute_its_prompt_takes_no_hit_but_caches_its_blocks():
    """Prompt logprobs need every position's logits: such a sequence reads nothing from the cache
    (and counts no lookup), while the blocks it fills serve the sequences after it."""
    bm = BlockManager(16, BS)
    a = admit(bm, FakeSeq(list(range(3 * BS))))
    scorer = admit(bm, FakeSeq(list(range(3 * BS)), reads_prefix_cache=False))
    assert scorer.num_cached_tokens == 0 and not set(scorer.block_table) & set(a.block_table)
    assert (bm.stats.queries, bm.stats.hits) == (3 * BS, 0)
    bm.deallocate(a)
    later = admit(bm, FakeSeq(list(range(3 * BS))))
    assert later.num_cached_tokens == 2 * BS and later.block_table[:2] == scorer.block_table[:2]
    bm.check_invariants()


def test_stats_count_tokens():
    bm = BlockManager(16, BS)
    admit(bm, FakeSeq(list(range(10))))
    admit(bm, FakeSeq(list(range(10))))
    assert (bm.stats.queries, bm.stats.hits) == (20, 2 * BS) and bm.stats.hit_rate == 0.4


def test_without_prefix_caching_nothing_is_hashed_or_shared():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = admit(bm, FakeSeq(list(range(3 * BS))))
    b = admit(bm, FakeSeq(list(range(3 * BS))))
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    assert not bm.hash_to_block_id and all(block.hash is None for block in bm.blocks)
    assert (bm.stats.queries, bm.stats.hits) == (0, 0)


def test_exhausted_pool():
    bm = BlockManager(4, BS)  # 3 usable
    a = admit(bm, FakeSeq(list(range(2 * BS))))
    big = FakeSeq(list(range(50, 50 + 2 * BS)))
    assert not bm.can_allocate(big)
    with pytest.raises(AssertionError, match="needs 2 free blocks, 1 free"):
        bm.allocate(big)
    assert big.block_table == [] and bm.num_free_blocks == 1  # nothing changed
    # a prefix hit on a block in use needs no free block: the same prompt plus one block fits
    assert bm.can_allocate(FakeSeq(list(range(2 * BS)) + [9]))
    a.token_ids.append(9)
    assert bm.can_append(a)
    bm.may_append(a)
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    a.token_ids.extend([10, 11, 12, 13])
    assert not bm.can_append(a)
    with pytest.raises(AssertionError, match="check can_append first"):
        bm.may_append(a)


def test_a_real_sequence_follows_the_protocol():
    seq = Sequence("r", None, [1, 2, 3, 4, 5, 6], SamplingParams(), arrival=0, cache_salt="d1")
    seq.output_token_ids += [7, 8, 9]
    assert [seq.block_token_ids(i, BS) for i in range(3)] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
    bm = BlockManager(8, BS)
    admit(bm, seq)
    other = admit(bm, FakeSeq([1, 2, 3, 4, 5, 6, 7, 8, 0], cache_salt="d1"))
    assert other.num_cached_tokens == 2 * BS and other.block_table[:2] == seq.block_table[:2]


def test_random_workload_never_leaks_and_never_reads_a_wrong_block():
    """Hundreds of sequences over shared prefixes and three adapters, prefilled in random chunks,
    decoded, preempted and finished, against an oracle of what each cache slot holds."""
    rng = random.Random(0)
    bm = BlockManager(41, BS)
    kv: dict[tuple[int, int], tuple] = {}  # (block, slot) -> (salt, the tokens up to that position)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 13))] for _ in range(4)]
    waiting, running, computed, finished = [], [], {}, 0

    def write(seq, start, stop):
        for p in range(start, stop):
            kv[seq.block_table[p // BS], p % BS] = (seq.cache_salt, tuple(seq.token_ids[:p + 1]))

    def check(seq, stop):  # the cache holds what this sequence would have computed itself
        for p in range(stop):
            expected = (seq.cache_salt, tuple(seq.token_ids[:p + 1]))
            assert kv.get((seq.block_table[p // BS], p % BS)) == expected

    while finished < 300:
        if len(waiting) < 3:
            tail = [rng.randrange(50) for _ in range(rng.randrange(1, 15))]
            waiting.append(FakeSeq(rng.choice(prefixes) + tail, cache_salt=rng.choice([None, "a", b"b"])))
        action = rng.random()
        if action < 0.3 and bm.can_allocate(waiting[0]):
            seq = waiting.pop(0)
            bm.allocate(seq)
            assert seq.num_cached_tokens % BS == 0 and seq.num_cached_tokens < seq.num_tokens
            check(seq, seq.num_cached_tokens)
            computed[seq] = seq.num_cached_tokens
            running.append(seq)
        elif action < 0.85 and running:
            seq = rng.choice(running)
            if computed[seq] < seq.num_tokens:  # a prefill chunk
                stop = min(seq.num_tokens, computed[seq] + rng.randrange(1, 9))
                bm.cache_full_blocks(seq, stop)
            else:  # a decode: the last step sampled a token, this one computes it
                seq.token_ids.append(rng.randrange(50))
                if not bm.can_append(seq):  # no room: preempt, recompute later
                    bm.deallocate(seq)
                    running.remove(seq)
                    waiting.insert(0, seq)
                    continue
                bm.may_append(seq)
                stop = seq.num_tokens
            write(seq, computed[seq], stop)
            computed[seq] = stop
            check(seq, stop)
        elif running:
            seq = running.pop(rng.randrange(len(running)))
            bm.deallocate(seq)
            finished += 1
        bm.check_invariants()
        for block in bm.blocks:
            assert block.ref_count == sum(seq.block_table.count(block.block_id) for seq in running)
        assert all(len(seq.block_table) == blocks_needed(seq.num_tokens, BS) for seq in running)
    assert bm.stats.hits > 0  # the workload exercised sharing
    for seq in running:
        bm.deallocate(seq)
    assert bm.num_free_blocks == bm.num_usable_blocks and not bm.used_block_ids
    bm.check_invariants()
