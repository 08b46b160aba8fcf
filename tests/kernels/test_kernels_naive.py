"""The MSA reference ops against docs/design.md §2's definition and properties 1–4.

The selection is also checked against a deliberately plain per-query loop written here, so the
vectorised reference is not only checked against itself.
"""

import math

import pytest
import torch
from kernel_testing import scattered_block_tables, selections_match

from msaserve.kernels import get_ops
from msaserve.kernels.dense import sdpa
from msaserve.kernels.indexer_prefill.naive import block_scores, gather_pages

NAIVE = get_ops("naive")
ATOL = 2e-5  # fp32 end to end: only summation-order differences


def make_case(
    seed, seq_lens, q_lens, num_kv_heads, group, head_dim, index_heads, page_size, dtype=torch.float32
):
    """Random paged caches and queries for a varlen batch; each sequence's queries are its last
    q_len tokens. Returns a dict of everything the ops take."""
    gen = torch.Generator().manual_seed(seed)
    pages = sum((n + page_size - 1) // page_size for n in seq_lens) + 3
    block_tables = scattered_block_tables(seq_lens, page_size, pages, gen)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    total_q = sum(q_lens)
    return dict(
        q=rand(total_q, num_kv_heads * group, head_dim),
        q_index=rand(total_q, num_kv_heads, head_dim),
        k_cache=rand(pages, page_size, num_kv_heads, head_dim),
        v_cache=rand(pages, page_size, num_kv_heads, head_dim),
        index_cache=rand(pages, page_size, index_heads, head_dim),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
    )


def select(case, top_k, n_init):
    """The reference selection for every query of a case made by make_case."""
    return NAIVE.indexer_prefill(
        case["q_index"],
        case["index_cache"],
        case["block_tables"],
        case["seq_lens"],
        case["cu_seqlens_q"],
        top_k,
        n_init,
    )


def plain_selection(scores_row, t, page_size, top_k, n_init):
    """docs/design.md §2 selection for one (query, head), written as directly as possible."""
    c = t // page_size
    if c < top_k:
        return list(range(c + 1))
    forced = [c, *range(n_init)]
    candidates = sorted(range(n_init, c), key=lambda j: (-float(scores_row[j]), j))
    return sorted(forced + candidates[: top_k - len(forced)])


@pytest.mark.parametrize(
    "page_size,top_k,n_init,index_heads",
    [
        (16, 4, 1, 1),
        (16, 4, 0, 2),
        (16, 6, 2, 2),
        (64, 3, 1, 1),
    ],
)
def test_selection_matches_definition(page_size, top_k, n_init, index_heads):
    seq_lens, q_lens = [page_size * 9 + 5, page_size * 2 + 1], [page_size * 9 + 5, 7]
    case = make_case(1, seq_lens, q_lens, 2, 2, 8, index_heads, page_size)
    selected = select(case, top_k, n_init)
    for b, (length, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        keys = gather_pages(case["index_cache"], case["block_tables"][b], length)
        start = int(case["cu_seqlens_q"][b])
        for i in range(q_len):
            t = length - q_len + i
            q_index = case["q_index"][start + i]  # [Hkv, DI]
            for h in range(2):
                k = keys[:, 0 if index_heads == 1 else h]  # [T, DI]
                dots = k[: t + 1].float() @ q_index[h].float()
                row = [dots[j * page_size : (j + 1) * page_size].max() for j in range(t // page_size + 1)]
                want = plain_selection(row, t, page_size, top_k, n_init)
                got = [x for x in selected[start + i, h].tolist() if x >= 0]
                assert got == want, f"seq {b} t={t} head {h}: {got} != {want}"
                assert selected[start + i, h, len(want) :].eq(-1).all()


def test_ties_go_to_lower_block():
    # All index keys equal → all scores tie → the lowest candidate blocks win.
    page_size, top_k, length = 16, 4, 16 * 10
    case = make_case(2, [length], [length], 1, 1, 8, 1, page_size)
    case["index_cache"][:] = 1.0
    selected = select(case, top_k, 1)
    t = length - 1  # c = 9 → forced {0, 9}, then ties → {1, 2}
    assert selected[t, 0].tolist() == [0, 1, 2, 9]


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("page_size,top_k,index_heads", [(16, 4, 1), (16, 5, 2), (64, 2, 2)])
def test_short_sequences_equal_dense(group, page_size, top_k, index_heads):
    """Property 1: T ≤ K·P ⇒ MSA equals dense causal attention."""
    seq_lens = [top_k * page_size, top_k * page_size - 7, 5]
    case = make_case(3, seq_lens, [seq_lens[0], 9, 5], 2, group, 16, index_heads, page_size)
    args = (case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"], case["cu_seqlens_q"])
    selected = select(case, top_k, 1)
    sparse = NAIVE.sparse_prefill(case["q"], *args, selected)
    dense = NAIVE.dense_prefill(case["q"], *args)
    torch.testing.assert_close(sparse, dense, atol=ATOL, rtol=0)
    torch.testing.assert_close(sdpa.dense_prefill(case["q"], *args), dense, atol=1e-5, rtol=1e-5)


def test_long_sequences_differ_from_dense():
    """The converse, so property 1's test cannot pass with a selection that keeps everything."""
    page_size, top_k = 16, 2
    case = make_case(4, [page_size * 8], [page_size * 8], 1, 2, 16, 1, page_size)
    args = (case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"], case["cu_seqlens_q"])
    selected = select(case, top_k, 1)
    assert (
        NAIVE.sparse_prefill(case["q"], *args, selected) - NAIVE.dense_prefill(case["q"], *args)
    ).abs().max() > 1e-2


@pytest.mark.parametrize("group,index_heads", [(3, 1), (4, 2)])
def test_chunks_and_decode_steps_equal_one_prefill(group, index_heads):
    """Property 2: any split into prefill chunks and decode steps gives the same output."""
    page_size, top_k, length = 16, 3, 16 * 7 + 3
    case = make_case(5, [length], [length], 2, group, 16, index_heads, page_size)
    full_sel = select(case, top_k, 1)
    caches = (case["k_cache"], case["v_cache"], case["block_tables"])
    full = NAIVE.sparse_prefill(case["q"], *caches, case["seq_lens"], case["cu_seqlens_q"], full_sel)
    # The cache already holds all tokens: a query at t must ignore everything after t anyway,
    # so poisoning the future proves causality instead of assuming it.
    pieces, start = [], 0
    for end in [37, 38, 80, 101, 102, length]:
        k_cache, v_cache, index_cache = (
            t.clone() for t in (case["k_cache"], case["v_cache"], case["index_cache"])
        )
        for cache in (k_cache, v_cache, index_cache):
            flat = gather_pages(cache, case["block_tables"][0], length)
            flat[end:] = 1e3  # view into a copy: write back through the page table
            pages = case["block_tables"][0][: (length + page_size - 1) // page_size].long()
            padded = torch.zeros(len(pages) * page_size, *flat.shape[1:])
            padded[:length] = flat
            cache[pages] = padded.view(len(pages), page_size, *flat.shape[1:])
        seq_lens = torch.tensor([end], dtype=torch.int32)
        if end - start == 1:  # a decode step through the decode-shaped ops
            sel = NAIVE.indexer_decode(
                case["q_index"][start:end][None], index_cache, case["block_tables"], seq_lens, top_k, 1
            )
            out = NAIVE.sparse_decode(
                case["q"][start:end][None], k_cache, v_cache, case["block_tables"], seq_lens, sel
            )[0]
            sel = sel[0]
        else:
            cu = torch.tensor([0, end - start], dtype=torch.int32)
            sel = NAIVE.indexer_prefill(
                case["q_index"][start:end], index_cache, case["block_tables"], seq_lens, cu, top_k, 1
            )
            out = NAIVE.sparse_prefill(
                case["q"][start:end], k_cache, v_cache, case["block_tables"], seq_lens, cu, sel
            )
        assert torch.equal(sel, full_sel[start:end])
        pieces.append(out)
        start = end
    torch.testing.assert_close(torch.cat(pieces), full, atol=ATOL, rtol=0)


def test_selection_order_does_not_matter():
    """Property 3."""
    page_size, top_k, length = 16, 4, 16 * 9
    case = make_case(6, [length], [length], 2, 2, 16, 1, page_size)
    sel = select(case, top_k, 1)
    shuffled = sel.gather(
        -1, torch.argsort(torch.rand(sel.shape, generator=torch.Generator().manual_seed(0)), dim=-1)
    )
    assert not torch.equal(shuffled, sel)
    args = (
        case["q"],
        case["k_cache"],
        case["v_cache"],
        case["block_tables"],
        case["seq_lens"],
        case["cu_seqlens_q"],
    )
    torch.testing.assert_close(
        NAIVE.sparse_prefill(*args, shuffled), NAIVE.sparse_prefill(*args, sel), atol=ATOL, rtol=0
    )


def test_bf16_selection_matches_fp32_up_to_near_ties():
    """Property 4: bf16 index inputs may swap only blocks whose fp32 scores nearly tie."""
    page_size, top_k, length = 16, 4, 16 * 12 + 5
    case = make_case(7, [length], [length], 2, 1, 32, 2, page_size)
    common = (case["block_tables"], case["seq_lens"], case["cu_seqlens_q"], top_k, 1)
    want = NAIVE.indexer_prefill(case["q_index"], case["index_cache"], *common)
    got = NAIVE.indexer_prefill(case["q_index"].bfloat16(), case["index_cache"].bfloat16(), *common)
    keys = gather_pages(case["index_cache"], case["block_tables"][0], length)
    scores = block_scores(case["q_index"], keys, torch.arange(length), page_size)
    ok, message = selections_match(got, want, scores, tolerance=0.25)
    assert ok, message
    # and the comparison helper does reject a real difference
    wrong = want.clone()
    wrong[-1, 0, 1] = (wrong[-1, 0, 1] + 5) % (length // page_size)
    assert not selections_match(wrong, want, scores, tolerance=1e-3)[0]


@pytest.mark.parametrize("num_q", [1, 4])
def test_decode_ops_equal_varlen_ops_and_paging_is_transparent(num_q):
    """Decode-shaped ops equal varlen ops; scattered pages equal contiguous pages."""
    page_size, top_k = 16, 3
    seq_lens = [16 * 6 + 2, 16 * 2, 16 * 4 + 15]
    case = make_case(8, seq_lens, [num_q] * 3, 2, 4, 16, 2, page_size)
    sel = NAIVE.indexer_decode(
        case["q_index"].view(3, num_q, 2, 16),
        case["index_cache"],
        case["block_tables"],
        case["seq_lens"],
        top_k,
        1,
    )
    out = NAIVE.sparse_decode(
        case["q"].view(3, num_q, 8, 16),
        case["k_cache"],
        case["v_cache"],
        case["block_tables"],
        case["seq_lens"],
        sel,
    )
    # contiguous copy of the same tokens: sequence b on pages [offset_b, offset_b + n_b)
    contiguous = {}
    tables, offset = torch.full_like(case["block_tables"], -1), 0
    for name in ("k_cache", "v_cache", "index_cache"):
        contiguous[name] = torch.zeros_like(case[name])
    for b, n in enumerate(seq_lens):
        pages = (n + page_size - 1) // page_size
        tables[b, :pages] = torch.arange(offset, offset + pages, dtype=torch.int32)
        for name in contiguous:
            contiguous[name][offset : offset + pages] = case[name][case["block_tables"][b, :pages].long()]
        offset += pages
    sel2 = NAIVE.indexer_decode(
        case["q_index"].view(3, num_q, 2, 16), contiguous["index_cache"], tables, case["seq_lens"], top_k, 1
    )
    out2 = NAIVE.sparse_decode(
        case["q"].view(3, num_q, 8, 16),
        contiguous["k_cache"],
        contiguous["v_cache"],
        tables,
        case["seq_lens"],
        sel2,
    )
    assert torch.equal(sel, sel2)
    torch.testing.assert_close(out, out2, atol=ATOL, rtol=0)
    flat_sel = select(case, top_k, 1)
    assert torch.equal(flat_sel.view_as(sel), sel)


def test_attention_matches_softmax_formula():
    """One query by hand: o = Σ softmax(q·k/√D) v over p ≤ t in the selected blocks."""
    page_size, top_k, length = 16, 2, 16 * 5 + 3
    case = make_case(9, [length], [1], 1, 1, 8, 1, page_size)
    sel = select(case, top_k, 1)
    out = NAIVE.sparse_prefill(
        case["q"],
        case["k_cache"],
        case["v_cache"],
        case["block_tables"],
        case["seq_lens"],
        case["cu_seqlens_q"],
        sel,
    )
    k = gather_pages(case["k_cache"], case["block_tables"][0], length)[:, 0]
    v = gather_pages(case["v_cache"], case["block_tables"][0], length)[:, 0]
    keep = [p for p in range(length) if p // page_size in sel[0, 0].tolist()]
    w = torch.softmax(k[keep] @ case["q"][0, 0] / math.sqrt(8), dim=0)
    torch.testing.assert_close(out[0, 0], w @ v[keep], atol=ATOL, rtol=0)


def test_fp8_index_scale_is_applied():
    page_size, top_k, length = 16, 3, 16 * 8
    case = make_case(10, [length], [4], 1, 1, 16, 1, page_size)
    scale = torch.rand(case["index_cache"].shape[:3], generator=torch.Generator().manual_seed(1)) + 0.5
    common = (case["block_tables"], case["seq_lens"], case["cu_seqlens_q"], top_k, 1)
    scaled = NAIVE.indexer_prefill(case["q_index"], case["index_cache"], *common, index_scale=scale)
    want = NAIVE.indexer_prefill(case["q_index"], case["index_cache"] * scale[..., None], *common)
    assert torch.equal(scaled, want)


def test_dispatch_rejects_unknown_and_unavailable_backends():
    with pytest.raises(ValueError, match="attention_backend='fast' is invalid: allowed dense, msa, naive"):
        get_ops("fast")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_ops("triton", "cpu")
    assert get_ops("msa", "cpu").name == "msa"  # the CPU ops (kernels/<op>/cpu.py)
    assert not get_ops("dense").sparse


def test_a_backend_is_one_file(tmp_path, monkeypatch):
    """Adding an attention backend is adding one module to `msaserve/kernels/backends/`: the registry
    lists it, resolves it, and the engine's config accepts its name."""
    from msaserve.engine.config import EngineConfig
    from msaserve.kernels import backends

    (tmp_path / "reference_copy.py").write_text(
        "import dataclasses\n"
        "from msaserve.kernels.backends import naive\n"
        "def resolve(device):\n"
        "    return dataclasses.replace(naive.resolve(device), name='reference_copy')\n"
    )
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(tmp_path)])
    assert "reference_copy" in backends.backend_names()
    assert get_ops("reference_copy").name == "reference_copy"
    EngineConfig(attention_backend="reference_copy")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="not_there")
