"""The M3 vision tower + projector against transformers' (the oracle), loaded from the tensors a
`save_pretrained` checkpoint holds: fp32 embeddings within 1e-4 relative, for images of several
shapes and a video split into chunks of ≤ 4 temporal patches."""

import pytest
import torch
from safetensors.torch import load_file

from msaserve.models.minimax_m3.vision import M3VisionConfig, M3VisionTower, m3_vision_name, vision_positions

modeling = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
configuration = pytest.importorskip("transformers.models.minimax_m3_vl.configuration_minimax_m3_vl")

RELATIVE_TOLERANCE = 1e-4


def tiny_hf_config():
    text = dict(
        vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rotary_dim=8, dense_intermediate_size=64,
        shared_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, index_n_heads=2,
        index_head_dim=16, index_block_size=16, index_topk_blocks=4, bos_token_id=1, eos_token_id=2,
        layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse"],
    )  # fmt: skip
    # head_dim 80 / 2 = 40 rotates 2·3·6 = 36 channels and passes 4 through (as the real 80 → 78 + 2).
    vision = dict(hidden_size=80, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2)
    return configuration.MiniMaxM3VLConfig(
        text_config=text, vision_config=vision, projector_hidden_size=48,
        image_token_index=290, video_token_index=291,
    )  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = tiny_hf_config()
    model = modeling.MiniMaxM3SparseForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger than the init's 0.02 so attention and GELU are far from linear
        for name, param in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                param.normal_(0.0, 0.2 if param.ndim > 1 else 0.1)
    directory = tmp_path_factory.mktemp("m3")
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    ours = M3VisionTower(M3VisionConfig.from_hf(config.to_dict()))
    ours.load_hf_state_dict(tensors)
    return model, ours.eval(), tensors


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 4, 6)],
        [(1, 6, 4), (1, 2, 2), (1, 8, 10)],
        [(4, 4, 6), (2, 4, 6)],  # one video of 6 temporal patches in chunks of 4 + 2
    ],
    ids=["one-image", "three-images", "video-two-chunks"],
)
def test_embeddings_equal_transformers(checkpoint, grids):
    model, ours, _ = checkpoint
    n = sum(t * h * w for t, h, w in grids)
    patches = torch.randn(n, ours.config.patch_dim, generator=torch.Generator().manual_seed(n))
    grid_thw = torch.tensor(grids)
    with torch.no_grad():
        reference = torch.cat(model.model.get_image_features(patches, grid_thw).pooler_output)
        got = ours(patches, grids)
    assert got.shape == reference.shape == (n // 4, 64)
    assert _relative_error(got, reference) < RELATIVE_TOLERANCE


def test_chunks_attend_apart(checkpoint):
    """A video chunk's rows do not depend on another chunk's patches (attention stays in a chunk)."""
    _, ours, _ = checkpoint
    grids = [(2, 4, 4), (2, 4, 4)]
    patches = torch.randn(64, ours.config.patch_dim, generator=torch.Generator().manual_seed(1))
    changed = patches.clone()
    changed[32:] += 1.0
    with torch.no_grad():
        a, b = ours(patches, grids), ours(changed, grids)
        whole_a, whole_b = ours(patches, [(4, 4, 4)]), ours(changed, [(4, 4, 4)])
    assert torch.equal(a[:8], b[:8])
    assert not torch.allclose(whole_a[:8], whole_b[:8])


def test_positions_in_merge_block_order():
    # 1×2×4 grid, merge 2: blocks (rows 0-1, cols 0-1) then (rows 0-1, cols 2-3), row-major inside.
    got = vision_positions([(1, 2, 4)], 2).tolist()
    assert got == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1], [0, 0, 2], [0, 0, 3], [0, 1, 2], [0, 1, 3]]
    video = vision_positions([(2, 2, 2)], 2)
    assert video[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_checkpoint_names_map_both_ways(checkpoint):
    model, _, tensors = checkpoint
    disk = {m3_vision_name(k) for k in tensors} - {None}
    memory = {m3_vision_name(k) for k in model.state_dict()} - {None}
    assert disk == memory and len(disk) == 1 + 2 + 2 * 16 + 4 + 4  # embed, pre-norm, 2 layers, 2 MLPs
    assert m3_vision_name("model.language_model.embed_tokens.weight") is None


def test_missing_and_misshapen_tensors_are_named(checkpoint):
    _, ours, tensors = checkpoint
    partial = {k: v for k, v in tensors.items() if "layers.1.mlp.fc2.weight" not in k}
    with pytest.raises(ValueError, match=r"missing \['vision_model.encoder.layers.1.mlp.fc2.weight'\]"):
        M3VisionTower(ours.config).load_hf_state_dict(partial)
    bad = dict(tensors)
    bad["multi_modal_projector.linear_1.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"projector.linear_1.weight \(3, 3\) \(expected \(48, 80\)\)"):
        M3VisionTower(ours.config).load_hf_state_dict(bad)


def test_wrong_patches_shape_is_an_error(checkpoint):
    _, ours, _ = checkpoint
    with pytest.raises(ValueError, match="do not match grids"):
        ours(torch.zeros(10, ours.config.patch_dim), [(1, 4, 4)])
