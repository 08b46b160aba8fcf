"""`dense_layers` (MSAConfig): the listed layers attend densely under every backend (as MiniMax's
full-attention layers); the others select blocks. Checked on the tiny preset, long enough that
selection drops blocks (top_k=4 of P=16, 160 tokens = 10 blocks)."""

import pytest
import torch
from reference_decode import SequenceState

from msaserve.models.config import MSAConfig
from msaserve.models.loader import load_model

PROMPT = list(range(3, 163))


def _hidden(backend: str, dense_layers: tuple[int, ...], fused: bool = False) -> torch.Tensor:
    model = load_model("tiny", attention_backend=backend, progress=False, dense_layers=dense_layers).model
    if fused:
        model.fuse_projections()
    with torch.inference_mode():
        return SequenceState(model, len(PROMPT)).forward(PROMPT, 0)


def test_all_layers_dense_equals_the_dense_backend() -> None:
    dense = _hidden("dense", ())
    torch.testing.assert_close(_hidden("msa", (0, 1)), dense, rtol=1e-5, atol=1e-5)
    # Without dense layers the selection drops blocks, so the same check must fail (the test can fail).
    assert not torch.allclose(_hidden("msa", ()), dense, rtol=1e-5, atol=1e-5)


def test_one_dense_layer_differs_from_both() -> None:
    one = _hidden("msa", (0,))
    assert not torch.allclose(one, _hidden("msa", ()), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(one, _hidden("dense", ()), rtol=1e-5, atol=1e-5)


def test_model_reports_its_dense_layers() -> None:
    model = load_model("tiny", progress=False, dense_layers=(1, 0)).model
    assert model.dense_layers == (0, 1)
    assert [layer.self_attn.dense for layer in model.layers] == [True, True]


def test_dense_layers_round_trip_through_the_hf_dict() -> None:
    config = load_model("tiny", progress=False, dense_layers=(1,)).config
    raw = config.to_hf_dict()
    assert raw["msa"]["dense_layers"] == [1]
    assert MSAConfig.from_hf_dict(raw).dense_layers == (1,)


def test_dense_layer_outside_the_model_is_rejected() -> None:
    config = load_model("tiny", progress=False).config.model_dump()
    with pytest.raises(ValueError, match=r"dense_layers=\[0, 2\] is invalid: \[2\] outside .*0\.\.1"):
        MSAConfig(**{**config, "dense_layers": (0, 2)})


def test_dense_layers_with_fused_projections_project_no_index() -> None:
    """A dense layer's fused GEMM leaves out the index projections (it writes no index keys)."""
    model = load_model("tiny", progress=False, dense_layers=(0,)).model
    model.fuse_projections()
    sizes = [layer.self_attn._fused_sizes for layer in model.layers]
    assert len(sizes[0]) == 3 and len(sizes[1]) == 5
    torch.testing.assert_close(_hidden("msa", (0,), fused=True), _hidden("msa", (0,)), rtol=1e-5, atol=1e-5)
