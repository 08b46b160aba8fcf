"""Sharded safetensors round trip and load_model on a checkpoint directory."""

import json

import pytest
import torch
from reference_decode import generate

from msaserve.models.loader import load_model
from msaserve.models.presets import get_preset
from msaserve.models.safetensors_loader import INDEX_FILE, load_safetensors, save_safetensors
from msaserve.models.transformer import MSATransformer, init_random_weights


@pytest.mark.parametrize("tie", [False, True])
def test_sharded_round_trip(tmp_path, tie: bool) -> None:
    model = init_random_weights(MSATransformer(get_preset("tiny", tie_word_embeddings=tie)), seed=4).eval()
    paths = save_safetensors(model, tmp_path, max_shard_bytes=100_000)
    assert len(paths) > 2
    weight_map = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    assert "model.layers.0.self_attn.q_proj.weight" in weight_map
    assert "model.layers.1.self_attn.index_k_proj.weight" in weight_map
    assert "model.embed_tokens.weight" in weight_map and "model.norm.weight" in weight_map
    assert ("lm_head.weight" in weight_map) is (not tie)

    loaded, config = load_safetensors(tmp_path, progress=False)
    assert config == model.config
    for (name, ours), (name2, theirs) in zip(model.state_dict().items(), loaded.state_dict().items(),
                                             strict=True):
        assert name == name2
        torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
    ids = list(range(3, 90))
    assert generate(loaded, ids, 8) == generate(model, ids, 8)


def test_single_file_and_load_model(tmp_path) -> None:
    model = init_random_weights(MSATransformer(get_preset("tiny")), seed=5).eval()
    paths = save_safetensors(model, tmp_path)
    assert [p.name for p in paths] == ["model.safetensors"]
    loaded = load_model(str(tmp_path), attention_backend="dense", progress=False)
    assert loaded.model.attention_backend == "dense"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("héllo ✓")) == "héllo ✓"


def test_missing_weights_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_dict()))
    with pytest.raises(FileNotFoundError, match=INDEX_FILE):
        load_safetensors(tmp_path, progress=False)
