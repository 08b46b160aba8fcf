"""Sparse-KV residency at 1M tokens: sessions per GPU, TPOT at page budgets, adoption without the stall.

`m3-mini` (MiniMax-M3's block at its real widths, random weights: Hq 64, Hkv 4, D 128, P 128,
top-16, MoE; `--preset m3-proxy` for the earlier figures' model), a 1,048,576-token session.
Replica A prefills it (the re-prefill baseline, MSA kernels) and decodes with everything resident
(the TPOT baseline: eager, and on CUDA again replayed as a CUDA graph). Then:
- **budgets**: the session is offloaded (`ResidentSession.offload`: index on the GPU, K/V in a
  pinned host tier) and decodes with a K/V working set of 5 / 10 / 25 % of its pages: TPOT
  against resident, pages and bytes moved per step, tokens against A's;
- **adoption**: the session, persisted to the KV cache service (in-process shards keeping K/V and
  index pages in pinned arenas), is adopted by a fresh sparse-resident session (10 % budget): time
  to first token and TPOT over the first `--adopt-steps` tokens, its K/V leased and read in place
  (the default), and for comparison read into the host tier (`lease_kv=False`: background fill in
  predicted order, steps replayed with presence checks or run through the host while it fills);
- **sessions per GPU**: 1M-token sessions allocated until the GPU is full, fully resident vs
  sparse resident (GPU memory only: the host tiers live in the node's KV cache service).

Keys (issue 30's done-when figures) hold the engine's decode mode on CUDA: both sides replayed as
CUDA graphs (`ResidentGraph` here for the resident session, `engine/kv/resident_graph.SparseDecodeGraph`
for the sparse-resident one, ~3 ms per token for m3-mini, 4 layers, 1M tokens on the H200):
- `kvcache.sparse_residency_tpot_penalty_{5,10,25}pct` against `kvcache.residency_tpot_resident_graph_ms`,
  the working set at `--granularity` (`..._per_page` / `..._per_head`: the other one);
- `kvcache.adopt_vs_reprefill`: the MSA re-prefill's time over the median first token of
  `--adoptions` graphed adoptions (K/V leased in place), and `kvcache.lazy_tpot_penalty` the
  median of their mean TPOTs over the first `--adopt-steps` tokens (`_filled`, `_host_steps`: one
  adoption without the lease each). Each of those adoptions is by a new session object, so its
  first steps run eagerly (warm-up) and it captures its own graph; `_warm`: `--adoptions` more, each
  into the last one's session object (`ResidentSession.adopt(into=)`, as the engine's lane keeps an
  ended session), whose captured graph replays the new session's steps from its first token.
The same figures with both sides eager (launch bound, ~12-18 ms per token, varying with the host)
carry `_eager`; without graphs (`--no-graphs`, or the CPU) the eager figures are the keys.
adopt.py's adoption into fully resident caches writes `kvcache.full_kv_adopt_vs_reprefill`.

    python benchmarks/kvcache/residency.py                        # H200
    python benchmarks/kvcache/residency.py --device cpu --quick   # CPU smoke run at small sizes
"""

import argparse
import contextlib
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(HERE)]

from adopt import QUICK_OVERRIDES, Replica, git_revision, hardware, log, merge_results, prefill_session, sync  # noqa: E402
from thread_watch import ThreadWatch  # noqa: E402

from msaserve.engine.kv.host_tier import HostKV  # noqa: E402
from msaserve.engine.kv.pages import identity_for  # noqa: E402
from msaserve.engine.kv.persist import SessionWriter  # noqa: E402
from msaserve.engine.kv.pinned_segments import segment_allocators  # noqa: E402
from msaserve.engine.kv.resident_graph import WARMUP_STEPS, CapturedStep, SparseDecodeGraph  # noqa: E402
from msaserve.engine.kv.resident_session import (  # noqa: E402
    HostHoldsPages,
    ResidentSession,
    allocate_resident_caches,
)
from msaserve.kernels import get_ops  # noqa: E402
from msaserve.kvcache.arena import numpy_segment  # noqa: E402
from msaserve.kvcache.client import KVCacheClient  # noqa: E402
from msaserve.kvcache.config import ServiceConfig  # noqa: E402
from msaserve.models.cache import allocate_caches  # noqa: E402
from msaserve.models.loader import load_model  # noqa: E402
from msaserve.models.metadata import AttentionMetadata  # noqa: E402
from msaserve.models.presets import M3_MINI_SMALL  # noqa: E402


def model_overrides(args: argparse.Namespace) -> dict:
    """The preset's overrides: its depth, and the small widths of a --quick run."""
    if args.preset == "m3-proxy":
        return dict(num_layers=args.num_layers, **(QUICK_OVERRIDES if args.quick else {}))
    return dict(num_hidden_layers=args.num_layers, **(M3_MINI_SMALL if args.quick else {}))


