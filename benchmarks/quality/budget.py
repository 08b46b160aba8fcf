"""Where MSA's perplexity loss comes from: the index (which blocks it picks) or the budget (how many
blocks any index may pick). SmolLM2-135M dense vs MSA variants on held-out real text, one L-token
window, one prefill each, all positions scored.

Variants (`KIND:K:N_INIT:N_LOCAL[:LO-HI]`, P stays the checkpoint's; LO-HI: those layers attend
densely, as MiniMax's full-attention layers do):
- `dense`: dense causal attention (SDPA), the reference;
- `calibrated`: the checkpoint's calibrated index (`msaserve convert`) at top_k=K, n_init, n_local;
- `keys`: the training-free index (`index_source: keys`, the GGUF converted on load);
- `oracle`: the ideal index at the same budget — every query's blocks are chosen by the true dense
  attention mass of each block (summed over the KV group's query heads), with the same forced
  init/local blocks and the same top-K rule; the attention itself is MSA's sparse attention. If the
  oracle loses as much as the calibrated index, the budget — not the indexer — is the limit.

Run: .venv/bin/python benchmarks/quality/budget.py --checkpoint OUT --length 8192 \
        --variants dense calibrated:16:1:1 oracle:16:1:1 calibrated:32:1:1
Writes benchmarks/results/quality_budget.json (`quality.budget_*` entries; kept across runs) and
prints a table last.
"""

import argparse
import dataclasses
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import git_revision, hardware, nll_sum  # noqa: E402
from reference_decode import SequenceState, step_metadata  # noqa: E402

from msaserve.kernels import AttentionOps, get_ops  # noqa: E402
from msaserve.kernels.indexer_prefill.naive import select_blocks  # noqa: E402
from msaserve.models.loader import load_model  # noqa: E402
from msaserve.models.transformer import MSATransformer  # noqa: E402

ORACLE_CHUNK = 256  # queries whose [chunk, G, T] attention probabilities are built at once


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str  # dense | calibrated | keys | oracle
    top_k: int = 16
    n_init: int = 1
    n_local: int = 1
    dense_layers: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "Variant":
        kind, *nums = text.split(":")
        dense: tuple[int, ...] = ()
        if len(nums) == 4:  # LO-HI: layers LO..HI attend densely
            lo, hi = map(int, nums.pop().split("-"))
            dense = tuple(range(lo, hi + 1))
        if kind not in ("dense", "calibrated", "keys", "oracle") or len(nums) not in (0, 3):
            raise SystemExit(f"--variants {text!r} is invalid: allowed dense or "
                             "calibrated|keys|oracle:K:N_INIT:N_LOCAL[:DENSE_LO-DENSE_HI]")
        return cls(kind, *map(int, nums), dense_layers=dense) if nums else cls(kind)

    @property
    def name(self) -> str:
        if self.kind == "dense":
            return "dense"
        dense = f"_dense{self.dense_layers[0]}-{self.dense_layers[-1]}" if self.dense_layers else ""
        return f"{self.kind}_k{self.top_k}_i{self.n_init}_l{self.n_local}{dense}"


def block_mass(q: torch.Tensor, keys: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    """True dense attention mass per block: q [T, Hq, D] (rotated), keys [T, Hkv, D] of one
    sequence at positions 0.. → [T, Hkv, NB] fp32, the mass summed over the KV group's query heads
    (-inf for blocks after the query's)."""
    length, num_heads, head_dim = q.shape
    num_kv, num_blocks = keys.shape[1], (length + page_size - 1) // page_size
    group = num_heads // num_kv
    out = torch.empty(length, num_kv, num_blocks)
    key_pos = torch.arange(length)
    for q0 in range(0, length, ORACLE_CHUNK):
        q1 = min(q0 + ORACLE_CHUNK, length)
        qc = q[q0:q1].float().view(q1 - q0, num_kv, group, head_dim)
        logits = torch.einsum("tkgd,skd->ktgs", qc, keys[:q1].float()) * scale  # [Hkv, c, G, q1]
        future = key_pos[None, :q1] > torch.arange(q0, q1)[:, None]
        probs = torch.softmax(logits.masked_fill_(future[None, :, None, :], float("-inf")), dim=-1)
        probs = torch.nn.functional.pad(probs.sum(2), (0, num_blocks * page_size - q1))
        mass = probs.view(num_kv, q1 - q0, num_blocks, page_size).sum(-1).permute(1, 0, 2)
        blocks_after = torch.arange(num_blocks)[None, :] > (torch.arange(q0, q1) // page_size)[:, None]
        out[q0:q1] = mass.masked_fill_(blocks_after[:, None, :], float("-inf"))
    return out


def oracle_ops(base: AttentionOps, variant: Variant) -> AttentionOps:
    """`base` with the selection replaced by the top-K blocks of true attention mass (one sequence
    from position 0, identity block table, as `SequenceState` lays it out)."""

    def sparse_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, selected, *args):
        page_size, num_kv, head_dim = k_cache.shape[1:]
        length = int(seq_lens[0])
        assert block_tables.shape[0] == 1 and q.shape[0] == length, "oracle: one sequence from position 0"
        keys = k_cache.reshape(-1, num_kv, head_dim)[:length]
        mass = block_mass(q, keys, page_size, head_dim ** -0.5)
        chosen = select_blocks(mass, torch.arange(length), page_size, variant.top_k, variant.n_init,
                               variant.n_local)
        return base.sparse_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, chosen, *args)

    return dataclasses.replace(base, name="oracle", sparse_prefill=sparse_prefill)


