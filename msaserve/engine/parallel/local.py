"""A group of one rank that runs in the driver's own process: `WorkerGroup`'s calls (`call_all`,
`call_one`, `ranks`, `full_config`, `tokenizer`, `shutdown`) made directly on a `RankWorker`, no
Ray and no broadcast. It drives the group path where Ray is absent (the H200 image: the benchmark
of the group's own cost) and in tests; `serialize=True` pickles every call's arguments and result
as Ray's transport would, so that cost is counted too."""

import pickle
from typing import Any

from msaserve.engine.parallel.worker import RankWorker


class LocalGroup:
    def __init__(self, worker: RankWorker, info: dict, serialize: bool = False) -> None:
        """worker: joined (`join`) and holding its model (`take_model`, whose result is `info`)."""
        if worker.layout.world_size != 1:
            raise ValueError(f"LocalGroup world_size={worker.layout.world_size} is invalid: allowed 1 "
                             "(a group of several ranks runs on Ray: WorkerGroup)")
        self.worker, self.ranks, self.serialize = worker, [info], serialize
        self.world_size = 1
        self.full_config, self.tokenizer = worker.describe()

    def _call(self, method: str, args: tuple) -> Any:
        if self.serialize:
            args = pickle.loads(pickle.dumps(args))
        result = getattr(self.worker, method)(*args)
        return pickle.loads(pickle.dumps(result)) if self.serialize else result

    def call_all(self, method: str, *args: Any) -> list[Any]:
        return [self._call(method, args)]

    def call_one(self, rank: int, method: str, *args: Any) -> Any:
        if rank != 0:
            raise ValueError(f"LocalGroup.call_one rank={rank} is invalid: allowed 0")
        return self._call(method, args)

    def shutdown(self) -> None:
        self.worker.shutdown()
