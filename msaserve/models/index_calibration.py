"""Calibrated MSA index for a converted dense checkpoint: a learned index-query projection per layer,
fitted on the CPU by distillation from the layer's dense attention.

The learned branch (`index_source='learned'`, DI = head_dim ≤ 64 here) starts as the training-free
conversion: index keys = the layer's keys (index_k_proj = k_proj), index query = the group's mean
query (index_q_proj = the mean of the group's q_proj rows; rotary is linear, so the mean commutes
with it). Then, per layer, index_q_proj is fitted to minimise KL(dense block mass ‖ softmax(block
scores / τ)) over the blocks that compete for the free top-K slots (the forced init and local blocks
excluded): the block mass of query t, KV head h, block j is the dense attention probability of the
group's heads summed over the keys of block j, averaged over the group. Keys stay fixed, so the
index cache is the same size and the keys are computed once per window.

Also measured here: the attention-mass recall of a selection (the dense mass inside the selected
blocks) for the training-free, calibrated and Quest-style (page min/max) scores.
"""

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from msaserve.kernels.indexer_prefill.naive import select_blocks
from msaserve.kernels.rotary import apply_rotary, rotary_cos_sin
from msaserve.models.transformer import MSATransformer


@dataclass(frozen=True)
class CalibrationSettings:
    steps: int = 25
    """Adam steps per layer."""
    queries_per_step: int = 128
    """Queries sampled per step (from positions where selection is real: block ≥ top_k)."""
    learning_rate: float = 2e-3
    eval_queries: int = 256
    """Held-out queries (other positions) on which loss and recall are reported."""
    seed: int = 0


@dataclass
class LayerReport:
    layer: int
    loss_before: float
    loss_after: float
    recall: dict[str, float] = field(default_factory=dict)
    """Mean attention-mass recall of the selected blocks: 'keys', 'calibrated', 'quest'."""
    kept: bool = True
    """Whether the fitted projection was kept: only if its held-out recall is at least the
    training-free one's (else the layer keeps the training-free index query)."""


@dataclass(frozen=True)
class LayerData:
    """One window through one layer: the layer's attention input and what is fixed under fitting."""

    x: torch.Tensor  # [T, H] the attention's input (after the input RMSNorm)
    keys: torch.Tensor  # [T, Hkv, D] rotated keys (= the index keys)
    mass: Callable[[torch.Tensor], torch.Tensor]  # positions [S] → dense block mass [S, Hkv, NB]


def layer_inputs(model: MSATransformer, run_dense: Callable[[], None]) -> list[torch.Tensor]:
    """Each layer's attention input [T, H] during `run_dense()` (a dense forward over one window)."""
    captured: list[torch.Tensor] = []
    def keep(_module: torch.nn.Module, args: tuple) -> None:
        captured.append(args[0].detach().clone())

    hooks = [layer.self_attn.register_forward_pre_hook(keep) for layer in model.layers]
    try:
        run_dense()
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def _rotate(model: MSATransformer, heads: torch.Tensor) -> torch.Tensor:
    """heads [T, n, D] at positions 0..T-1 → rotated."""
    c = model.config
    cos, sin = rotary_cos_sin(torch.arange(heads.shape[0]), heads.shape[-1], c.rope_theta, heads.dtype)
    return apply_rotary(heads, cos, sin)


@torch.no_grad()
def prepare_layer(model: MSATransformer, index: int, x: torch.Tensor) -> LayerData:
    c, attn = model.config, model.layers[index].self_attn
    x = x.float()
    q = _rotate(model, (x @ attn.q_proj.weight.float().T).view(-1, c.num_heads, c.head_dim))
    keys = _rotate(model, (x @ attn.k_proj.weight.float().T).view(-1, c.num_kv_heads, c.head_dim))
    scale = 1.0 / math.sqrt(c.head_dim)

    @torch.no_grad()
    def mass(positions: torch.Tensor) -> torch.Tensor:
        length = int(positions.max()) + 1
        num_blocks = (length + c.page_size - 1) // c.page_size
        k = keys[:length].repeat_interleave(c.group_size, dim=1)  # [T, Hq, D]
        logits = torch.einsum("shd,thd->sht", q[positions], k) * scale
        future = torch.arange(length)[None, :] > positions[:, None]
        probs = torch.softmax(logits.masked_fill(future[:, None, :], float("-inf")), dim=-1)
        probs = probs.view(len(positions), c.num_kv_heads, c.group_size, length).mean(dim=2)
        probs = torch.nn.functional.pad(probs, (0, num_blocks * c.page_size - length))
        return probs.view(len(positions), c.num_kv_heads, num_blocks, c.page_size).sum(dim=-1)

    return LayerData(x, keys, mass)


def block_scores_of(index_q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                    page_size: int) -> torch.Tensor:
    """Differentiable block-max scores: index_q [S, Hkv, D] at `positions`, keys [T, Hkv, D]
    → [S, Hkv, NB] (-inf for blocks wholly after the query), as the spec's `block_scores`."""
    length = int(positions.max()) + 1
    num_blocks = (length + page_size - 1) // page_size
    logits = torch.einsum("shd,thd->sht", index_q, keys[:length])
    future = torch.arange(length)[None, :] > positions[:, None]
    logits = logits.masked_fill(future[:, None, :], float("-inf"))
    logits = torch.nn.functional.pad(logits, (0, num_blocks * page_size - length), value=float("-inf"))
    return logits.view(*logits.shape[:2], num_blocks, page_size).amax(dim=-1)


