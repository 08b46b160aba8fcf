"""The C kernel of the CPU MSA indexer's block-max scores: one (run of up to P queries, KV head)
per OpenMP task; each visible index-key block is transposed once and scored against the run's
queries, keeping only the per-block max, so the [Tq, Hkv, T] logits are never materialised.
`cpu.py` calls it and falls back to its PyTorch path where no C compiler is available.
"""

import ctypes

import torch

from msaserve.kernels import cpu_native

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>

/* Built with -ffast-math: no infinities, so a future block's score is the finite floor NEG. */
#define NEG (-1e30f)

/* q [rows, Hkv, DI] at positions first.. (ascending, consecutive); keys [T, HkI, DI];
   out [rows, Hkv, NB]: out[t, h, j] = max over p in block j, p <= t of <q[t, h], keys[p, h']>. */
void msa_block_scores(const float *q, const float *keys, float *out, int64_t rows, int64_t first,
                      int64_t hkv, int64_t hki, int64_t di, int64_t page, int64_t num_blocks, int threads) {
    const int64_t lead = first % page, groups = (lead + rows + page - 1) / page;
    #pragma omp parallel num_threads(threads)
    {
        float *kt = malloc(sizeof(float) * di * page), *s = malloc(sizeof(float) * page);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < groups * hkv; task++) {
            const int64_t grp = task / hkv, h = task % hkv, hk = hki == 1 ? 0 : h;
            int64_t r0 = grp * page - lead, r1 = r0 + page;
            if (r0 < 0) r0 = 0;
            if (r1 > rows) r1 = rows;
            const int64_t last_block = (first + r1 - 1) / page;
            for (int64_t r = r0; r < r1; r++)
                for (int64_t j = last_block + 1; j < num_blocks; j++)
                    out[(r * hkv + h) * num_blocks + j] = NEG;
            for (int64_t j = 0; j <= last_block; j++) {
                const float *kb = keys + (j * page * hki + hk) * di;
                int64_t avail = first + r1 - j * page;  /* keys of block j any row may see */
                if (avail > page) avail = page;
                for (int64_t p = 0; p < avail; p++)
                    for (int64_t i = 0; i < di; i++) kt[i * page + p] = kb[p * hki * di + i];
                for (int64_t r = r0; r < r1; r++) {
                    int64_t n = first + r - j * page + 1;
                    if (n > page) n = page;
                    float best = NEG;
                    if (n > 0) {
                        const float *qr = q + (r * hkv + h) * di;
                        for (int64_t p = 0; p < n; p++) s[p] = 0.0f;
                        for (int64_t i = 0; i < di; i++) {
                            const float qi = qr[i], *kti = kt + i * page;
                            #pragma omp simd
                            for (int64_t p = 0; p < n; p++) s[p] += qi * kti[p];
                        }
                        #pragma omp simd reduction(max:best)
                        for (int64_t p = 0; p < n; p++) best = s[p] > best ? s[p] : best;
                    }
                    out[(r * hkv + h) * num_blocks + j] = best;
                }
            }
        }
        free(kt); free(s);
    }
}
"""


def library() -> ctypes.CDLL | None:
    lib = cpu_native.load("msa_block_scores", SOURCE)
    if lib is not None and lib.msa_block_scores.argtypes is None:
        lib.msa_block_scores.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 7 + [ctypes.c_int]
        lib.msa_block_scores.restype = None
    return lib


def supported(q_index: torch.Tensor) -> bool:
    """CPU tensors with a built library: the kernel's domain (else the PyTorch path)."""
    return q_index.device.type == "cpu" and cpu_native.enabled() and library() is not None


def block_scores(q_index: torch.Tensor, keys: torch.Tensor, first: int, page_size: int) -> torch.Tensor:
    """q_index [Tq, Hkv, DI] at positions first..first+Tq-1; keys [T ≥ first + Tq, HkI, DI]
    → [Tq, Hkv, num_blocks] fp32 block-max scores, -inf for blocks wholly after the query."""
    lib = library()
    assert lib is not None, "block_scores called where supported() is False"
    rows, num_heads, index_dim = q_index.shape
    visible = first + rows
    num_blocks = (visible + page_size - 1) // page_size
    q = q_index.float().contiguous()
    keys = keys[:visible].float().contiguous()
    out = torch.empty(rows, num_heads, num_blocks, dtype=torch.float32)
    lib.msa_block_scores(q.data_ptr(), keys.data_ptr(), out.data_ptr(), rows, first, num_heads,
                         keys.shape[1], index_dim, page_size, num_blocks, torch.get_num_threads())
    return out.masked_fill_(out <= -1e30, float("-inf"))
