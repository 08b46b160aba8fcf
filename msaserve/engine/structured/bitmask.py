"""One token bitmask for the whole batch per step, and its application to the logits.

The bitmask is int32 [N, ceil(V / 32)] on the CPU: bit `t % 32` of word `t // 32` is 1 when token t
is allowed. llguidance fills every constrained row in one call (`LLExecutor`, its own threads, the
GIL released), so `fill_async` can run it while the model's forward pass runs.
"""

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

_BITS = torch.arange(32, dtype=torch.int32)


def allocate(num_rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [N, W] → bool [N, vocab_size], True where the token is allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1  # [N, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [N, V] fp32, in place: in each of `rows`, disallowed tokens become -inf.
    `bitmask[i]` is the mask of `rows[i]`."""
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    allowed = unpack(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_bitmask_naive(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The reference for `apply_bitmask`: token by token, bit by bit."""
    for i, row in enumerate(rows):
        for token in range(logits.shape[-1]):
            word = int(bitmask[i, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                logits[row, token] = float("-inf")


class BatchMasker:
    """Fills the bitmask of a step's constrained matchers, on a worker thread if asked."""

    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor(num_threads)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def fill(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """int32 [len(matchers), W]: row i is what matchers[i] allows next."""
        bitmask = allocate(len(matchers), self.vocab_size)
        if matchers:
            width = bitmask.shape[1]
            self.executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), width * 4, len(matchers)
            )
        return bitmask

    def fill_async(self, matchers: list[llguidance.LLMatcher]) -> "Future[torch.Tensor]":
        return self._pool.submit(self.fill, matchers)
