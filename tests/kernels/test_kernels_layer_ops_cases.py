"""Checks shared by the interpreted (CPU) and compiled (GPU) tests of `kernels/layer_ops`: each
fused op against its PyTorch spec on the same inputs, outputs poisoned before each run."""

import torch
from kernel_testing import import_interpreted

from msaserve.kernels.layer_ops import LayerOps
from msaserve.kernels.layer_ops import naive as spec
from msaserve.kernels.rotary import rotary_cos_sin

POISON = 7.0  # written into every output before a run; no result of these inputs equals it


def interpreted_triton_ops() -> LayerOps:
    """The layer ops' Triton kernels under the interpreter (CPU tests)."""
    (module,) = import_interpreted("msaserve.kernels.layer_ops.triton")
    return LayerOps("triton", module.add_rms_norm, module.rotary_and_write, module.silu_mul)


def _tolerance(dtype: torch.dtype) -> float:
    """Two roundings of the activation dtype: the fused RMSNorm sums in another order, and the
    interpreter truncates fp32 → bf16 where the GPU rounds to nearest."""
    return {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]


def check_add_rms_norm(ops: LayerOps, rows: int, cols: int, dtype: torch.dtype, device: str,
                       residual: bool, seed: int = 0) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen).to(device=device, dtype=dtype)
    res = torch.randn(rows, cols, generator=gen).to(device=device, dtype=dtype) if residual else None
    weight = (1 + 0.1 * torch.randn(cols, generator=gen)).to(device=device, dtype=dtype)
    want_out, want_sum = spec.add_rms_norm(x, res, weight, 1e-5)
    got_out, got_sum = ops.add_rms_norm(x, res, weight, 1e-5)
    assert got_out.dtype == want_out.dtype and got_out.shape == want_out.shape
    tol = _tolerance(dtype)
    # Compiled, the add rounds as PyTorch's does; the interpreter truncates fp32 → bf16.
    exact = device == "cuda" or dtype == torch.float32
    torch.testing.assert_close(got_sum, want_sum, rtol=0 if exact else tol, atol=0 if exact else tol)
    torch.testing.assert_close(got_out.float(), want_out.float(), rtol=tol, atol=tol)


def check_rotary_and_write(ops: LayerOps, tokens: int, heads: int, dim: int, rotate: bool,
                           num_caches: int, dtype: torch.dtype, device: str, seed: int = 0,
                           rotary_dim: int | None = None) -> None:
    """The heads are a strided view of a wider projection output (as the fused GEMM gives them)
    and the slots are scattered over the pages, including the last slot of a page. With rotary_dim,
    cos and sin are that wide (partial rotary, as M3's) and the dims past it must pass unchanged."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    page_size, num_pages = 8, 2 * tokens // 8 + 3
    wide = torch.randn(tokens, (heads + 3) * dim, generator=gen).to(device=device, dtype=dtype)
    positions = torch.randint(0, 5000, (tokens,), generator=gen).to(device)
    cos, sin = rotary_cos_sin(positions, rotary_dim or dim, 10000.0, dtype)
    perm = torch.randperm(num_pages * page_size, generator=gen)
    # Token 0 takes a page's last slot, swapped with the token that held it: slots must stay distinct,
    # or two tokens race for one slot (a plain `slots[0] = P - 1` collided at 999 tokens, seed 2).
    last = int((perm == page_size - 1).nonzero()[0, 0])
    perm[[0, last]] = perm[[last, 0]]
    slots = perm[:tokens].to(device=device, dtype=torch.int64)
    assert slots.unique().numel() == tokens, "slots must be distinct"
    cache_dtypes = [dtype, torch.float32][:num_caches]
    results = []
    for impl in (spec, ops):
        heads_view = wide.clone()[:, dim:dim + heads * dim].view(tokens, heads, dim)
        caches = tuple(torch.full((num_pages, page_size, heads, dim), POISON, device=device, dtype=d)
                       for d in cache_dtypes)
        out = impl.rotary_and_write(heads_view, cos, sin, rotate, slots if caches else None, caches,
                                    rotary_dim=rotary_dim)
        assert out.data_ptr() == heads_view.data_ptr(), "rotary_and_write works in place"
        results.append((heads_view, caches))
    (want, want_caches), (got, got_caches) = results
    if rotary_dim is not None:  # the tail is the input's, bit for bit
        tail = wide[:, dim:dim + heads * dim].view(tokens, heads, dim)[..., rotary_dim:]
        assert torch.equal(got[..., rotary_dim:], tail) and torch.equal(want[..., rotary_dim:], tail)
    tol = _tolerance(dtype)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for got_cache, want_cache in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(got_cache.float(), want_cache.float(), rtol=tol, atol=tol)
        assert int((got_cache == POISON).sum()) == int((want_cache == POISON).sum()), "writes outside slots"


def check_silu_mul(ops: LayerOps, rows: int, cols: int, dtype: torch.dtype, device: str,
                   seed: int = 0) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gate_up = (3 * torch.randn(rows, 2 * cols, generator=gen)).to(device=device, dtype=dtype)
    tol = _tolerance(dtype)
    got, want = ops.silu_mul(gate_up), spec.silu_mul(gate_up)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def check_add_offset_rms_norm(module, rows: int, cols: int, dtype: torch.dtype, device: str,
                              residual: bool, seed: int = 0) -> None:
    """M3's residual add + RMSNorm (`add_offset_rms_norm` of the module given) against the spec."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = (3 * torch.randn(rows, cols, generator=gen)).to(device=device, dtype=dtype)
    res = (3 * torch.randn(rows, cols, generator=gen)).to(device=device, dtype=dtype) if residual else None
    weight = (0.1 * torch.randn(cols, generator=gen)).to(device=device, dtype=dtype)
    want_out, want_sum = spec.add_offset_rms_norm(x, res, weight, 1e-6)
    got_out, got_sum = module.add_offset_rms_norm(x, res, weight, 1e-6)
    assert got_out.dtype == dtype and got_out.shape == x.shape and got_sum.shape == x.shape
    exact = device == "cuda" or dtype == torch.float32  # the interpreter truncates fp32 → bf16
    tol = 0 if exact else _tolerance(dtype)
    torch.testing.assert_close(got_sum, want_sum, rtol=tol, atol=tol)
    # the norm of the sum the kernel made (the interpreter's truncated sum may be a step off)
    _within_one_step(got_out, spec.offset_rms_norm(got_sum, weight, 1e-6) if not exact else want_out)


