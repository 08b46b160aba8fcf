"""Session adoption through the KV cache service vs re-prefill vs copying the whole KV first.

Replica A prefills a long session (`m3-proxy`, random weights; that prefill is baseline (a):
re-prefilling from the token ids) and persists it to the service (index store + block store).
Then a fresh replica produces the session's next token three ways:
- adopt: load the whole index, then fetch per layer only the K/V pages the indexer selects;
- full copy (b): fetch every page's index and K/V first, then decode;
- re-prefill (a): A's prefill time (plus reading the session record).
It then decodes `--steps` more tokens with lazy fetch + background prefetch, against A's decode
with everything resident (the TPOT penalty). Tokens are checked equal to A's at every step.

Keys: the adoption here fills fully resident caches (`kvcache.full_kv_adopt_vs_reprefill`,
`kvcache.full_kv_lazy_tpot_penalty`); `kvcache.adopt_vs_reprefill` and `kvcache.lazy_tpot_penalty`
are the sparse-resident adoption's (residency.py). Entries merge into the output file.

    python benchmarks/kvcache/adopt.py                          # H200: 1M tokens, 4 layers
    python benchmarks/kvcache/adopt.py --device cpu --quick     # CPU smoke run at small sizes
"""

import argparse
import contextlib
import importlib.util
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # reference_decode: the single-sequence reference the tests use

from reference_decode import SequenceState, step_metadata  # noqa: E402

from msaserve.engine.kv import staging  # noqa: E402
from msaserve.engine.kv.adoption import LazyPageFetcher, PackedUnit, forward_with_ops, load_packed  # noqa: E402
from msaserve.engine.kv.pages import PageCodec, identity_for  # noqa: E402
from msaserve.engine.kv.persist import SessionWriter  # noqa: E402
from msaserve.kernels import get_ops  # noqa: E402
from msaserve.kvcache.client import KVCacheClient, start_shards  # noqa: E402
from msaserve.kvcache.config import ServiceConfig  # noqa: E402
from msaserve.models.presets import get_preset  # noqa: E402
from msaserve.models.transformer import MSATransformer, init_random_weights  # noqa: E402

# The M3 attention shape scaled down so that the naive ops run on a CPU in seconds.
QUICK_OVERRIDES = dict(hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32, index_head_dim=32,
                       intermediate_size=512, vocab_size=2048, page_size=32, top_k=8)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


class Replica:
    """One sequence's caches on a replica, decoding with the given ops."""

    index_dtype: torch.dtype | None = None  # set from --index-dtype

    def __init__(self, model: MSATransformer, capacity: int, ops) -> None:
        self.model, self.ops = model, ops
        self.state = SequenceState(model, capacity, index_dtype=Replica.index_dtype)
        self.device = next(model.parameters()).device

    def run(self, token_ids: list[int], start: int, decode: bool) -> int:
        """Run tokens at positions start.. and return the greedy next token."""
        meta = step_metadata(start, len(token_ids), self.state.max_pages, self.model.config.page_size,
                             decode, self.device)
        ids = torch.tensor(token_ids, device=self.device)
        hidden = forward_with_ops(self.model, ids, meta, self.state.caches, self.ops)[-1:]
        return int(torch.argmax(self.model.compute_logits(hidden)[0]))


def prefill_session(model, ops, tokens: list[int], capacity: int, chunk: int) -> tuple[Replica, int, float]:
    """Baseline (a): prefill every token on a fresh replica → (replica, next token, seconds)."""

    def go() -> tuple[Replica, int]:
        replica = Replica(model, capacity, ops)  # allocating the caches counts, as in the others
        for start in range(0, len(tokens) - chunk, chunk):  # all but the last chunk
            replica.run(tokens[start : start + chunk], start, decode=False)
        last = (len(tokens) - 1) // chunk * chunk
        return replica, replica.run(tokens[last:], last, decode=False)

    with torch.inference_mode():
        (replica, token), seconds = timed(next(model.parameters()).device, go)
    return replica, token, seconds


