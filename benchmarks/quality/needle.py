"""Long-context retrieval, dense vs MSA: 10 needles ("The pass code of <name> is <5 digits>.", 10
different names) hidden at 10 depths (0 %, 11 %, ..., 100 %) of held-out real text, at 3 lengths.
After the haystack, each needle is asked for in turn ("Question: what is the pass code of <name>?
Answer: The pass code of <name> is") and the model must greedily continue with its digits; a case
is correct iff the greedy tokens equal the answer's tokens exactly. Same prompts, same weights,
both sides. All needles are present at once (a multi-key needle test, as RULER's): the model must
pick the asked one among ten look-alikes.

Small enough for a shared 2-core CPU: the haystack with its needles is prefilled once per length
and side; each question is then prefilled as a chunk after it (positions L.., rewritten by the
next question, and a position only reads positions ≤ itself, so every question sees exactly the
haystack) and a few tokens decoded — SmolLM2-135M at 2K/4K/8K, 10 depths each = 30 cases per side.

Run: .venv/bin/python benchmarks/quality/needle.py --checkpoint OUT [--lengths 2048 4096 8192]
Writes benchmarks/results/quality_needle.json (`quality.needle_*` entries) and prints a table last.
"""

import argparse
import json
import random
import sys
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Needle:
    name: str
    question: list[int]  # the question and the answer's lead-in, after the haystack
    answer: list[int]  # the digits' tokens


def make_haystack(tokenizer: Tokenizer, text: list[int], length: int, depths: int,
                  rng: random.Random) -> tuple[list[int], list[Needle]]:
    """(prompt ids, needles in depth order): `depths` needle sentences, each with its own name and
    code, inserted at depths 0..1 of `length` − (longest question) tokens of `text`."""
    names = rng.sample(NAMES, depths)
    codes = [f"{rng.randrange(10000, 100000)}" for _ in names]
    pairs = list(zip(names, codes, strict=True))
    sentences = [tokenizer.encode(f" The pass code of {n} is {c}. ") for n, c in pairs]
    needles = [Needle(n, tokenizer.encode(QUESTION.format(name=n)), tokenizer.encode(f" {c}.")[:-1])
               for n, c in pairs]
    room = length - max(len(n.question) for n in needles) - sum(map(len, sentences))
    cuts = [round(d / (depths - 1) * room) for d in range(depths)]
    prompt: list[int] = []
    for i, sentence in enumerate(sentences):
        prompt += text[cuts[i - 1] if i else 0 : cuts[i]] + sentence
    return prompt + text[cuts[-1] : room], needles


def answers(model: MSATransformer, haystack: list[int], needles: list[Needle]) -> list[bool]:
    """Prefill the haystack once, then per needle its question as a chunk after it and greedy digits."""
    longest = max(len(n.question) + len(n.answer) for n in needles)
    state = SequenceState(model, len(haystack) + longest)
    state.forward(haystack, 0)
    return [greedy(model, state, n.question, len(haystack), len(n.answer)) == n.answer for n in needles]


def greedy(model: MSATransformer, state: SequenceState, question: list[int], start: int,
           count: int) -> list[int]:
    """Greedy tokens after prefilling `question` at `start`; decode steps on one thread (a step is
    too small to split, and on the shared machine a second thread waiting for a busy core slows it)."""
    hidden = state.forward(question, start)[-1:]
    out: list[int] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(count):
            out.append(int(model.compute_logits(hidden)[0].argmax()))
            if i + 1 < count:
                hidden = state.forward([out[-1]], start + len(question) + i, decode=True)
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
            prompt, needles = make_haystack(loaded.tokenizer, haystack, length, args.depths, rng)
            rows[length] = {}
            for backend in ("dense", "msa"):
                loaded.model.attention_backend = backend
                rows[length][backend] = answers(loaded.model, prompt, needles)
                print(f"L={length} {backend}: {rows[length][backend]}", file=sys.stderr, flush=True)
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
            "note": f"{len(hits)} cases: lengths {sorted(rows)} x {len(hits) // len(rows)} depths, all "
                    f"needles in one haystack per length (multi-key); {note}",
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
