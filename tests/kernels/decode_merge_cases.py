"""Inputs and PyTorch statements of the decode ops' two merges, shared by the CPU interpreter tests
(test_kernels_decode_merges.py) and the GPU tests (tests/gpu/test_gpu_decode_merges.py). No tests here.

- split merge: top-K block ids per row over the splits' (value, id) candidates, value desc then id
  asc; empty slots (id ≥ EMPTY) and -inf values never chosen; stored ascending, -1 pad;
- LSE merge: out = Σ_k 2^(lse_k − max) · o_k / Σ_k 2^(lse_k − max) over the valid parts k.
All on the CPU; callers move the tensors where they test.
"""

import torch

EMPTY = 1 << 29  # EMPTY_ID_BASE of msaserve.kernels.triton_common


def candidates(batch: int, key_heads: int, splits: int, rows: int, kp: int, seed: int):
    """cand_val, cand_id [B, HkI, splits, pow2(rows, 16), KP] as the score kernel leaves them: ids
    distinct per row across splits, values from a few integers (many ties) with ±0.0 among them,
    ~20 % empty slots (id ≥ EMPTY, -inf), a few real -inf values and some wholly empty splits."""
    gen = torch.Generator().manual_seed(seed)
    nr = max(16, 1 << (rows - 1).bit_length())
    shape = (batch, key_heads, splits, nr, kp)
    vals = torch.randint(-3, 4, shape, generator=gen).float()
    vals = torch.where((vals == 0) & (torch.rand(shape, generator=gen) < 0.5), -0.0, vals)
    ids = torch.argsort(torch.rand(batch, key_heads, nr, splits * kp * 3, generator=gen), dim=-1)
    ids = ids[..., : splits * kp].view(batch, key_heads, nr, splits, kp).transpose(2, 3).to(torch.int32)
    empty = torch.rand(shape, generator=gen) < 0.2
    empty[:, :, splits // 2] = True  # an empty split
    slot = torch.arange(kp, dtype=torch.int32).expand(shape)
    ids = torch.where(empty, EMPTY + slot, ids).contiguous()
    vals = torch.where(empty | (torch.rand(shape, generator=gen) < 0.03), float("-inf"), vals).contiguous()
    return vals, ids


def selection_rule(vals: torch.Tensor, ids: torch.Tensor, num_q: int, hpk: int, top_k: int) -> torch.Tensor:
    """→ [B, Q, HkI·hpk, top_k] int32, what `merge_splits` must store (row r: query r // hpk, head
    r % hpk of its key head)."""
    batch, key_heads = vals.shape[:2]
    out = torch.full((batch, num_q, key_heads * hpk, top_k), -1, dtype=torch.int32)
    for b in range(batch):
        for hk in range(key_heads):
            for row in range(num_q * hpk):
                v, i = vals[b, hk, :, row].flatten().tolist(), ids[b, hk, :, row].flatten().tolist()
                real = sorted((-x, j) for x, j in zip(v, i, strict=True) if j < EMPTY and x > float("-inf"))
                chosen = sorted(j for _, j in real[:top_k])
                out[b, row // hpk, hk * hpk + row % hpk, : len(chosen)] = torch.tensor(chosen)
    return out


def partials(rows: int, parts: int, group: int, dim: int, dtype: torch.dtype, seed: int):
    """part_o [R, N, G, D], part_lse [R, N, G] (log2 units, some -inf: empty splits), valid [R, N]."""
    gen = torch.Generator().manual_seed(seed)
    part_o = torch.randn(rows, parts, group, dim, generator=gen).to(dtype)
    part_lse = torch.randn(rows, parts, group, generator=gen) * 4
    part_lse[torch.rand(rows, parts, group, generator=gen) < 0.2] = float("-inf")
    valid = torch.where(torch.rand(rows, parts, generator=gen) < 0.25, -1, 3).to(torch.int32)
    return part_o, part_lse, valid


def lse_merge_formula(part_o, part_lse, valid, heads_per_row: int) -> torch.Tensor:
    """→ [R // H, H·G, D] fp32 (in fp64 first), what `lse_merge` must store; parts with valid < 0 skipped."""
    lse = part_lse if valid is None else part_lse.masked_fill((valid < 0)[..., None], float("-inf"))
    m = lse.amax(1, keepdim=True)
    weight = torch.exp2(lse - m.nan_to_num(neginf=0.0))  # [R, N, G]
    denom = weight.sum(1)
    result = (part_o.double() * weight.double()[..., None]).sum(1)
    result = result / denom.clamp_min(1e-30).double()[..., None]
    rows, _, group, dim = part_o.shape
    return result.float().reshape(rows // heads_per_row, heads_per_row * group, dim)