def sparse_decode(
    model, ops, session: ResidentSession, first: int, start: int, steps: int, prefetch_items: int = 0
) -> tuple[list[int], list[float]]:
    """Greedy decode on a sparse-resident session → (tokens after `first`, step times)."""
    wrapped, device = session.wrap_ops(ops), session.device
    tokens, times = [first], []
    with torch.inference_mode():
        for step in range(steps):
            sync(device)
            t0 = time.perf_counter()
            if prefetch_items:  # background reads queued after the previous token went out
                session.prefetch(prefetch_items)
            meta = session.decode_metadata(start + step)
            hidden = model(torch.tensor([tokens[-1]], device=device), meta, session.caches, ops=wrapped)
            tokens.append(int(torch.argmax(model.compute_logits(hidden)[0])))
            sync(device)
            times.append(time.perf_counter() - t0)
    return tokens[1:], times


def resident_decode(replica: Replica, first: int, start: int, steps: int) -> tuple[list[int], list[float]]:
    tokens, times = [first], []
    with torch.inference_mode():
        for step in range(steps):
            sync(replica.device)
            t0 = time.perf_counter()
            tokens.append(replica.run([tokens[-1]], start + step, decode=True))
            sync(replica.device)
            times.append(time.perf_counter() - t0)
    return tokens[1:], times


