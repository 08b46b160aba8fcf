"""Payloads reach the device in chunks, in order and unchanged, whatever the chunk size."""

import numpy as np
import pytest
import torch

from msaserve.engine.kv.staging import to_device_chunks
from msaserve.kvcache.codec import copy_rows


@pytest.mark.parametrize("chunk_bytes", [64, 100, 1 << 20])
def test_chunks_cover_every_payload_in_order(chunk_bytes):
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, 48, dtype=np.uint8) for _ in range(7)]
    rows = []
    for start, chunk in to_device_chunks(payloads, 48, torch.device("cpu"), "index", "tiny", chunk_bytes):
        assert start == len(rows) and chunk.dtype == torch.uint8 and chunk.shape[1] == 48
        rows.extend(chunk.numpy())
    assert len(rows) == 7
    assert all(np.array_equal(a, b) for a, b in zip(payloads, rows, strict=True))


def test_a_payload_of_the_wrong_size_is_refused_by_name():
    payloads = [np.zeros(48, dtype=np.uint8), np.zeros(40, dtype=np.uint8)]
    with pytest.raises(ValueError, match="K\\+V payload has 40 bytes; the layout of tiny needs 48"):
        list(to_device_chunks(payloads, 48, torch.device("cpu"), "K+V", "tiny"))


def test_upload_ring_hands_out_its_buffers_round_robin_and_grows_for_a_large_row():
    from msaserve.engine.kv.staging import UploadRing

    ring = UploadRing(torch.device("cpu"), buffer_bytes=1024, count=3)
    assert ring.rows_per_buffer(100) == 10
    slots = []
    for value in range(4):
        slot, host = ring.acquire(10, 100)
        host[:] = value
        slots.append(slot)
        chunk = ring.upload(slot, 10, 100)
        assert chunk.shape == (10, 100) and bool((chunk == value).all())
    assert slots == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="11 rows of 100 bytes exceed the ring's 1024-byte buffers"):
        ring.acquire(11, 100)
    assert ring.rows_per_buffer(4096) == 1 and ring.buffer_bytes == 4096


def test_copy_rows_fills_every_destination_in_parallel_slices():
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, 256, (rows, 4096), dtype=np.uint8), np.zeros((rows, 4096), np.uint8))
             for rows in (1, 700, 2048)]  # 11 MiB in all: above the threshold for the copy threads
    copy_rows(pairs)
    for src, dst in pairs:
        np.testing.assert_array_equal(dst, src)
    small = [(np.arange(12, dtype=np.uint8).reshape(3, 4), np.zeros((3, 4), np.uint8))]
    copy_rows(small)
    np.testing.assert_array_equal(small[0][1], small[0][0])
    with pytest.raises(ValueError, match="differ"):
        copy_rows([(np.zeros((2, 4), np.uint8), np.zeros((3, 4), np.uint8))])


def test_pinned_staging_chunks_cover_every_payload_in_order():
    """The import path's chunking over its own two-buffer ring (on the CPU the ring hands out its
    host buffers themselves: each chunk is consumed before the next is packed, as imports do)."""
    from msaserve.engine.kv.staging import PinnedStaging

    rng = np.random.default_rng(1)
    payloads = [rng.integers(0, 256, 1000, dtype=np.uint8) for _ in range(37)]
    staging = PinnedStaging(torch.device("cpu"), chunk_bytes=4096)  # 4 rows per chunk
    got, starts = [], []
    for start, chunk in staging.upload(payloads, 1000):
        starts.append(start)
        got.append(chunk.clone())
    assert starts == list(range(0, 37, 4))
    np.testing.assert_array_equal(torch.cat(got).numpy(), np.stack(payloads))
    big = [rng.integers(0, 256, 5000, dtype=np.uint8) for _ in range(3)]  # a row above the buffer size
    np.testing.assert_array_equal(torch.cat([c.clone() for _, c in staging.upload(big, 5000)]).numpy(),
                                  np.stack(big))


def test_a_bare_cuda_device_names_the_current_one_so_both_spellings_compare_equal(monkeypatch):
    """A session built with device "cuda" and one given its tensors' `cuda:0` are the same device
    (`ResidentSession.mismatch` compares them this way: on an H100 the GPU test's adoption into an
    ended session was refused with device=cuda:0 against cuda before this)."""
    from msaserve.engine.kv.staging import indexed_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert indexed_device("cuda") == torch.device("cuda", 1) == indexed_device(torch.device("cuda:1"))
    assert indexed_device("cuda") != indexed_device("cuda:0")
    assert indexed_device("cpu") == torch.device("cpu")
