"""Names of things in the service: the model a page belongs to, page keys, and shard routing.

A page is content-addressed by its chained page hash (`page_hash.py`), which names the tokens but
not the model, so every key also carries the model identity: two models never share a page.
"""

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import xxhash


class IncompatibleModel(ValueError):
    """A session or page written by another model or cache layout than the caller's."""


@dataclass(frozen=True)
class ModelIdentity:
    """What must match for KV pages to be reusable: weights and the exact cache layout."""

    name: str
    """Checkpoint identity (path or repo id, plus revision where known)."""
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    num_index_heads: int
    index_dim: int
    kv_dtype: str
    index_dtype: str

    @property
    def key(self) -> str:
        """16 hex digits naming this identity in page keys."""
        return xxhash.xxh3_64_hexdigest(json.dumps(asdict(self), sort_keys=True).encode())

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> "ModelIdentity":
        return cls(**data)  # type: ignore[arg-type]

    def check_compatible(self, other: "ModelIdentity", what: str) -> None:
        """Raise IncompatibleModel naming every field where `other` (the stored one) differs."""
        mine, theirs = asdict(self), asdict(other)
        diffs = [f"{k}: stored {theirs[k]!r}, this replica {mine[k]!r}" for k in mine if mine[k] != theirs[k]]
        if diffs:
            raise IncompatibleModel(f"{what} was written by an incompatible model ({'; '.join(diffs)})")


def kv_key(model_key: str, page_hash: int, layer: int) -> str:
    """Key of one page's K+V in one layer (the unit a sparse decode step fetches)."""
    return f"kv/{model_key}/{page_hash:016x}/{layer}"


def kv_keys(model_key: str, page_hashes: Sequence[int], num_layers: int) -> list[str]:
    """`kv_key` of every layer of each page, page-major (item i · num_layers + layer), each page's
    hash formatted once (a million-token session is 32K keys)."""
    return KV_GROUPS.join_all([kv_page_group(model_key, h) for h in page_hashes], num_layers)


PageGroup = tuple[str, int]
"""(namespace, page hash): the group of one page's K+V keys of every layer."""


def kv_page_group(model_key: str, page_hash: int) -> PageGroup:
    """The group of a page's K+V keys (`kv_key` of each layer): a memory tier with `KV_GROUPS` keeps
    where each layer of a page lies under it, so that a lease of many pages costs one lookup per
    page (`MemoryTier.acquire_groups`), no key string built, not one lookup per layer."""
    return (kv_namespace(model_key), page_hash)


def kv_namespace(model_key: str) -> str:
    """The part of a model's K+V keys before the page hash (a `PageGroup`'s namespace)."""
    return f"kv/{model_key}"


class PageKeyGroups:
    """Keys `{namespace}/{page hash:016x}/{member}` grouped by (namespace, page hash): `split` and
    `join` them (a key not of that form belongs to no group)."""

    @staticmethod
    def split(key: str) -> tuple[PageGroup, int] | None:
        parts = key.rsplit("/", 2)
        if len(parts) != 3 or len(parts[1]) != 16 or not parts[2].isdigit():
            return None
        try:
            return (parts[0], int(parts[1], 16)), int(parts[2])
        except ValueError:
            return None

    @staticmethod
    def join(group: PageGroup, member: int) -> str:
        return f"{group[0]}/{group[1]:016x}/{member}"

    @staticmethod
    def join_all(groups: Sequence[PageGroup], members: int) -> list[str]:
        """`join` of members 0..members-1 of each group, group-major."""
        suffixes = [f"/{member}" for member in range(members)]
        pages = ["%s/%016x" % group for group in groups]  # noqa: UP031 (faster than an f-string: 32K keys)
        return [page + suffix for page in pages for suffix in suffixes]


KV_GROUPS = PageKeyGroups()
"""The K/V store's grouping: a page's layers."""


class SingleKeyGroups:
    """Keys `{namespace}/{page hash:016x}` (one key per page: the index store's), each the only
    member (0) of its group (namespace, page hash): the index store's memory tier then keeps each
    page's arena slot under its group, and a lease of a million-token session's 8K index pages is
    one dictionary lookup per page and one numpy call (`PageStore.lease_groups`), no key string
    built."""

    @staticmethod
    def split(key: str) -> tuple[PageGroup, int] | None:
        parts = key.rsplit("/", 1)
        if len(parts) != 2 or len(parts[1]) != 16:
            return None
        try:
            return (parts[0], int(parts[1], 16)), 0
        except ValueError:
            return None

    @staticmethod
    def join(group: PageGroup, member: int) -> str:
        if member != 0:
            raise ValueError(f"member={member} is invalid: a page of one key has only member 0")
        return f"{group[0]}/{group[1]:016x}"

    @staticmethod
    def join_all(groups: Sequence[PageGroup], members: int) -> list[str]:
        if members != 1:
            raise ValueError(f"members={members} is invalid: a page of one key has 1 member")
        return ["%s/%016x" % group for group in groups]  # noqa: UP031 (faster than an f-string: 8K keys)


INDEX_GROUPS = SingleKeyGroups()
"""The index store's grouping: each page's single key."""

KeyGroups = PageKeyGroups | SingleKeyGroups
"""A store's grouping of its keys (`MemoryTier(groups=)`)."""


def index_key(model_key: str, page_hash: int) -> str:
    """Key of one page's index-K in every layer (the index is loaded whole, before any KV)."""
    return INDEX_GROUPS.join((index_namespace(model_key), page_hash), 0)


def index_namespace(model_key: str) -> str:
    """The part of a model's index keys before the page hash (its `INDEX_GROUPS` namespace)."""
    return f"ix/{model_key}"


def shard_of_page(page_hash: int, num_shards: int) -> int:
    return page_hash % num_shards


def shards_of_pages(page_hashes: Sequence[int], num_shards: int) -> np.ndarray:
    """`shard_of_page` of many hashes at once → int64 [n] (one numpy pass for 64-bit hashes)."""
    try:
        hashes = np.fromiter(page_hashes, np.uint64, len(page_hashes))
    except OverflowError:  # not unsigned 64-bit: one at a time
        return np.array([shard_of_page(h, num_shards) for h in page_hashes], np.int64)
    return (hashes % np.uint64(num_shards)).astype(np.int64)


def shard_of_session(session_id: str, num_shards: int) -> int:
    return xxhash.xxh3_64_intdigest(session_id.encode()) % num_shards
