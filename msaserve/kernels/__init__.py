"""MSA attention ops. Each op lives in `<op>/naive.py` (PyTorch, the spec, any device) beside
`<op>/triton.py` (the GPU kernel); `dispatch.get_ops` resolves a backend (a module in `backends/`)
into one set.

Shared conventions (docs/design.md §2–3):
- caches: `k_cache, v_cache [num_pages, P, Hkv, D]`, `index_cache [num_pages, P, HkI, DI]`;
- `block_tables [B, max_pages] int32`: logical page → physical page (-1 = not resident);
- `seq_lens [B] int32`: tokens of each sequence *including* this step's queries; the queries of a
  sequence are its last `q_len` tokens, at positions `seq_len - q_len .. seq_len - 1`;
- varlen (prefill) ops take queries flattened as `[Tq, ...]` with `cu_seqlens_q [B + 1] int32`;
  decode ops take a fixed `Q` (1–16) queries per sequence as `[B, Q, ...]`;
- selections are logical block ids `[..., Hkv, top_k] int32`, valid ids first in ascending
  order, padded with -1. Consumers must not depend on the order (property 3);
- the indexers force the `n_local ≥ 1` blocks ending at the query's block c = ⌊t/P⌋ and the
  `n_init ≥ 0` leading blocks (trailing arguments `n_init=1`, `n_local=1`: msaserve's form;
  MiniMax-M3's is `n_init=0`, `n_local=index_local_blocks`), `indexer_prefill/naive.select_blocks`.
"""

from typing import Any

__all__ = ["AttentionOps", "get_ops"]


def __getattr__(name: str) -> Any:
    """`AttentionOps` / `get_ops` load torch and the kernels only when asked for, so that importing
    a torch-free part (`kernels.backends.backend_names`) stays light."""
    if name in __all__:
        from msaserve.kernels import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
