"""One replica's engine from the ServeConfig: with the KV cache service behind it when enabled.

With `kvcache.enabled`, the replica attaches to (or starts) the service's shard actors — named,
detached Ray actors, so they outlive a replica and a redeploy — and the engine swaps preempted
sequences' pages into the service (`msaserve.engine.kv.service_swap.ServiceSwapStore`) instead of
host memory of its own.
"""

import logging

from msaserve.engine.async_engine import AsyncEngine
from msaserve.engine.config import EngineConfig
from msaserve.platform.config import ServeConfig

logger = logging.getLogger("ray.serve.msaserve.model")


def build_engine(config: ServeConfig, engine_config: EngineConfig) -> AsyncEngine:
    """Blocking (loads weights); the model deployment runs it in a thread."""
    if engine_config.world_size > 1:
        return AsyncEngine(engine_config, engine=_group_engine(config, engine_config))
    if not config.kvcache.enabled:
        return AsyncEngine(engine_config)
    from msaserve.engine.kv.pages import identity_for
    from msaserve.engine.kv.service_swap import ServiceSwapStore
    from msaserve.engine.llm_engine import LLMEngine, load_engine_model
    from msaserve.engine.memory import cache_dtypes
    from msaserve.kvcache.client import KVCacheClient, start_shards
    from msaserve.kvcache.config import ServiceConfig

    model, tokenizer = load_engine_model(engine_config)
    # Shared index arenas: an engine on the shards' node leases index pages in place (adoption).
    service = ServiceConfig.from_settings(config.kvcache, shared_index_arena=True)
    shards = start_shards(service, detached=True)
    kv_dtype, index_dtype = cache_dtypes(engine_config)
    identity = identity_for(model.config, config.model.resolved_name(), kv_dtype, index_dtype)
    page_store = ServiceSwapStore(KVCacheClient(shards, identity))
    logger.info("KV cache service attached: %d shard(s), %d bytes", service.num_shards, service.memory_bytes)
    return AsyncEngine(
        engine_config, engine=LLMEngine(engine_config, model, tokenizer, page_store=page_store)
    )


def _group_engine(config: ServeConfig, engine_config: EngineConfig):
    """A multi-rank replica (tensor/expert parallel): the ranks load the model, this process
    schedules; preempted pages go to the KV cache service when it is enabled."""
    from msaserve.engine.parallel.engine import group_llm_engine

    if not config.kvcache.enabled:
        return group_llm_engine(engine_config)
    from msaserve.engine.kv.pages import identity_for
    from msaserve.engine.kv.service_swap import ServiceSwapStore
    from msaserve.engine.memory import cache_dtypes
    from msaserve.kvcache.client import KVCacheClient, start_shards
    from msaserve.kvcache.config import ServiceConfig

    shards = start_shards(ServiceConfig.from_settings(config.kvcache, shared_index_arena=True), detached=True)
    kv_dtype, index_dtype = cache_dtypes(engine_config)

    def store(model_config) -> ServiceSwapStore:
        identity = identity_for(model_config, config.model.resolved_name(), kv_dtype, index_dtype)
        return ServiceSwapStore(KVCacheClient(shards, identity))

    return group_llm_engine(engine_config, page_store=store)
