"""Pick the fastest dense attention per shape and mask kind: measured once, then cached.

A shape key (mask kind, batch, heads, bucketed lengths, head dim, dtype, device name) maps to the
candidate that ran fastest on the first call with that key (`candidates.py` lists them; the paged
decode of `gpu.py` adds its own). Every applicable candidate runs on the real inputs of that first
call, its output is checked against the first candidate that ran (relative L2 error), and its time
is the median of a few event-timed calls. The choice lives in memory and, when a cache path is
given, in a JSON file that later processes read instead of measuring again.

On CPU nothing is timed unless a timer is injected: SDPA's own choice (`sdpa_default`) runs.
Lengths and the batch are bucketed to powers of two, so one measurement serves a bucket (a serving
engine sees a new exact length every step, and a new count of decoding sequences in many steps of a
continuous batch: with exact batch sizes, an H200 run at concurrency 32 measured a new key in most
mixed steps, which took the dense engine's TPOT to 1.4 s).
"""

import json
import os
import statistics
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from msaserve.kernels.dense.candidates import CANDIDATES, Candidate, Unsupported, bucketable, mask_kind

Timer = Callable[[str, Callable[[], torch.Tensor]], float]
FALLBACK = "sdpa_default"
# ‖o - o_ref‖ / ‖o_ref‖ above which a candidate is dropped as computing something else: bf16
# outputs of correct kernels differ by 2e-3..8e-3 (different accumulation orders and P rounding).
_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def bucket(n: int) -> int:
    """The power of two ≥ n (n ≥ 1)."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class ShapeKey:
    kind: str
    batch: int  # bucketed
    q_heads: int
    kv_heads: int
    q_len: int  # bucketed
    kv_len: int  # bucketed
    head_dim: int
    dtype: str
    device: str  # the GPU's name ("cpu" on CPU): a cache file may travel between machines

    def text(self) -> str:
        return "|".join(str(v) for v in asdict(self).values())


@dataclass
class Choice:
    """winner: candidate name; times_ms: each candidate that ran; errors: why the others did not."""

    winner: str
    times_ms: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def key_for(q: torch.Tensor, k: torch.Tensor, kind: str | None = None) -> ShapeKey:
    """q [B, Hq, Tq, D], k [B, Hkv, T, D] → its key (kind from the lengths unless given)."""
    batch, q_heads, q_len, head_dim = q.shape
    kind = kind or mask_kind(q_len, k.shape[2])
    return ShapeKey(kind, bucket(batch), q_heads, k.shape[1], bucket(q_len), bucket(k.shape[2]), head_dim,
                    str(q.dtype).removeprefix("torch."), device_name(q.device))


def cuda_event_timer(reps: int = 3) -> Timer:
    """Median of `reps` event-timed calls after one warm-up call (one call if a call takes > 1 s)."""

    def timed(_name: str, fn: Callable[[], torch.Tensor]) -> float:
        def once() -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        first = once()  # warm-up: compilation, autotuning, handle creation
        return once() if first > 1000 else statistics.median(once() for _ in range(reps))

    return timed


class DenseSelector:
    """candidates: name → Candidate (default: every one in candidates.py); timer(name, fn) → ms
    (default: CUDA events on CUDA, none on CPU); cache_path: JSON file of earlier choices."""

    def __init__(self, candidates: Mapping[str, Candidate] | None = None, timer: Timer | None = None,
                 cache_path: str | os.PathLike | None = None, check_outputs: bool = True):
        self.candidates = dict(CANDIDATES if candidates is None else candidates)
        self.timer = timer
        self.cache_path = Path(cache_path) if cache_path else None
        self.check_outputs = check_outputs
        self.choices: dict[str, Choice] = {}
        self.measurements = 0  # how many keys were measured in this process (tests read it)
        if self.cache_path is not None and self.cache_path.exists():
            raw = json.loads(self.cache_path.read_text())
            self.choices = {key: Choice(**entry) for key, entry in raw.items()}

    def choose_among(self, key: ShapeKey, runs: Mapping[str, Callable[[], torch.Tensor]],
                     fallback: str = FALLBACK) -> Choice:
        """The cached choice for `key`, else measure `runs` (name → zero-argument call) now. A cached
        winner missing from `runs` (a package since uninstalled) is measured again."""
        cached = self.choices.get(key.text())
        if cached is not None and cached.winner in runs:
            return cached
        timer = self.timer
        if timer is None:
            if key.device == "cpu":
                return Choice(fallback if fallback in runs else next(iter(runs)))
            timer = cuda_event_timer()
        choice = self._measure(runs, timer, self._tolerance(key.dtype))
        self.choices[key.text()] = choice
        self.measurements += 1
        self._save()
        return choice

    def pretune(self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device | str, q_lens: list[int], max_kv_len: int) -> int:
        """Measure now, on random inputs, every key that prefill chunks of `q_lens` tokens over up to
        `max_kv_len` keys will meet (batch 1: the prefill op runs per sequence; KV buckets from the
        chunk's own length up to bucket(max_kv_len)), so that no measurement runs inside a serving
        step or a timed benchmark. Returns how many keys were measured (0 on the CPU without a timer:
        nothing is timed there)."""
        device = torch.device(device)
        if device.type == "cpu" and self.timer is None:
            return 0
        before, scale = self.measurements, 1.0 / head_dim ** 0.5
        for q_len in sorted({bucket(n) for n in q_lens}):
            kv_len = q_len
            while kv_len <= max(q_len, bucket(max_kv_len)):
                q = torch.randn(1, q_heads, q_len, head_dim, dtype=dtype, device=device)
                k, v = (torch.randn(1, kv_heads, kv_len, head_dim, dtype=dtype, device=device) for _ in "kv")
                self.attention(q, k, v, scale)
                del q, k, v
                kv_len *= 2
        return self.measurements - before

    def record(self, key: ShapeKey, choice: Choice) -> None:
        """Store a choice measured elsewhere (bench_dense.py --selector-cache writes a cache file the
        engine then reads, so a serving process measures nothing)."""
        self.choices[key.text()] = choice
        self._save()

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Lower-right causal GQA attention (see candidates.py) by the fastest candidate for its key."""
        choice = self.choose_among(key_for(q, k), self.runs(q, k, v, scale))
        return self.candidates[choice.winner].fn(q, k, v, scale)

    def runs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             scale: float) -> dict[str, Callable[[], torch.Tensor]]:
        """name → call, for every candidate that applies to these inputs' kind and device."""
        kind = mask_kind(q.shape[2], k.shape[2])
        return {name: (lambda c=c: c.fn(q, k, v, scale)) for name, c in self.candidates.items()
                if kind in c.kinds and (q.device.type == "cuda" or not c.cuda_only)}

    def _measure(self, runs: Mapping[str, Callable[[], torch.Tensor]], timer: Timer,
                 tolerance: float) -> Choice:
        times, errors, reference = {}, {}, None
        for name, fn in runs.items():
            try:
                out = _rows_to_check(fn())
                if self.check_outputs:
                    if reference is None:
                        reference = out
                    else:
                        err = float((out - reference).norm() / reference.norm().clamp(min=1e-30))
                        if not err <= tolerance:
                            raise Unsupported(f"output differs from the first candidate's: rel err {err:.3g}")
                del out
                times[name] = timer(name, fn)
            except Exception as exc:  # a refusing or failing candidate is skipped, with the reason
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
        if not times:
            raise RuntimeError(f"no dense attention candidate ran; errors: {errors}")
        return Choice(min(times, key=times.__getitem__), times, errors)

    @staticmethod
    def _tolerance(dtype: str) -> float:
        return _TOLERANCE.get(getattr(torch, dtype, torch.bfloat16), 2e-2)

    def _save(self) -> None:
        if self.cache_path is None:
            return
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: asdict(c) for k, c in self.choices.items()}, indent=1, sort_keys=True))
        tmp.replace(self.cache_path)


def _rows_to_check(out: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """The first and last `rows` queries of o [..., Tq, D] in fp32 (all of them when Tq ≤ 2·rows):
    enough to see a wrong mask or scale, without an fp32 copy of a 1M-token output."""
    if out.shape[-2] > 2 * rows:
        out = torch.cat([out[..., :rows, :], out[..., -rows:, :]], dim=-2)
    return out.float()


_DEFAULT: DenseSelector | None = None


def default_selector() -> DenseSelector:
    """The process-wide selector the dense backend uses; `MSASERVE_DENSE_CACHE` names its optional
    on-disk cache (a JSON file; written after every new measurement)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = DenseSelector(bucketable(), cache_path=os.environ.get("MSASERVE_DENSE_CACHE") or None)
    return _DEFAULT
