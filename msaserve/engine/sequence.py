"""One request's state inside the engine: its tokens, its pages and how far it has been computed."""

import enum
from dataclasses import dataclass, field

import torch

from msaserve.engine.media import MediaPrompt
from msaserve.engine.types import FinishReason, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    """Queued; no pages (or only the prefix-cache pages it may reuse when admitted)."""
    RUNNING = "running"
    """Holds pages; prefilling in chunks or decoding."""
    SWAPPED = "swapped"
    """Preempted: its pages' contents wait in the swap store, its GPU pages are free."""
    RESIDENT = "resident"
    """Decoding sparse-resident (`engine/kv/resident_lane.py`): no pool pages; its index and a working
    set of its K/V on the device, every page's K/V in host memory."""
    FINISHED = "finished"


@dataclass
class Sequence:
    """Token ids are the prompt followed by the output so far.

    Invariant: tokens `[0, num_computed_tokens)` have K/V/index-K in the pages of `block_table`;
    the next step computes tokens `[num_computed_tokens, len(token_ids))` (a prefill chunk or the
    one token sampled last).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_time: float
    generator: torch.Generator | None = None
    enable_prefix_caching: bool = True
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    """Physical page of each logical page. Changed only by appending in place or by assigning a new
    list (never an item set or removed in place): `step_inputs.TableMirror` relies on it."""
    table_mirror: object | None = field(default=None, repr=False, compare=False)
    """The block table as numpy for the step inputs (`step_inputs.table_array`)."""
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose pages came from the prefix cache on admission."""
    page_hashes: list[int] = field(default_factory=list)
    """Chained hashes of the full pages computed so far (registered in the prefix cache)."""
    swapped_pages: int = 0
    """Pages whose contents sit in the swap store while SWAPPED."""
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    media: MediaPrompt | None = None
    """Images/videos whose (expanded) placeholders are in the prompt; None for text."""
    root_hash: int = 0
    """Parent hash of the first page (`GenerateRequest.cache_salt`): the tenant's chain root."""
    matcher: object | None = None
    """llguidance matcher of the request's grammar (`msaserve.engine.structured`), at the output so far."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def page_tokens(self, page: int, page_size: int) -> list[int]:
        return self.token_ids[page * page_size : (page + 1) * page_size]

    def page_media_hashes(self, page: int) -> list[int]:
        """Content hashes of the media with placeholders in `page` (folded into its page hash)."""
        return self.media.page_media_hashes(page) if self.media is not None else []
