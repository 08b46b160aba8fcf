"""The C kernel of CPU MSA attention: one (query block, KV head) per OpenMP task; each block any of
its queries selected is read once from the paged cache and applied to those queries with an online
softmax (fp32 throughout), so the work is the sparse work.
Results equal `naive.py` (the spec) up to fp32 rounding; `cpu.py` calls it and falls back to its
PyTorch path where no C compiler is available.
"""

import ctypes

import torch

from msaserve.kernels import cpu_native

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Built with -ffast-math (vectorised expf): no infinities, so "minus infinity" is a finite floor. */
#define NEG (-1e30f)

/* 16 fp32 lanes (GCC vector extension: zmm with AVX-512, two ymm with AVX2, ...). */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* Online-softmax attention of up to 4 query vectors (rows x group heads) over one 64-key slice of
   a block: scores from a 4 x 64 register tile over D, masked past each vector's n[t] keys, then
   acc[t] (D floats) += softmax weights x V, 4 x 64 dims at a time. kt: the keys transposed
   [D][page]; vb: the slice's first value row (row stride vs); qv[t]: the query; m, l: running
   max and sum per vector. Vectors past `count` are copies of the last (their results dropped). */
static void attend_tile(const float *const qv[4], int count, const int64_t n[4], const float *kt,
                        int64_t page, const float *vb, int64_t vs, int64_t d, float scale,
                        float *const acc[4], float *m, float *l) {
    v16 sc[4][4] = {{{0}}};
    for (int64_t i = 0; i < d; i++) {
        const v16 *k = (const v16 *)(kt + i * page);
        const v16 k0 = k[0], k1 = k[1], k2 = k[2], k3 = k[3];
        for (int t = 0; t < 4; t++) {
            const float b = qv[t][i];
            sc[t][0] += b * k0; sc[t][1] += b * k1; sc[t][2] += b * k2; sc[t][3] += b * k3;
        }
    }
    float w[4][64], corr[4];
    int64_t keys = 0;
    for (int t = 0; t < 4; t++) {
        for (int v = 0; v < 4; v++) *(v16 *)(w[t] + 16 * v) = sc[t][v] * scale;
        const int64_t nt = t < count ? n[t] : 0;
        float bmax = NEG;
        #pragma omp simd reduction(max:bmax)
        for (int64_t p = 0; p < 64; p++) {
            const float x = p < nt ? w[t][p] : NEG;
            bmax = x > bmax ? x : bmax;
        }
        const float nm = bmax > m[t] ? bmax : m[t];
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t p = 0; p < 64; p++) {
            w[t][p] = p < nt ? expf(w[t][p] - nm) : 0.0f;
            sum += w[t][p];
        }
        corr[t] = expf(m[t] - nm);
        l[t] = l[t] * corr[t] + sum;
        m[t] = nm;
        if (nt > keys) keys = nt;
    }
    for (int64_t c = 0; c < d; c += 64) {
        v16 o[4][4];
        for (int t = 0; t < 4; t++)
            for (int v = 0; v < 4; v++) o[t][v] = *(const v16 *)(acc[t] + c + 16 * v) * corr[t];
        for (int64_t p = 0; p < keys; p++) {  /* keys < n[t] of another vector are written rows */
            const v16 *vr = (const v16 *)(vb + p * vs + c);
            const v16 v0 = vr[0], v1 = vr[1], v2 = vr[2], v3 = vr[3];
            for (int t = 0; t < 4; t++) {
                const float b = w[t][p];
                o[t][0] += b * v0; o[t][1] += b * v1; o[t][2] += b * v2; o[t][3] += b * v3;
            }
        }
        for (int t = 0; t < count; t++)
            for (int v = 0; v < 4; v++) *(v16 *)(acc[t] + c + 16 * v) = o[t][v];
    }
}

/* One block for the listed query vectors (rows x group heads that selected it), page % 64 == 0,
   d % 64 == 0: 4 vectors at a time, 64 keys at a time. list[x] = row * gs + g; nk[x]: its keys. */
