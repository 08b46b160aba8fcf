"""XXH3-64 (seed 0, the default secret) of equal-length rows, one program per row, in Triton.

XXH3's long form (inputs over 240 bytes), for rows of whole 64-byte stripes:
- eight 64-bit accumulators start at fixed primes; the row is read in blocks of 16 stripes
  (1,024 bytes); every stripe adds, per lane i, the data word to lane i^1 and the product of the
  low and high halves of (data ^ secret word) to lane i; after each whole block but the last the
  accumulators are scrambled (xorshift 47, xor a secret word, multiply by PRIME32_1);
- the last, partial block's stripes, then the row's last stripe with the secret at offset 121;
- the digest folds the accumulator pairs with 128-bit products (built here from 32-bit halves)
  into len·PRIME64_1 and avalanches the sum.
Within a block the accumulators only add (mod 2^64), so the 16 stripes of a block are one tile
summed at once: the even lanes and the odd lanes are kept as two [4] vectors, which makes the
i^1 swap a swap of the two vectors. The only order the row imposes is block after block, and it
binds the accumulators, not the loads: a group of blocks is loaded as one tile (words read once, by
pairs, then split into the even and the odd ones), then added and scrambled one block after another.
A page read from pinned host memory over PCIe (`verify_pages`) pays the link's latency per round of
loads. Measured on the H200 (256 KiB pages through UVA): one block a round took 420 µs for one
page and reached 50 GB/s from 128 pages; groups of 4 at 2 warps take 160 µs for one page (165 µs
for 16) and reach 46 GB/s; groups of 8 took 120-140 µs for one page but fell to 29-36 GB/s for many
(more requests in flight than the link serves well). Rows in GPU memory (`xxh3_64_rows`, 2048 rows
of 128 KiB): 2.47 TB/s with groups of 4 at 1 warp, 1.84 TB/s one block a round with two loads.

The secret (XXH3's kSecret, 192 bytes, part of the format) is read as the little-endian 64-bit
words each step needs; the words and the primes travel to the kernel in one int64 tensor (Triton
has no unsigned 64-bit literals above 2^63), and every value is handled as uint64 inside.
"""

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from msaserve.kernels.checksum.naive import check_pages_args
from msaserve.kernels.triton_common import check

K_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
PRIME32_1, PRIME32_2, PRIME32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
PRIME64_1, PRIME64_2, PRIME64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
PRIME64_4, PRIME64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
AVALANCHE = 0x165667919E3779F9
STRIPE, BLOCK = 64, 1024  # bytes; 16 stripes per block with the 192-byte secret
GROUP, VERIFY_WARPS = 4, 2
"""Blocks `verify_pages` loads at once (a power of two: a tile dimension), and its warps."""
ROWS_GROUP, ROWS_WARPS = 4, 1
"""The same for `xxh3_64_rows` (rows in GPU memory)."""

# Layout of the constants tensor (int64 words, uint64 bits):
C_STRIPE_KEYS = tl.constexpr(0)  # [16 stripes × 8 lanes] secret words of each stripe of a block
C_SCRAMBLE = tl.constexpr(128)  # [8] secret words at byte 128 (scramble)
C_LAST = tl.constexpr(136)  # [8] secret words at byte 121 (the last stripe)
C_MERGE = tl.constexpr(144)  # [8] secret words at byte 11 (the final merge)
C_INIT = tl.constexpr(152)  # [8] the accumulators' initial values
C_PRIME32_1, C_AVALANCHE = tl.constexpr(160), tl.constexpr(161)
C_START = tl.constexpr(162)  # len · PRIME64_1 (mod 2^64)
C_SIZE = 163


def _words(offset: int, count: int) -> list[int]:
    return [int.from_bytes(K_SECRET[offset + 8 * i : offset + 8 * i + 8], "little") for i in range(count)]


@functools.cache
def _constants_host(row_bytes: int) -> np.ndarray:
    values = (
        [w for stripe in range(16) for w in _words(8 * stripe, 8)]
        + _words(len(K_SECRET) - STRIPE, 8)
        + _words(len(K_SECRET) - STRIPE - 7, 8)
        + _words(11, 8)
        + [PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1]
        + [PRIME32_1, AVALANCHE, (row_bytes * PRIME64_1) % (1 << 64)]
    )
    assert len(values) == C_SIZE
    return np.array(values, dtype=np.uint64).view(np.int64)


_DEVICE_CONSTANTS: dict[tuple[str, int], torch.Tensor] = {}


