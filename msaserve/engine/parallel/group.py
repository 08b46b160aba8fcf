"""The ranks of one replica: a Ray placement group with a bundle per rank (a GPU, or a CPU on CPU
runs), one `RankWorker` actor per bundle, joined in a torch.distributed group.

Inside a Serve replica started with placement-group bundles (`platform/model_placement.py`), the
workers take bundles 1..N of the replica's own group (bundle 0 is the driver's); elsewhere (tests,
benchmarks) the group reserves its own and removes it on shutdown.

Failure: every call waits at most `collective_timeout_s`. A rank that dies or stops answering
fails the group: all its actors are killed, its placement group (if its own) removed, and this and
every later call raise `ReplicaGroupFailed`, which names the rank and the cause. The workers'
collectives carry the same timeout, so the survivors never hang on a dead peer.
"""

import contextlib
import logging
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from msaserve.engine.config import EngineConfig
from msaserve.engine.parallel.errors import ReplicaGroupFailed
from msaserve.engine.parallel.messages import StepMessage
from msaserve.engine.parallel.worker import RankWorker

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 1800.0
"""Starting the ranks (actor start, joining the group, every rank loading its weights — minutes for
M3's 428 GB) may take this long; steps and page calls get `collective_timeout_s`."""


INLINE_BYTES = 64 << 10
"""Step messages up to this size go inline (under Ray's 100 KiB cap for inline arguments)."""


def _inline(arg: Any) -> bool:
    return isinstance(arg, StepMessage) and arg.nbytes <= INLINE_BYTES


def rank_bundle(config: EngineConfig) -> dict[str, float]:
    """What one rank reserves: a GPU (and a CPU to drive it), or a CPU on CPU runs."""
    return {"GPU": 1.0, "CPU": 1.0} if config.device.startswith("cuda") else {"CPU": 1.0}


class WorkerGroup:
    def __init__(self, config: EngineConfig) -> None:
        """Reserve the bundles, start the ranks, join them (blocking: loads the model on every rank)."""
        self.config = config
        self.world_size = config.world_size
        self.failure: str | None = None
        current = get_current_placement_group()
        self._own_group = current is None
        if current is None:
            current = placement_group([rank_bundle(config)] * self.world_size,
                                      strategy=config.placement_strategy)
            self._wait(current.ready(), "reserving the placement group", LOAD_TIMEOUT_S)
            first = 0
        else:
            first = 1  # bundle 0 holds the Serve replica (the driver)
        self.placement = current
        bundle = rank_bundle(config)
        actor = ray.remote(RankWorker)
        self.workers = [
            actor.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    current, placement_group_bundle_index=first + r),
            ).remote(config, r)
            for r in range(self.world_size)
        ]
        address = self._wait(self.workers[0].rendezvous_address.remote(), "starting rank 0", LOAD_TIMEOUT_S)
        setups = [w.setup.remote(address) for w in self.workers]
        self.ranks: list[dict[str, Any]] = self._wait(setups, "loading the ranks", LOAD_TIMEOUT_S)
        self.full_config, self.tokenizer = self.call_one(0, "describe")
        logger.info("replica group of %d ranks ready (%s)", self.world_size, config.placement_strategy)

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every rank → their results. A small step message (decode) travels
        inline in each call, Ray's direct path (a third faster than a put measured on the dev
        CPU); a large one (prefill chunks) goes into the object store once for all ranks."""
        self._check()
        refs = [a if _inline(a) else ray.put(a) for a in args]
        return self._wait([getattr(w, method).remote(*refs) for w in self.workers], method)

    def call_one(self, rank: int, method: str, *args: Any) -> Any:
        self._check()
        return self._wait(getattr(self.workers[rank], method).remote(*args), method)

    def _wait(self, refs, what: str, timeout_s: float | None = None):
        try:
            return ray.get(refs, timeout=self.config.collective_timeout_s if timeout_s is None else timeout_s)
        except Exception as error:  # RayActorError, GetTimeoutError, a rank's own exception
            self.fail(f"{what} failed on the replica's ranks: {type(error).__name__}: {error}")
            raise ReplicaGroupFailed(self.failure) from error

    def _check(self) -> None:
        if self.failure is not None:
            raise ReplicaGroupFailed(f"this multi-rank replica failed earlier: {self.failure}")

    def fail(self, reason: str) -> None:
        """Stop every rank (a survivor would wait on the dead one until its collective timed out)."""
        if self.failure is None:
            self.failure = reason[:2000]
            logger.error("replica group failed: %s", self.failure)
        self.shutdown()

    def shutdown(self) -> None:
        for worker in getattr(self, "workers", []):
            with contextlib.suppress(Exception):  # already gone
                ray.kill(worker, no_restart=True)
        self.workers = []
        if getattr(self, "_own_group", False) and getattr(self, "placement", None) is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement)
            self.placement = None
