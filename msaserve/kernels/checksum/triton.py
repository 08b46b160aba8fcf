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
i^1 swap a swap of the two vectors. The only order the row imposes is block after block.

The secret (XXH3's kSecret, 192 bytes, part of the format) is read as the little-endian 64-bit
words each step needs; the words and the primes travel to the kernel in one int64 tensor (Triton
has no unsigned 64-bit literals above 2^63), and every value is handled as uint64 inside.
"""

import functools

import numpy as np
import torch
import triton
import triton.language as tl

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
def _xxh3_rows_kernel(data_ptr, row_words, consts_ptr, out_ptr, full_blocks, last_stripes, last_word):
    row = tl.program_id(0)
    row_ptr = data_ptr + row.to(tl.int64) * row_words
    lanes = tl.arange(0, 4)
    stripes = tl.arange(0, 16)[:, None]
    keys_even = _u64(consts_ptr, C_STRIPE_KEYS + stripes * 8 + lanes[None, :] * 2)
    keys_odd = _u64(consts_ptr, C_STRIPE_KEYS + stripes * 8 + lanes[None, :] * 2 + 1)
    scramble_even = _u64(consts_ptr, C_SCRAMBLE + lanes * 2)
    scramble_odd = _u64(consts_ptr, C_SCRAMBLE + lanes * 2 + 1)
    prime32_1 = _u64(consts_ptr, C_PRIME32_1 + lanes * 0)
    acc_even = _u64(consts_ptr, C_INIT + lanes * 2)
    acc_odd = _u64(consts_ptr, C_INIT + lanes * 2 + 1)
    for block in range(full_blocks):
        to_even, to_odd = _stripes(row_ptr, block * 128, stripes, keys_even, keys_odd, 16)
        acc_even += to_even
        acc_odd += to_odd
        acc_even = (acc_even ^ (acc_even >> 47) ^ scramble_even) * prime32_1
        acc_odd = (acc_odd ^ (acc_odd >> 47) ^ scramble_odd) * prime32_1
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
    merged = merged ^ (merged >> 32)
    tl.store(out_ptr + row, merged.to(tl.int64, bitcast=True))


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
    full_blocks = (length - 1) // BLOCK
    last_stripes = ((length - 1) - BLOCK * full_blocks) // STRIPE
    _xxh3_rows_kernel[(n,)](words, rows.stride(0) // 8, _constants(rows.device, length), out,
                            full_blocks, last_stripes, (length - STRIPE) // 8, num_warps=1)
    return out
