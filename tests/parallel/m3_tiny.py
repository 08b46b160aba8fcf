"""A tiny random MiniMax-M3 for the multi-rank tests, built without transformers (fast): the same
shape as tests/models/m3_checkpoint.py's (4 layers: sparse/full attention × dense/MoE MLPs, 8
experts top-2, Hq 4, Hkv 2, index block 16, top-k 4), written as a checkpoint directory when the
test needs the real loading path (Ray workers load it by path)."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from msaserve.models.minimax_m3.config import TEXT_MODEL_TYPE, m3_config_from_hf
from msaserve.models.minimax_m3.model import M3ForCausalLM

VOCAB = 320
TINY_M3: dict = dict(
    model_type=TEXT_MODEL_TYPE, vocab_size=VOCAB, hidden_size=64, intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    dense_intermediate_size=96, shared_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
    index_n_heads=2, index_head_dim=16, index_block_size=16, index_topk_blocks=4, index_local_blocks=1,
    routed_scaling_factor=2.0, swiglu_limit=1.5,
    layer_types=["minimax_m3_sparse", "full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
    mlp_layer_types=["dense", "sparse", "sparse", "dense"], bos_token_id=256, eos_token_id=257,
    pad_token_id=0, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def random_m3(seed: int = 0, backend: str = "naive") -> M3ForCausalLM:
    """The tiny M3 in fp32 with weights drawn from `seed` (the same on every rank)."""
    config = m3_config_from_hf(TINY_M3)
    generator = torch.Generator().manual_seed(seed)
    model = M3ForCausalLM(config, backend)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                param.copy_(0.01 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    return model.eval()


def write_m3_directory(directory: Path, seed: int = 0) -> Path:
    """config.json + model.safetensors of `random_m3(seed)` in transformers' text-model names."""
    directory.mkdir(parents=True, exist_ok=True)
    model = random_m3(seed)
    tensors = {("lm_head.weight" if name == "lm_head.weight" else f"model.{name}"): t.contiguous()
               for name, t in model.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(TINY_M3))
    return directory


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (length,), generator=generator).tolist()
