"""The driver's side of a multi-rank replica: what `LLMEngine` holds instead of a `ModelRunner`.

The driver schedules as for one rank and builds each step's inputs in one flat host buffer
(`build_host_step`: numpy, the plain runner's own first stage; no torch here); `execute` sends it to
every rank as one `StepMessage` and gets rank 0's logits (or, for a step whose sampled rows are all
greedy, rank 0's argmax tokens: the logits stay on the device). Pages are reached through
`caches`, one `RemoteLayerCache` per layer whose tensors gather whole pages (every KV head, the
index once) from the ranks and scatter them back, so swapping, persisting sessions to the KV
cache service and the service prefix cache see the layout-free page of one rank.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.decode_round import RoundTokens
from msaserve.engine.parallel.errors import ReplicaGroupFailed
from msaserve.engine.parallel.messages import StepMessage
from msaserve.engine.scheduler import ScheduledBatch
from msaserve.engine.step_inputs import HostStep, build_host_step
from msaserve.kernels import AttentionOps, get_ops

if TYPE_CHECKING:  # the Ray group; the GPU benchmark drives a rank in-process through the same calls
    from msaserve.engine.parallel.group import WorkerGroup

_pointers = itertools.count(1)


class RemotePages:
    """One cache tensor of one layer, spread over the ranks: `pages[index]` gathers, and
    `pages[index] = value` scatters, whole pages [n, P, heads, D] (heads of all ranks)."""

    def __init__(self, runner: "GroupRunner", layer: int, name: str) -> None:
        self.runner, self.layer, self.name = runner, layer, name
        self.device = torch.device("cpu")
        self._pointer = next(_pointers)

    def data_ptr(self) -> int:  # a unique key per tensor, as the engine's page maps expect
        return self._pointer

    def __getitem__(self, pages: torch.Tensor) -> torch.Tensor:
        return self.runner.gather(self.layer, self.name, torch.as_tensor(pages, dtype=torch.long))

    def __setitem__(self, pages: torch.Tensor, value: torch.Tensor) -> None:
        self.runner.scatter(self.layer, self.name, torch.as_tensor(pages, dtype=torch.long), value)


@dataclass
class RemoteLayerCache:
    k_cache: RemotePages
    v_cache: RemotePages
    index_cache: RemotePages
    index_scale: RemotePages | None


class GroupModel:
    """What the driver's engine reads of the model: its (whole) config and backend. No weights."""

    def __init__(self, config, attention_backend: str) -> None:
        self.config = config
        self.attention_backend = attention_backend
        self.visual = None  # media are not sent to the ranks yet

    @property
    def dense_layers(self) -> tuple[int, ...]:
        kinds = getattr(self.config, "layer_types", ())
        return tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")


class GroupRunner:
    """ModelRunner's interface (execute, execute_decode_round, caches, num_pages, ...) over a group."""

    def __init__(self, group: "WorkerGroup", config: EngineConfig) -> None:
        self.group, self.config = group, config
        self.model = GroupModel(group.full_config, config.attention_backend)
        self.device = torch.device("cpu")  # the driver's: step inputs are built on the host
        # Only `ops.sparse` is read here (the ranks resolve their own ops): the CPU's ops say it.
        self.ops: AttentionOps = get_ops(config.attention_backend, torch.device("cpu"))
        self.page_size = group.full_config.page_size
        self.num_pages = min(r["num_pages"] for r in group.ranks)  # every rank holds these pages
        self.last_selections = None
        fp8 = group.ranks[0]["index_scale"]
        self.caches = [
            RemoteLayerCache(*(RemotePages(self, layer, n) for n in ("k_cache", "v_cache", "index_cache")),
                             RemotePages(self, layer, "index_scale") if fp8 else None)
            for layer in range(group.full_config.num_layers)
        ]
        # One rank per KV head for reading (the first that holds it); every rank for writing.
        self._readers: list[int] = []
        covered = 0
        for info in group.ranks:
            start, stop = info["kv_heads"]
            if start == covered:
                self._readers.append(info["rank"])
                covered = stop

    samples_greedy_on_ranks = True
    """`LLMEngine` may call `execute_greedy`: rank 0 samples greedy steps, only token ids travel."""

    def execute(self, batch: ScheduledBatch, record_selections: bool = False,
                ops_wrapper: Callable[[AttentionOps], AttentionOps] | None = None,
                ) -> tuple[HostStep, torch.Tensor]:
        """One step → (its inputs on the host, the sampled rows' logits [N, vocab] on the host)."""
        if ops_wrapper is not None or record_selections:
            raise ReplicaGroupFailed("a multi-rank replica cannot adopt sessions lazily or record MSA "
                                     "selections yet (its attention runs on the ranks)")
        step = build_host_step(batch, self.page_size)
        return step, self.group.call_all("execute", StepMessage(step))[0]

    def execute_greedy(self, batch: ScheduledBatch) -> tuple[HostStep, list[int]]:
        """One step whose sampled rows are all greedy without logprobs → (its inputs on the host,
        their tokens [N]): rank 0 takes the argmax on its device, so the logits never leave it."""
        step = build_host_step(batch, self.page_size)
        return step, self.group.call_all("execute", StepMessage(step, greedy=True))[0]

    def execute_decode_round(self, batch: ScheduledBatch, steps: int) -> RoundTokens:
        """The round on every rank; rank 0 sends its tokens once the round is done."""
        step = build_host_step(batch, self.page_size)
        return RoundTokens.ready(self.group.call_all("execute", StepMessage(step, decode_steps=steps))[0])

    def gather(self, layer: int, name: str, pages: torch.Tensor) -> torch.Tensor:
        if name.startswith("index"):  # the index-K head is on every rank: read it once
            return self.group.call_one(0, "read_pages", layer, name, pages)
        parts = [self.group.call_one(rank, "read_pages", layer, name, pages) for rank in self._readers]
        return torch.cat(parts, dim=2)  # [n, P, Hkv, D]

    def scatter(self, layer: int, name: str, pages: torch.Tensor, value: torch.Tensor) -> None:
        for info in self.group.ranks:
            part = value
            if not name.startswith("index"):
                start, stop = info["kv_heads"]
                part = value[:, :, start:stop]
            self.group.call_one(info["rank"], "write_pages", layer, name, pages, part.contiguous())

    @property
    def kv_cache_bytes(self) -> int:
        return 0  # on the ranks

    def shutdown(self) -> None:
        self.group.shutdown()
