"""How many KV pages fit: one page holds P tokens of K, V *and* index-K (plus fp8 scales) in every
layer, so the index cache comes out of the same budget as the KV cache (docs/design.md §3)."""

import torch

from msaserve.engine.config import EngineConfig
from msaserve.models.cache import allocate_caches
from msaserve.models.config import MSAConfig

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_dtype(config: EngineConfig) -> torch.dtype:
    return _DTYPES[config.dtype]


def cache_dtypes(config: EngineConfig) -> tuple[torch.dtype, torch.dtype]:
    """(K/V dtype, index-K dtype) of the pool."""
    kv = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else model_dtype(config)
    index = {
        "auto": model_dtype(config), "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
    }[config.index_cache_dtype]
    return kv, index


def page_bytes(model_config: MSAConfig, kv_dtype: torch.dtype, index_dtype: torch.dtype) -> int:
    """Bytes of one physical page across all layers (K + V + index-K + scales)."""
    caches = allocate_caches(model_config, 1, "meta", kv_dtype, index_dtype)
    return sum(cache.page_bytes for cache in caches)


def plan_num_pages(
    model_config: MSAConfig,
    config: EngineConfig,
    device: torch.device,
    activation_bytes: int = 0,
) -> int:
    """Pages for the pool: `config.num_pages` if set; on GPU what fits in the free HBM share after
    weights and the profiled activation peak; on CPU `cpu_kv_cache_bytes`. Capped at what
    `max_num_seqs` sequences of `max_model_len` tokens could ever use."""
    if config.num_pages is not None:
        return config.num_pages
    per_page = page_bytes(model_config, *cache_dtypes(config))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1.0 - config.gpu_memory_utilization) * total - activation_bytes
    else:
        budget = config.cpu_kv_cache_bytes
    num_pages = int(budget // per_page)
    page_size = model_config.page_size
    ceiling = config.max_num_seqs * -(-config.max_model_len // page_size) + 1
    num_pages = min(num_pages, ceiling)
    if num_pages < 2:
        raise RuntimeError(
            f"no room for the KV cache: {budget / 2**30:.2f} GiB available for pages of "
            f"{per_page / 2**20:.2f} MiB; lower max_num_batched_tokens, use fp8 caches, or set num_pages"
        )
    return num_pages