def quest_scores(index_q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    """Quest (Tang et al., 2024): the upper bound Σ_d max(q_d·min_d, q_d·max_d) of ⟨q, k⟩ over each
    page's keys from the page's elementwise key min/max → [S, Hkv, NB] (-inf after the query)."""
    length = int(positions.max()) + 1
    num_blocks = (length + page_size - 1) // page_size
    pad = num_blocks * page_size - length
    k = keys[:length]
    kmax = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad), value=float("-inf"))
    kmin = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad), value=float("inf"))
    kmax = kmax.view(num_blocks, page_size, *k.shape[1:]).amax(dim=1)  # [NB, Hkv, D]
    kmin = kmin.view(num_blocks, page_size, *k.shape[1:]).amin(dim=1)
    upper = torch.maximum(index_q[:, None] * kmax[None], index_q[:, None] * kmin[None]).sum(-1)
    scores = upper.transpose(1, 2)  # [S, Hkv, NB]
    after = torch.arange(num_blocks)[None, :] > (positions // page_size)[:, None]
    return scores.masked_fill(after[:, None, :], float("-inf"))


def _candidates(positions: torch.Tensor, num_blocks: int, page_size: int, n_init: int,
                n_local: int) -> torch.Tensor:
    """[S, NB] bool: the blocks that compete for free slots (not forced, not after the query)."""
    ids = torch.arange(num_blocks)[None, :]
    return (ids >= n_init) & (ids <= (positions // page_size)[:, None] - n_local)


def distillation_loss(scores: torch.Tensor, mass: torch.Tensor, candidates: torch.Tensor,
                      log_temperature: torch.Tensor) -> torch.Tensor:
    """Mean over (query, KV head) of KL(target ‖ predicted) over the candidate blocks: target = the
    dense block mass renormalised over them, predicted = softmax(scores / τ) over them."""
    allowed = candidates[:, None, :]
    target = torch.where(allowed, mass, 0.0)
    total = target.sum(-1, keepdim=True)
    target = target / total.clamp(min=1e-12)
    finite = torch.where(allowed, scores, 0.0)  # -inf scores outside would make 0·∞ gradients
    logits = torch.where(allowed, finite / log_temperature.exp(), float("-inf"))
    log_pred = torch.where(allowed, torch.log_softmax(logits, dim=-1), 0.0)  # no 0·∞ in the gradient
    kl = (target * (target.clamp(min=1e-12).log() - log_pred)).sum(-1)
    weight = (total[..., 0] > 1e-6).float()  # rows whose candidates hold no mass teach nothing
    return (kl * weight).sum() / weight.sum().clamp(min=1.0)


def recall(selected: torch.Tensor, mass: torch.Tensor) -> float:
    """Mean dense attention mass inside the selected blocks: selected [S, Hkv, K] (-1 pad)."""
    padded = torch.nn.functional.pad(mass, (0, 1))  # -1 → the zero column
    index = torch.where(selected < 0, mass.shape[-1], selected).long()
    return float(padded.gather(-1, index).sum(-1).mean())


class IndexCalibrator:
    """Fits each layer's index_q_proj of a learned-index model from the dense attention."""

    def __init__(self, model: MSATransformer, settings: CalibrationSettings) -> None:
        c = model.config
        keys_as_index = c.num_index_heads == c.num_kv_heads and c.index_head_dim == c.head_dim
        if c.index_source != "learned" or not keys_as_index:
            raise ValueError(
                f"index_source={c.index_source!r}, num_index_heads={c.num_index_heads}, index_head_dim="
                f"{c.index_head_dim} is invalid: calibration needs index_source='learned' with index keys "
                f"= keys (num_index_heads={c.num_kv_heads}, index_head_dim={c.head_dim}); see initial_index()"
            )
        self.model, self.settings = model, settings

    def positions(self, length: int, count: int, generator: torch.Generator) -> torch.Tensor:
        """`count` random positions where selection is real (query block ≥ top_k)."""
        c = self.model.config
        first = c.top_k * c.page_size
        if length <= first:
            raise ValueError(f"calibration window of {length} tokens is invalid: allowed > top_k·P = {first}")
        return torch.randint(first, length, (count,), generator=generator).sort().values

    def fit_layer(self, index: int, data: LayerData) -> LayerReport:
        c, s = self.model.config, self.settings
        proj = self.model.layers[index].self_attn.index_q_proj
        gen = torch.Generator().manual_seed(s.seed + index)
        length = data.x.shape[0]
        held_out = self.positions(length, s.eval_queries, gen)
        held_mass = data.mass(held_out)
        weight = proj.weight.detach().float().clone().requires_grad_(True)
        log_t = torch.zeros((), requires_grad=True)

        def scores_at(positions: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            q = (data.x[positions] @ w.T).view(-1, c.num_kv_heads, c.index_head_dim)
            cos, sin = rotary_cos_sin(positions, c.index_head_dim, c.rope_theta, q.dtype)
            return block_scores_of(apply_rotary(q, cos, sin), data.keys, positions, c.page_size)

        def loss_at(positions: torch.Tensor, mass: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            scores = scores_at(positions, w)
            cand = _candidates(positions, scores.shape[-1], c.page_size, c.n_init, c.n_local)
            return distillation_loss(scores, mass, cand, log_t)

        with torch.no_grad():
            before = float(loss_at(held_out, held_mass, weight))
            base_scores = scores_at(held_out, weight)
        optimiser = torch.optim.Adam([weight, log_t], lr=s.learning_rate)
        for _ in range(s.steps):
            positions = self.positions(length, s.queries_per_step, gen)
            with torch.no_grad():
                mass = data.mass(positions)
            optimiser.zero_grad()
            with torch.enable_grad():  # the fit needs autograd whatever the caller's grad mode is
                loss_at(positions, mass, weight).backward()
            optimiser.step()
        with torch.no_grad():
            after = float(loss_at(held_out, held_mass, weight))
            new_scores = scores_at(held_out, weight)
            mean_q = (data.x[held_out] @ self.model.layers[index].self_attn.q_proj.weight.float().T)
            mean_q = mean_q.view(-1, c.num_kv_heads, c.group_size, c.head_dim).mean(2)
            cos, sin = rotary_cos_sin(held_out, c.head_dim, c.rope_theta, mean_q.dtype)
            quest = quest_scores(apply_rotary(mean_q, cos, sin), data.keys, held_out, c.page_size)
        select = lambda sc: select_blocks(sc, held_out, c.page_size, c.top_k, c.n_init, c.n_local)  # noqa: E731
        rec = {name: recall(select(sc), held_mass)
               for name, sc in (("keys", base_scores), ("calibrated", new_scores), ("quest", quest))}
        kept = rec["calibrated"] >= rec["keys"]
        if kept:
            with torch.no_grad():
                proj.weight.copy_(weight.to(proj.weight.dtype))
        return LayerReport(index, before, after, rec, kept)


def initial_index(dense: MSATransformer, changes: dict | None = None) -> MSATransformer:
    """The learned-index model equal to the training-free conversion of `dense` (index_source
    'keys'): index_k_proj = k_proj, index_q_proj = the mean of each group's q_proj rows.
    changes: other config fields of the converted model (top_k, dense_layers, ...), validated."""
    c = dense.config
    update = {"index_source": "learned", "num_index_heads": c.num_kv_heads, "index_head_dim": c.head_dim,
              **(changes or {})}
    config = type(c)(**{**c.model_dump(), **update})
    param = next(dense.parameters())
    with torch.device("meta"):
        model = MSATransformer(config, dense.attention_backend)
    state = dict(dense.state_dict())
    for i, layer in enumerate(dense.layers):
        attn = layer.self_attn
        state[f"layers.{i}.self_attn.index_k_proj.weight"] = attn.k_proj.weight.detach().clone()
        q = attn.q_proj.weight.detach().view(c.num_kv_heads, c.group_size, c.head_dim, c.hidden_size)
        state[f"layers.{i}.self_attn.index_q_proj.weight"] = q.mean(1).reshape(-1, c.hidden_size).clone()
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=param.device, dtype=param.dtype).eval()


def calibrate(model: MSATransformer, windows: list[list[int]], settings: CalibrationSettings,
              progress: bool = True) -> list[LayerReport]:
    """Fit every layer's index_q_proj of `model` (from `initial_index`) on token `windows`; the
    layer inputs come from a dense forward over each window (the first window is the fitting one)."""
    from msaserve.models.cache import allocate_caches
    from msaserve.models.metadata import AttentionMetadata

    calibrator = IndexCalibrator(model, settings)
    ids = windows[0]
    pages = (len(ids) + model.config.page_size - 1) // model.config.page_size
    caches = allocate_caches(model.config, pages, torch.device("cpu"), next(model.parameters()).dtype, None)
    positions = torch.arange(len(ids))
    meta = AttentionMetadata(
        positions=positions, slot_mapping=positions.clone(),
        block_tables=torch.arange(pages, dtype=torch.int32)[None, :],
        seq_lens=torch.tensor([len(ids)], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, len(ids)], dtype=torch.int32), max_query_len=len(ids),
        decode_query_len=None, logits_indices=torch.tensor([len(ids) - 1]), selections=None,
    )
    backend = model.attention_backend
    model.attention_backend = "dense"
    try:
        with torch.no_grad():
            inputs = layer_inputs(model, lambda: model(torch.tensor(ids), meta, caches))
    finally:
        model.attention_backend = backend
    reports = []
    layers = tqdm(range(len(model.layers)), desc="calibrating index", unit="layer", file=sys.stderr,
                  disable=not progress)
    for index in layers:
        reports.append(calibrator.fit_layer(index, prepare_layer(model, index, inputs[index])))
        inputs[index] = torch.empty(0)
    return reports
