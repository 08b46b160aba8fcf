"""BlockManager: prefix reuse with token re-check, reference counts, LRU eviction, events."""

import pytest
import torch

from msaserve.engine.block_manager import BlockManager
from msaserve.engine.sequence import Sequence
from msaserve.engine.types import SamplingParams
from msaserve.kvcache.page_hash import page_hashes

P = 4


def seq(tokens: list[int], name: str = "r") -> Sequence:
    return Sequence(name, list(tokens), len(tokens), SamplingParams(), 0.0, torch.Generator())


def compute_all(manager: BlockManager, s: Sequence) -> None:
    """What a finished prefill does: allocate, mark computed, register full pages."""
    assert manager.allocate_slots(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = s.num_tokens
    manager.commit(s)


def test_prefix_hit_shares_full_pages_and_leaves_last_token_to_compute():
    manager = BlockManager(num_pages=16, page_size=P)
    first = seq(list(range(10)), "a")
    manager.admit(first)
    compute_all(manager, first)  # pages: [0..3] [4..7] and partial [8, 9]
    second = seq([*range(10), 99], "b")
    assert manager.admit(second) == 8
    assert second.block_table == first.block_table[:2]
    assert [manager.ref_counts[p] for p in first.block_table] == [2, 2, 1]
    # A prompt that is exactly the cached pages still computes its last token.
    exact = seq(list(range(8)), "c")
    assert manager.admit(exact) == 4
    assert manager.prefix_hit_rate == pytest.approx((8 + 4) / (10 + 11 + 8))


def test_hash_hit_with_other_tokens_is_rejected():
    manager = BlockManager(num_pages=8, page_size=P)
    first = seq([1, 2, 3, 4, 5], "a")
    manager.admit(first)
    compute_all(manager, first)
    # Forge a collision: the right hash in the table for another page's tokens.
    hashes = page_hashes([1, 2, 3, 4], P)
    assert manager.lookup(hashes, [1, 2, 3, 4]) == [first.block_table[0]]
    assert manager.lookup(hashes, [1, 2, 3, 7]) == []


def test_free_pages_are_evicted_least_recently_freed_first_and_reported():
    manager = BlockManager(num_pages=4, page_size=P)
    a, b = seq([1] * 8 + [0], "a"), seq([2] * 8 + [0], "b")
    for s in (a, b):
        manager.admit(s)
        assert manager.allocate_slots(s, 8)
        s.num_computed_tokens = 8
        manager.commit(s)
    a_pages = list(a.block_table)
    manager.free(a)
    manager.free(b)
    assert manager.num_free_pages == 4 and manager.num_cached_pages == 4
    stored = [e for e in manager.drain_events() if e.kind == "stored"]
    assert sum(len(e.page_hashes) for e in stored) == 4
    # a's pages were freed first; its tail page (freed before its head) goes first.
    assert manager.allocate(1) == [a_pages[1]]
    events = manager.drain_events()
    assert [e.kind for e in events] == ["removed"]
    assert events[0].page_hashes == [page_hashes([1] * 8, P)[1]]
    # a's first page is still a hit; b's pages too.
    assert manager.lookup(page_hashes([1] * 8, P), [1] * 8) != []
    manager.check_consistency()


def test_refcounts_return_every_page():
    manager = BlockManager(num_pages=10, page_size=P)
    sequences = [seq(list(range(13)), f"s{i}") for i in range(3)]
    for s in sequences:
        manager.admit(s)
        compute_all(manager, s)
    assert manager.num_free_pages == 10 - 4 - 2 * 1  # 3 shared full pages + 3 private tails
    for s in sequences:
        manager.free(s)
    assert all(n == 0 for n in manager.ref_counts)
    assert manager.num_free_pages == 10
    manager.check_consistency()
    manager.reset_prefix_cache()
    assert manager.num_cached_pages == 0 and manager.drain_events()[-1].kind == "cleared"


def test_allocation_fails_cleanly_when_the_pool_is_short():
    manager = BlockManager(num_pages=2, page_size=P)
    s = seq(list(range(12)))
    assert not manager.allocate_slots(s, 12)
    assert s.block_table == [] and manager.num_free_pages == 2
