"""MiniMax-M3's text model in msaserve against transformers (the definition): fp32 logits, the
indexer's block selections (as sets, up to near-ties defined below), the MoE ops, the norm."""

import math

import pytest
import torch
from m3_checkpoint import one_cpu_thread, write_m3_checkpoint

from msaserve.kernels.moe import naive as moe
from msaserve.models.cache import allocate_caches
from msaserve.models.loader import load_model
from msaserve.models.metadata import AttentionMetadata
from msaserve.models.minimax_m3.layers import m3_rms_norm

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures(one_cpu_thread.__name__)
modeling = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")

SHORT, LONG = 40, 200  # below and well above top_k × block = 64 tokens
LOGIT_RTOL = 1e-4
NEAR_TIE = 1e-4
"""Two block scores within NEAR_TIE · max(1, |cutoff|) of the selection's cutoff are a near-tie."""


@pytest.fixture(scope="module", params=["text", "vl", "local2"])
def pair(request, tmp_path_factory):
    """The text-only form, the VL wrapper, and two forced local blocks (index_local_blocks=2)."""
    text = {"index_local_blocks": 2} if request.param == "local2" else None
    vl = request.param == "vl"
    directory, oracle = write_m3_checkpoint(tmp_path_factory.mktemp("m3"), vl=vl, text=text)
    loaded = load_model(str(directory), attention_backend="naive", progress=False)
    return loaded.model, oracle


