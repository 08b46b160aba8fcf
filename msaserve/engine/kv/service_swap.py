"""The engine's swap protocol (`msaserve.engine.kv.swap.SwapStore`) served by the KV cache service.

    client = KVCacheClient.connect(service_config, identity_for(model.config, name, kv_dtype))
    engine = LLMEngine(config, model, tokenizer, page_store=ServiceSwapStore(client))

A preempted sequence's pages (full and partial) are swap data private to this replica: they are
stored under synthetic page hashes `xxh3("swap", replica nonce, key, i)`, pinned until `pop` or
`delete` (so LRU never drops swap data that the engine will ask for), and removed after. Their
bytes go through the same checksummed tiers as every page; a corrupt page raises `PageLost`
rather than resuming from bad K/V.
"""

import uuid

import torch
import xxhash

from msaserve.engine.kv.adoption import PageLost
from msaserve.engine.kv.pages import PageCodec
from msaserve.kvcache.client import CapacityError, KVCacheClient

PageData = dict[str, torch.Tensor]
"""As in msaserve.engine.kv.swap: "k", "v" [L, n, P, Hkv, D]; "index" [L, n, P, HkI, DI];
optionally "index_scale" [L, n, P, HkI]."""


class ServiceSwapStore:
    """Implements `msaserve.engine.kv.swap.SwapStore` (put / pop / delete) over a KVCacheClient."""

    def __init__(self, client: KVCacheClient) -> None:
        self.client = client
        self.codec = PageCodec(client.model)
        self.nonce = uuid.uuid4().hex  # two replicas may swap the same request id
        self._swapped: dict[str, list[int]] = {}  # key → page hashes in the service
        self.bytes_stored = 0

    def _hashes(self, key: str, num_pages: int) -> list[int]:
        return [xxhash.xxh3_64_intdigest(f"swap/{self.nonce}/{key}/{i}".encode()) for i in range(num_pages)]

    def put(self, key: str, data: PageData) -> bool:
        """Store a sequence's pages; False when the service has no room (the engine recomputes)."""
        self.delete(key)
        num_layers, num_pages = data["k"].shape[:2]
        scale = data.get("index_scale")
        pages = self.codec.encode(
            k=[data["k"][layer] for layer in range(num_layers)],
            v=[data["v"][layer] for layer in range(num_layers)],
            index=data["index"].transpose(0, 1),  # [n, L, P, HkI, DI]
            index_scale=None if scale is None else scale.transpose(0, 1),
        )
        hashes = self._hashes(key, num_pages)
        try:
            self.bytes_stored += self.client.put_pages(
                [(h, kv, ix) for h, (kv, ix) in zip(hashes, pages, strict=True)], pin=True
            )
        except CapacityError:
            self.client.delete_pages(hashes)  # drop the part that fitted, and its pins
            return False
        self._swapped[key] = hashes
        return True

    def pop(self, key: str) -> PageData:
        """The pages put under `key` (host tensors), removed from the service."""
        hashes = self._swapped[key]
        num_layers = self.client.model.num_layers
        index_payloads = self.client.get_index(hashes)
        kv_payloads = self.client.get_kv([(h, layer) for layer in range(num_layers) for h in hashes])
        lost = sum(p is None for p in index_payloads) + sum(p is None for p in kv_payloads)
        if lost:
            raise PageLost(f"swap {key!r}: {lost} of its page payloads are missing or corrupt in the KV "
                           "cache service; the sequence must be recomputed")
        n = len(hashes)
        kv = [self.codec.decode_kv(kv_payloads[layer * n : (layer + 1) * n]) for layer in range(num_layers)]
        index, scale = self.codec.decode_index(index_payloads)  # [n, L, ...]
        data = {
            "k": torch.stack([layer[:, 0] for layer in kv]),  # [L, n, P, Hkv, D]
            "v": torch.stack([layer[:, 1] for layer in kv]),
            "index": index.transpose(0, 1).contiguous(),
        }
        if scale is not None:
            data["index_scale"] = scale.transpose(0, 1).contiguous()
        self.delete(key)
        return data

    def delete(self, key: str) -> None:
        hashes = self._swapped.pop(key, None)
        if hashes:
            self.client.delete_pages(hashes)

    def __len__(self) -> int:
        return len(self._swapped)

    def __bool__(self) -> bool:
        # An empty store is still a store: LLMEngine picks `page_store or HostSwapStore(...)`.
        return True
