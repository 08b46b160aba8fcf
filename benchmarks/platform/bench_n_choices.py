"""How long an `n` = 16 (`--n`) chat request takes to start all its choices, against a real local Serve app
(SmolLM2 on the CPU default engine), streamed through the `openai` client.

The stream's first chunk is sent once every choice has started (`choices.start_choices` returns
then), so its arrival time is the start latency: the first choice's prefill and first token, then
the other n − 1 — one after another before they were started together (each waiting for the
previous one's first token), together since. Also measured: the whole request, and an n = 1
request's time to its first chunk for scale. Median of REPEATS, written to
benchmarks/results/api_n_choices.json (`api.n16_start_s`, `api.n16_e2e_s`, `api.n1_start_s`).

    .venv/bin/python benchmarks/platform/bench_n_choices.py [--n 16] [--tokens 4] [--repeats 5]
        [--suffix _before --revision R]

`--suffix` and `--revision` label a run of another checkout (PYTHONPATH pointing at it), so that
before and after sit side by side in the same file.
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

import openai

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from local_serve_app import start_live_app  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "api_n_choices.json"
MODEL = "msaserve/smollm2"
CONFIG = {"model": {"spec": "smollm2"}, "engine": {"max_model_len": 2048, "max_num_seqs": 16}}
PROMPT = "Write a short poem about the sea, the wind and a lighthouse keeper who counts the waves."


def timed(client: openai.OpenAI, n: int, seed: int, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first chunk, seconds to the end) of one streamed request."""
    start = time.perf_counter()
    first = None
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], n=n, seed=seed, temperature=1.0,
        max_tokens=max_tokens, stream=True,
    )
    for _ in stream:
        first = first if first is not None else time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--suffix", default="")
    parser.add_argument("--revision", default=None)
    args = parser.parse_args()
    n = args.n
    runs: dict[str, list[float]] = {f"n{n}_start_s": [], f"n{n}_e2e_s": [], "n1_start_s": []}
    with start_live_app(CONFIG, num_cpus=2) as app:
        client = openai.OpenAI(base_url=app.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        timed(client, n, 0, 2)  # warm-up: first prefill, router caches
        for r in range(args.repeats):  # a new seed each time; the prompt's pages are cached after the first
            start, end = timed(client, n, r + 1, args.tokens)
            runs[f"n{n}_start_s"].append(start)
            runs[f"n{n}_e2e_s"].append(end)
            runs["n1_start_s"].append(timed(client, 1, r + 1, args.tokens)[0])
    revision = args.revision or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                               text=True, cwd=ROOT).stdout.strip()
    common = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "hardware": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared)",
        "model": "SmolLM2-135M-Instruct (CPU default engine), one model replica, local Ray Serve",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_revision": revision,
        "note": f"streamed chat, {args.tokens} output tokens per choice, temperature 1, median of "
                f"{args.repeats}; shared 2-core machine under load (other sessions' tests): noisy",
    }
    record = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for name, values in runs.items():
        record[f"api.{name}{args.suffix}"] = {"value": round(statistics.median(values), 3), "unit": "s",
                                              **common, "runs": [round(v, 3) for v in values]}
    RESULTS.write_text(json.dumps(dict(sorted(record.items())), indent=2) + "\n")
    print(f"{'metric':<22} {'median s':>9}  runs")
    for name, values in runs.items():
        print(f"{name + args.suffix:<22} {statistics.median(values):>9.3f}  {[round(v, 2) for v in values]}")


if __name__ == "__main__":
    main()
