"""Cost of structured decoding in a batch: output tokens/s of SmolLM2 on the CPU default engine at
concurrency 8 with 0 / 50 / 100 % of the requests constrained by a grammar; written to
benchmarks/results/api.json (`api.structured_overhead_pct_c8` = slowdown of the 100 % batch vs 0 %).

Every request makes exactly OUTPUT_TOKENS tokens (free ones ignore EOS; constrained ones follow a
JSON schema whose only string is longer than that, so none ends early), so tokens/s compare alike.
The grammar is compiled and llguidance's tokenizer built before timing (both are one-off costs,
reported by bench_grammars.py). Median of REPEATS runs.

    .venv/bin/python benchmarks/platform/bench_structured_overhead.py [--tokens 16] [--repeats 1]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, GrammarSpec, SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "results" / "api.json"
CONCURRENCY = 8
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
          "required": ["story"], "additionalProperties": False}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))


def run(engine: LLMEngine, prompts: list[list[int]], num_constrained: int, tag: str, output_tokens: int
        ) -> float:
    """Output tokens/s of one batch of CONCURRENCY requests."""
    for i, prompt in enumerate(prompts):
        grammar = SPEC if i < num_constrained else None
        params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=grammar is None,
                                grammar=grammar)
        engine.add_request(GenerateRequest(f"{tag}-{i}", prompt, params))
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running) or \
            engine.scheduler.waiting:  # prefill untimed: the decode steps are what the mask touches
        engine.step()
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(out.token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=48, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model="smollm2", max_num_seqs=CONCURRENCY))
    prompts = [engine.tokenizer.encode(f"Write a long story about topic number {i}.")
               for i in range(CONCURRENCY)]
    run(engine, prompts, CONCURRENCY, "warmup", 4)  # builds llguidance's tokenizer, compiles the grammar
    run(engine, prompts, 0, "warmup-free", 4)
    shares = {0: 0, 50: CONCURRENCY // 2, 100: CONCURRENCY}
    runs: dict[int, list[float]] = {pct: [] for pct in shares}
    for r in range(args.repeats):  # interleaved, so drift in the machine's load hits every share alike
        for pct, n in shares.items():
            runs[pct].append(run(engine, prompts, n, f"{pct}-{r}", args.tokens))
    tok_s = {pct: statistics.median(values) for pct, values in runs.items()}
    overhead = {pct: 100.0 * (tok_s[0] - v) / tok_s[0] for pct, v in tok_s.items()}
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    common = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "hardware": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared), torch {torch.__version__}",
        "model": "SmolLM2-135M-Instruct (CPU default engine)",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_revision": revision.strip(),
        "note": f"c={CONCURRENCY}, {args.tokens} greedy output tokens each, decode steps only "
                f"(prefill untimed), median of {args.repeats}; llguidance json_schema grammar; "
                f"shared 2-core machine under load (other sessions' tests): noisy",
    }
    record = {f"api.structured_tok_s_c8_{pct}pct": {"value": round(v, 2), "unit": "tokens/s", **common,
                                                     "runs": [round(x, 2) for x in runs[pct]]}
              for pct, v in tok_s.items()}
    record["api.structured_overhead_pct_c8"] = {"value": round(overhead[100], 2), "unit": "%", **common,
                                                "note": common["note"] + "; 100 % constrained vs 0 %"}
    record["api.structured_overhead_pct_c8_half"] = {"value": round(overhead[50], 2), "unit": "%", **common,
                                                     "note": common["note"] + "; 50 % constrained vs 0 %"}
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'constrained':>11} {'tokens/s':>9} {'overhead %':>11}", flush=True)
    for pct in shares:
        print(f"{pct:>10}% {tok_s[pct]:>9.1f} {overhead[pct]:>11.1f}")


if __name__ == "__main__":
    main()
