"""What the calibrated index buys: SmolLM2-135M-Instruct dense vs MSA with the training-free index
(`index_source: keys`) vs MSA with the calibrated index (`msaserve convert`), on held-out real text.

Text: benchmarks/data/quality_eval_text.txt (Python's language-reference prose, disjoint from the
calibration text; see benchmarks/data/README.md). Per context length L:
- perplexity over the L-token window (one prefill, all positions scored), each MSA over dense;
- at the first length, the attention-mass recall of the selected blocks per layer (the dense
  attention mass, averaged over the group's heads, inside the K selected blocks), for the
  training-free, calibrated and Quest-style (page min/max) scores on the same held-out queries.

Run first: msaserve convert --model smollm2 --out OUT \
               --calibration-text benchmarks/data/quality_calibration_text.txt
then:      .venv/bin/python benchmarks/quality/calibrated.py --checkpoint OUT [--lengths 4096 8192]
Updates benchmarks/results/quality.json (`quality.*` entries) and prints a table last.
"""

import argparse
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

from msaserve.kernels.indexer_prefill.naive import select_blocks  # noqa: E402
from msaserve.models.index_calibration import (  # noqa: E402
    block_scores_of,
    layer_inputs,
    prepare_layer,
    quest_scores,
    recall,
)
from msaserve.models.loader import load_model  # noqa: E402
from msaserve.models.transformer import MSATransformer  # noqa: E402

COLUMNS = {"dense": ("source", "dense"), "keys": ("source", "msa"), "calibrated": ("checkpoint", "msa")}


def perplexity(model: MSATransformer, backend: str, ids: list[int]) -> float:
    model.attention_backend = backend
    hidden = SequenceState(model, len(ids)).forward(ids, 0)
    targets = torch.tensor(ids[1:])
    return float(torch.tensor(nll_sum(model, hidden[:-1], targets) / targets.numel()).exp())


def layer_recalls(calibrated: MSATransformer, ids: list[int], queries: int) -> list[dict[str, float]]:
    """Per layer: recall of the keys / calibrated / Quest selections at `queries` held-out positions."""
    c = calibrated.config
    state = SequenceState(calibrated, len(ids))
    meta = step_metadata(0, len(ids), state.max_pages, c.page_size, False, torch.device("cpu"))
    calibrated.attention_backend = "dense"
    inputs = layer_inputs(calibrated, lambda: calibrated(torch.tensor(ids), meta, state.caches))
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(c.top_k * c.page_size, len(ids), (queries,), generator=gen).sort().values
    rows = []
    for index, x in enumerate(inputs):
        data = prepare_layer(calibrated, index, x)
        attn = calibrated.layers[index].self_attn
        mass = data.mass(positions)
        xs = x[positions].float()
        cos_sin = _rotary(calibrated, positions)
        mean_q = (xs @ attn.q_proj.weight.float().T).view(-1, c.num_kv_heads, c.group_size, c.head_dim)
        mean_q = mean_q.mean(2)
        learned_q = (xs @ attn.index_q_proj.weight.float().T).view(-1, c.num_kv_heads, c.head_dim)
        mean_q, learned_q = (_apply(q, *cos_sin) for q in (mean_q, learned_q))
        scores = {
            "keys": block_scores_of(mean_q, data.keys, positions, c.page_size),
            "calibrated": block_scores_of(learned_q, data.keys, positions, c.page_size),
            "quest": quest_scores(mean_q, data.keys, positions, c.page_size),
        }
        rows.append({
            name: recall(select_blocks(s, positions, c.page_size, c.top_k, c.n_init, c.n_local), mass)
            for name, s in scores.items()
        })
        inputs[index] = torch.empty(0)
    return rows


