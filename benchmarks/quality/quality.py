"""What MSA costs in quality on a real model: SmolLM2-135M-Instruct, dense vs MSA (P=64, K=16,
a 1,024-token budget), on long real text, on the CPU.

Per context length L (default 4,096 and 8,192 tokens of the Python stdlib's argparse.py):
- perplexity over the L-token window, dense and MSA, and their ratio;
- greedy-token agreement over G=256 generated tokens: the prompt is the window's first L−G
  tokens, so prompt + output = L. Dense generates greedily; MSA is scored two ways:
  teacher-forced (MSA's argmax given dense's own prefix equals dense's token) and free-running
  (MSA generates on its own; fraction of positions equal, and the first position that differs);
- the time of one forward pass over the first length's window (last-token logits) of ours,
  dense and MSA, beside `transformers` loading the same GGUF.

Run: .venv/bin/python benchmarks/quality/quality.py   (several minutes on 2 cores)
Writes benchmarks/results/quality.json (`quality.<metric>` entries) and prints a table last.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # reference_decode: the single-sequence reference the tests use

from reference_decode import SequenceState  # noqa: E402

from msaserve.models.gguf_loader import smollm2_gguf_path  # noqa: E402
from msaserve.models.loader import load_model  # noqa: E402
from msaserve.models.transformer import MSATransformer  # noqa: E402

BACKENDS = {"dense": "dense", "msa": "msa"}  # our backend name for each column (msa: the CPU ops)
LOGIT_ROWS = 1024  # rows of [rows, vocab] fp32 logits materialised at once


def nll_sum(model: MSATransformer, hidden: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum of -log p(target) for hidden [N, H] predicting targets [N]."""
    total = 0.0
    for i in range(0, hidden.shape[0], LOGIT_ROWS):
        logits = model.compute_logits(hidden[i : i + LOGIT_ROWS])
        logp = torch.log_softmax(logits, dim=-1)
        total -= float(logp.gather(1, targets[i : i + LOGIT_ROWS, None]).sum())
    return total


def greedy_decode(model: MSATransformer, state: SequenceState, last_hidden: torch.Tensor,
                  start: int, count: int) -> list[int]:
    """Greedy tokens at positions start.. given the hidden state of position start-1.

    One thread: a decode step is too small to split, and on a shared 2-core machine a second
    thread spinning for a busy core made steps 8× slower (0.47 s vs 0.06 s at 1K context).
    """
    tokens: list[int] = []
    hidden = last_hidden
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(count):
            tokens.append(int(model.compute_logits(hidden)[0].argmax()))
            if i + 1 < count:
                hidden = state.forward([tokens[-1]], start + i, decode=True)
    finally:
        torch.set_num_threads(threads)
    return tokens


def evaluate_length(model: MSATransformer, ids: list[int], gen: int) -> dict[str, dict[str, float]]:
    """Perplexity and generation for both backends on one window `ids` of length L."""
    length, prompt_len = len(ids), len(ids) - gen
    targets = torch.tensor(ids[1:])
    results: dict[str, dict[str, float]] = {}
    dense_tokens: list[int] = []
    for column, backend in BACKENDS.items():
        model.attention_backend = backend
        SequenceState(model, 256).forward(ids[:256], 0)  # warm-up: first calls allocate and init
        state = SequenceState(model, length)
        started = time.perf_counter()
        hidden = state.forward(ids, 0)  # [L, H]: one forward pass over the whole window
        model.compute_logits(hidden[-1:])
        row = {"forward_s": time.perf_counter() - started}
        row["ppl"] = float(torch.tensor(nll_sum(model, hidden[:-1], targets) / targets.numel()).exp())
        # The cache now holds the window; generating from the prompt's end rewrites slots
        # prompt_len.. in order, and a position only reads slots ≤ itself, so this is exact.
        prompt_last = hidden[prompt_len - 1 : prompt_len]
        started = time.perf_counter()
        tokens = greedy_decode(model, state, prompt_last, prompt_len, gen)
        row["decode_s_per_token"] = (time.perf_counter() - started) / gen
        if column == "dense":
            dense_tokens = tokens
        else:
            forced = state.forward(dense_tokens[:-1], prompt_len)  # MSA given dense's prefix
            predicted = [int(model.compute_logits(prompt_last)[0].argmax())]
            predicted += model.compute_logits(forced).argmax(dim=-1).tolist()
            row["agree_teacher_forced"] = sum(map(int.__eq__, predicted, dense_tokens)) / gen
            row["agree_free_running"] = sum(map(int.__eq__, tokens, dense_tokens)) / gen
            diverge = [i for i, (x, y) in enumerate(zip(tokens, dense_tokens, strict=True)) if x != y]
            row["first_divergence"] = float(diverge[0]) if diverge else float(gen)
        results[column] = row
    return results


