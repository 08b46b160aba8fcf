"""Drain and failure of replicas with live sessions: how many sessions are lost, and the write-behind lag.

Replicas are in-process `LLMEngine`s (the `tiny` preset, CPU) sharing one KV cache service. Every
session starts on replica r0 or r1 and is stepped mid-turn; then r0 **drains** (its sessions are
persisted, released and adopted by the least-loaded replicas the router's `plan_moves` picks) and
r1 **fails** (no warning: its sessions continue on other replicas from their records plus the tokens
the client already received). A session is lost if it does not finish or its tokens differ from
a run on one replica that never moved. The write-behind lag (tokens generated and not yet in the
service's record) is sampled after every step of the replicas.

    python benchmarks/kvcache/drain.py            # 12 sessions, 4 replicas
"""

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from msaserve.engine.config import EngineConfig  # noqa: E402
from msaserve.engine.kv.moves import move_in, move_out, persist_lag_tokens  # noqa: E402
from msaserve.engine.kv.pages import identity_for  # noqa: E402
from msaserve.engine.llm_engine import LLMEngine  # noqa: E402
from msaserve.engine.types import GenerateRequest, SamplingParams  # noqa: E402
from msaserve.kvcache.client import KVCacheClient  # noqa: E402
from msaserve.kvcache.config import ServiceConfig  # noqa: E402
from msaserve.models.presets import get_preset  # noqa: E402
from msaserve.models.transformer import MSATransformer, init_random_weights  # noqa: E402
from msaserve.router.moves import plan_moves  # noqa: E402
from msaserve.router.state import RouterState  # noqa: E402


def new_engine(model, client, sync_every: int) -> LLMEngine:
    config = EngineConfig(
        model="tiny",
        attention_backend="msa",
        num_pages=512,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=2048,
    )
    engine = LLMEngine(config, model=model, kv_client=client)
    if engine.sessions is not None:
        engine.sessions.sync_every = sync_every
    return engine


