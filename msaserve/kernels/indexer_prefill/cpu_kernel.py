"""The C kernel of the CPU MSA indexer's block-max scores: one (run of up to P queries, KV head)
per OpenMP task; each visible index-key block is transposed once and scored against the run's
queries, keeping only the per-block max, so the [Tq, Hkv, T] logits are never materialised.
`cpu.py` calls it and falls back to its PyTorch path where no C compiler is available.
"""

import ctypes

import torch

from msaserve.kernels import cpu_native

MAX_TOP_K = 4096
"""The most blocks msa_select_blocks selects (its candidate arrays live on the stack); MSAConfig caps top_k
at the same value."""

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>

/* Built with -ffast-math: no infinities, so a future block's score is the finite floor NEG. */
#define NEG (-1e30f)
#define MAX_TOP_K @MAX_TOP_K@  /* msa_select_blocks keeps its candidates on the stack */

/* 16 fp32 lanes (GCC vector extension: zmm with AVX-512, two ymm with AVX2, ...). */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* Scores of up to 4 query rows against 64 transposed keys kt[i * page + p] (p in 0..63): a 4 x 64
   register tile, DI rank-1 updates (4 key vectors loaded, 16 FMAs per step). out[r][p]. */
static void tile_4x64(const float *const qrow[4], const float *kt, int64_t page, int64_t di,
                      float out[4][64]) {
    v16 acc[4][4] = {{{0}}};
    for (int64_t i = 0; i < di; i++) {
        const v16 *k = (const v16 *)(kt + i * page);
        const v16 k0 = k[0], k1 = k[1], k2 = k[2], k3 = k[3];
        for (int r = 0; r < 4; r++) {
            const float b = qrow[r][i];
            acc[r][0] += b * k0; acc[r][1] += b * k1; acc[r][2] += b * k2; acc[r][3] += b * k3;
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < 4; v++) *(v16 *)(out[r] + 16 * v) = acc[r][v];
}

/* As msa_block_scores, for page % 64 == 0: the scores of a block come from 4 x 64 register tiles. */
static void block_scores_tiled(const float *q, const float *kt, float *out, int64_t r0, int64_t r1,
                               int64_t first, int64_t j, int64_t hkv, int64_t h, int64_t di, int64_t page,
                               int64_t num_blocks) {
    float s[4][64];
    for (int64_t r = r0; r < r1; r += 4) {
        const float *qrow[4];
        for (int t = 0; t < 4; t++) qrow[t] = q + ((r + t < r1 ? r + t : r1 - 1) * hkv + h) * di;
        float best[4] = {NEG, NEG, NEG, NEG};
        for (int64_t p0 = 0; p0 < page; p0 += 64) {
            if (first + r1 - 1 < j * page + p0) break;  /* no row of the tile sees these keys */
            tile_4x64(qrow, kt + p0, page, di, s);
            for (int t = 0; t < 4 && r + t < r1; t++) {
                int64_t n = first + r + t - j * page - p0 + 1;  /* keys at positions <= the row's */
                if (n > 64) n = 64;
                float b = best[t];
                #pragma omp simd reduction(max:b)
                for (int64_t p = 0; p < 64; p++) {
                    const float x = p < n ? s[t][p] : NEG;
                    b = x > b ? x : b;
                }
                best[t] = b;
            }
        }
        for (int t = 0; t < 4 && r + t < r1; t++) {
            const int64_t n = first + r + t - j * page + 1;
            out[((r + t) * hkv + h) * num_blocks + j] = n > 0 ? best[t] : NEG;
        }
    }
}

/* The query rows [r0, r1) of OpenMP task `task` (one run of up to `page` rows, one KV head `h`) and the
   last block any of them sees; the blocks past it get the floor NEG. */
static int64_t task_span(int64_t task, int64_t hkv, int64_t page, int64_t lead, int64_t rows, int64_t first,
                         int64_t num_blocks, float *out, int64_t *r0, int64_t *r1) {
    const int64_t grp = task / hkv, h = task % hkv;
    *r0 = grp * page - lead;
    *r1 = *r0 + page;
    if (*r0 < 0) *r0 = 0;
    if (*r1 > rows) *r1 = rows;
    const int64_t last_block = (first + *r1 - 1) / page;
    for (int64_t r = *r0; r < *r1; r++)
        for (int64_t j = last_block + 1; j < num_blocks; j++)
            out[(r * hkv + h) * num_blocks + j] = NEG;
    return last_block;
}

/* msa_block_scores for page % 64 == 0 with the keys already transposed per block:
   keys_t [HkI, num_blocks, DI, page] (zero past the last key), so no task transposes a block. */
void msa_block_scores_tiled(const float *q, const float *keys_t, float *out, int64_t rows, int64_t first,
                            int64_t hkv, int64_t hki, int64_t di, int64_t page, int64_t num_blocks,
                            int threads) {
    const int64_t lead = first % page, groups = (lead + rows + page - 1) / page;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < groups * hkv; task++) {
        const int64_t h = task % hkv, hk = hki == 1 ? 0 : h;
        int64_t r0, r1;
        const int64_t last_block = task_span(task, hkv, page, lead, rows, first, num_blocks, out, &r0, &r1);
        for (int64_t j = 0; j <= last_block; j++)
            block_scores_tiled(q, keys_t + (hk * num_blocks + j) * di * page, out, r0, r1, first, j, hkv, h,
                               di, page, num_blocks);
    }
}