def prefill_meta(n: int, page_size: int) -> AttentionMetadata:
    positions = torch.arange(n)
    pages = -(-n // page_size)
    return AttentionMetadata(
        positions=positions, slot_mapping=positions.clone(),
        block_tables=torch.arange(pages, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n, selections=[],
    )


def run_ours(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    c = model.config
    meta = prefill_meta(len(ids), c.page_size)
    caches = allocate_caches(c, -(-len(ids) // c.page_size), "cpu", torch.float32)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, meta, caches))
    return logits, meta.selections


def text_model(oracle):
    return oracle.model.language_model if hasattr(oracle.model, "language_model") else oracle.model


def run_theirs(oracle, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """→ logits [T, V], selections [T, Hkv, K] and block scores [T, Hkv, blocks] per sparse layer."""
    selections, scores, hooks = [], [], []
    for layer in text_model(oracle).layers:
        indexer = layer.self_attn.indexer
        if indexer is None:
            continue
        hooks.append(indexer.register_forward_hook(_capture(selections, scores)))
    try:
        with torch.no_grad():
            logits = oracle(input_ids=ids[None]).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return logits, selections, scores


def _capture(selections: list, scores: list):
    def hook(module, args, output):
        hidden, (cos, sin) = args[0], args[1]
        q = module.q_norm(module.q_proj(hidden).view(*hidden.shape[:2], -1, module.head_dim)).transpose(1, 2)
        k = module.k_norm(module.k_proj(hidden).view(*hidden.shape[:2], 1, module.head_dim)).transpose(1, 2)
        d = module.head_dim
        q, k = modeling.apply_rotary_pos_emb(q, k, cos[..., :d], sin[..., :d])
        logits = torch.matmul(q.float(), k.float().transpose(-1, -2))[0]  # [H, T, T]
        n = logits.shape[-1]
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        blocks = -(-n // module.block_size)
        logits = torch.nn.functional.pad(logits, (0, blocks * module.block_size - n), value=float("-inf"))
        scores.append(logits.view(*logits.shape[:2], blocks, module.block_size).amax(-1).transpose(0, 1))
        selections.append(output[0].transpose(0, 1))  # [T, H, K]
    return hook


def same_up_to_near_ties(ours: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor,
                         positions: torch.Tensor, page_size: int, n_local: int) -> list[str]:
    """Compare selections [T, H, K] as sets per (t, h). A difference is allowed only as a
    near-tie: both sets have the same size and every block in one but not the other scores within
    NEAR_TIE · max(1, |cutoff|) of the cutoff (the lowest score either set admits among the
    competing blocks, i.e. blocks < c - n_local + 1). → the (t, h) that differ otherwise."""
    bad = []
    for row in range(ours.shape[0]):
        t = int(positions[row])
        c = t // page_size
        for h in range(ours.shape[1]):
            a = {int(x) for x in ours[row, h] if x >= 0}
            b = {int(x) for x in theirs[row, h] if x >= 0}
            if a == b:
                continue
            competing = [j for j in a | b if j <= c - n_local]
            cutoff = min(float(scores[row, h, j]) for j in competing) if competing else math.inf
            tol = NEAR_TIE * max(1.0, abs(cutoff))
            if len(a) != len(b) or any(
                j > c - n_local or abs(float(scores[row, h, j]) - cutoff) > tol for j in a ^ b
            ):
                bad.append(f"t={t} h={h}: ours {sorted(a)} theirs {sorted(b)}")
    return bad


@pytest.mark.parametrize("length", [SHORT, LONG])
def test_logits_match_transformers(pair, length) -> None:
    ours, oracle = pair
    ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length))
    logits, _ = run_ours(ours, ids)
    expected, _, _ = run_theirs(oracle, ids)
    error = (logits - expected).abs().max() / expected.abs().max()
    assert error <= LOGIT_RTOL, f"relative logit error {float(error):.2e} at {length} tokens"


@pytest.mark.parametrize("length", [SHORT, LONG])
def test_block_selections_match_transformers(pair, length) -> None:
    ours, oracle = pair
    c = ours.config
    ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length + 1))
    _, selections = run_ours(ours, ids)
    _, expected, scores = run_theirs(oracle, ids)
    sparse_layers = [i for i, kind in enumerate(c.layer_types) if kind == "minimax_m3_sparse"]
    assert len(selections) == len(expected) == len(sparse_layers)
    for layer, a, b, s in zip(sparse_layers, selections, expected, scores, strict=True):
        assert a.shape == (length, c.num_kv_heads, c.top_k)
        differ = same_up_to_near_ties(a, b, s, torch.arange(length), c.page_size, c.n_local)
        assert not differ, f"layer {layer}: {differ[:4]}"
        if length == LONG:  # past top_k blocks the selection is really sparse: K of ⌈T/P⌉ blocks
            assert int((a[-1] >= 0).sum(-1).min()) == c.top_k < -(-length // c.page_size)


def test_near_tie_rule() -> None:
    """Query t = 40 (block c = 2, one free slot beside the forced block 2): blocks 0 and 1
    compete. Equal scores → either pick agrees; a clear gap → only the higher one does."""
    t = torch.tensor([40])
    ours, theirs = torch.tensor([[[0, 2, -1, -1]]]), torch.tensor([[[1, 2, -1, -1]]])
    tied = torch.tensor([[[0.5, 0.5 + 1e-6, 3.0]]])
    gap = torch.tensor([[[0.5, 0.9, 3.0]]])
    assert not same_up_to_near_ties(ours, theirs, tied, t, 16, 1)
    assert same_up_to_near_ties(ours, theirs, gap, t, 16, 1)
    # A forced (local) block missing is never a tie, whatever the scores.
    no_local = torch.tensor([[[0, 1, -1, -1]]])
    assert same_up_to_near_ties(no_local, ours, tied, t, 16, 1)


def test_route_and_experts_match_transformers_modules() -> None:
    config = transformers.MiniMaxM3VLTextConfig(
        hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
        swiglu_limit=1.0, num_hidden_layers=1,
    )
    torch.manual_seed(0)
    router, experts = modeling.MiniMaxM3VLTopKRouter(config), modeling.MiniMaxM3VLExperts(config)
    for p in (router.weight, experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(p, std=0.5)
    router.e_score_correction_bias.copy_(torch.randn(8))
    x = torch.randn(20, 32)
    _, weights, ids = router(x)
    logits = torch.nn.functional.linear(x, router.weight)
    ours_w, ours_ids = moe.route(logits, router.e_score_correction_bias, 2)
    order, ours_order = ids.sort(-1), ours_ids.sort(-1)
    assert torch.equal(order.values, ours_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ours_w.gather(1, ours_order.indices))
    torch.testing.assert_close(ours_w.sum(-1), torch.ones(20))
    with torch.no_grad():
        expected = experts(x, ids, weights)
    got = moe.experts(x, experts.gate_up_proj.data, experts.down_proj.data, ours_ids, ours_w,
                      config.swiglu_alpha, config.swiglu_limit)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # The bias only chooses: a bias that flips the choice leaves weights as plain sigmoids.
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    w, chosen = moe.route(logits, torch.tensor([0.0, 0.0, 5.0]), 2)
    assert sorted(chosen[0].tolist()) == [0, 2]
    s = torch.sigmoid(torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(w[0].sort().values, (s / s.sum()).sort().values)


def test_rms_norm_scales_by_one_plus_weight() -> None:
    norm = modeling.MiniMaxM3VLRMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(m3_rms_norm(x, norm.weight, 1e-6), norm(x))
    zero = torch.zeros(8)
    unit = m3_rms_norm(x.float(), zero, 1e-6).norm(dim=-1)
    torch.testing.assert_close(unit, torch.full((3,), math.sqrt(8)))
