"""MSAConfig validation, HF config.json mapping and presets."""

import json

import pytest
from pydantic import ValidationError

from msaserve.models.config import MSAConfig
from msaserve.models.presets import PRESETS, get_preset


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"num_heads": 0}, "num_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"num_kv_heads": 3}, "num_kv_heads"),  # does not divide 4
        ({"num_index_heads": 3}, "num_index_heads"),
        ({"n_init": 4}, "n_init"),  # must be < top_k = 4
        ({"page_size": 0}, "page_size"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"index_source": "values"}, "index_source"),
        ({"eos_token_id": 512}, "eos_token_id"),  # vocab_size is 512
        ({"index_source": "keys", "num_index_heads": 1}, "num_index_heads"),
        ({"index_source": "keys", "num_index_heads": 2, "index_head_dim": 32}, "index_head_dim"),
    ],
)
def test_invalid_config_error_names_field(override: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        get_preset("tiny", **override)
    assert field in str(info.value)


def test_config_is_frozen() -> None:
    config = get_preset("tiny")
    with pytest.raises(ValidationError):
        config.num_layers = 3  # type: ignore[misc]


def test_from_json_maps_hf_names_and_msa_section(tmp_path) -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 256, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 5e5},
        "tie_word_embeddings": True, "eos_token_id": 2,
        "msa": {"index_source": "keys", "num_index_heads": 2, "index_head_dim": 16, "page_size": 64,
                "top_k": 8, "n_init": 2},
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = MSAConfig.from_json(tmp_path)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (3, 8, 2, 16)
    assert (config.rope_theta, config.page_size, config.top_k, config.n_init) == (5e5, 64, 8, 2)
    assert config.index_source == "keys" and config.tie_word_embeddings
    assert MSAConfig.from_hf_dict(config.to_hf_dict()) == config


def test_presets() -> None:
    tiny = get_preset("tiny")
    assert tiny.page_size * tiny.top_k == 64 and tiny.index_source == "learned"
    proxy = get_preset("m3-proxy", num_layers=2)
    assert (proxy.num_heads, proxy.num_kv_heads, proxy.head_dim) == (64, 4, 128)
    assert (proxy.num_index_heads, proxy.index_head_dim, proxy.page_size, proxy.top_k) == (1, 128, 128, 16)
    assert (proxy.hidden_size, proxy.intermediate_size, proxy.n_init) == (6144, 8192, 1)
    with pytest.raises(ValueError, match="num_layers"):
        get_preset("m3-proxy")
    with pytest.raises(ValueError, match="tiny"):
        get_preset("huge")
    assert set(PRESETS) == {"tiny", "m3-proxy"}


def test_m3_proxy_attention_shapes() -> None:
    """Built on the meta device: the shapes only, no memory."""
    import torch

    from msaserve.models.transformer import MSATransformer

    with torch.device("meta"):
        model = MSATransformer(get_preset("m3-proxy", num_layers=2))
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (64 * 128, 6144) and attn.k_proj.weight.shape == (4 * 128, 6144)
    assert attn.index_q_proj.weight.shape == (4 * 128, 6144)  # one index query per KV group
    assert attn.index_k_proj.weight.shape == (128, 6144)  # one shared index-K head
    assert model.layers[0].mlp.gate_proj.weight.shape == (8192, 6144) and len(model.layers) == 2