class Phases:
    """Wall time of each phase of one timed run (a device sync ends each, so GPU work lands in its
    phase); printed with the run, not part of its result."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times, self._last = device, {}, 0.0

    def start(self) -> None:
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        sync(self.device)
        now = time.perf_counter()
        self.times[name], self._last = now - self._last, now

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in self.times.items())


def log(message: str) -> None:
    print(f"[{datetime.now(UTC).strftime('%H:%M:%S')}] {message}", flush=True)


def decode_steps(
    replica: Replica, tokens: list[int], steps: int, before_step=None
) -> tuple[list[int], list[float]]:
    """Decode `steps` greedy tokens after `tokens` (its last token not yet run) → tokens, step times."""
    out, times = [], []
    tokens = list(tokens)
    with torch.inference_mode():
        for _ in range(steps):
            sync(replica.device)
            start = time.perf_counter()
            if before_step is not None:
                before_step()
            token = replica.run([tokens[-1]], len(tokens) - 1, decode=True)
            sync(replica.device)
            times.append(time.perf_counter() - start)
            out.append(token)
            tokens.append(token)
    return out, times


def adopt(client, model, ops, capacity: int, session: str) -> tuple[Replica, LazyPageFetcher, int, float]:
    """Adoption: record, whole index, then the next token with per-layer lazy K/V fetch."""
    device = next(model.parameters()).device
    phases = Phases(device)

    def go():
        record = client.get_session_head(session)
        tokens = client.get_session_tokens_async(session)  # read while the index loads
        phases.mark("record")
        replica = Replica(model, capacity, None)
        fetcher = LazyPageFetcher(client, record, replica.state.caches, list(range(replica.state.max_pages)))
        phases.mark("caches")
        covered = fetcher.load_index()
        phases.mark("index")
        replica.ops = fetcher.wrap_ops(ops)
        with torch.inference_mode():
            tail = tokens.result()[covered:].tolist()  # 1 token when the tail page was stored
            token = replica.run(tail, covered, decode=len(tail) == 1)
        phases.mark("step")
        return replica, fetcher, token

    phases.start()
    (replica, fetcher, token), seconds = timed(device, go)
    log(f"adopt phases: {phases}; on-demand K/V {fetcher.stats.on_demand_seconds * 1e3:.1f} ms "
        f"in {fetcher.stats.on_demand_fetches} reads")
    return replica, fetcher, token, seconds


def full_copy(client, model, ops, capacity: int, session: str) -> tuple[int, float, int]:
    """Baseline (b): fetch every page's index and K/V, then decode. Reads and uploads run exactly
    as adoption's index load does (`load_packed`: packed reads into the pinned upload buffers, the
    next reads in flight while one buffer is copied and scattered), index and K/V alike."""
    codec = PageCodec(client.model)
    num_layers = model.config.num_layers

    device = next(model.parameters()).device
    phases = Phases(device)

    def go():
        record = client.get_session_head(session)
        tokens = client.get_session_tokens_async(session)  # read while the pages load, as in adopt
        phases.mark("record")
        replica = Replica(model, capacity, ops)
        caches = replica.state.caches
        phases.mark("caches")
        hashes = record.page_hashes + ([record.tail_hash] if record.tail_hash is not None else [])
        physical = torch.arange(len(hashes), device=device)
        ring = staging.ring_for(device)
        index_bytes = codec.index_bytes + codec.scale_bytes
        units: list[PackedUnit] = []
        targets: list[tuple[int | None, range]] = []  # (layer or None for the index, pages) per unit
        with ring.lock:
            kinds = [(None, index_bytes)] + [(layer, codec.kv_bytes) for layer in range(num_layers)]
            for layer, row_bytes in kinds:
                size = ring.rows_per_buffer(row_bytes)
                for first in range(0, len(hashes), size):
                    pages = range(first, min(first + size, len(hashes)))
                    if layer is None:
                        start = lambda out, p=pages: client.get_index_packed_async(  # noqa: E731
                            [hashes[i] for i in p], out)
                    else:
                        start = lambda out, p=pages, layer=layer: client.get_kv_packed_async(  # noqa: E731
                            [(hashes[i], layer) for i in p], out)
                    units.append((row_bytes, len(pages), start))
                    targets.append((layer, pages))
            moved = 0
            with contextlib.closing(load_packed(ring, units)) as loads:
                for i, ok, upload in loads:
                    layer, pages = targets[i]
                    if not all(ok):
                        raise RuntimeError(f"full copy: a page of layer {layer} is missing from the service")
                    chunk, items = upload(len(pages))
                    if layer is None:
                        codec.scatter_index(caches, physical[pages.start + items], chunk)
                    else:
                        codec.scatter_kv(caches[layer], physical[pages.start + items], chunk)
                    moved += len(pages) * units[i][0]
        phases.mark("index+K/V")
        covered = record.num_stored_tokens
        with torch.inference_mode():
            tail = tokens.result()[covered:].tolist()  # 1 token when the tail page was stored
            token = replica.run(tail, covered, decode=len(tail) == 1)
        phases.mark("step")
        return token, moved

    phases.start()
    (token, moved), seconds = timed(device, go)
    log(f"full copy phases: {phases}")
    return token, seconds, moved


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    overrides = QUICK_OVERRIDES if args.quick else {}
    config = get_preset("m3-proxy", num_layers=args.num_layers, **overrides)
    with torch.device(device):  # built on the device: the m3-proxy weights are GBs
        model = init_random_weights(MSATransformer(config, attention_backend="msa").to(dtype), seed=0)
    model.eval().requires_grad_(False)
    ops = get_ops("msa", device)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, config.vocab_size, (args.context,), generator=generator).tolist()
    capacity = args.context + args.steps + 2
    index_dtype = getattr(torch, args.index_dtype) if args.index_dtype else None
    Replica.index_dtype = index_dtype
    identity = identity_for(config, f"m3-proxy-random-seed0-L{args.num_layers}", dtype, index_dtype)

    session_bytes = 2 * identity_bytes(identity, args.context)
    service = ServiceConfig(num_shards=args.shards, memory_bytes=max(2 * session_bytes, 64 << 20))
    if args.transport == "ray":
        client = KVCacheClient(start_shards(service), identity)
    else:
        client = KVCacheClient.in_process(service, identity)

    # Warm up kernels (and their autotuning) and every service path on a short session, off the clock.
    warm = min(args.context // 2, 4 * args.chunk)
    # Other tokens than the session's, so that no page of it is in the service before it is persisted.
    warm_tokens = torch.randint(3, config.vocab_size, (warm,), generator=generator).tolist()
    warm_replica, warm_token, _ = prefill_session(model, ops, warm_tokens, warm + 8, args.chunk)
    SessionWriter(client, "warm-up").sync([*warm_tokens, warm_token], warm_replica.state.caches,
                                          range(warm_replica.state.max_pages), warm, tail=True)
    decode_steps(warm_replica, [*warm_tokens, warm_token], 2)
    warm_replica = None
    warm_replica, _, _, _ = adopt(client, model, ops, warm + 8, "warm-up")
    decode_steps(warm_replica, [*warm_tokens, warm_token, 0], 2)
    full_copy(client, model, ops, warm + 8, "warm-up")
    warm_replica = None
    client.delete_session("warm-up")

    log(f"warm-up done; {transport_note(args)}; session {session_bytes / 2**31:.2f} GiB")

    # Replica A: baseline (a), then persist the session and decode with everything resident.
    replica_a, first_token, reprefill_s = prefill_session(model, ops, tokens, capacity, args.chunk)
    log(f"(a) re-prefill of {args.context} tokens: {reprefill_s:.3f} s")
    writer = SessionWriter(client, "bench", pinned=True)
    session_tokens = [*tokens, first_token]
    caches_a, max_pages_a = replica_a.state.caches, replica_a.state.max_pages
    _, persist_s = timed(
        device, lambda: writer.sync(session_tokens, caches_a, range(max_pages_a), args.context, tail=True)
    )
    log(f"persisted the session: {persist_s:.3f} s, {writer.bytes_uploaded / (1 << 30):.3f} GiB")
    want, resident_times = decode_steps(replica_a, session_tokens, args.steps + 1)
    replica_a = caches_a = None  # free A's caches before the adopting replica allocates its own
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # Adoption (--repeats times, each on fresh caches: the median counts), then lazy decode with
    # background prefetch on the last adopted replica.
    adopt_times, adopt_tokens = [], []
    for repeat in range(args.repeats):
        if repeat:
            replica_b = fetcher = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        replica_b, fetcher, adopt_token, seconds = adopt(client, model, ops, capacity, "bench")
        adopt_times.append(seconds)
        adopt_tokens.append(adopt_token)
        log(f"adopted: next token in {seconds:.4f} s (index {fetcher.stats.index_seconds:.4f} s)")
    adopt_s = median(adopt_times)
    first_fetch = (fetcher.stats.index_bytes, fetcher.stats.kv_bytes_on_demand)

    def background(fetcher: LazyPageFetcher = fetcher) -> None:
        fetcher.poll()
        fetcher.prefetch(args.prefetch_pages)

    got, lazy_times = decode_steps(replica_b, [*session_tokens, adopt_token], args.steps, background)
    fetcher.poll(wait=True)
    # Equal unless a kernel is nondeterministic (then near-tie selections may differ): reported.
    adopt_match = [adopt_token, *got] == want and all(t == want[0] for t in adopt_tokens)
    replica_b = fetcher = background = None
    if device.type == "cuda":
        torch.cuda.empty_cache()

    full_copy_times, copy_tokens = [], []
    for _ in range(args.repeats):
        copy_token, seconds, full_copy_bytes = full_copy(client, model, ops, capacity, "bench")
        full_copy_times.append(seconds)
        copy_tokens.append(copy_token)
        log(f"(b) full copy: next token in {seconds:.4f} s")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    full_copy_s = median(full_copy_times)
    return dict(
        adopt_tokens_match=adopt_match, full_copy_token_matches=all(t == want[0] for t in copy_tokens),
        adopt_samples_s=adopt_times, full_copy_samples_s=full_copy_times,
        config=config, device=device, reprefill_s=reprefill_s, adopt_s=adopt_s, full_copy_s=full_copy_s,
        persist_s=persist_s, adopt_index_bytes=first_fetch[0], adopt_kv_bytes=first_fetch[1],
        full_copy_bytes=full_copy_bytes, token_id_bytes=8 * len(session_tokens),
        tpot_resident_s=median(resident_times[1:]), tpot_lazy_s=median(lazy_times),
        tpot_lazy_first_s=lazy_times[0], uploaded_bytes=writer.bytes_uploaded,
    )


def transport_note(args: argparse.Namespace) -> str:
    if args.transport != "ray":
        return f"{args.shards} shards in this process (no Ray: no object store, no serialization)"
    import ray

    store_gib = ray.cluster_resources().get("object_store_memory", 0) / (1 << 30)
    return f"{args.shards} Ray shard actors, object store {store_gib:.1f} GiB"


def identity_bytes(identity, num_tokens: int) -> int:
    codec = PageCodec(identity)
    pages = -(-num_tokens // identity.page_size)
    return pages * (identity.num_layers * codec.kv_bytes + codec.index_bytes + codec.scale_bytes)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def merge_results(path: str | Path, entries: dict) -> Path:
    """Write `entries` into the JSON file at `path`, keeping the other scripts' keys there."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update(entries)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return out


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(args: argparse.Namespace, r: dict) -> None:
    gib = 1 << 30
    adopt_bytes = r["adopt_index_bytes"] + r["adopt_kv_bytes"] + r["token_id_bytes"]
    rows = [
        ("adopt (index first, lazy K/V)", r["adopt_s"], adopt_bytes),
        ("(a) re-prefill from token ids", r["reprefill_s"], r["token_id_bytes"]),
        ("(b) copy whole KV first", r["full_copy_s"], r["full_copy_bytes"] + r["token_id_bytes"]),
    ]
    meta = dict(command="python benchmarks/kvcache/adopt.py " + " ".join(sys.argv[1:]),
                hardware=hardware(r["device"]), date=datetime.now(UTC).isoformat(timespec="seconds"),
                git_revision=git_revision())
    shape = "m3-proxy (quick shapes)" if args.quick else "m3-proxy"
    where = "Ray shard actors" if args.transport == "ray" else "in-process shards, no Ray"
    index = f", {args.index_dtype} index keys" if args.index_dtype else ""
    label = f"{shape}, {r['config'].num_layers} layers{index}, {args.context} tokens, {args.shards} {where}"
    entries = {
        "kvcache.full_kv_adopt_vs_reprefill": dict(value=round(r["reprefill_s"] / r["adopt_s"], 2), unit="x"),
        "kvcache.adopt_vs_full_copy": dict(value=round(r["full_copy_s"] / r["adopt_s"], 2), unit="x"),
        "kvcache.adopt_time_to_token_s": dict(value=round(r["adopt_s"], 4), unit="s"),
        "kvcache.reprefill_time_to_token_s": dict(value=round(r["reprefill_s"], 4), unit="s"),
        "kvcache.full_copy_time_to_token_s": dict(value=round(r["full_copy_s"], 4), unit="s"),
        "kvcache.adopt_bytes_moved": dict(value=adopt_bytes, unit="bytes"),
        "kvcache.full_copy_bytes_moved": dict(value=r["full_copy_bytes"] + r["token_id_bytes"], unit="bytes"),
        "kvcache.full_kv_lazy_tpot_penalty": dict(value=round(r["tpot_lazy_s"] / r["tpot_resident_s"] - 1, 4),
                                          unit="fraction of resident TPOT"),
    }
    samples = {"kvcache.adopt_time_to_token_s": r["adopt_samples_s"],
               "kvcache.full_copy_time_to_token_s": r["full_copy_samples_s"]}
    for key, entry in entries.items():
        entry.update(meta, workload=label)
        if key in samples:
            entry["samples"] = [round(x, 4) for x in samples[key]]
        if key in samples or "adopt_vs" in key:
            entry["note"] = f"median of {args.repeats} runs, each on fresh caches"
    out = merge_results(args.output, entries)
    print(f"\n{label}; persist (upload) {r['persist_s']:.3f} s, "
          f"{r['uploaded_bytes'] / gib:.3f} GiB; results → {out}")
    print(f"TPOT resident {r['tpot_resident_s'] * 1e3:.2f} ms | lazy (median of {args.steps}) "
          f"{r['tpot_lazy_s'] * 1e3:.2f} ms | first lazy step {r['tpot_lazy_first_s'] * 1e3:.2f} ms")
    print(f"tokens equal to the unmoved replica's: adopt {r['adopt_tokens_match']}, "
          f"full copy {r['full_copy_token_matches']}")
    print(f"{'next token after adoption':<34}{'time (s)':>12}{'GiB moved':>12}{'vs adopt':>10}")
    for name, seconds, nbytes in rows:
        print(f"{name:<34}{seconds:>12.4f}{nbytes / gib:>12.4f}{seconds / r['adopt_s']:>9.1f}x")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes and context (CPU smoke run)")
    parser.add_argument("--context", type=int, default=None, help="session tokens (default 1M; quick 4096)")
    parser.add_argument("--num-layers", type=int, default=None, help="default 4 (quick 2)")
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 32768; quick 1024)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps for TPOT")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--transport", choices=("ray", "local"), default=None,
                        help="shards as Ray actors (default when Ray is installed) or in this process")
    parser.add_argument("--prefetch-pages", type=int, default=256, help="(page, layer) reads in flight")
    parser.add_argument("--index-dtype", choices=("float8_e4m3fn",), default=None,
                        help="index-K cache dtype (default: the K/V dtype); fp8 stores per-key fp32 scales")
    parser.add_argument("--repeats", type=int, default=3,
                        help="adoptions and full copies timed (each on fresh caches); medians reported")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    args.context = args.context or (4096 if args.quick else 1 << 20)
    args.num_layers = args.num_layers or (2 if args.quick else 4)
    args.chunk = args.chunk or (1024 if args.quick else 32768)
    default_name = "kvcache_cpu_quick.json" if args.quick else "kvcache.json"
    args.output = args.output or str(ROOT / "benchmarks" / "results" / default_name)
    if args.transport is None:
        args.transport = "ray" if importlib.util.find_spec("ray") else "local"
        if args.transport == "local":
            print("Ray is not installed: the shards run in this process (--transport local)")
    if args.transport == "local":
        report(args, run(args))
        return
    import ray

    ray.init(address="local", include_dashboard=False, configure_logging=False, _node_ip_address="127.0.0.1")
    try:
        report(args, run(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
