"""Fused projections (`MSATransformer.fuse_projections`) and the fused layer ops leave a model's
outputs and caches as they were: the tiny preset, fp32, prefill + decode, both index sources."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from reference_decode import SequenceState, step_metadata
from test_kernels_layer_ops_cases import interpreted_triton_ops

from msaserve.kernels.layer_ops import LayerOps, get_layer_ops
from msaserve.models.loader import load_model

PROMPT = list(range(3, 90))  # 87 tokens: past K·P = 64, so MSA selects


def _model(index_source: str, backend: str = "msa"):
    overrides = {} if index_source == "learned" else dict(index_source="keys", num_index_heads=2,
                                                             index_head_dim=16)
    return load_model("tiny", attention_backend=backend, progress=False, seed=4, **overrides).model


@torch.inference_mode()
def _run(model, layer_ops: LayerOps, index_dtype: torch.dtype | None = None):
    """Prefill PROMPT in two chunks, then 3 decode steps → (hidden of every step, caches)."""
    state = SequenceState(model, len(PROMPT) + 8, index_dtype=index_dtype)
    hidden, start = [], 0
    for ids, decode in ((PROMPT[:50], False), (PROMPT[50:], False), ([7], True), ([8], True), ([9], True)):
        meta = step_metadata(start, len(ids), state.max_pages, model.config.page_size, decode, "cpu")
        hidden.append(model(torch.tensor(ids), meta, state.caches, layer_ops=layer_ops))
        start += len(ids)
    return hidden, state.caches


def _assert_same(a, b, atol: float) -> None:
    (hidden_a, caches_a), (hidden_b, caches_b) = a, b
    for x, y in zip(hidden_a, hidden_b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)
    for ca, cb in zip(caches_a, caches_b, strict=True):
        for name in ("k_cache", "v_cache", "index_cache", "index_scale"):
            want, got = getattr(ca, name), getattr(cb, name)
            if want is not None:
                torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("backend", ["msa", "dense"])
@pytest.mark.parametrize("index_source", ["learned", "keys"])
def test_fused_projections_keep_outputs_names_and_memory(index_source: str, backend: str) -> None:
    model = _model(index_source, backend)
    fused = copy.deepcopy(model)
    names = list(model.state_dict())
    numel = sum(p.numel() for p in model.parameters())
    fused.fuse_projections()
    assert list(fused.state_dict()) == names, "checkpoint names stay the same"
    assert sum(p.numel() for p in fused.parameters()) == numel
    attn = fused.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.fused_weight.data_ptr(), "weights are views, not copies"
    assert fused.layers[0].mlp.up_proj.weight.untyped_storage().data_ptr() == \
        fused.layers[0].mlp.gate_up_weight.untyped_storage().data_ptr()
    ops = get_layer_ops("cpu")
    _assert_same(_run(model, ops), _run(fused, ops), atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: tests/gpu runs the compiled kernels "
                    "in a model (re-importing them interpreted would replace the compiled ones)")
@pytest.mark.parametrize("index_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("index_source", ["learned", "keys"])
def test_triton_layer_ops_in_the_model_match_pytorch(index_source: str, index_dtype) -> None:
    """The interpreted kernels in a whole forward, fused projections included (as on CUDA)."""
    model = _model(index_source)
    fused = copy.deepcopy(model)
    fused.fuse_projections()
    want = _run(model, get_layer_ops("cpu"), index_dtype)
    got = _run(fused, interpreted_triton_ops(), index_dtype)
    _assert_same(want, got, atol=1e-4)