def with_dense_layers(base: AttentionOps, layers: tuple[int, ...], num_layers: int) -> AttentionOps:
    """`base` whose sparse attention is dense causal attention in `layers` (the ops are called once
    per layer, in order, so a counter knows the layer)."""
    calls = {"n": 0}

    def sparse_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, selected, *args):
        layer = calls["n"] % num_layers
        calls["n"] += 1
        chosen = None if layer in layers else selected
        return base.sparse_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, chosen, *args)

    return dataclasses.replace(base, sparse_prefill=sparse_prefill)


def with_budget(model: MSATransformer, variant: Variant) -> None:
    """Set every layer's selection budget (the attention reads its own config copy)."""
    update = {"top_k": variant.top_k, "n_init": variant.n_init, "n_local": variant.n_local}
    for layer in model.layers:
        layer.self_attn.config = layer.self_attn.config.model_copy(update=update)


def perplexity(model: MSATransformer, ops: AttentionOps, ids: list[int]) -> float:
    state = SequenceState(model, len(ids))
    meta = step_metadata(0, len(ids), state.max_pages, model.config.page_size, False, torch.device("cpu"))
    hidden = model(torch.tensor(ids), meta, state.caches, ops=ops)
    targets = torch.tensor(ids[1:])
    return float(torch.tensor(nll_sum(model, hidden[:-1], targets) / targets.numel()).exp())


def run_variant(models: dict[str, MSATransformer], variant: Variant, ids: list[int]) -> float:
    if variant.kind == "dense":
        return perplexity(models["calibrated"], get_ops("dense"), ids)
    model = models["keys" if variant.kind == "keys" else "calibrated"]
    with_budget(model, variant)
    ops = get_ops("msa")
    ops = oracle_ops(ops, variant) if variant.kind == "oracle" else ops
    if variant.dense_layers:
        ops = with_dense_layers(ops, variant.dense_layers, len(model.layers))
    return perplexity(model, ops, ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="the directory `msaserve convert` wrote")
    parser.add_argument("--text", default=str(ROOT / "benchmarks/data/quality_eval_text.txt"))
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--variants", nargs="+", default=["dense", "calibrated:16:1:1", "oracle:16:1:1"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quality_budget.json"))
    args = parser.parse_args()
    variants = [Variant.parse(v) for v in args.variants]
    torch.set_grad_enabled(False)
    meta = {"command": "python " + " ".join(sys.argv), "hardware": hardware(),
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "git_revision": git_revision(),
            "text": "benchmarks/data/quality_eval_text.txt (pydoc_data topics assert..compound, PSF licence)"}
    models = {"calibrated": load_model(args.checkpoint, attention_backend="msa", progress=False).model}
    if any(v.kind == "keys" for v in variants):
        models["keys"] = load_model("smollm2", attention_backend="msa", progress=False).model
    tokenizer = load_model(args.checkpoint, attention_backend="msa", progress=False).tokenizer
    ids = tokenizer.encode(Path(args.text).read_text())[: args.length]
    if len(ids) < args.length:
        raise SystemExit(f"{args.text} has {len(ids)} tokens; --length {args.length} needs as many")
    ppl: dict[str, float] = {}
    with torch.inference_mode():
        for variant in variants:
            ppl[variant.name] = run_variant(models, variant, ids)
            print(f"L={args.length} {variant.name}: ppl {ppl[variant.name]:.4f}", file=sys.stderr, flush=True)
            write(Path(args.out), args.length, ppl, models["calibrated"].config.page_size, meta)
    print_table(args.length, ppl, models["calibrated"].config.page_size)
    print(f"\nupdated {args.out}")
    return 0


def write(out: Path, length: int, ppl: dict[str, float], page_size: int, meta: dict) -> None:
    entries = json.loads(out.read_text()) if out.is_file() else {}
    tag = f"{length // 1024}k"
    for name, value in ppl.items():
        entries[f"quality.budget_ppl_{name}_{tag}"] = {"value": round(value, 4), "unit": "perplexity", **meta}
        if name != "dense" and "dense" in ppl:
            entries[f"quality.budget_ppl_ratio_{name}_{tag}"] = {
                "value": round(value / ppl["dense"], 4), "unit": "ratio", "note": f"P={page_size}", **meta}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(entries, indent=2) + "\n")


def print_table(length: int, ppl: dict[str, float], page_size: int) -> None:
    print(f"\nSmolLM2-135M, held-out pydoc text, L={length}, P={page_size}")
    head = f"{'variant':<28} {'budget tok':>10} {'ppl':>9} {'/dense':>8}"
    print(head)
    print("-" * len(head))
    for name, value in ppl.items():
        budget = "all" if name == "dense" else str(int(name.split("_k")[1].split("_")[0]) * page_size)
        budget += "+dense" if "_dense" in name else ""
        ratio = f"{value / ppl['dense']:.4f}" if "dense" in ppl else "-"
        print(f"{name:<28} {budget:>10} {value:>9.4f} {ratio:>8}")


if __name__ == "__main__":
    sys.exit(main())