def _constants(device: torch.device, row_bytes: int) -> torch.Tensor:
    key = (str(device), row_bytes)
    if key not in _DEVICE_CONSTANTS:
        _DEVICE_CONSTANTS[key] = torch.from_numpy(_constants_host(row_bytes).copy()).to(device)
    return _DEVICE_CONSTANTS[key]


@triton.jit
def _u64(ptr, offsets):
    return tl.load(ptr + offsets).to(tl.uint64, bitcast=True)


@triton.jit
def _mul_fold(a, b):
    """(a·b) mod 2^64 xor (a·b) >> 64, from 32-bit halves (uint64 vectors)."""
    a_lo = (a << 32) >> 32
    a_hi = a >> 32
    b_lo = (b << 32) >> 32
    b_hi = b >> 32
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    hi_hi = a_hi * b_hi
    cross = (lo_lo >> 32) + ((hi_lo << 32) >> 32) + lo_hi
    upper = (hi_lo >> 32) + (cross >> 32) + hi_hi
    lower = (cross << 32) | ((lo_lo << 32) >> 32)
    return lower ^ upper


@triton.jit
def _stripes(row_ptr, word0, stripes, keys_even, keys_odd, count):
    """Sums over the first `count` stripes at word `word0` of one block: (to the even lanes, to the
    odd lanes) — the odd lanes' data plus the even lanes' products, and the converse."""
    valid = stripes < count  # [16, 1]
    even = tl.load(row_ptr + word0 + stripes * 8 + tl.arange(0, 4)[None, :] * 2, mask=valid, other=0)
    odd = tl.load(row_ptr + word0 + stripes * 8 + tl.arange(0, 4)[None, :] * 2 + 1, mask=valid, other=0)
    even = even.to(tl.uint64, bitcast=True)
    odd = odd.to(tl.uint64, bitcast=True)
    key_even = even ^ keys_even
    key_odd = odd ^ keys_odd
    prod_even = ((key_even << 32) >> 32) * (key_even >> 32)
    prod_odd = ((key_odd << 32) >> 32) * (key_odd >> 32)
    zero = tl.zeros_like(even)
    to_even = tl.sum(tl.where(valid, odd + prod_even, zero), axis=0)
    to_odd = tl.sum(tl.where(valid, even + prod_odd, zero), axis=0)
    return to_even, to_odd


@triton.jit
def _group_sums(row_ptr, block0, count, blocks, stripes, lanes, keys_even, keys_odd):
    """Sums of each of the blocks block0.. block0+GROUP-1 (the first `count` of them; the others 0),
    as `_stripes` makes them for one block: ([GROUP, 4] to the even lanes, [GROUP, 4] to the odd).
    The group is one load of [GROUP, 16, 4, 2] words, split into the even and the odd words: every
    load of the group is issued before any is used (reading pages over PCIe pays the link's latency
    once per group), and each word is read once, by contiguous pairs."""
    valid = blocks < count  # [GROUP, 1, 1]
    words = (block0 + blocks) * 128 + stripes * 8 + lanes * 2  # [GROUP, 16, 4]: the even words
    pair = tl.arange(0, 2)[None, None, None, :]
    data = tl.load(row_ptr + words[:, :, :, None] + pair, mask=valid[:, :, :, None], other=0)
    even, odd = tl.split(data.to(tl.uint64, bitcast=True))
    key_even = even ^ keys_even
    key_odd = odd ^ keys_odd
    prod_even = ((key_even << 32) >> 32) * (key_even >> 32)
    prod_odd = ((key_odd << 32) >> 32) * (key_odd >> 32)
    return tl.sum(odd + prod_even, axis=1), tl.sum(even + prod_odd, axis=1)


@triton.jit
def _accumulate_group(acc_even, acc_odd, sums_even, sums_odd, count, scramble_even, scramble_odd, prime32_1,
                      GROUP: tl.constexpr):
    """The accumulators after the first `count` blocks of a group, in order: add the block's sums,
    scramble. Adds within a block commute (mod 2^64), so this is the one-block-at-a-time sequence."""
    groups = tl.arange(0, GROUP)[:, None]  # [GROUP, 1]
    zero = tl.zeros_like(sums_even)
    for g in tl.static_range(GROUP):
        mixed_even = acc_even + tl.sum(tl.where(groups == g, sums_even, zero), axis=0)
        mixed_odd = acc_odd + tl.sum(tl.where(groups == g, sums_odd, zero), axis=0)
        mixed_even = (mixed_even ^ (mixed_even >> 47) ^ scramble_even) * prime32_1
        mixed_odd = (mixed_odd ^ (mixed_odd >> 47) ^ scramble_odd) * prime32_1
        acc_even = tl.where(g < count, mixed_even, acc_even)
        acc_odd = tl.where(g < count, mixed_odd, acc_odd)
    return acc_even, acc_odd


