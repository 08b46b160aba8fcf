"""Long-context retrieval, dense vs MSA: a needle ("The pass code of <name> is <5 digits>.") hidden at
10 depths in held-out real text of 3 lengths; the prompt ends with the question and the answer's
lead-in, and the model must greedily continue with the digits. Same prompts, same weights, both
sides; a case is correct iff the greedy tokens equal the answer's tokens exactly.

Small enough for a shared 2-core CPU: one prefill per case plus a few decode steps (SmolLM2-135M
at 2K/4K/8K, 10 depths each = 30 cases per side).

Run: .venv/bin/python benchmarks/quality/needle.py --checkpoint OUT [--lengths 2048 4096 8192]
Writes benchmarks/results/quality_needle.json (`quality.needle_*` entries) and prints a table last.
"""

import argparse
import json
import random
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import git_revision, hardware  # noqa: E402
from reference_decode import SequenceState  # noqa: E402

from msaserve.models.loader import load_model  # noqa: E402
from msaserve.models.tokenizer import Tokenizer  # noqa: E402
from msaserve.models.transformer import MSATransformer  # noqa: E402

NAMES = ("Alder", "Birch", "Cedar", "Dahlia", "Elm", "Fern", "Gorse", "Hazel", "Iris", "Juniper")
QUESTION = "\n\nQuestion: what is the pass code of {name}?\nAnswer: The pass code of {name} is"


def make_case(tokenizer: Tokenizer, haystack: list[int], length: int, depth: float,
              rng: random.Random) -> tuple[list[int], list[int]]:
    """(prompt ids of exactly `length` tokens, answer ids): the needle sentence inserted at a
    sentence boundary near `depth` of the haystack, the question at the end."""
    name, code = rng.choice(NAMES), f"{rng.randrange(10000, 100000)}"
    needle = tokenizer.encode(f" The pass code of {name} is {code}. ")
    question = tokenizer.encode(QUESTION.format(name=name))
    answer = tokenizer.encode(f" {code}.")[:-1]  # the digits (the full stop only closes them)
    body = length - len(needle) - len(question)
    at = int(depth * body)
    text = haystack[:body]
    return text[:at] + needle + text[at:] + question, answer


def greedy(model: MSATransformer, prompt: list[int], count: int) -> list[int]:
    """Greedy tokens after one prefill of `prompt`; decode steps on one thread (a step is too small
    to split, and on the shared machine a second thread waiting for a busy core slows it)."""
    state = SequenceState(model, len(prompt) + count)
    hidden = state.forward(prompt, 0)[-1:]
    out: list[int] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(count):
            out.append(int(model.compute_logits(hidden)[0].argmax()))
            if i + 1 < count:
                hidden = state.forward([out[-1]], len(prompt) + i, decode=True)
    finally:
        torch.set_num_threads(threads)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="the directory `msaserve convert` wrote")
    parser.add_argument("--text", default=str(ROOT / "benchmarks/data/quality_eval_text.txt"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--depths", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quality_needle.json"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    meta = {"command": "python " + " ".join(sys.argv), "hardware": hardware(),
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "git_revision": git_revision(),
            "text": "benchmarks/data/quality_eval_text.txt (pydoc_data topics assert..compound, PSF licence)"}
    loaded = load_model(args.checkpoint, attention_backend="msa", progress=False)
    haystack = loaded.tokenizer.encode(Path(args.text).read_text())
    rng = random.Random(0)
    rows: dict[int, dict[str, list[bool]]] = {}
    with torch.inference_mode():
        for length in args.lengths:
            rows[length] = {"dense": [], "msa": []}
            for d in range(args.depths):
                prompt, answer = make_case(loaded.tokenizer, haystack, length, d / (args.depths - 1), rng)
                for backend in ("dense", "msa"):
                    loaded.model.attention_backend = backend
                    ok = greedy(loaded.model, prompt, len(answer)) == answer
                    rows[length][backend].append(ok)
                got = {b: rows[length][b][-1] for b in ("dense", "msa")}
                print(f"L={length} depth {d}: {got}", file=sys.stderr, flush=True)
            write(Path(args.out), rows, meta, loaded.config)
    print_table(rows, loaded.config)
    print(f"\nwrote {args.out}")
    return 0


def accuracy(hits: list[bool]) -> float:
    return 100.0 * sum(hits) / max(len(hits), 1)


def write(out: Path, rows: dict, meta: dict, config) -> None:
    note = f"MSA P={config.page_size} K={config.top_k} n_init={config.n_init} n_local={config.n_local}"
    entries = {}
    for backend in ("dense", "msa"):
        hits = [h for row in rows.values() for h in row[backend]]
        entries[f"quality.needle_accuracy_{backend}"] = {
            "value": round(accuracy(hits), 2), "unit": "percent",
            "note": f"{len(hits)} cases: lengths {sorted(rows)} x {len(hits) // len(rows)} depths; {note}",
            **meta}
        for length, row in rows.items():
            entries[f"quality.needle_accuracy_{backend}_{length // 1024}k"] = {
                "value": round(accuracy(row[backend]), 2), "unit": "percent", "note": note, **meta}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(entries, indent=2) + "\n")


def print_table(rows: dict, config) -> None:
    print(f"\nNeedle retrieval, SmolLM2-135M converted (P={config.page_size} K={config.top_k}, dense layers "
          f"{list(config.dense_layers)}), held-out text")
    head = f"{'L':>6} {'dense %':>8} {'MSA %':>8}  per depth (dense/MSA)"
    print(head)
    print("-" * len(head))
    for length, row in rows.items():
        marks = " ".join(f"{int(a)}{int(b)}" for a, b in zip(row["dense"], row["msa"], strict=True))
        print(f"{length:>6} {accuracy(row['dense']):>8.1f} {accuracy(row['msa']):>8.1f}  {marks}")
    total = {b: [h for row in rows.values() for h in row[b]] for b in ("dense", "msa")}
    print(f"{'all':>6} {accuracy(total['dense']):>8.1f} {accuracy(total['msa']):>8.1f}")


if __name__ == "__main__":
    sys.exit(main())