def step_all(
    engines: dict[str, LLMEngine], out: dict[str, list[int]], steps: int | None, lags: list[int]
) -> None:
    """Step every engine `steps` times (None: until idle), collecting tokens per session."""
    done = 0
    while any(e.has_unfinished() for e in engines.values()) and (steps is None or done < steps):
        for engine in engines.values():
            for output in engine.step():
                out.setdefault(output.request_id.split("/")[0], []).extend(output.token_ids)
            lags.append(persist_lag_tokens(engine))
        done += 1


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    model = init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).eval()
    generator = torch.Generator().manual_seed(7)
    prompts = {
        f"s{i}": torch.randint(3, 512, (args.prompt_len + 13 * i,), generator=generator).tolist()
        for i in range(args.sessions)
    }
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    reference: dict[str, list[int]] = {}
    ref = new_engine(model, None, args.sync_every)
    for sid, prompt in prompts.items():
        ref.add_request(GenerateRequest(sid, prompt, sampling))
    step_all({"ref": ref}, reference, None, [])

    client = KVCacheClient.in_process(
        ServiceConfig(num_shards=4, memory_bytes=256 << 20),
        identity_for(model.config, "tiny@seed0", torch.float32),
    )
    engines = {f"r{i}": new_engine(model, client, args.sync_every) for i in range(args.replicas)}
    router = RouterState()
    router.sync_replicas(engines)
    for i, (sid, prompt) in enumerate(prompts.items()):
        home = f"r{i % 2}"
        engines[home].add_request(GenerateRequest(sid, prompt, sampling, session_id=sid))
        router.sessions[sid] = home
    got: dict[str, list[int]] = {}
    lags: list[int] = []
    step_all(engines, got, args.steps_before, lags)
    for rid, engine in engines.items():
        stats = engine.stats()
        replica = router.replica(rid)
        replica.num_running, replica.num_waiting = stats.num_running, stats.num_waiting

    # r0 drains: the router plans (moving r0's sessions, and any overload the drain leaves);
    # each source persists and releases its sessions, the targets adopt them.
    router.replica("r0").draining = True
    start = time.perf_counter()
    plan = {m.session_id: m for m in plan_moves(router)}
    moves = []
    for source in sorted({m.from_replica for m in plan.values()}):
        moves += move_out(engines[source], {sid for sid, m in plan.items() if m.from_replica == source})
    for move in moves:
        move_in(engines[plan[move.session_id].to_replica], move, request_id=f"{move.session_id}/moved")
    drain_s = time.perf_counter() - start
    # r1 fails: no move_out; the client's tokens extend each prompt.
    failed = engines.pop("r1")
    failed_sessions = [sid for sid, rid in router.sessions.items() if rid == "r1"]
    router.remove_replica("r1")
    replan = {m.session_id: m for m in plan_moves(router) if m.reason == "dead"}
    rehomed = []
    for sid in failed_sessions:
        received = got.get(sid, [])
        if len(received) >= args.tokens:
            continue  # the turn had finished before the failure
        rehomed.append(sid)
        left = SamplingParams(max_tokens=args.tokens - len(received), temperature=0.0, ignore_eos=True)
        engines[replan[sid].to_replica].add_request(
            GenerateRequest(f"{sid}/retry", prompts[sid] + received, left, session_id=sid)
        )
    del failed
    step_all(engines, got, None, lags)

    drained = [m.session_id for m in moves]
    lost = lambda sids: [sid for sid in sids if got.get(sid) != reference[sid]]  # noqa: E731
    reasons = sorted({m.reason for m in plan.values()})
    return dict(
        drained=drained,
        failed=rehomed,
        reasons=reasons,
        drained_lost=lost(drained),
        failed_lost=lost(failed_sessions),
        all_lost=lost(prompts),
        max_lag=max(lags),
        drain_s=drain_s,
        adopted=sum(e.sessions.stats.adopted for e in engines.values()),
    )


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(args: argparse.Namespace, r: dict) -> None:
    meta = dict(
        command="python benchmarks/kvcache/drain.py " + " ".join(sys.argv[1:]),
        hardware=f"CPU ({torch.get_num_threads()} thread)",
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        git_revision=git_revision(),
        workload=f"tiny, {args.sessions} sessions of {args.prompt_len}+ tokens, {args.replicas} "
        f"in-process replicas, one drained and one failed after {args.steps_before} steps, "
        f"sync_every {args.sync_every}",
    )
    entries = {
        "kvcache.drain_moved_sessions_lost": dict(
            value=len(r["drained_lost"]),
            unit="sessions",
            note=f"of {len(r['drained'])} moved mid-turn ({', '.join(r['reasons'])})",
        ),
        "kvcache.failure_sessions_lost": dict(
            value=len(r["failed_lost"]), unit="sessions", note=f"of {len(r['failed'])} on the failed replica"
        ),
        "kvcache.write_behind_max_lag_tokens": dict(
            value=r["max_lag"], unit="tokens", note=f"bound: sync_every - 1 = {args.sync_every - 1}"
        ),
    }
    for entry in entries.values():
        entry.update(meta)
    out = Path(args.output)
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update(entries)
    out.write_text(json.dumps(data, indent=1) + "\n")  # the file's own indent: small diffs
    print(
        f"drain: {len(r['drained'])} sessions moved ({', '.join(r['reasons'])}) "
        f"in {r['drain_s'] * 1e3:.1f} ms; "
        f"failure: {len(r['failed'])} sessions re-homed; {r['adopted']} adoptions; results → {out}"
    )
    print(f"{'metric':<40}{'value':>8}")
    for key, entry in entries.items():
        print(f"{key:<40}{entry['value']:>8}")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument(
        "--steps-before", type=int, default=16, help="steps of every replica before the drain"
    )
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "kvcache.json"))
    args = parser.parse_args()
    report(args, run(args))


if __name__ == "__main__":
    main()
