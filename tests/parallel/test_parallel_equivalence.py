"""Tensor, expert and tensor×expert parallel MiniMax-M3 on 2 and 4 gloo ranks give the logits
(fp32 tolerance) and the greedy tokens of one rank (docs/scaling.md). Plain torch.multiprocessing,
no Ray: one spawn of 4 processes runs every layout (gloo_cases.py)."""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from gloo_cases import LAYOUTS, run_rank

LOGITS_ATOL = 2e-4
"""fp32: the sharded sums (all-reduce of per-rank partials) differ from one rank's in rounding only."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo")
    mp.spawn(run_rank, args=(4, free_port(), str(out)), nprocs=4, join=True)
    load = lambda name: torch.load(out / name, weights_only=False)  # noqa: E731
    return load("reference.pt"), {
        (tp, ep): [load(f"tp{tp}_ep{ep}_rank{r}.pt") for r in range(tp * ep)] for tp, ep in LAYOUTS
    }, out


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{tp}_ep{ep}" for tp, ep in LAYOUTS])
def test_sharded_m3_matches_one_rank(results, layout) -> None:
    reference, cases, _ = results
    ranks = cases[layout]
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result["logits"], reference["logits"], atol=LOGITS_ATOL, rtol=0)
        assert result["tokens"] == reference["tokens"], f"rank {rank}"
    assert reference["tokens"]["r0"] and len(reference["tokens"]) == 3


def test_ranks_keep_only_their_heads(results) -> None:
    """Hq 4, Hkv 2: TP 2 keeps 2 query heads and 1 KV head per rank; TP 4 keeps 1 query head and
    1 KV head, each KV head on two ranks (replicated); EP alone keeps every head."""
    _, cases, _ = results
    assert [(r["q_heads"], r["kv_heads"]) for r in cases[(2, 1)]] == [(2, 1)] * 2
    assert [(r["q_heads"], r["kv_heads"]) for r in cases[(4, 1)]] == [(1, 1)] * 4
    assert [(r["q_heads"], r["kv_heads"]) for r in cases[(1, 4)]] == [(4, 2)] * 4


def test_session_moved_rank_to_rank_gives_the_same_tokens(results) -> None:
    """A TP 2 replica's session sent rank to rank (gloo send/recv, index first) to another TP 2
    replica, which decodes on from other physical pages: the tokens of the unmoved run."""
    out = results[2]
    source = [torch.load(out / f"move_rank{r}.pt") for r in (0, 1)]
    target = [torch.load(out / f"move_rank{r}.pt") for r in (2, 3)]
    assert len(source[0]) == 8 and source[0] == source[1] == target[0] == target[1]