@triton.jit
def _xxh3_row(row_ptr, consts_ptr, full_blocks, last_stripes, last_word, GROUP: tl.constexpr):
    """The xxh3_64 of one row of 8-byte words at row_ptr (uint64 scalar): its whole blocks GROUP at
    a time (the last group masked), the partial last block, the last stripe, the merge."""
    lanes = tl.arange(0, 4)
    stripes = tl.arange(0, 16)[:, None]
    keys_even = _u64(consts_ptr, C_STRIPE_KEYS + stripes * 8 + lanes[None, :] * 2)
    keys_odd = _u64(consts_ptr, C_STRIPE_KEYS + stripes * 8 + lanes[None, :] * 2 + 1)
    scramble_even = _u64(consts_ptr, C_SCRAMBLE + lanes * 2)
    scramble_odd = _u64(consts_ptr, C_SCRAMBLE + lanes * 2 + 1)
    prime32_1 = _u64(consts_ptr, C_PRIME32_1 + lanes * 0)
    acc_even = _u64(consts_ptr, C_INIT + lanes * 2)
    acc_odd = _u64(consts_ptr, C_INIT + lanes * 2 + 1)
    blocks = tl.arange(0, GROUP)[:, None, None]
    stripes3 = tl.arange(0, 16)[None, :, None]
    lanes3 = lanes[None, None, :]
    keys_even3 = keys_even[None, :, :]
    keys_odd3 = keys_odd[None, :, :]
    whole_groups = full_blocks // GROUP
    for group in range(whole_groups):
        sums_even, sums_odd = _group_sums(row_ptr, group * GROUP, GROUP, blocks, stripes3, lanes3,
                                          keys_even3, keys_odd3)
        acc_even, acc_odd = _accumulate_group(acc_even, acc_odd, sums_even, sums_odd, GROUP, scramble_even,
                                              scramble_odd, prime32_1, GROUP)
    tail = full_blocks - whole_groups * GROUP
    if tail > 0:
        sums_even, sums_odd = _group_sums(row_ptr, whole_groups * GROUP, tail, blocks, stripes3, lanes3,
                                          keys_even3, keys_odd3)
        acc_even, acc_odd = _accumulate_group(acc_even, acc_odd, sums_even, sums_odd, tail, scramble_even,
                                              scramble_odd, prime32_1, GROUP)
    to_even, to_odd = _stripes(row_ptr, full_blocks * 128, stripes, keys_even, keys_odd, last_stripes)
    acc_even += to_even
    acc_odd += to_odd
    # The row's last stripe, with the secret at byte 121.
    even = _u64(row_ptr, last_word + lanes * 2)
    odd = _u64(row_ptr, last_word + lanes * 2 + 1)
    key_even = even ^ _u64(consts_ptr, C_LAST + lanes * 2)
    key_odd = odd ^ _u64(consts_ptr, C_LAST + lanes * 2 + 1)
    acc_even += odd + ((key_even << 32) >> 32) * (key_even >> 32)
    acc_odd += even + ((key_odd << 32) >> 32) * (key_odd >> 32)
    # Merge: len·PRIME64_1 + Σ fold(acc[2i] ^ s[2i], acc[2i+1] ^ s[2i+1]), then the avalanche.
    folded = _mul_fold(acc_even ^ _u64(consts_ptr, C_MERGE + lanes * 2),
                       acc_odd ^ _u64(consts_ptr, C_MERGE + lanes * 2 + 1))
    merged = tl.sum(folded, axis=0) + tl.load(consts_ptr + C_START).to(tl.uint64, bitcast=True)
    merged = merged ^ (merged >> 37)
    merged = merged * tl.load(consts_ptr + C_AVALANCHE).to(tl.uint64, bitcast=True)
    return merged ^ (merged >> 32)


