"""Ray resources of a model replica that spans several ranks (engine.tensor_parallel_size ×
engine.expert_parallel_size > 1): Serve starts the replica in a placement group whose bundle 0 is
the driver (the replica actor: it schedules and holds no GPU) and bundles 1..N one rank each (a
GPU and a CPU; a CPU on CPU runs), packed as engine.placement_strategy says (STRICT_PACK: one
node). The ranks' actors take those bundles (msaserve/engine/parallel/group.py)."""

from typing import Any

from msaserve.platform.config import ServeConfig


def replica_ranks(config: ServeConfig) -> int:
    return config.engine.tensor_parallel_size * config.engine.expert_parallel_size


def model_deployment_options(config: ServeConfig) -> dict[str, Any]:
    """`Deployment.options(...)` of the model deployment, with the rank bundles when N > 1."""
    options = config.deployments.model.to_serve_options()
    ranks = replica_ranks(config)
    if ranks == 1:
        return options
    actor = options["ray_actor_options"]
    actor["num_gpus"] = 0.0  # cluster_problems refuses a config that asks otherwise
    driver: dict[str, float] = {"CPU": actor.get("num_cpus", 1.0), **actor.get("resources", {})}
    if actor.get("memory"):
        driver["memory"] = float(actor["memory"])
    rank = {"GPU": 1.0, "CPU": 1.0} if config.model.device == "cuda" else {"CPU": 1.0}
    options["placement_group_bundles"] = [driver] + [dict(rank) for _ in range(ranks)]
    options["placement_group_strategy"] = config.engine.placement_strategy
    return options