class ResidentGraph:
    """The fully resident replica's decode step (identity block table: slot = position), the
    forward, logits and greedy token captured as one CUDA graph after WARMUP_STEPS eager steps
    through the same static buffers — as `SparseDecodeGraph` does for a sparse-resident session."""

    def __init__(self, replica: Replica) -> None:
        self.replica, device = replica, replica.device
        self.token = torch.zeros(1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(1, dtype=torch.int32, device=device)
        self.meta = AttentionMetadata(
            positions=self.positions, slot_mapping=self.positions,
            block_tables=torch.arange(replica.state.max_pages, device=device, dtype=torch.int32)[None],
            seq_lens=self.seq_lens, cu_seqlens_q=torch.tensor([0, 1], device=device, dtype=torch.int32),
            max_query_len=1, decode_query_len=1,
            logits_indices=torch.zeros(1, dtype=torch.long, device=device))
        # Off CUDA the same steps run eagerly (a smoke run).
        self.captured = CapturedStep(self._body, capture=device.type == "cuda")

    def _body(self) -> torch.Tensor:
        r = self.replica
        hidden = r.model(self.token, self.meta, r.state.caches, ops=r.ops)
        return torch.argmax(r.model.compute_logits(hidden)[0])

    @torch.inference_mode()
    def step(self, token: int, position: int) -> int:
        self.token.fill_(token)
        self.positions.fill_(position)
        self.seq_lens.fill_(position + 1)
        return int(self.captured.run())


def graphed_decode(stepper, device, first: int, start: int, steps: int,
                   prefetch_items: int = 0) -> tuple[list[int], list[float]]:
    """Greedy decode through a graph stepper (`ResidentGraph`, `SparseDecodeGraph`) → (tokens after
    `first`, step times; the first WARMUP_STEPS + 1 steps are the eager ones and the capture).
    prefetch_items: background service reads queued before each step (an adopted session)."""
    tokens, times = [first], []
    for step in range(steps):
        sync(device)
        t0 = time.perf_counter()
        if prefetch_items:
            stepper.session.prefetch(prefetch_items)
        tokens.append(stepper.step(tokens[-1], start + step))
        sync(device)
        times.append(time.perf_counter() - t0)
    return tokens[1:], times


def replayed(times: list[float]) -> float:
    """Median step time over the replays (after the eager warm-up steps and the capture)."""
    return statistics.median(times[WARMUP_STEPS + 1 :])


def budget_pages_for(config, pages: int, fraction: float) -> int:
    least = max(2, config.n_local + 1) + config.num_kv_heads * config.top_k
    return max(least, round(fraction * pages))


def count_sessions(make) -> int:
    """How many `make()` allocations fit on the GPU (freed again before returning)."""
    held = []
    try:
        while len(held) < 10_000:
            held.append(make())
    except torch.cuda.OutOfMemoryError:
        pass
    count = len(held)
    del held
    torch.cuda.empty_cache()
    return count


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    overrides = model_overrides(args)
    model = load_model(args.preset, device, dtype, "msa", progress=False, seed=0, **overrides).model
    model.eval().requires_grad_(False)
    config = model.config
    ops = get_ops("msa", device)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, config.vocab_size, (args.context,), generator=generator).tolist()
    steps = max(args.steps, args.adopt_steps)
    capacity = args.context + steps + 2
    pages = -(-args.context // config.page_size)
    max_pages = -(-capacity // config.page_size)
    identity = identity_for(config, f"{args.preset}-random-seed0-L{args.num_layers}", dtype)
    # The shards keep their index pages in pinned arenas on CUDA: adoption copies the index to the
    # GPU straight from there, verified beside the copy (engine/kv/direct_index.py).
    client = KVCacheClient.in_process(
        ServiceConfig(
            num_shards=args.shards,
            memory_bytes=max(
                3 * pages * config.page_size * config.num_kv_heads * config.head_dim * 4 * args.num_layers,
                64 << 20,
            ),
        ),
        identity,
        # K/V and index pages in arenas (pinned on CUDA): adoptions lease the K/V in place
        segment_allocators=segment_allocators(device, ("index", "kv"))
        or {"index": numpy_segment, "kv": numpy_segment},
    )

    # Warm-up off the clock: every kernel (autotuning) and path on a short session.
    warm = min(args.context // 2, 2 * args.chunk)
    warm_tokens = torch.randint(3, config.vocab_size, (warm,), generator=generator).tolist()
    warm_replica, warm_first, _ = prefill_session(model, ops, warm_tokens, warm + 40, args.chunk)
    warm_pages = -(-(warm + 40) // config.page_size)
    SessionWriter(client, "warm").sync(
        [*warm_tokens, warm_first],
        warm_replica.state.caches,
        range(warm_replica.state.max_pages),
        warm,
        tail=True,
    )
    resident_decode(warm_replica, warm_first, warm, 4)
    budget = budget_pages_for(config, warm_pages, 0.5)
    session = ResidentSession.offload(config, warm_replica.state.caches, warm, budget, warm_pages)
    sparse_decode(model, ops, session, warm_first, warm, 4)
    session, _ = ResidentSession.adopt(
        client, client.get_session("warm"), config, budget, warm_pages, device, dtype
    )
    sparse_decode(model, ops, session, warm_first, warm, 4, prefetch_items=8)
    warm_replica = session = None
    client.delete_session("warm")
    log("warm-up done")

    replica, first, reprefill_s = prefill_session(model, ops, tokens, capacity, args.chunk)
    log(f"re-prefill of {args.context} tokens: {reprefill_s:.3f} s")
    caches = replica.state.caches
    SessionWriter(client, "bench").sync(
        [*tokens, first], caches, range(replica.state.max_pages), args.context, tail=True
    )
    host = HostKV(
        len(caches), max_pages, tuple(caches[0].k_cache.shape[1:]), dtype, pin=device.type == "cuda"
    )
    for layer, cache in enumerate(caches):  # the host tier every budget's session shares
        for start in range(0, pages, 1024):
            end = min(pages, start + 1024)
            host.write(
                layer, range(start, end), torch.stack([cache.k_cache[start:end], cache.v_cache[start:end]], 1)
            )
    # Resident decode writes only at positions ≥ context: the offloads below copy the index of the
    # prefilled pages, and the host tier already holds their K/V.
    want, resident_times = resident_decode(replica, first, args.context, steps)
    tpot_resident = statistics.median(resident_times[1:])
    log(f"resident TPOT {tpot_resident * 1e3:.2f} ms")
    # On the CPU (--quick smoke runs) the "graph" runs take the same code path with every step eager.
    graphs = not args.no_graphs and (device.type == "cuda" or args.quick)
    tpot_resident_graph = None
    if graphs:  # the same steps again, replayed (they rewrite the same K/V at the same slots)
        got, times = graphed_decode(ResidentGraph(replica), device, first, args.context, args.steps)
        tpot_resident_graph = replayed(times)
        log(f"resident TPOT, CUDA graph {tpot_resident_graph * 1e3:.2f} ms, tokens equal "
            f"{got == want[: args.steps]}")

    results = dict(
        config=config,
        device=device,
        pages=pages,
        reprefill_s=reprefill_s,
        tpot_resident=tpot_resident,
        tpot_resident_graph=tpot_resident_graph,
        budgets={},
        adoption={},
    )
    for fraction in args.budgets:
        budget = budget_pages_for(config, pages, fraction)
        sync(device)
        t0 = time.perf_counter()
        session = ResidentSession.offload(config, caches, args.context, budget, max_pages,
                                          host=HostHoldsPages(host), per_head=args.per_head)
        sync(device)
        offload_s = time.perf_counter() - t0
        got, times = sparse_decode(model, ops, session, first, args.context, args.steps)
        stats = session.stats
        results["budgets"][fraction] = dict(
            budget_pages=budget,
            tpot=statistics.median(times[1:]),
            match=got == want[: args.steps],
            pages_per_step=stats.pages_fetched / args.steps,
            bytes_per_step=stats.bytes_fetched / args.steps,
            offload_s=offload_s,
            gpu_bytes=session.gpu_bytes,
            host_steps=stats.host_steps,
        )
        log(
            f"budget {fraction:.0%} ({budget} pages): "
            f"TPOT {results['budgets'][fraction]['tpot'] * 1e3:.2f} ms, "
            f"{stats.pages_fetched / args.steps:.1f} pages/step, tokens equal {got == want[: args.steps]}, "
            f"{stats.host_steps} layer-steps through the host"
        )
        session = None
        for per_head in (args.per_head, not args.per_head) if graphs else ():
            # a fresh session at the same budget, its steps replayed as one CUDA graph; the other
            # granularity too, for the comparison
            mode = "head" if per_head else "page"
            session = ResidentSession.offload(config, caches, args.context, budget, max_pages,
                                              host=HostHoldsPages(host), per_head=per_head)
            stepper = SparseDecodeGraph(session, model, ops)
            got, times = graphed_decode(stepper, device, first, args.context, args.steps)
            stats = session.stats
            results["budgets"][fraction][f"graph_{mode}"] = dict(
                tpot=replayed(times), match=got == want[: args.steps],
                pages_per_step=stats.pages_fetched / args.steps,
                bytes_per_step=stats.bytes_fetched / args.steps, replays=stepper.replays)
            log(f"budget {fraction:.0%}, CUDA graph, per {mode}: TPOT {replayed(times) * 1e3:.2f} ms, "
                f"{stats.pages_fetched / args.steps:.1f} columns or pages/step, "
                f"{stats.bytes_fetched / args.steps / 2**20:.1f} MiB/step, "
                f"tokens equal {got == want[: args.steps]}, {stepper.replays} replays")
            session = stepper = None
    replica = caches = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    args.adopt_host = host

    # eager steps: the K/V leased in place (the default), and read into the host tier instead
    results["adoption"]["leased"] = adopt_and_decode(
        args, model, ops, client, config, pages, max_pages, dtype, device, first, want, 0)
    results["adoption"][f"filled, prefetch {args.prefetch_items}"] = adopt_and_decode(
        args, model, ops, client, config, pages, max_pages, dtype, device, first, want, args.prefetch_items,
        lease_kv=False)
    if graphs:  # the engine's mode, the K/V leased in place: replays from the third step (two
        # warm-up steps, then the capture); several adoptions (the first token is one host-clock
        # sample each), their medians reported
        warm: dict = {}
        runs = [adopt_and_decode(args, model, ops, client, config, pages, max_pages, dtype, device, first,
                                 want, args.prefetch_items, graphed=True, keep=warm)
                for _ in range(args.adoptions)]
        results["adoption_graph"] = median_run(runs)
        # a replica's steady state: each adoption into the last one's session object (device memory,
        # host tier, captured graph: `ResidentSession.adopt(into=)`), its first step a replay
        runs = [adopt_and_decode(args, model, ops, client, config, pages, max_pages, dtype, device, first,
                                 want, args.prefetch_items, graphed=True, keep=warm, into=warm)
                for _ in range(args.adoptions)]
        results["adoption_graph_warm"] = median_run(runs)
        warm.clear()
        # without the lease: pages read into the host tier, filled in the background; steps replay
        # with presence checks and run again after repairs (filled), or run eagerly through the host
        results["adoption_graph_filled"] = adopt_and_decode(
            args, model, ops, client, config, pages, max_pages, dtype, device, first, want,
            args.prefetch_items, graphed=True, lease_kv=False)
        results["adoption_graph_host"] = adopt_and_decode(
            args, model, ops, client, config, pages, max_pages, dtype, device, first, want,
            args.prefetch_items, graphed=True, speculate=False, lease_kv=False)
    if device.type == "cuda":
        kv_dtype = dtype
        results["sessions_resident"] = count_sessions(
            lambda: allocate_caches(config, max_pages, device, kv_dtype)
        )
        results["sessions_sparse"] = {
            fraction: count_sessions(
                lambda f=fraction: allocate_resident_caches(
                    config, max_pages, budget_pages_for(config, pages, f), device, kv_dtype
                )[0]
            )
            for fraction in args.budgets
        }
        log(
            f"1M sessions per GPU: resident {results['sessions_resident']}, "
            f"sparse {results['sessions_sparse']}"
        )
    return results


def in_ms(parts: dict[str, float]) -> str:
    """Phases in seconds (`name_s`) → "name 1.2, other 3.4" in milliseconds."""
    return ", ".join(f"{name.removesuffix('_s')} {seconds * 1e3:.1f}" for name, seconds in parts.items())


def median_run(runs: list[dict]) -> dict:
    """Several adoptions → the one of median first token, with every run's first token and the
    median of their TPOT medians."""
    ordered = sorted(runs, key=lambda r: r["ttft"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle.update(runs=len(runs), ttfts=[r["ttft"] for r in runs],
                  tpot_median=statistics.median(r["tpot_median"] for r in runs),
                  tpot_mean=statistics.median(r["tpot_mean"] for r in runs),
                  tpot_max=max(r["tpot_max"] for r in runs),
                  match=all(r["match"] for r in runs),
                  replayed_first=sum(r["first_step_replayed"] for r in runs))
    return middle


def adopt_and_decode(
    args, model, ops, client, config, pages, max_pages, dtype, device, first, want, prefetch: int,
    graphed: bool = False, speculate: bool = True, lease_kv: bool = True, keep: dict | None = None,
    into: dict | None = None,
) -> dict:
    """A fresh sparse-resident session (10 % budget) adopts the stored session and decodes (graphed:
    through `SparseDecodeGraph`, eager steps while the host tier fills, then replays). keep: the
    session and its graph stepper are left there (`session`, `stepper`); into: the adoption goes
    into the session left there and is stepped by its stepper (`ResidentSession.adopt(into=)`)."""
    budget = budget_pages_for(config, pages, 0.10)
    host = args.adopt_host  # the replica's pinned host tier, allocated before (pinning takes seconds)
    sync(device)
    t0 = time.perf_counter()
    record = client.get_session_head("bench")
    token_ids = client.get_session_tokens_async("bench")
    record_s = time.perf_counter() - t0
    with ThreadWatch() if args.thread_watch else contextlib.nullcontext() as watch:
        session, covered = ResidentSession.adopt(
            client, record, config, budget, max_pages, device, dtype, host=host, per_head=args.per_head,
            lease_kv=lease_kv, into=into["session"] if into else None,
        )
    sync(device)
    index_s = time.perf_counter() - t0
    if watch is not None:
        log(f"threads during the adoption: {watch.report()}")
    assert covered == args.context, (covered, args.context)
    last = int(token_ids.result()[-1])
    first_replayed = False
    if graphed:
        stepper = into["stepper"] if into else SparseDecodeGraph(session, model, ops, speculate=speculate)
        if keep is not None:
            keep.update(session=session, stepper=stepper)
        got, times = graphed_decode(stepper, device, last, args.context, 1)
        first_replayed = stepper.replays == 1
        ttft = time.perf_counter() - t0
        rest, rest_times = graphed_decode(stepper, device, got[0], args.context + 1, args.adopt_steps - 1,
                                          prefetch)
    else:
        got, times = sparse_decode(model, ops, session, last, args.context, 1)  # prefetch starts after it
        ttft = time.perf_counter() - t0
        rest, rest_times = sparse_decode(
            model, ops, session, got[0], args.context + 1, args.adopt_steps - 1, prefetch
        )
    tokens, times = got + rest, times + rest_times
    n = len(times)
    result = dict(
        ttft=ttft,
        index_s=index_s,
        tpot_median=statistics.median(times),
        tpot_mean=sum(times) / n,
        tpot_p90=sorted(times)[int(0.9 * (n - 1))],
        tpot_max=max(times),
        second_token=times[1] if n > 1 else float("nan"),
        match=tokens == want[:n],
        steps=n,
        service_bytes_per_step=session.host.service_bytes / n,
        device_bytes_per_step=session.stats.bytes_fetched / n,
        first_step=times[0],
        record_s=record_s,
        host_synced_layer_steps=session.stats.host_steps,
        phases=dict(session.adopt_phases),
        lease_phases=dict(session.lease_phases),
        eager_steps=stepper.host_steps if graphed else n,
        replays=stepper.replays if graphed else 0,
        reruns=stepper.reruns if graphed else 0,
        speculate=graphed and stepper.speculate,
        leased_items=int(session.host.leased.sum()),
        lease_kv=lease_kv,
        into=bool(into),
        first_step_replayed=first_replayed,
    )
    phases = (f"{in_ms(session.adopt_phases)} (host_reset: {in_ms(session.host.reset_phases)}) "
              f"(lease: {in_ms(session.lease_phases)})")
    how = f"{result['leased_items']} (page, layer) leased in place" if lease_kv else "read"
    log(
        f"adopted ({how}"
        f", prefetch {prefetch}{', CUDA graph' if graphed else ''}"
        f"{', into the last session' if into else ''}"
        f"{', first step replayed' if first_replayed else ''}): "
        f"first token {ttft * 1e3:.1f} ms (record {record_s * 1e3:.1f} ms, "
        f"caches + index {(index_s - record_s) * 1e3:.1f} ms [{phases} ms, host clock], "
        f"first step {times[0] * 1e3:.1f} ms; "
        f"{session.stats.host_steps} layer-steps through the host"
        f"{f', {stepper.reruns} step runs again after repairs' if graphed else ''}), TPOT "
        f"median {result['tpot_median'] * 1e3:.2f} ms, mean {result['tpot_mean'] * 1e3:.2f} ms, max "
        f"{result['tpot_max'] * 1e3:.1f} ms (second token {result['second_token'] * 1e3:.1f} ms) over {n}, "
        f"tokens equal {result['match']}"
    )
    return result


def report(args: argparse.Namespace, r: dict) -> None:
    meta = dict(
        command="python benchmarks/kvcache/residency.py " + " ".join(sys.argv[1:]),
        hardware=hardware(r["device"]),
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        git_revision=os.environ.get("MSASERVE_GIT_REVISION") or git_revision(),  # a copy has no .git
    )
    shape = f"{args.preset} (quick shapes)" if args.quick else args.preset
    label = (
        f"{shape}, {r['config'].num_layers} layers, {args.context} tokens, working set per "
        f"{'head' if args.per_head else 'page'}; both sides replayed as CUDA graphs (the engine's decode "
        f"mode: the penalty keys without a suffix; `_per_page`/`_per_head`: the other granularity) and "
        f"eager (keys ending `_eager`"
        f"{'; on the CPU the graph steps run eagerly, a smoke run' if r['device'].type != 'cuda' else ''}), "
        f"in-process KV cache shards ({args.shards})"
    )
    base = r["tpot_resident"]
    ten = r["budgets"].get(0.10)
    best = min(r["adoption"].items(), key=lambda kv: kv[1]["tpot_median"])
    graph_base = r.get("tpot_resident_graph")
    graph_adoption = r.get("adoption_graph")
    mode = "head" if args.per_head else "page"
    # The done-when keys of issue 30 hold the engine's decode mode: both sides replayed as CUDA
    # graphs, the working set at this run's granularity. Eager steps are launch bound (the resident
    # eager step is 4x its replay and varies by run), so their ratios carry `_eager`.
    headline = "_eager" if graph_base else ""
    entries = {
        "kvcache.residency_tpot_resident_ms": dict(value=round(base * 1e3, 3), unit="ms",
                                                   note="fully resident decode, eager steps"),
        f"kvcache.lazy_tpot_penalty{headline}": dict(
            value=round(best[1]["tpot_mean"] / base, 3),
            unit="x resident TPOT (both eager; mean over the first tokens)",
            note=f"sparse-resident adoption (10% budget, per {mode}, K/V {best[0]}), eager steps, "
            f"mean over the first {best[1]['steps']} tokens {best[1]['tpot_mean'] * 1e3:.2f} ms (median "
            f"{best[1]['tpot_median'] * 1e3:.2f}, slowest {best[1]['tpot_max'] * 1e3:.1f}, second token "
            f"{best[1]['second_token'] * 1e3:.1f} ms); tokens equal: {best[1]['match']}; "
            f"{best[1]['host_synced_layer_steps']} layer-steps through the host",
        ),
        # adoption into a sparse-resident session vs the MSA re-prefill (adopt.py's full-KV adoption
        # writes kvcache.full_kv_adopt_vs_reprefill); eager adoption's here, the graphed
        # adoptions' median below when they ran.
        f"kvcache.adopt_vs_reprefill{headline}": dict(
            value=round(r["reprefill_s"] / best[1]["ttft"], 2),
            unit="x",
            note=f"re-prefill (MSA, chunk {args.chunk}) {r['reprefill_s']:.3f} s / "
            f"sparse-resident adoption's "
            f"first token {best[1]['ttft']:.4f} s (in-process shards, one adoption)",
        ),
        f"kvcache.sparse_adopt_time_to_token_s{headline}": dict(
            value=round(best[1]["ttft"], 4), unit="s",
            note=f"record {best[1]['record_s'] * 1e3:.1f} ms, caches + whole index "
            f"{(best[1]['index_s'] - best[1]['record_s']) * 1e3:.1f} ms (of which host tier reset "
            f"{best[1]['phases'].get('host_reset_s', 0) * 1e3:.1f}, allocation "
            f"{best[1]['phases'].get('allocate_s', 0) * 1e3:.1f}, index "
            f"{best[1]['phases'].get('index_s', 0) * 1e3:.1f} ms on the host clock), first step "
            f"{best[1]['first_step'] * 1e3:.1f} ms"),
    }
    for fraction, b in r["budgets"].items():
        entries[f"kvcache.sparse_residency_tpot_penalty_{round(fraction * 100)}pct{headline}"] = dict(
            value=round(b["tpot"] / base, 3),
            unit="x resident TPOT (both eager)",
            note=f"working set per {mode}; {b['budget_pages']} of {r['pages']} pages per layer; "
            f"{b['pages_per_step']:.1f} pages or columns ({b['bytes_per_step'] / 2**20:.1f} MiB) moved per "
            f"step; tokens equal: {b['match']}; {b['host_steps']} layer-steps with a host sync",
        )
    if graph_base:
        entries["kvcache.residency_tpot_resident_graph_ms"] = dict(
            value=round(graph_base * 1e3, 3), unit="ms",
            note="fully resident decode replayed as a CUDA graph (forward, logits, greedy token)")
        for fraction, b in r["budgets"].items():
            for run_mode in ("head", "page"):
                g = b.get(f"graph_{run_mode}")
                if g is None:
                    continue
                suffix = "" if run_mode == mode else f"_per_{run_mode}"
                unit_moved = "(page, KV head) columns" if run_mode == "head" else "pages"
                entries[f"kvcache.sparse_residency_tpot_penalty_{round(fraction * 100)}pct{suffix}"] = dict(
                    value=round(g["tpot"] / graph_base, 3), unit="x resident TPOT (both CUDA graphs)",
                    note=f"working set per {run_mode}, {b['budget_pages']} of {r['pages']} slots per layer; "
                    f"sparse {g['tpot'] * 1e3:.3f} ms vs resident "
                    f"{graph_base * 1e3:.3f} ms per step, both replayed as CUDA graphs; "
                    f"{g['pages_per_step']:.1f} {unit_moved} ({g['bytes_per_step'] / 2**20:.1f} MiB) moved "
                    f"per step through the UVA view; tokens equal: {g['match']}; {g['replays']} replays")
    if graph_base and graph_adoption:
        a = graph_adoption
        ttfts = ", ".join(f"{t * 1e3:.1f}" for t in a["ttfts"])
        entries["kvcache.adopt_vs_reprefill"] = dict(
            value=round(r["reprefill_s"] / a["ttft"], 2), unit="x",
            note=f"re-prefill (MSA, chunk {args.chunk}) {r['reprefill_s']:.3f} s / the median first token "
            f"of {a['runs']} sparse-resident adoptions decoding through SparseDecodeGraph "
            f"({a['ttft'] * 1e3:.1f} ms; each: {ttfts} ms; the median one's phases: record "
            f"{a['record_s'] * 1e3:.1f}, {in_ms(a['phases'])} ms, first step {a['first_step'] * 1e3:.1f} ms; "
            f"in-process shards, host clock)")
        entries["kvcache.sparse_adopt_time_to_token_s"] = dict(
            value=round(a["ttft"], 4), unit="s",
            note=f"median of {a['runs']} graphed adoptions (each: {ttfts} ms)")
        entries["kvcache.lazy_tpot_penalty"] = dict(
            value=round(a["tpot_mean"] / graph_base, 3),
            unit="x resident TPOT (both CUDA graphs; mean over the first tokens)",
            note=f"sparse-resident adoption (10% budget, per {mode}) decoding through SparseDecodeGraph, "
            f"its K/V leased in place from the in-process shards' pinned arenas ({a['leased_items']} "
            f"(page, layer) items; no host-tier fill, each page checked on the GPU at its first copy): "
            f"{a['eager_steps']} steps through the host, {a['reruns']} runs again, "
            f"{a['replays']} replays in all (the median-first-token run of {a['runs']}); the median "
            f"over {a['runs']} runs of each run's mean over its first {a['steps']} tokens "
            f"{a['tpot_mean'] * 1e3:.3f} ms (median {a['tpot_median'] * 1e3:.3f}, slowest step of any run "
            f"{a['tpot_max'] * 1e3:.1f} ms, second token {a['second_token'] * 1e3:.1f} ms) vs the resident "
            f"graph "
            f"{graph_base * 1e3:.3f} ms; first token {a['ttft'] * 1e3:.1f} ms; tokens equal: {a['match']}")
    warm = r.get("adoption_graph_warm")
    if graph_base and warm:
        ttfts = ", ".join(f"{t * 1e3:.1f}" for t in warm["ttfts"])
        how = (f"each adoption into the last one's session object (`ResidentSession.adopt(into=)`: its "
               f"device memory, host tier and captured CUDA graph, as the engine's lane keeps an ended "
               f"session); "
               f"first step replayed in {warm['replayed_first']} of {warm['runs']} runs")
        entries["kvcache.adopt_vs_reprefill_warm"] = dict(
            value=round(r["reprefill_s"] / warm["ttft"], 2), unit="x",
            note=f"as kvcache.adopt_vs_reprefill, {how}: re-prefill {r['reprefill_s']:.3f} s / the median "
            f"first token ({warm['ttft'] * 1e3:.1f} ms; each: {ttfts} ms; the median one's phases: record "
            f"{warm['record_s'] * 1e3:.1f}, {in_ms(warm['phases'])} ms, first step "
            f"{warm['first_step'] * 1e3:.1f} ms); tokens equal: {warm['match']}")
        entries["kvcache.lazy_tpot_penalty_warm"] = dict(
            value=round(warm["tpot_mean"] / graph_base, 3),
            unit="x resident TPOT (both CUDA graphs; mean over the first tokens)",
            note=f"as kvcache.lazy_tpot_penalty, {how}: median over the runs of each run's mean over its "
            f"first {warm['steps']} tokens {warm['tpot_mean'] * 1e3:.3f} ms vs the resident graph "
            f"{graph_base * 1e3:.3f} ms; tokens equal: {warm['match']}")
    comparisons = (
        ("kvcache.lazy_tpot_penalty_filled", "adoption_graph_filled",
         "as kvcache.lazy_tpot_penalty, one adoption, without the lease (lease_kv=False): pages read "
         "into the host tier, filled in the background; steps replay with presence checks ({reruns} runs "
         "again after repairs)"),
        ("kvcache.lazy_tpot_penalty_host_steps", "adoption_graph_host",
         "as kvcache.lazy_tpot_penalty_filled, but the steps before the host tier holds every page run "
         "eagerly through the host ({eager_steps} of them) instead of replaying with presence checks"),
    )
    for key, run_key, how in comparisons:
        c = r.get(run_key)
        if graph_base and c:
            entries[key] = dict(
                value=round(c["tpot_mean"] / graph_base, 3),
                unit="x resident TPOT (both CUDA graphs; mean over the first tokens)",
                note=how.format(**c) + f"; mean {c['tpot_mean'] * 1e3:.3f} ms, slowest "
                f"{c['tpot_max'] * 1e3:.1f} ms, first token {c['ttft'] * 1e3:.1f} ms; tokens equal: "
                f"{c['match']}")
    if ten is not None:
        entries["kvcache.sparse_residency_bytes_per_step_10pct"] = dict(
            value=round(ten["bytes_per_step"]), unit="bytes",
            note=f"host → GPU K/V per decode step (all layers), {ten['pages_per_step']:.1f} pages")
    if ten is not None and "sessions_resident" in r:
        sparse = r["sessions_sparse"][0.10]
        entries["kvcache.sparse_residency_sessions_per_gpu_1m"] = dict(
            value=sparse,
            unit="sessions",
            note=f"10% budget; fully resident: {r['sessions_resident']} "
            f"({sparse / max(1, r['sessions_resident']):.1f}x); "
            f"5%/25%: {r['sessions_sparse'].get(0.05)}/{r['sessions_sparse'].get(0.25)}; GPU memory only, "
            f"{r['config'].num_layers} layers",
        )
        entries["kvcache.fully_resident_sessions_per_gpu_1m"] = dict(
            value=r["sessions_resident"], unit="sessions"
        )
    for entry in entries.values():
        entry.update(meta, workload=label)
    out = merge_results(args.output, entries)
    print(f"\n{label}; results → {out}")
    print(f"{'run':<34}{'TPOT ms':>9}{'x resident':>11}{'MiB/step':>10}{'tokens eq':>10}")
    print(f"{'resident':<34}{base * 1e3:>9.2f}{1:>11.2f}{0:>10.1f}{'-':>10}")
    for fraction, b in r["budgets"].items():
        name = f"sparse {fraction:.0%} ({b['budget_pages']} pages)"
        print(
            f"{name:<34}{b['tpot'] * 1e3:>9.2f}{b['tpot'] / base:>11.2f}{b['bytes_per_step'] / 2**20:>10.1f}"
            f"{b['match']!s:>10}"
        )
    if graph_base:
        print(f"{'resident, CUDA graph':<34}{graph_base * 1e3:>9.2f}{1:>11.2f}{0:>10.1f}{'-':>10}")
        for fraction, b in r["budgets"].items():
            for run_mode in ("head", "page"):
                g = b.get(f"graph_{run_mode}")
                if g is not None:
                    name = f"sparse {fraction:.0%}, CUDA graph, per {run_mode}"
                    print(f"{name:<34}{g['tpot'] * 1e3:>9.2f}{g['tpot'] / graph_base:>11.2f}"
                          f"{g['bytes_per_step'] / 2**20:>10.1f}{g['match']!s:>10}")
    for how, a in r["adoption"].items():
        name = f"adopted 10%, {how} (ttft {a['ttft'] * 1e3:.0f} ms), mean"
        print(
            f"{name:<34}{a['tpot_mean'] * 1e3:>9.2f}{a['tpot_mean'] / base:>11.2f}"
            f"{a['device_bytes_per_step'] / 2**20:>10.1f}{a['match']!s:>10}"
        )
    if graph_base and graph_adoption:
        name = (f"adopted 10%, CUDA graph, median of {graph_adoption['runs']} "
                f"(ttft {graph_adoption['ttft'] * 1e3:.0f} ms)")
        print(f"{name:<34}{graph_adoption['tpot_mean'] * 1e3:>9.2f}"
              f"{graph_adoption['tpot_mean'] / graph_base:>11.2f}"
              f"{graph_adoption['device_bytes_per_step'] / 2**20:>10.1f}{graph_adoption['match']!s:>10}")
        for label_, key in (("into the last session", "adoption_graph_warm"),
                            ("filled, replays", "adoption_graph_filled"),
                            ("filled, host steps", "adoption_graph_host")):
            h = r.get(key)
            if h:
                name = f"adopted 10%, CUDA graph, {label_} (ttft {h['ttft'] * 1e3:.0f} ms)"
                print(f"{name:<34}{h['tpot_mean'] * 1e3:>9.2f}{h['tpot_mean'] / graph_base:>11.2f}"
                      f"{h['device_bytes_per_step'] / 2**20:>10.1f}{h['match']!s:>10}")
        print("(adopted rows: mean TPOT over the first tokens; the log lines above give median, "
              "slowest and second token)")
    for how, a in r["adoption"].items():
        print(f"adoption phases ({how}), ms: record {a['record_s'] * 1e3:.1f}, {in_ms(a['phases'])}, "
              f"first step {a['first_step'] * 1e3:.1f}; first token {a['ttft'] * 1e3:.1f}")
    print(
        f"re-prefill {r['reprefill_s']:.3f} s; "
        f"adopt vs re-prefill {entries['kvcache.adopt_vs_reprefill']['value']}x"
    )
    if "sessions_resident" in r:
        print(f"1M-token sessions per GPU: resident {r['sessions_resident']}, sparse {r['sessions_sparse']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes and context (CPU smoke run)")
    parser.add_argument("--context", type=int, default=None, help="session tokens (default 1M; quick 8192)")
    parser.add_argument("--preset", choices=["m3-mini", "m3-proxy"], default="m3-mini")
    parser.add_argument("--num-layers", type=int, default=None, help="default: m3-mini 4, m3-proxy 2")
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 32768; quick 1024)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per budget")
    parser.add_argument("--adopt-steps", type=int, default=256, help="decode steps after adoption")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.10, 0.25])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--adoptions", type=int, default=5,
                        help="graphed adoptions (the engine's mode); first token and TPOT are their medians")
    parser.add_argument(
        "--prefetch-items", type=int, default=1 << 16,
        help="(page, layer) background service reads queued (default: every page)"
    )
    parser.add_argument("--output", default=None)
    parser.add_argument("--thread-watch", action="store_true",
                        help="a diagnostic: sample the other threads' Python frames during each adoption "
                        "(thread_watch.py) and log where they were; it perturbs the timings")
    parser.add_argument("--granularity", choices=["page", "head"], default="head",
                        help="the sparse-resident working set's unit for the eager and adoption runs "
                        "(the graph runs measure both; `head`: ResidentSession(per_head=True))")
    parser.add_argument("--no-graphs", action="store_true",
                        help="skip the CUDA-graph runs (resident and each budget replayed as graphs)")
    args = parser.parse_args()
    args.per_head = args.granularity == "head"
    args.num_layers = args.num_layers or (4 if args.preset == "m3-mini" else 2)
    args.context = args.context or (8192 if args.quick else 1 << 20)
    args.chunk = args.chunk or (1024 if args.quick else 32768)
    default_name = "kvcache_cpu_quick.json" if args.quick else "kvcache.json"
    args.output = args.output or str(ROOT / "benchmarks" / "results" / default_name)
    report(args, run(args))


if __name__ == "__main__":
    main()
