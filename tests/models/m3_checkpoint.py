"""Tiny MiniMax-M3 checkpoints built with transformers (the oracle), shared by the M3 tests
(text, vision, serving): random config, random weights, save_pretrained, a byte-level tokenizer
with a MiniMax-style chat template (transformers ships no M3 template), block-fp8 variants.

    directory, oracle = write_m3_checkpoint(tmp_path / "m3", vl=True)

`oracle` is the transformers model in fp32 eval mode holding the very weights written.
"""

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from msaserve.models.fp8_blocks import quantize_blocks
from msaserve.models.tokenizer import bytes_to_unicode

VOCAB_SIZE = 320
BOS, EOS, ROLE = 256, 257, 258
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 300, 301
SPECIALS = {
    BOS: "]~!b[", EOS: "[e~[", ROLE: "]~b]", 259: "<minimax:tool_call>", 260: "</minimax:tool_call>",
    IMAGE_TOKEN_ID: "]<]image[>[", VIDEO_TOKEN_ID: "]<]video[>[",
}
# MiniMax-M2/M3 style: ]~!b[ then ]~b]role\n...[e~[\n per message; tools in the system message;
# calls as <minimax:tool_call><invoke name=...><parameter name=...>value</parameter></invoke>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}]~b]system\nYou may call these tools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "To call a tool, write:\n<minimax:tool_call>\n<invoke name=\"NAME\">\n"
    "<parameter name=\"ARG\">VALUE</parameter>\n</invoke>\n</minimax:tool_call>[e~[\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}]~b]ai\n"
    "{% if message.get('content') %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}<minimax:tool_call>\n"
    "<invoke name=\"{{ call['function']['name'] }}\">\n"
    "{% set args = call['function']['arguments'] %}"
    "{% if args is mapping %}{% for key, value in args.items() %}"
    "<parameter name=\"{{ key }}\">{{ value if value is string else value | tojson }}</parameter>\n"
    "{% endfor %}{% else %}{{ args }}\n{% endif %}</invoke>\n</minimax:tool_call>{% endfor %}[e~[\n"
    "{% elif message['role'] == 'tool' %}]~b]tool\n<response>{{ message['content'] }}</response>[e~[\n"
    "{% else %}]~b]{{ message['role'] }}\n"
    "{{ message['content'] if message['content'] is string else '' }}[e~[\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n{% endif %}"
)


@pytest.fixture(scope="module", autouse=False)
def one_cpu_thread():
    """Tiny models are all small ops: one thread is ~10× faster than two on a shared, loaded CPU.
    Test modules use it with `from m3_checkpoint import one_cpu_thread` + `pytestmark`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def text_config_kwargs(**overrides: Any) -> dict[str, Any]:
    """4 layers: full/sparse attention × dense/sparse MLP; 8 experts top-2; index block 16,
    top-k 4, local 1; partial rotary (16 of head_dim 32); clamps that bite (swiglu_limit 1.5)."""
    kwargs = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16,
        dense_intermediate_size=96, shared_intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, index_n_heads=2, index_head_dim=16, index_block_size=16,
        index_topk_blocks=4, index_local_blocks=1, routed_scaling_factor=2.0, swiglu_limit=1.5,
        layer_types=["minimax_m3_sparse", "full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"], bos_token_id=BOS, eos_token_id=EOS,
        pad_token_id=0, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    kwargs.update(overrides)
    return kwargs


def vision_config_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    kwargs.update(overrides)
    return kwargs


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of a trained model's scale: matrices N(0, 1/fan_in), norms' weights U(-0.5, 0.5)
    (M3 scales by 1 + weight), correction biases N(0, 0.1) — so every path matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.copy_(torch.rand(param.shape, generator=generator) - 0.5)
            elif param.dim() == 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1]))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)


def write_m3_checkpoint(
    directory: Path, *, vl: bool = False, seed: int = 0, max_shard_size: str = "60KB",
    text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None,
) -> tuple[Path, torch.nn.Module]:
    """Save a tiny random M3 (VL wrapper when `vl`, else the text-only form) in shards, with
    tokenizer files → (directory, the transformers model in fp32 eval mode, eager attention)."""
    import transformers

    text_kwargs = text_config_kwargs(**(text or {}))
    if vl:
        config = transformers.MiniMaxM3VLConfig(
            text_config=text_kwargs, vision_config=vision_config_kwargs(**(vision or {})),
            image_token_index=IMAGE_TOKEN_ID, video_token_index=VIDEO_TOKEN_ID,
            projector_hidden_size=64,
        )
        cls = transformers.MiniMaxM3SparseForConditionalGeneration
    else:
        config = transformers.MiniMaxM3VLTextConfig(**text_kwargs)
        cls = transformers.MiniMaxM3VLForCausalLM
    config._attn_implementation = "eager"
    model = cls(config).eval()
    randomize(model, seed)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    write_tokenizer(directory)
    return directory, model


def write_tokenizer(directory: Path) -> Tokenizer:
    """tokenizer.json (bytes as ids 0–255, the specials above, no merges) and tokenizer_config.json
    with CHAT_TEMPLATE."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab.update({token: i for i, token in SPECIALS.items()})
    vocab.update({f"<unused_{i}>": i for i in range(VOCAB_SIZE) if i not in vocab.values()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS.values()])
    backend.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[BOS], "eos_token": SPECIALS[EOS],
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return backend


def quantize_checkpoint(
    source: Path, target: Path, block: tuple[int, int] = (16, 16)
) -> dict[str, torch.Tensor]:
    """Copy `source` to `target` with every 2-D projection weight of the text model (not
    embeddings, LM head, router, norms) stored as block fp8 + `weight_scale_inv`, and the
    quantization_config transformers/DeepSeek/MiniMax write → {name: the dequantized weight}."""
    target.mkdir(parents=True, exist_ok=True)
    raw = json.loads((source / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (target / "config.json").write_text(json.dumps(raw, indent=2))
    dequantized: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name)
                if _quantized(name, tensor):
                    q, scale = quantize_blocks(tensor, block)
                    tensors[name], tensors[name + "_scale_inv"] = q, scale
                    rows = scale.repeat_interleave(block[0], 0)[: tensor.shape[0]]
                    dequantized[name] = q.float() * rows.repeat_interleave(block[1], 1)[:, : tensor.shape[1]]
                else:
                    tensors[name] = tensor
        save_file(tensors, str(target / shard.name), metadata={"format": "pt"})
        weight_map.update({name: shard.name for name in tensors})
    index = {"metadata": {}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).is_file():
            (target / name).write_text((source / name).read_text())
    return dequantized


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    skip = ("embed_tokens", "lm_head", "norm", ".gate.weight", "vision_tower", "projector", "patch_merge")
    if tensor.dim() != 2 or any(part in name for part in skip):
        return False
    return name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))
