"""A decode round's tokens as the device produces them.

`ModelRunner.queue_decode_round` queues `steps` greedy decode steps at once, each step's argmax the next
one's input on the device. On CUDA each step's tokens are copied to pinned host memory behind it,
with an event, so the engine can hand out step i's tokens while the device runs steps i+1… (the
host's work per token, its output and the stream to the client, overlaps the device's) instead
of waiting for the round's end and streaming its tokens in one burst.
"""

import torch


class RoundTokens:
    """Tokens [steps][B] of a decode round; `step(i)` waits for step i of it only."""

    def __init__(self, host: torch.Tensor, events: list[torch.cuda.Event] | None = None) -> None:
        """host [steps, B] int64: filled by the device behind `events` (one per step, CUDA), or
        already filled (events None)."""
        self._host = host
        self._events = events
        self.steps = int(host.shape[0])

    @classmethod
    def ready(cls, tokens: list[list[int]]) -> "RoundTokens":
        """A round whose tokens are on the host already (a multi-rank replica's rank 0 sends them)."""
        return cls(torch.tensor(tokens, dtype=torch.long).reshape(len(tokens), -1))

    @classmethod
    def record(cls, sampled: list[torch.Tensor]) -> "RoundTokens":
        """The round's per-step token tensors [B] (queued on the current stream, in order): on CUDA,
        each copied to pinned host memory behind an event; elsewhere they are computed already."""
        if not sampled:
            raise ValueError("a decode round has at least one step")
        if sampled[0].device.type != "cuda":
            return cls(torch.stack(sampled))
        host = torch.empty((len(sampled), sampled[0].shape[0]), dtype=torch.long, pin_memory=True)
        events = []
        for step, ids in enumerate(sampled):
            host[step].copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            events.append(event)
        return cls(host, events)

    def step(self, i: int) -> list[int]:
        """Step i's tokens [B], once the device has produced them."""
        if not 0 <= i < self.steps:
            raise IndexError(f"step {i} of a round of {self.steps} steps: allowed 0..{self.steps - 1}")
        if self._events is not None:
            self._events[i].synchronize()
        return self._host[i].tolist()

    def all(self) -> list[list[int]]:
        """Every step's tokens [steps][B] (waits for the round's end)."""
        if self._events:
            self._events[-1].synchronize()
        return self._host.tolist()