def transformers_forward_s(ids: list[int]) -> float:
    """Wall seconds of one `transformers` forward pass (last-token logits) on the same GGUF,
    after a 256-token warm-up."""
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf(torch.tensor([ids[:256]]), logits_to_keep=1)
    started = time.perf_counter()
    hf(torch.tensor([ids]), logits_to_keep=1)
    return time.perf_counter() - started


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0]
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), " \
        f"load average {load:.1f} at start (machine shared)"


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", default=argparse.__file__, help="long text file (default: argparse.py)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192],
                        help="context lengths; forward passes are timed at the first")
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers timing")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quality.json"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    host = hardware()
    loaded = load_model("smollm2", attention_backend="dense")
    ids = loaded.tokenizer.encode(Path(args.text).read_text())
    if len(ids) < max(args.lengths):
        raise SystemExit(f"{args.text} has {len(ids)} tokens; need {max(args.lengths)}")
    meta = {"command": "python " + " ".join(sys.argv), "hardware": host,
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "git_revision": git_revision()}
    per_length: dict[int, dict] = {}
    times: dict[str, float] = {}
    timed = args.lengths[0]
    with torch.inference_mode():
        for length in args.lengths:
            print(f"evaluating L={length} ...", file=sys.stderr)
            per_length[length] = evaluate_length(loaded.model, ids[:length], args.gen_tokens)
            print(json.dumps(per_length[length]), file=sys.stderr)
            if length == timed:
                times = {f"ours_{c}": per_length[length][c]["forward_s"] for c in BACKENDS}
                if not args.no_transformers:
                    print(f"timing transformers' {timed}-token forward pass ...", file=sys.stderr)
                    times["transformers"] = transformers_forward_s(ids[:timed])
            # Written after every length, so an interrupted run keeps what it measured.
            write_results(Path(args.out), per_length, times, timed, meta)
    print_table(per_length, times, timed, args, loaded.config.page_size * loaded.config.top_k, host)
    print(f"\nwrote {args.out}")
    return 0


def write_results(out: Path, per_length: dict, times: dict, timed: int, meta: dict) -> None:
    entries = {}

    def put(name: str, value: float, unit: str) -> None:
        entries[f"quality.{name}"] = {"value": round(value, 4), "unit": unit, **meta}

    for length, res in per_length.items():
        tag = f"{length // 1024}k"
        put(f"smollm2_ppl_dense_{tag}", res["dense"]["ppl"], "perplexity")
        put(f"smollm2_ppl_msa_{tag}", res["msa"]["ppl"], "perplexity")
        put(f"smollm2_ppl_ratio_msa_over_dense_{tag}", res["msa"]["ppl"] / res["dense"]["ppl"], "ratio")
        put(f"smollm2_greedy_agreement_teacher_forced_{tag}", res["msa"]["agree_teacher_forced"], "fraction")
        put(f"smollm2_greedy_agreement_free_running_{tag}", res["msa"]["agree_free_running"], "fraction")
        put(f"smollm2_greedy_first_divergence_{tag}", res["msa"]["first_divergence"], "tokens")
        for column in BACKENDS:
            put(f"smollm2_decode_ms_per_token_{column}_{tag}", 1e3 * res[column]["decode_s_per_token"], "ms")
    for name, seconds in times.items():
        put(f"smollm2_forward_{timed}_tokens_{name}_s", seconds, "s")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(entries, indent=2) + "\n")


def print_table(per_length: dict, times: dict, timed: int, args: argparse.Namespace, budget: int,
                host: str) -> None:
    print(f"\nSmolLM2-135M-Instruct (Q4_1 GGUF → fp32), text {Path(args.text).name}; MSA P=64 K=16 "
          f"(budget {budget} tokens); {host}")
    head = f"{'L':>6} {'ppl dense':>10} {'ppl MSA':>10} {'ratio':>7} {'agree TF':>9} {'agree free':>11} " \
        f"{'1st diff':>9} {'decode ms/tok d/MSA':>20}"
    print(head)
    print("-" * len(head))
    for length, res in per_length.items():
        d, m = res["dense"], res["msa"]
        decode = f"{1e3 * d['decode_s_per_token']:.0f}/{1e3 * m['decode_s_per_token']:.0f}"
        print(f"{length:>6} {d['ppl']:>10.3f} {m['ppl']:>10.3f} {m['ppl'] / d['ppl']:>7.4f} "
              f"{m['agree_teacher_forced']:>9.3f} {m['agree_free_running']:>11.3f} "
              f"{m['first_divergence']:>9.0f} {decode:>20}")
    print(f"(decode ms/token with 1 thread; other timings with {torch.get_num_threads()} threads)")
    print(f"\n{timed}-token forward pass (last-token logits), wall seconds:")
    for name, seconds in times.items():
        print(f"  {name:<14} {seconds:8.2f} s")


if __name__ == "__main__":
    sys.exit(main())
