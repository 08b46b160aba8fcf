"""Generate the second routing trace: multi-turn agent sessions (seeded, Mooncake's row format).

The shape differs from the Mooncake trace on purpose (the router was tuned there): traffic comes
in sessions that share one of a few long system prompts, turns follow each other after a think
time, and agent turns fan out into bursts of parallel tool calls that share the conversation so
far. Rows: timestamp (ms), input_length, output_length, hash_ids (512-token prefix blocks: equal
ids = equal content up to the block's end, the partial last block included), session_id.

    python benchmarks/router/make_session_trace.py [--seed 0] [--sessions 300]
        [--out benchmarks/data/agent_sessions_trace.jsonl]
"""

import argparse
import json
import random
import sys
from pathlib import Path

BLOCK = 512
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "agent_sessions_trace.jsonl"
SYSTEM_PROMPTS = [(3_000, 0.15), (6_000, 0.35), (12_000, 0.3), (24_000, 0.2)]
"""(tokens, share of sessions): long shared system prompts (tool schemas, instructions)."""


class BlockIds:
    """Ids of 512-token prefix blocks: content is a list of segments (id, tokens); a block's id
    names everything up to its end, so two prompts share ids exactly as far as they share text."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.next_segment = 0

    def segment(self, tokens: int) -> tuple[int, int]:
        self.next_segment += 1
        return (self.next_segment, tokens)

    def hash_ids(self, segments: list[tuple[int, int]]) -> list[int]:
        total = sum(n for _, n in segments)
        ends = [min((b + 1) * BLOCK, total) for b in range(-(-total // BLOCK))]
        out, done, start, k = [], (), 0, 0
        for seg_id, n in segments:
            while k < len(ends) and ends[k] <= start + n:
                key = (done, seg_id, ends[k] - start)
                out.append(self.ids.setdefault(key, len(self.ids)))
                k += 1
            done = (done, seg_id)
            start += n
        return out


def session_rows(rng: random.Random, blocks: BlockIds, system: tuple[int, int], start_s: float,
                 session_id: str) -> list[dict]:
    """One session: 2-12 turns after think times; ~30% of turns fan out into 2-6 tool calls."""
    context = [system, blocks.segment(int(rng.uniform(200, 3_000)))]
    rows, t = [], start_s
    for _ in range(rng.randint(2, 12)):
        output = min(1_500, max(16, int(rng.lognormvariate(5.0, 0.8))))
        rows.append(_row(blocks, context, t, output, session_id))
        context = [*context, blocks.segment(output)]
        t += output * 0.02  # the answer streams
        if rng.random() < 0.3:  # an agent turn: parallel tool calls on the same context
            results = []
            for _ in range(rng.randint(2, 6)):
                call = [*context, blocks.segment(int(rng.uniform(100, 2_000)))]
                rows.append(_row(blocks, call, t + rng.uniform(0.05, 1.5), int(rng.uniform(20, 150)),
                                 session_id))
                results.append(call[-1])
            context = [*context, *results]
            t += 2.0
        t += rng.expovariate(1 / 15.0)  # the user thinks
        context = [*context, blocks.segment(int(rng.uniform(50, 800)))]
        if sum(n for _, n in context) > 120_000:
            break
    return rows


def _row(blocks: BlockIds, segments: list[tuple[int, int]], t: float, output: int, session_id: str) -> dict:
    return {"timestamp": int(t * 1000), "input_length": sum(n for _, n in segments),
            "output_length": output, "hash_ids": blocks.hash_ids(segments), "session_id": session_id}


def generate(seed: int, sessions: int, session_rate_per_s: float) -> list[dict]:
    rng = random.Random(seed)
    blocks = BlockIds()
    systems = [blocks.segment(tokens) for tokens, _ in SYSTEM_PROMPTS]
    weights = [share for _, share in SYSTEM_PROMPTS]
    rows, t = [], 0.0
    for i in range(sessions):
        t += rng.expovariate(session_rate_per_s)
        system = rng.choices(systems, weights)[0]
        rows += session_rows(rng, blocks, system, t, f"s{i}")
    return sorted(rows, key=lambda r: r["timestamp"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions", type=int, default=300)
    parser.add_argument("--session-rate", type=float, default=0.5, help="new sessions per second")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    rows = generate(args.seed, args.sessions, args.session_rate)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000
    mean_in = sum(r["input_length"] for r in rows) / len(rows)
    size = Path(args.out).stat().st_size
    print(f"{len(rows)} requests over {span:.0f} s ({len(rows) / span:.2f} req/s), mean input {mean_in:.0f} "
          f"tokens, {size / 1e6:.2f} MB → {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
