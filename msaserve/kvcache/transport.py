"""How the client reaches its shards: Ray actors (the service), or shard objects in this process.

`RayTransport` is what replicas use. `LocalTransport` runs `KVCacheShard` objects in the client's
process, one worker thread per shard (one call at a time, as an actor does): for single-process
tools and for machines without Ray (the GPU benchmark can run either way). Both give futures that
`gather` resolves in order; a shard that cannot answer raises `ServiceUnavailable`.
"""

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol


class ServiceUnavailable(RuntimeError):
    """A shard did not answer (its actor died or is restarting): treat its pages as missing."""


class Transport(Protocol):
    shares_memory: bool
    """Whether shards run in the caller's process (a call may then fill the caller's buffers)."""

    def submit(self, shard: Any, method: str, *args: Any) -> Any:
        """Start `shard.method(*args)`; returns a future."""
        ...

    def gather(self, futures: Sequence[Any], timeout_s: float | None = None) -> list[Any]: ...

    def all_done(self, futures: Sequence[Any]) -> bool: ...


class RayTransport:
    shares_memory = False

    def submit(self, shard: Any, method: str, *args: Any) -> Any:
        return getattr(shard, method).remote(*args)

    def gather(self, futures: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
        import ray

        try:
            return ray.get(list(futures), timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise ServiceUnavailable(f"a KV cache shard did not answer: {e}") from e

    def all_done(self, futures: Sequence[Any]) -> bool:
        import ray

        ready, _ = ray.wait(list(futures), num_returns=len(futures), timeout=0, fetch_local=False)
        return len(ready) == len(futures)


class LocalTransport:
    """Shards are `KVCacheShard` objects; each runs calls on its own single worker thread."""

    shares_memory = True

    def __init__(self, shards: Sequence[Any]) -> None:
        self._workers = {id(s): ThreadPoolExecutor(1, thread_name_prefix=f"kvcache-shard-{i}")
                         for i, s in enumerate(shards)}

    def submit(self, shard: Any, method: str, *args: Any) -> Future:
        return self._workers[id(shard)].submit(getattr(shard, method), *args)

    def gather(self, futures: Sequence[Future], timeout_s: float | None = None) -> list[Any]:
        return [f.result(timeout=timeout_s) for f in futures]

    def all_done(self, futures: Sequence[Future]) -> bool:
        return all(f.done() for f in futures)

    def close(self) -> None:
        for worker in self._workers.values():
            worker.shutdown(wait=True)
