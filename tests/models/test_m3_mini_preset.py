"""The `m3-mini` preset: MiniMax-M3's text model at its real widths, read through the registry as a
checkpoint's config.json is, and (scaled down) built and run on the CPU."""

import json

import pytest
import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.models.loader import load_model
from msaserve.models.minimax_m3.config import M3Config
from msaserve.models.minimax_m3.model import M3ForCausalLM
from msaserve.models.presets import M3_MINI_LAYERS, M3_MINI_SMALL, get_preset, preset_config_json
from msaserve.models.registry import architecture_of, read_config_json


def test_m3_mini_has_the_real_widths_and_pattern() -> None:
    config = get_preset("m3-mini")
    assert isinstance(config, M3Config) and config.num_layers == M3_MINI_LAYERS == 4
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (6144, 64, 4, 128)
    assert (config.index_head_dim, config.page_size, config.top_k, config.n_init, config.n_local) == (
        128, 128, 16, 0, 1)
    assert (config.num_experts, config.num_experts_per_tok, config.intermediate_size) == (128, 4, 3072)
    assert (config.shared_intermediate_size, config.dense_intermediate_size) == (3072, 12288)
    assert config.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    assert set(config.layer_types) == {"minimax_m3_sparse"} and config.vocab_size == 200064
    assert get_preset("m3-mini", num_hidden_layers=8).mlp_layer_types == ("dense",) + ("sparse",) * 7


def test_m3_mini_reads_as_a_checkpoint_config(tmp_path) -> None:
    """The preset's config.json written to a directory is recognised and parsed by the registry
    into the very config get_preset returns."""
    (tmp_path / "config.json").write_text(json.dumps(preset_config_json("m3-mini", num_hidden_layers=3)))
    architecture = architecture_of(tmp_path)
    assert architecture.name == "minimax_m3"
    assert architecture.parse_config(read_config_json(tmp_path)) == get_preset("m3-mini", num_hidden_layers=3)


def test_m3_mini_parameter_shapes_on_meta() -> None:
    with torch.device("meta"):
        model = M3ForCausalLM(get_preset("m3-mini"))
    experts = model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (128, 2 * 3072, 6144)
    assert experts.down_proj.shape == (128, 6144, 3072)
    assert model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 12288, 6144)
    assert model.layers[0].self_attn.indexer.k_proj.weight.shape == (128, 6144)


def test_m3_mini_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="dense_mlp_layers=5 is invalid"):
        get_preset("m3-mini", dense_mlp_layers=5)
    with pytest.raises(ValueError, match="m3-mini"):
        get_preset("m3-huge")


def test_small_m3_mini_loads_and_generates() -> None:
    """Scaled down: random weights (zero norm weights: M3 scales by 1 + w), a forward through the
    engine with MSA (prompt longer than top_k × block, so the selection is sparse) and dense."""
    loaded = load_model("m3-mini", attention_backend="naive", progress=False, **M3_MINI_SMALL)
    model = loaded.model
    assert isinstance(model, M3ForCausalLM)
    assert all(not layer.input_layernorm.weight.detach().any() for layer in model.layers)
    assert float(model.layers[1].mlp.experts.gate_up_proj.detach().std()) == pytest.approx(0.02, rel=0.05)
    again = load_model("m3-mini", attention_backend="naive", progress=False, **M3_MINI_SMALL).model
    assert torch.equal(again.layers[2].mlp.experts.down_proj, model.layers[2].mlp.experts.down_proj)
    prompt = torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens = {}
    for backend in ("naive", "dense"):
        model.attention_backend = backend
        engine = LLMEngine(EngineConfig(model="m3-mini", attention_backend=backend, num_pages=64,
                                        max_model_len=512, max_num_batched_tokens=64), model=model,
                           tokenizer=loaded.tokenizer)
        engine.add_request(GenerateRequest("r", prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                                       ignore_eos=True)))
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.token_ids]
        tokens[backend] = out
    assert len(tokens["naive"]) == len(tokens["dense"]) == 4