/* The spec's select_blocks (naive.py) for rows at positions first.. : scores [rows, Hkv, NB] →
   out [rows, Hkv, top_k] int32 ascending, -1 pad. Block c = pos / page; c < top_k: all of 0..c;
   else the forced blocks (n_local ending at c, n_init leading) and the best free candidates
   (blocks < c not forced), ranked by score then lower id, kept in a small sorted array. */
void msa_select_blocks(const float *scores, int32_t *out, int64_t rows, int64_t first, int64_t hkv,
                       int64_t num_blocks, int64_t page, int64_t top_k, int64_t n_init, int64_t n_local,
                       int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < rows * hkv; task++) {
        const int64_t c = (first + task / hkv) / page;
        const float *s = scores + task * num_blocks;
        int32_t *o = out + task * top_k;
        int64_t n = 0;
        if (c < top_k) {
            for (int64_t j = 0; j <= c; j++) o[n++] = (int32_t)j;
        } else {
            const int64_t local_lo = c - n_local + 1 > 0 ? c - n_local + 1 : 0;
            for (int64_t j = 0; j < n_init && j < local_lo; j++) o[n++] = (int32_t)j;
            for (int64_t j = local_lo; j <= c; j++) o[n++] = (int32_t)j;
            const int64_t free = top_k - n;
            int32_t best[MAX_TOP_K];
            float best_s[MAX_TOP_K];
            int64_t kept = 0;
            for (int64_t j = n_init; j < local_lo; j++) {  /* ascending ids: ties keep the earlier */
                const float v = s[j];
                if (kept == free && !(v > best_s[kept - 1])) continue;
                int64_t at = kept < free ? kept++ : free - 1;
                while (at > 0 && v > best_s[at - 1]) {
                    best_s[at] = best_s[at - 1];
                    best[at] = best[at - 1];
                    at--;
                }
                best_s[at] = v;
                best[at] = (int32_t)j;
            }
            for (int64_t x = 0; x < kept; x++) o[n++] = best[x];
            for (int64_t a = 1; a < n; a++) {  /* ascending ids (n <= top_k, small) */
                const int32_t v = o[a];
                int64_t b = a;
                while (b > 0 && o[b - 1] > v) { o[b] = o[b - 1]; b--; }
                o[b] = v;
            }
        }
        for (int64_t x = n; x < top_k; x++) o[x] = -1;
    }
}

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
            const int64_t h = task % hkv, hk = hki == 1 ? 0 : h;
            int64_t r0, r1;
            const int64_t last_block = task_span(task, hkv, page, lead, rows, first, num_blocks, out,
                                                 &r0, &r1);
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
""".replace("@MAX_TOP_K@", str(MAX_TOP_K))


def library() -> ctypes.CDLL | None:
    lib = cpu_native.load("msa_block_scores", SOURCE)
    if lib is not None and lib.msa_block_scores.argtypes is None:
        for fn in (lib.msa_block_scores, lib.msa_block_scores_tiled):
            fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 7 + [ctypes.c_int]
            fn.restype = None
        lib.msa_select_blocks.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 8 + [ctypes.c_int]
        lib.msa_select_blocks.restype = None
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
    keys = keys[:visible].float()
    out = torch.empty(rows, num_heads, num_blocks, dtype=torch.float32)
    if page_size % 64 == 0:  # the register-tiled kernel, on keys transposed once per block here
        pad = torch.nn.functional.pad(keys, (0, 0, 0, 0, 0, num_blocks * page_size - visible))
        keys_t = pad.view(num_blocks, page_size, keys.shape[1], index_dim).permute(2, 0, 3, 1).contiguous()
        lib.msa_block_scores_tiled(q.data_ptr(), keys_t.data_ptr(), out.data_ptr(), rows, first, num_heads,
                                   keys.shape[1], index_dim, page_size, num_blocks, torch.get_num_threads())
        return out.masked_fill_(out <= -1e30, float("-inf"))
    keys = keys.contiguous()
    lib.msa_block_scores(q.data_ptr(), keys.data_ptr(), out.data_ptr(), rows, first, num_heads,
                         keys.shape[1], index_dim, page_size, num_blocks, torch.get_num_threads())
    return out.masked_fill_(out <= -1e30, float("-inf"))


def select_blocks(scores: torch.Tensor, first: int, page_size: int, top_k: int, n_init: int,
                  n_local: int) -> torch.Tensor:
    """As `naive.select_blocks` for rows at positions first.. (consecutive): scores [Tq, Hkv, NB]
    fp32 → [Tq, Hkv, top_k] int32, ascending, -1 pad."""
    lib = library()
    assert lib is not None, "select_blocks called where supported() is False"
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k={top_k} is invalid for the CPU kernel: allowed 1 to {MAX_TOP_K}")
    rows, num_heads, num_blocks = scores.shape
    scores = scores.float().contiguous()
    out = torch.empty(rows, num_heads, top_k, dtype=torch.int32)
    lib.msa_select_blocks(scores.data_ptr(), out.data_ptr(), rows, first, num_heads, num_blocks, page_size,
                          top_k, n_init, n_local, torch.get_num_threads())
    return out
