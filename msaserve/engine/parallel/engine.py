"""An `LLMEngine` whose steps run on a group of ranks (tensor_parallel_size × expert_parallel_size
> 1): the driver in the replica schedules, the ranks hold the weights and pages."""

from collections.abc import Callable

from msaserve.engine.config import EngineConfig
from msaserve.engine.kv.swap import SwapStore
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.parallel.group import WorkerGroup
from msaserve.engine.parallel.runner import GroupRunner


def group_llm_engine(config: EngineConfig, page_store: Callable[[object], SwapStore] | None = None
                     ) -> LLMEngine:
    """Start the ranks (blocking: every rank loads the model) and an engine driving them.
    page_store: built from the whole model's config (the KV cache service's swap store needs
    its page identity), None for host memory. A group of one rank is allowed (the benchmark of
    the group's own cost); serving uses it from 2 ranks (`platform/engine_factory.py`)."""
    group = WorkerGroup(config)
    try:
        runner = GroupRunner(group, config)
        store = None if page_store is None else page_store(runner.model.config)
        return LLMEngine(config, model=runner.model, tokenizer=group.tokenizer, page_store=store,
                         runner=runner)
    except BaseException:
        group.shutdown()
        raise
