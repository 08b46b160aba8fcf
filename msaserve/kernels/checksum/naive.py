"""The spec: xxHash's own XXH3-64 (seed 0) of each row, computed on the host by the `xxhash` package;
and the page check of `verify_pages` on the host, over the bytes read at each page's address."""

import ctypes

import numpy as np
import torch
import xxhash


def xxh3_64_rows_naive(rows: torch.Tensor) -> torch.Tensor:
    """rows [N, L] uint8 → [N] int64 holding each row's xxh3_64 bits (on rows' device)."""
    host = rows.detach().cpu().contiguous().numpy()
    digests = np.array([xxhash.xxh3_64_intdigest(row) for row in host], dtype=np.uint64)
    return torch.from_numpy(digests.view(np.int64)).to(rows.device)


def check_pages_args(base: torch.Tensor, byte_offsets: torch.Tensor, expected: torch.Tensor,
                     verified: torch.Tensor, failures: torch.Tensor, pages: torch.Tensor,
                     wanted: torch.Tensor, page_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks `verify_pages` makes of its arguments (shapes, dtypes, one device) → pages and
    wanted flattened, contiguous."""
    n = byte_offsets.shape[0] if byte_offsets.dim() == 1 else -1
    for name, t, dtype in (("byte_offsets", byte_offsets, torch.int64), ("expected", expected, torch.int64),
                           ("verified", verified, torch.uint8)):
        if t.dtype != dtype or t.dim() != 1 or t.shape[0] != n or not t.is_contiguous():
            raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}: allowed a contiguous {dtype} "
                             f"[N] tensor, N the length of byte_offsets ({n if n >= 0 else 'not 1-D'})")
    if failures.dtype != torch.int64 or failures.shape != (2,) or not failures.is_contiguous():
        raise ValueError(f"failures is {failures.dtype} {tuple(failures.shape)}: allowed a contiguous "
                         "int64 tensor [2]")
    for name, t in (("pages", pages), ("wanted", wanted)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} is {t.dtype}: allowed int64 (or int32)")
    if pages.numel() != wanted.numel():
        raise ValueError(f"pages {tuple(pages.shape)} and wanted {tuple(wanted.shape)}: allowed the same "
                         "number of entries")
    if not isinstance(page_bytes, int) or page_bytes <= 0:
        raise ValueError(f"page_bytes is {page_bytes!r}: allowed a positive int")
    device = verified.device
    for name, t in (("base", base), ("byte_offsets", byte_offsets), ("expected", expected),
                    ("failures", failures), ("pages", pages), ("wanted", wanted)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}: allowed verified's device {device}")
    return pages.reshape(-1).contiguous(), wanted.reshape(-1).contiguous()


def verify_pages_naive(base: torch.Tensor, byte_offsets: torch.Tensor, expected: torch.Tensor,
                       verified: torch.Tensor, failures: torch.Tensor, pages: torch.Tensor,
                       wanted: torch.Tensor, page_bytes: int) -> None:
    """`verify_pages` on the host (CPU tensors; base's address a host one): entries in order, each
    page read at base.data_ptr() + byte_offsets[page] and hashed by `xxhash`. A page out of range
    raises before any is checked (the kernel cannot tell without a host sync; here it would be a
    wild read)."""
    pages, wanted = check_pages_args(base, byte_offsets, expected, verified, failures, pages, wanted,
                                     page_bytes)
    if verified.device.type != "cpu":
        raise ValueError(f"the tensors are on {verified.device}: the naive page check reads host memory "
                         "only; allowed CPU tensors")
    address, n = base.data_ptr(), byte_offsets.numel()
    named = pages[(wanted >= 0) & (pages >= 0)]
    if named.numel() and int(named.max()) >= n:
        raise ValueError(f"pages holds page {int(named.max())}: allowed -1 or 0 ≤ page < {n} (the length "
                         "of byte_offsets)")
    digests = expected.numpy().view(np.uint64)
    for page, slot in zip(pages.tolist(), wanted.tolist(), strict=True):
        if slot < 0 or page < 0 or verified[page]:
            continue
        data = (ctypes.c_uint8 * page_bytes).from_address(address + int(byte_offsets[page]))
        if xxhash.xxh3_64_intdigest(memoryview(data)) == int(digests[page]):
            verified[page] = 1
        else:
            failures[0] += 1
            failures[1] = page