def _within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """Elementwise at most one step of the dtype apart (fp32: 1e-5 relative): sums in another
    order, or the interpreter's truncation where the GPU rounds to nearest."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    step = (want.float().abs() * 2 ** -7).clamp_min(1e-30) * 1.01
    diff = (got.float() - want.float()).abs()
    assert (diff <= step).all(), f"max difference {float(diff.max())} beyond one step"


def check_m3_attention_heads(module, tokens: int, layout, dtype: torch.dtype, device: str,
                             rotary_dim: int, seed: int = 0) -> None:
    """M3's attention input (`m3_attention_heads`: per-head norms, partial rotary, K/V and index-K
    writes) of the module given against the spec: the projection a strided view's rows as the
    fused GEMM gives them, slots scattered over pages (K/V and index slots apart, as under sparse
    residency), caches poisoned first."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    width = sum(layout.widths)
    projected = (3 * torch.randn(tokens, width + 5, generator=gen)).to(device=device, dtype=dtype)[:, :width]
    positions = torch.randint(0, 100_000, (tokens,), generator=gen).to(device)
    cos, sin = rotary_cos_sin(positions, rotary_dim, 5e6, dtype)
    dims = (layout.head_dim, layout.head_dim, layout.index_dim, layout.index_dim)
    weights = tuple((0.3 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype)
                    for d in dims[: 4 if layout.index_heads else 2])
    page_size, num_pages = 4, tokens + 3
    kv_slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens].to(device)
    index_slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens].to(device)
    cache_heads = ((layout.num_kv_heads, layout.head_dim),) * 2 + (
        (max(1, layout.index_key_heads), layout.index_dim or layout.head_dim),)
    outputs = []
    for impl in (spec, module):
        caches = [torch.full((num_pages, page_size, heads, d), POISON, device=device, dtype=dtype)
                  for heads, d in cache_heads]
        index_cache = caches[2] if layout.index_heads else None
        heads = impl.m3_attention_heads(projected, layout, weights, 1e-6, cos, sin, kv_slots, caches[0],
                                        caches[1], index_slots, index_cache)
        outputs.append((*heads, *caches[: 3 if layout.index_heads else 2]))
    names = ("q", "index q", "index k", "k cache", "v cache", "index cache")[: len(outputs[0])]
    for name, want, got in zip(names, *outputs, strict=True):
        if want is None:
            assert got is None, f"{name}: expected None"
            continue
        assert torch.isfinite(got.float()).all(), f"{name}: NaN or inf"
        # a norm summed in another order can move a value a step, and a rotation's sum that cancels
        # keeps that step's absolute size: compare at the dtype's tolerance, and compiled, also
        # count the values that differ at all
        tol = _tolerance(dtype)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=name)
        if dtype != torch.float32:  # fp32: the sum order moves most values in their last bits
            # in bf16 both round to nearest even (the kernel in integer arithmetic, `_round_as`; the
            # interpreter's casts truncate), so only the norm's sum order may move a value a step
            differ = (got != want).float().mean()
            assert differ < 0.02, f"{name}: {differ.item():.1%} of the values differ"
        if name.endswith("cache"):  # the same slots written, nothing else
            assert torch.equal(got == POISON, want == POISON), f"{name}: writes outside the slots"
