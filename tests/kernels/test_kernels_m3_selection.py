"""The reference MSA selection in its M3 form (n_init ≥ 0, n_local ≥ 1 forced blocks ending at the
query's block, one shared index-K head) against the selection of transformers' `MiniMaxM3VLIndexer`.

`m3_indexer_selection` below re-implements that module's selection step line for line (block-max of
masked fp32 scores, `+inf` scattered onto the local blocks, `topk`, `-inf` slots → -1), extended by
the init blocks the msaserve form forces (scattered like the local ones, clamped to the query's
block). The reference ops see the same keys through a scattered paged cache and chunked queries.
Selections are compared as sets up to near-ties (`testing.selections_match`): the reference breaks
ties to the lower block id, `torch.topk` in no promised order.
"""

import pytest
import torch
from kernel_testing import scattered_block_tables, selections_match

from msaserve.kernels.indexer_decode.naive import indexer_decode
from msaserve.kernels.indexer_prefill.naive import block_scores, indexer_prefill, select_blocks

# fp32 on both sides, summed in different orders: real differences are far above this.
SCORE_TOLERANCE = 1e-4


def m3_indexer_selection(
    idx_q: torch.Tensor, idx_k: torch.Tensor, position_ids: torch.Tensor, block_size: int, topk_blocks: int,
    local_blocks: int, init_blocks: int = 0,
) -> torch.Tensor:
    """`MiniMaxM3VLIndexer.forward` after the projections: idx_q [B, H, Sq, D], idx_k [B, 1, Sk, D],
    position_ids [B, Sq] → [B, H, Sq, min(topk_blocks, num_key_blocks)] block ids, -1 for empty slots."""
    batch, num_heads, q_len, _ = idx_q.shape
    k_len = idx_k.shape[2]
    num_key_blocks = -(-k_len // block_size)
    pad = num_key_blocks * block_size - k_len
    scores = torch.matmul(idx_q.float(), idx_k.float().transpose(-1, -2))
    k_positions = torch.arange(k_len)
    token_future = k_positions[None, None, None, :] > position_ids[:, None, :, None]
    scores = scores.masked_fill(token_future, float("-inf"))
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    scores = scores.view(batch, num_heads, q_len, num_key_blocks, block_size)
    block_scores_ = scores.amax(dim=-1)
    q_block = position_ids // block_size
    local = torch.arange(local_blocks)
    local_idx = (q_block[..., None] - local.view(1, 1, -1)).clamp(min=0)
    block_scores_.scatter_(-1, local_idx.unsqueeze(1).expand(-1, num_heads, -1, -1), float("inf"))
    if init_blocks:  # the msaserve form's leading blocks, never past the query's own block
        init_idx = torch.minimum(torch.arange(init_blocks).view(1, 1, -1), q_block[..., None])
        block_scores_.scatter_(-1, init_idx.unsqueeze(1).expand(-1, num_heads, -1, -1), float("inf"))
    topk = min(topk_blocks, num_key_blocks)
    topk_scores, topk_indices = block_scores_.topk(topk, dim=-1)
    return topk_indices.masked_fill(topk_scores == float("-inf"), -1)


def paged_index_cache(keys: torch.Tensor, page_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [Sk, DI] → index cache [num_pages, P, 1, DI] on scattered pages (random elsewhere) and
    its block table [1, max_pages]."""
    gen = torch.Generator().manual_seed(seed)
    length, dim = keys.shape
    num_pages = -(-length // page_size) + 3
    table = scattered_block_tables([length], page_size, num_pages, gen)
    cache = torch.randn(num_pages, page_size, 1, dim, generator=gen)
    flat = torch.zeros(-(-length // page_size) * page_size, dim)
    flat[:length] = keys
    cache[table[0, : -(-length // page_size)].long()] = flat.view(-1, page_size, 1, dim)
    return cache, table


def _as_ours(transformers_sel: torch.Tensor, top_k: int) -> torch.Tensor:
    """[1, H, Sq, k'] (k' ≤ top_k) → [Sq, H, top_k] padded with -1, as our ops lay it out."""
    sel = transformers_sel[0].transpose(0, 1)
    pad = top_k - sel.shape[-1]
    return torch.nn.functional.pad(sel, (0, pad), value=-1).to(torch.int32)


@pytest.mark.parametrize(
    "page_size,top_k,n_local,n_init,num_heads,length,chunk",
    [
        (16, 4, 1, 0, 2, 16 * 11 + 5, 16 * 11 + 5),  # the M3 default form, one prefill
        (16, 4, 2, 0, 4, 16 * 9, 37),  # two local blocks, a chunk that starts mid-page
        (16, 6, 3, 0, 1, 16 * 13 + 1, 16 * 13 + 1),
        (8, 5, 2, 1, 2, 8 * 20 + 3, 50),  # both kinds of forced block
        (16, 4, 1, 1, 2, 16 * 10 + 7, 16 * 10 + 7),  # today's msaserve form
        (32, 3, 1, 2, 3, 32 * 7 + 31, 32 * 7 + 31),
        (16, 8, 4, 0, 2, 16 * 6, 16 * 6),  # shorter than top_k · P: every block 0..c
    ],
)
def test_prefill_selection_matches_m3_indexer(page_size, top_k, n_local, n_init, num_heads, length, chunk):
    gen = torch.Generator().manual_seed(page_size * 100 + top_k * 10 + n_local)
    dim = 16
    keys = torch.randn(length, dim, generator=gen)
    q = torch.randn(chunk, num_heads, dim, generator=gen)
    positions = torch.arange(length - chunk, length)
    want = m3_indexer_selection(
        q.transpose(0, 1)[None], keys[None, None], positions[None], page_size, top_k, n_local, n_init
    )
    cache, table = paged_index_cache(keys, page_size, seed=length)
    cu = torch.tensor([0, chunk], dtype=torch.int32)
    seq_lens = torch.tensor([length], dtype=torch.int32)
    got = indexer_prefill(q, cache, table, seq_lens, cu, top_k, n_init, None, n_local)
    scores = block_scores(q, keys[:, None], positions, page_size)
    ok, message = selections_match(got, _as_ours(want, top_k), scores, SCORE_TOLERANCE)
    assert ok, message
    # the forced blocks are in every row, whatever their scores
    for i, t in enumerate(positions.tolist()):
        c = t // page_size
        forced = set(range(max(0, c - n_local + 1), c + 1)) | set(range(min(n_init, c + 1)))
        assert forced <= set(got[i, 0].tolist()), f"t={t}: {got[i, 0].tolist()} lacks {forced}"


@pytest.mark.parametrize("n_local,n_init,num_q", [(1, 0, 1), (2, 0, 3), (2, 1, 16)])
def test_decode_selection_matches_m3_indexer(n_local, n_init, num_q):
    page_size, top_k, dim, num_heads = 16, 4, 16, 2
    lengths = [16 * 9 + 3, 16 * 3, num_q + 1]
    gen = torch.Generator().manual_seed(num_q)
    for b, length in enumerate(lengths):
        keys = torch.randn(length, dim, generator=gen)
        q = torch.randn(1, num_q, num_heads, dim, generator=gen)
        positions = torch.arange(length - num_q, length)
        want = m3_indexer_selection(
            q[0].transpose(0, 1)[None], keys[None, None], positions[None], page_size, top_k, n_local, n_init
        )
        cache, table = paged_index_cache(keys, page_size, seed=b)
        got = indexer_decode(q, cache, table, torch.tensor([length]), top_k, n_init, None, n_local)[0]
        scores = block_scores(q[0], keys[:, None], positions, page_size)
        ok, message = selections_match(got, _as_ours(want, top_k), scores, SCORE_TOLERANCE)
        assert ok, f"length {length}: {message}"


def test_forced_local_blocks_beat_higher_scores():
    """Scores rise with the block id everywhere except the local window, which scores lowest: the
    n_local blocks still take their slots, and no init block is forced when n_init = 0."""
    page_size, top_k = 4, 4
    scores = torch.arange(10, dtype=torch.float32).view(1, 1, -1)  # block j scores j ...
    scores[..., 7:] = -100.0  # ... except 7, 8, 9, the lowest
    t = torch.tensor([page_size * 9 + 1])  # c = 9
    assert select_blocks(scores, t, page_size, top_k, n_init=0, n_local=3)[0, 0].tolist() == [6, 7, 8, 9]
    # block 0 (a low score) is not forced any more; block 8 is not local with n_local = 1
    assert select_blocks(scores, t, page_size, top_k, n_init=0, n_local=1)[0, 0].tolist() == [4, 5, 6, 9]
    assert select_blocks(scores, t, page_size, top_k, n_init=1, n_local=2)[0, 0].tolist() == [0, 6, 8, 9]


@pytest.mark.parametrize(
    "top_k,n_init,n_local,match",
    [(4, 0, 0, "n_local=0 is invalid: allowed n_local ≥ 1"), (4, 2, 3, "n_init=2 with n_local=3 is invalid"),
     (4, -1, 1, "n_init=-1 with n_local=1 is invalid")],
)
def test_forced_blocks_that_do_not_fit_are_rejected(top_k, n_init, n_local, match):
    with pytest.raises(ValueError, match=match):
        select_blocks(torch.zeros(1, 1, 8), torch.tensor([40]), 4, top_k, n_init, n_local)


def test_index_branch_matches_transformers_module():
    """transformers' own `MiniMaxM3VLIndexer` (tiny random weights, 2 local blocks of 8, top-4) against
    our index branch: its normed q and k (captured from its norms) rotated by the layer-ops spec with
    partial rotary, the keys written to a scattered paged cache, and the reference indexer in two
    chunks."""
    m3 = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    from msaserve.kernels.layer_ops import naive as layer_ops
    from msaserve.kernels.rotary import rotary_cos_sin

    torch.manual_seed(0)
    page_size, top_k, n_local, rotary_dim, length = 8, 4, 2, 16, 8 * 12 + 3
    config = MiniMaxM3VLTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=rotary_dim,
        index_n_heads=2, index_head_dim=32, index_block_size=page_size, index_topk_blocks=top_k,
        index_local_blocks=n_local, num_hidden_layers=1, vocab_size=256, bos_token_id=1, eos_token_id=2,
    )
    indexer = m3.MiniMaxM3VLIndexer(config, layer_idx=0).eval()
    with torch.no_grad():
        indexer.q_norm.weight.normal_(0, 0.2)
        indexer.k_norm.weight.normal_(0, 0.2)
    captured = {}
    indexer.q_norm.register_forward_hook(lambda _m, _i, out: captured.__setitem__("q", out))
    indexer.k_norm.register_forward_hook(lambda _m, _i, out: captured.__setitem__("k", out))
    hidden = torch.randn(1, length, 64)
    positions = torch.arange(length)
    cos, sin = rotary_cos_sin(positions, rotary_dim, 5e6, torch.float32)  # [T, 1, R]
    with torch.no_grad():
        want = indexer(hidden, (cos[None, :, 0], sin[None, :, 0]), None, positions[None])

    q_index = layer_ops.rotary_and_write(captured["q"][0].clone(), cos, sin, True, rotary_dim=rotary_dim)
    cache, table = paged_index_cache(torch.zeros(length, 32), page_size, seed=1)
    slots = table[0].long()[positions // page_size] * page_size + positions % page_size
    keys = layer_ops.rotary_and_write(captured["k"][0].clone(), cos, sin, True, slots, (cache,),
                                      rotary_dim=rotary_dim)  # [T, 1, DI], written to the cache
    got = []
    for start, end in ((0, 40), (40, length)):
        cu = torch.tensor([0, end - start], dtype=torch.int32)
        got.append(indexer_prefill(q_index[start:end], cache, table, torch.tensor([end]), cu, top_k, 0, None,
                                   n_local))
    scores = block_scores(q_index, keys, positions, page_size)
    ok, message = selections_match(torch.cat(got), _as_ours(want, top_k), scores, SCORE_TOLERANCE)
    assert ok, message
    assert (torch.cat(got)[page_size * top_k :] >= 0).all(), "past top_k · P every slot is used"


def test_every_backend_takes_n_local():
    """The agreed signatures: a trailing n_local=1 on both indexers of every implementation."""
    import inspect

    for impl in ("naive", "triton"):
        for op in ("indexer_prefill", "indexer_decode"):
            module = __import__(f"msaserve.kernels.{op}.{impl}", fromlist=[op])
            params = inspect.signature(getattr(module, op)).parameters
            assert params["n_local"].default == 1 and params["n_init"].default == 1, f"{impl}.{op}"
            assert list(params).index("n_local") > list(params).index("index_scale"), f"{impl}.{op}"