static void attend_block_tiled(const float *q, const int64_t *list, const int64_t *nk, int64_t count,
                               int64_t r0, int64_t hq, int64_t h, int64_t gs, const float *kt,
                               int64_t page, const float *vb, int64_t vs, int64_t d, float scale,
                               float *acc, float *m, float *l) {
    for (int64_t x = 0; x < count; x += 4) {
        const int cnt = count - x < 4 ? (int)(count - x) : 4;
        const float *qv[4];
        float *av[4], mt[4], lt[4];
        int64_t n[4];
        for (int t = 0; t < 4; t++) {
            const int64_t e = list[x + (t < cnt ? t : cnt - 1)], r = e / gs, g = e % gs;
            qv[t] = q + ((r0 + r) * hq + h * gs + g) * d;
            av[t] = acc + e * d;
            n[t] = nk[x + (t < cnt ? t : cnt - 1)];
            mt[t] = m[e]; lt[t] = l[e];
        }
        for (int64_t p0 = 0; p0 < page; p0 += 64) {
            int64_t rest[4], any = 0;
            for (int t = 0; t < 4; t++) {
                rest[t] = n[t] - p0 > 64 ? 64 : (n[t] - p0 > 0 ? n[t] - p0 : 0);
                any |= t < cnt && rest[t] > 0;
            }
            if (!any) break;
            attend_tile(qv, cnt, rest, kt + p0, page, vb + p0 * vs, vs, d, scale, av, mt, lt);
        }
        for (int t = 0; t < cnt; t++) { m[list[x + t]] = mt[t]; l[list[x + t]] = lt[t]; }
    }
}

/* A group is a run of rows of one sequence in one MSA block (group_start [groups + 1]). For each
   (group, KV head) every block any of its rows selected is read once, transposed, and applied to
   the rows that selected it with an online softmax (fp32).
   q [rows, Hq, D]; k, v [num_pages, P, Hkv, D]; block_tables [B, max_pages]; row_seq, row_pos
   [rows]; selected [rows, Hkv, K] ascending, -1 pad; out [rows, Hq, D]. All contiguous. */
void msa_sparse_attention(const float *q, const float *k, const float *v, const int32_t *block_tables,
                          int64_t max_pages, const int32_t *row_seq, const int64_t *row_pos,
                          const int32_t *selected, const int64_t *group_start, int64_t groups,
                          float *out, int64_t max_rows, int64_t hq, int64_t hkv, int64_t d,
                          int64_t page, int64_t top_k, float scale, int threads) {
    const int64_t gs = hq / hkv, key_stride = hkv * d;
    const int tiled = page % 64 == 0 && d % 64 == 0;
    #pragma omp parallel num_threads(threads)
    {
        float *kt = malloc(sizeof(float) * d * page), *s = malloc(sizeof(float) * gs * page);
        float *acc = malloc(sizeof(float) * max_rows * gs * d);
        float *m = malloc(sizeof(float) * max_rows * gs), *l = malloc(sizeof(float) * max_rows * gs);
        int64_t *next = malloc(sizeof(int64_t) * max_rows);
        int64_t *list = malloc(sizeof(int64_t) * max_rows * gs);
        int64_t *nk = malloc(sizeof(int64_t) * max_rows * gs);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < groups * hkv; task++) {
            const int64_t grp = task / hkv, h = task % hkv;
            const int64_t r0 = group_start[grp], nr = group_start[grp + 1] - r0;
            const int32_t *bt = block_tables + (int64_t)row_seq[r0] * max_pages;
            for (int64_t i = 0; i < nr * gs; i++) { m[i] = NEG; l[i] = 0.0f; }
            memset(acc, 0, sizeof(float) * nr * gs * d);
            for (int64_t r = 0; r < nr; r++) next[r] = 0;
            for (;;) {
                /* The next block: the smallest not yet applied among the rows' ascending selections. */
                int64_t blk = -1;
                for (int64_t r = 0; r < nr; r++) {
                    const int32_t *sel = selected + ((r0 + r) * hkv + h) * top_k;
                    while (next[r] < top_k && sel[next[r]] < 0) next[r]++;
                    if (next[r] < top_k && (blk < 0 || sel[next[r]] < blk)) blk = sel[next[r]];
                }
                if (blk < 0) break;
                const int64_t pg = bt[blk];
                const float *kb = k + pg * page * key_stride + h * d;
                const float *vb = v + pg * page * key_stride + h * d;
                for (int64_t p = 0; p < page; p++)
                    for (int64_t i = 0; i < d; i++) kt[i * page + p] = kb[p * key_stride + i];
                if (tiled) {  /* the query vectors that selected blk, then 4 x 64 tiles */
                    int64_t count = 0;
                    for (int64_t r = 0; r < nr; r++) {
                        const int32_t *sel = selected + ((r0 + r) * hkv + h) * top_k;
                        if (next[r] >= top_k || sel[next[r]] != blk) continue;
                        next[r]++;
                        int64_t n = row_pos[r0 + r] - blk * page + 1;
                        if (n <= 0) continue;
                        for (int64_t g = 0; g < gs; g++) {
                            list[count] = r * gs + g;
                            nk[count++] = n > page ? page : n;
                        }
                    }
                    attend_block_tiled(q, list, nk, count, r0, hq, h, gs, kt, page, vb, key_stride, d, scale,
                                       acc, m, l);
                    continue;
                }
                for (int64_t r = 0; r < nr; r++) {
                    const int32_t *sel = selected + ((r0 + r) * hkv + h) * top_k;
                    if (next[r] >= top_k || sel[next[r]] != blk) continue;
                    next[r]++;
                    int64_t n = row_pos[r0 + r] - blk * page + 1;  /* keys at positions <= the row's */
                    if (n <= 0) continue;
                    if (n > page) n = page;
                    const float *qr = q + ((r0 + r) * hq + h * gs) * d;
                    for (int64_t g = 0; g < gs; g++) {
                        float *sg = s + g * page;
                        for (int64_t p = 0; p < n; p++) sg[p] = 0.0f;
                        for (int64_t i = 0; i < d; i++) {
                            const float qi = qr[g * d + i] * scale;
                            const float *kti = kt + i * page;
                            #pragma omp simd
                            for (int64_t p = 0; p < n; p++) sg[p] += qi * kti[p];
                        }
                        float bmax = NEG;
                        #pragma omp simd reduction(max:bmax)
                        for (int64_t p = 0; p < n; p++) bmax = sg[p] > bmax ? sg[p] : bmax;
                        const int64_t st = r * gs + g;
                        const float nm = bmax > m[st] ? bmax : m[st], corr = expf(m[st] - nm);
                        float *ag = acc + st * d, sum = 0.0f;
                        #pragma omp simd reduction(+:sum)
                        for (int64_t p = 0; p < n; p++) {
                            sg[p] = expf(sg[p] - nm);
                            sum += sg[p];
                        }
                        #pragma omp simd
                        for (int64_t i = 0; i < d; i++) ag[i] *= corr;
                        for (int64_t p = 0; p < n; p++) {
                            const float w = sg[p];
                            const float *vp = vb + p * key_stride;
                            #pragma omp simd
                            for (int64_t i = 0; i < d; i++) ag[i] += w * vp[i];
                        }
                        l[st] = l[st] * corr + sum;
                        m[st] = nm;
                    }
                }
            }
            for (int64_t r = 0; r < nr; r++) {
                float *o = out + ((r0 + r) * hq + h * gs) * d;
                for (int64_t g = 0; g < gs; g++) {
                    const float norm = l[r * gs + g];  /* 0: the row selected nothing → zeros */
                    for (int64_t i = 0; i < d; i++)
                        o[g * d + i] = norm > 0.0f ? acc[(r * gs + g) * d + i] / norm : 0.0f;
                }
            }
        }
        free(kt); free(s); free(acc); free(m); free(l); free(next); free(list); free(nk);
    }
}
"""

_ARGTYPES = (
    [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64]
    + [ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
)


def library() -> ctypes.CDLL | None:
    lib = cpu_native.load("msa_sparse_attention", SOURCE)
    if lib is not None and lib.msa_sparse_attention.argtypes is None:
        lib.msa_sparse_attention.argtypes = _ARGTYPES
        lib.msa_sparse_attention.restype = None
    return lib


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """fp32 CPU tensors with a built library: the kernel's domain (else the PyTorch path)."""
    tensors = (q, k_cache, v_cache)
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return False
    return cpu_native.enabled() and library() is not None