@triton.jit
def _xxh3_rows_kernel(data_ptr, row_words, consts_ptr, out_ptr, full_blocks, last_stripes, last_word,
                      GROUP: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = data_ptr + row.to(tl.int64) * row_words
    digest = _xxh3_row(row_ptr, consts_ptr, full_blocks, last_stripes, last_word, GROUP)
    tl.store(out_ptr + row, digest.to(tl.int64, bitcast=True))


@triton.jit
def _verify_pages_kernel(base_words, byte_offsets, expected, verified, failures, pages, wanted, consts_ptr,
                         full_blocks, last_stripes, last_word, GROUP: tl.constexpr):
    """Program i: entry i's page, if it is wanted and not yet verified, hashed where it lies
    (base + byte_offsets[page]) and compared with its stored digest: verified[page] = 1 if equal,
    else failures[0] += 1 and failures[1] = page."""
    i = tl.program_id(0)
    page = tl.load(pages + i).to(tl.int64)
    named = (tl.load(wanted + i) >= 0) & (page >= 0)
    if tl.load(verified + page, mask=named, other=1) == 0:
        row_ptr = base_words + (tl.load(byte_offsets + page) >> 3)
        digest = _xxh3_row(row_ptr, consts_ptr, full_blocks, last_stripes, last_word, GROUP)
        if digest.to(tl.int64, bitcast=True) == tl.load(expected + page):
            tl.store(verified + page, 1)
        else:
            tl.atomic_add(failures, 1)
            tl.store(failures + 1, page)


def xxh3_64_rows_triton(rows: torch.Tensor) -> torch.Tensor:
    """rows [N, L] uint8 (L a multiple of 64, at least 256; rows 8-byte aligned) → [N] int64 bits."""
    check(rows.dim() == 2 and rows.dtype == torch.uint8, f"rows is {rows.dtype} {tuple(rows.shape)}: "
          "allowed a 2-D uint8 tensor")
    n, length = rows.shape
    check(length >= 256 and length % STRIPE == 0,
          f"row length {length} bytes: allowed a multiple of {STRIPE}, at least 256")
    rows = rows if rows.stride(1) == 1 and rows.stride(0) % 8 == 0 else rows.contiguous()
    if rows.data_ptr() % 8:
        rows = rows.clone()  # the kernel reads 8-byte words
    out = torch.empty(n, dtype=torch.int64, device=rows.device)
    if n == 0:
        return out
    words = rows.view(torch.int64)  # the same bytes as [N, L/8] little-endian words
    _xxh3_rows_kernel[(n,)](words, rows.stride(0) // 8, _constants(rows.device, length), out,
                            *_layout(length), GROUP=ROWS_GROUP, num_warps=ROWS_WARPS)
    return out


def _layout(length: int) -> tuple[int, int, int]:
    """(whole blocks before the last, stripes in the partial last block, word of the last stripe)."""
    full_blocks = (length - 1) // BLOCK
    last_stripes = ((length - 1) - BLOCK * full_blocks) // STRIPE
    return full_blocks, last_stripes, (length - STRIPE) // 8


def _word_view(base: torch.Tensor) -> torch.Tensor:
    """An int64 tensor at base's address, over the rest of base's storage (which it keeps alive):
    the kernel's pointer to base as 8-byte words, whatever base's dtype and shape. (Not an empty
    one: the data_ptr() of an empty tensor is 0.)"""
    storage = base.untyped_storage()
    start = base.storage_offset() * base.element_size()
    check(start % 8 == 0 and base.data_ptr() % 8 == 0, f"base is at address {base.data_ptr():#x} "
          f"(byte {start} of its storage): allowed 8-byte aligned")
    words = (storage.nbytes() - start) // 8
    check(words > 0, f"base has {storage.nbytes() - start} bytes of storage from its address: allowed "
          "at least 8")
    view = torch.empty(0, dtype=torch.int64, device=base.device)
    return view.set_(storage, start // 8, (words,), (1,))


def verify_pages_triton(base: torch.Tensor, byte_offsets: torch.Tensor, expected: torch.Tensor,
                        verified: torch.Tensor, failures: torch.Tensor, pages: torch.Tensor,
                        wanted: torch.Tensor, page_bytes: int) -> None:
    """See `verify_pages`; one program per entry of pages/wanted, no host sync. page_bytes a
    multiple of 64, at least 256; base 8-byte aligned, byte_offsets multiples of 8 (not checked
    here, on the device: a page at an offset that is not is read from the multiple of 8 below, so
    it fails its check)."""
    pages, wanted = check_pages_args(base, byte_offsets, expected, verified, failures, pages, wanted,
                                     page_bytes)
    check(page_bytes >= 256 and page_bytes % STRIPE == 0,
          f"page_bytes is {page_bytes}: allowed a multiple of {STRIPE}, at least 256")
    words = _word_view(base)
    if pages.numel() == 0:
        return
    _verify_pages_kernel[(pages.numel(),)](words, byte_offsets, expected, verified, failures, pages, wanted,
                                           _constants(verified.device, page_bytes), *_layout(page_bytes),
                                           GROUP=GROUP, num_warps=VERIFY_WARPS)