def _rotary(model: MSATransformer, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from msaserve.kernels.rotary import rotary_cos_sin

    return rotary_cos_sin(positions, model.config.head_dim, model.config.rope_theta, torch.float32)


def _apply(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from msaserve.kernels.rotary import apply_rotary

    return apply_rotary(q, cos, sin)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="the directory `msaserve convert` wrote")
    parser.add_argument("--text", default=str(ROOT / "benchmarks/data/quality_eval_text.txt"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--recall-queries", type=int, default=256)
    parser.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=list(COLUMNS),
                        help="which perplexities to measure (default all; dense is the reference)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quality.json"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    meta = {"command": "python " + " ".join(sys.argv), "hardware": hardware(),
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "git_revision": git_revision(),
            "text": "benchmarks/data/quality_eval_text.txt (pydoc_data topics assert..compound, PSF licence)"}
    models = {"source": load_model("smollm2", attention_backend="dense", progress=False),
              "checkpoint": load_model(args.checkpoint, attention_backend="msa", progress=False)}
    c = models["checkpoint"].config
    dense = f", dense layers {list(c.dense_layers)}" if c.dense_layers else ""
    meta["msa_model"] = (f"{args.checkpoint}: calibrated index, P={c.page_size} K={c.top_k} "
                         f"n_init={c.n_init} n_local={c.n_local}{dense}; rope as the source "
                         f"(theta {c.rope_theta:g}, "
                         f"no scaling; native context {c.max_position_embeddings})")
    ids = models["source"].tokenizer.encode(Path(args.text).read_text())
    ppl: dict[int, dict[str, float]] = {}
    recalls: list[dict[str, float]] = []
    with torch.inference_mode():
        for length in args.lengths:
            ppl[length] = {}
            for column, (which, backend) in COLUMNS.items():
                if column not in args.columns:
                    continue
                ppl[length][column] = perplexity(models[which].model, backend, ids[:length])
                print(f"L={length} {column}: ppl {ppl[length][column]:.4f}", file=sys.stderr)
            write(Path(args.out), ppl, recalls, meta)
        recalls = layer_recalls(models["checkpoint"].model, ids[: args.lengths[0]], args.recall_queries)
        write(Path(args.out), ppl, recalls, meta)
    print_table(ppl, recalls, args.lengths[0])
    print(f"\nupdated {args.out}")
    return 0


def write(out: Path, ppl: dict, recalls: list, meta: dict) -> None:
    entries = json.loads(out.read_text()) if out.is_file() else {}

    def put(name: str, value: float, unit: str, note: str = "") -> None:
        entry = {"value": round(value, 4), "unit": unit, **meta}
        entries[f"quality.{name}"] = {**entry, "note": note} if note else entry

    for length, row in ppl.items():
        tag = f"{length // 1024}k"
        put(f"smollm2_ppl_dense_{tag}", row["dense"], "perplexity")
        if "keys" in row:
            put(f"smollm2_ppl_msa_keys_{tag}", row["keys"], "perplexity",
                "training-free index (index_source keys)")
            put(f"smollm2_ppl_ratio_msa_keys_over_dense_{tag}", row["keys"] / row["dense"], "ratio",
                "training-free index (index_source keys)")
        if "calibrated" in row:
            put(f"smollm2_ppl_msa_{tag}", row["calibrated"], "perplexity",
                "calibrated index (msaserve convert)")
            put(f"smollm2_ppl_ratio_msa_over_dense_{tag}", row["calibrated"] / row["dense"], "ratio",
                "calibrated index (msaserve convert)")
    if recalls:
        for name in recalls[0]:
            mean = sum(r[name] for r in recalls) / len(recalls)
            put(f"smollm2_attention_recall_{name}", mean, "fraction",
                "mean over layers; per layer: " + " ".join(f"{r[name]:.3f}" for r in recalls))
    out.write_text(json.dumps(entries, indent=2) + "\n")


def print_table(ppl: dict, recalls: list, recall_length: int) -> None:
    print("\nSmolLM2-135M, held-out pydoc text (MSA settings: the entries' msa_model)")
    head = f"{'L':>6} {'ppl dense':>10} {'ppl keys':>10} {'ppl calib':>10} {'keys/dense':>11} " \
        f"{'calib/dense':>12}"
    print(head)
    print("-" * len(head))
    nan = float("nan")
    for length, row in ppl.items():
        keys, calibrated = row.get("keys", nan), row.get("calibrated", nan)
        print(f"{length:>6} {row['dense']:>10.4f} {keys:>10.4f} {calibrated:>10.4f} "
              f"{keys / row['dense']:>11.4f} {calibrated / row['dense']:>12.4f}")
    if recalls:
        print(f"\nattention-mass recall of the selected blocks at L={recall_length} (per layer)")
        print(f"{'layer':>5} {'keys':>7} {'calib':>7} {'quest':>7}")
        for i, r in enumerate(recalls):
            print(f"{i:>5} {r['keys']:>7.3f} {r['calibrated']:>7.3f} {r['quest']:>7.3f}")
        means = {k: sum(r[k] for r in recalls) / len(recalls) for k in recalls[0]}
        print(f"{'mean':>5} {means['keys']:>7.3f} {means['calibrated']:>7.3f} {means['quest']:>7.3f}")


if __name__ == "__main__":
    sys.exit(main())