def sparse_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    row_seq: torch.Tensor, row_pos: torch.Tensor, selected: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q [rows, Hq, D] fp32; caches [num_pages, P, Hkv, D] fp32; block_tables [B, max_pages];
    row_seq [rows] (the row's sequence); row_pos [rows] (its position); selected [rows, Hkv, K]
    → o [rows, Hq, D] fp32; a (row, KV head) that selected no block gives zeros."""
    lib = library()
    assert lib is not None, "sparse_attention called where supported() is False"
    rows, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1:3]
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    row_seq, row_pos = row_seq.to(torch.int32).contiguous(), row_pos.to(torch.int64).contiguous()
    selected = torch.sort(selected.to(torch.int32), dim=-1).values.contiguous()  # any slot order
    # Groups: runs of rows of one sequence in one MSA block.
    key = row_seq.long() * (1 << 40) + row_pos // page_size
    change = torch.ones(rows, dtype=torch.bool)
    change[1:] = key[1:] != key[:-1]
    starts = torch.nonzero(change).flatten()
    group_start = torch.cat([starts, torch.tensor([rows])]).contiguous()
    max_rows = int((group_start[1:] - group_start[:-1]).max()) if rows else 0
    out = torch.empty_like(q)
    lib.msa_sparse_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        row_seq.data_ptr(), row_pos.data_ptr(), selected.data_ptr(), group_start.data_ptr(),
        starts.shape[0], out.data_ptr(), max_rows, num_heads, num_kv_heads, head_dim, page_size,
        selected.shape[-1], scale, torch.get_num_threads(),
    )
    return out
