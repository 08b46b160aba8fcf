"""Reading MiniMax-M3 config.json files: both forms, MiniMax's legacy names, and errors that name
the field, the value and what is allowed."""

import pytest
import torch
from m3_checkpoint import text_config_kwargs

from msaserve.models.fp8_blocks import dequantize_blocks, fp8_block_size, quantize_blocks
from msaserve.models.minimax_m3.config import m3_config_from_hf


def text_raw(**overrides) -> dict:
    return {"model_type": "minimax_m3_vl_text", **text_config_kwargs(**overrides)}


def test_text_and_vl_forms_give_the_same_text_config() -> None:
    text = text_raw()
    vl = {"model_type": "minimax_m3_vl", "text_config": text_raw(), "vision_config": {"hidden_size": 32},
          "image_token_index": 300, "video_token_index": 301}
    a, b = m3_config_from_hf(text), m3_config_from_hf(vl)
    assert a.model_dump(exclude={"image_token_id", "video_token_id", "vision_config"}) == \
        b.model_dump(exclude={"image_token_id", "video_token_id", "vision_config"})
    assert (b.image_token_id, b.video_token_id, b.has_vision, a.has_vision) == (300, 301, True, False)
    assert (a.page_size, a.top_k, a.n_init, a.n_local, a.num_index_heads) == (16, 4, 0, 1, 1)
    assert (a.rotary_dim, a.num_experts, a.intermediate_size, a.dense_intermediate_size) == (16, 8, 32, 96)


def test_legacy_minimax_names_are_read_as_transformers_reads_them() -> None:
    raw = text_raw(layer_types=None, mlp_layer_types=None)
    raw.update(
        sparse_attention_config={"sparse_num_index_heads": 2, "sparse_index_dim": 16, "sparse_block_size": 32,
                                 "sparse_topk_blocks": 8, "sparse_local_block": 2,
                                 "sparse_attention_freq": [0, 1, 1, 0]},
        moe_layer_freq=[1, 0, 1, 0], num_experts=8, eos_token_id=[257, 2],
    )
    raw.pop("num_local_experts")
    config = m3_config_from_hf(raw)
    sparse, full = "minimax_m3_sparse", "full_attention"
    assert config.layer_types == (full, sparse, sparse, full)
    assert config.mlp_layer_types == ("sparse", "dense", "sparse", "dense")
    assert (config.page_size, config.top_k, config.n_local) == (32, 8, 2)
    assert (config.eos_token_id, config.eos_token_ids) == (257, (257, 2))


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(index_n_heads=1), "index_n_heads=1 is not supported: allowed num_key_value_heads=2"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type='yarn' is not supported"),
    (dict(mlp_layer_types=["dense"]), "mlp_layer_types has 1 entries: allowed one per layer (4)"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 is invalid: allowed ≤ num_local_experts=8"),
    (dict(index_local_blocks=5), "n_local=5 is invalid: allowed 1 ≤ n_local ≤ top_k - n_init = 4"),
])
def test_invalid_configs_name_the_field(overrides, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        m3_config_from_hf(text_raw(**overrides))


def test_quantization_config() -> None:
    assert fp8_block_size({}) is None
    assert fp8_block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}) \
        == (128, 128)
    with pytest.raises(ValueError, match="quant_method='awq' is not supported: allowed 'fp8'"):
        fp8_block_size({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match=r"weight_block_size=\[128\] is invalid"):
        fp8_block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})


@pytest.mark.parametrize("shape", [(64, 96), (40, 50), (3, 64, 32)])
def test_block_dequantization_inverts_quantization_blockwise(shape) -> None:
    """Whole blocks (broadcast path) and ragged edges (repeat path) give the same per-block rule."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    pairs = [quantize_blocks(w, (16, 32)) for w in weight.reshape(-1, *shape[-2:])]
    q = torch.stack([p[0] for p in pairs]).view(shape)
    scale = torch.stack([p[1] for p in pairs]).view(*shape[:-2], *pairs[0][1].shape)
    out = dequantize_blocks(q, scale, (16, 32))
    for i in range(shape[-2]):
        for j in (0, shape[-1] - 1):
            expected = q[..., i, j].float() * scale[..., i // 16, j // 32]
            assert torch.equal(out[..., i, j], expected)
    assert float(((out - weight).abs() / weight.abs().amax()).max()) < 0.07  # e4m3: 3 mantissa bits
