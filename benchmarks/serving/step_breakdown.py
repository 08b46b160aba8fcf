"""Where an engine step's device time goes, per part of the model: attention, indexer, MoE, dense
MLP, and the rest (embedding, norms, residuals, LM head, sampling, step inputs).

The engine's steps run eagerly (its decode CUDA graphs set aside: a replayed graph's kernels
cannot be told apart by module) under torch.profiler. Each module of interest runs inside a
`record_function` range, and so does each MSA / dense attention op; every GPU kernel counts
for the innermost range it was launched in (on the CPU, each op's own CPU time does). Kernels
the profiler links to no range (Triton's launcher calls the driver directly: an H200 run credited
the dense paged-decode kernel and MSA's Triton kernels to no part, so dense and MSA decode steps
showed the same attention time) count by name for the part whose msaserve/kernels package defines
them: indexer_* → indexer, moe → moe, sparse_*, dense and the shared LSE merge → attention, the
rest (layer_ops: fused norm, rotary + cache writes, SwiGLU product; residency, page_gather) → rest,
whichever module launched them. Only those names: the device timeline also holds the ranges
themselves as annotation events (counted once, they put 20 ms per step in `rest`). Kernel time
only: launch gaps, which the graphs remove, are left out, so the parts add up to the GPU work of
a step, not to its wall time.

  attention  q/k/v/o projections, QK norms, rotary, K/V cache writes, and the attention kernels
             (sparse over the selected blocks, or dense)
  indexer    the index projections (q, k, norms, rotary, index-K write) and the block selection
             (score + top-k: indexer_prefill / indexer_decode); M3 runs its index projections in
             the attention's one GEMM and head kernel (models/minimax_m3/attention.py), so there
             they count for attention and only the selection here
  moe        router, routed experts, shared expert
  dense_mlp  the dense MLP of the leading layers
  rest       everything else
"""

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.autograd.profiler import record_function

PARTS = ("attention", "indexer", "moe", "dense_mlp", "rest")
_PREFIX = "part:"
_OP_PARTS = {"indexer_prefill": "indexer", "indexer_decode": "indexer", "sparse_prefill": "attention",
             "sparse_decode": "attention", "dense_prefill": "attention", "dense_decode": "attention"}


def _labelled(fn: Callable, part: str) -> Callable:
    def run(*args, **kwargs):
        with record_function(_PREFIX + part):
            return fn(*args, **kwargs)

    return run


def _module_parts(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    for layer in model.layers:
        yield layer.self_attn, "attention"
        if getattr(layer.self_attn, "indexer", None) is not None:
            yield layer.self_attn.indexer, "indexer"
        yield layer.mlp, "moe" if hasattr(layer.mlp, "experts") else "dense_mlp"


@contextmanager
def labelled_engine(engine) -> Iterator[None]:
    """Inside: the engine's model modules and attention ops run in labelled ranges, eagerly."""
    runner = engine.runner
    handles = []
    for module, part in _module_parts(engine.model):
        ranges: list = []

        def enter(_module, _inputs, ranges=ranges, part=part):
            ranges.append(record_function(_PREFIX + part).__enter__())

        def leave(_module, _inputs, _output, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    ops, graphs = runner.ops, runner.graphs
    runner.ops = dataclasses.replace(ops, **{name: _labelled(getattr(ops, name), part)
                                             for name, part in _OP_PARTS.items()})
    runner.graphs = None
    try:
        yield
    finally:
        runner.ops, runner.graphs = ops, graphs
        for handle in handles:
            handle.remove()


def _part_of(event) -> str:
    while event is not None:
        if event.name.startswith(_PREFIX):
            return event.name[len(_PREFIX):]
        event = event.cpu_parent
    return "rest"


def kernel_parts() -> dict[str, str]:
    """Triton kernel name → part, from the msaserve.kernels package that defines it."""
    import sys

    parts: dict[str, str] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("msaserve.kernels."):
            continue
        package = module_name.split(".")[2]
        part = ("indexer" if package.startswith("indexer") else "moe" if package == "moe" else
                "attention" if package.startswith(("sparse", "dense", "triton_common")) else "rest")
        for value in vars(module).values():
            fn = value
            while hasattr(fn, "fn"):  # Autotuner / Heuristics → JITFunction → the Python function
                fn = fn.fn
            if fn is not value:
                parts[fn.__name__] = part
    return parts


def attribute(events, device: str) -> dict[str, float]:
    """Milliseconds per part over the profiled events: GPU kernel time on CUDA, self CPU time on
    the CPU."""
    totals: dict[str, float] = defaultdict(float)
    linked: dict[str, float] = defaultdict(float)
    for event in events:
        if event.device_type.name != "CPU" or event.is_async:
            continue
        if device == "cuda":
            micros = sum(kernel.duration for kernel in event.kernels)
            for kernel in event.kernels:
                linked[kernel.name] += kernel.duration
        else:
            micros = 0.0 if event.name.startswith(_PREFIX) else event.self_cpu_time_total
        if micros:
            totals[_part_of(event)] += micros / 1000
    if device == "cuda":  # kernels linked to no CPU range: by name
        on_device: dict[str, float] = defaultdict(float)
        for event in events:
            if event.device_type.name == "CUDA":
                on_device[event.name] += event.time_range.end - event.time_range.start
        parts = kernel_parts()  # only our Triton kernels: the device timeline also holds the
        for name, micros in on_device.items():  # ranges themselves (gpu_user_annotation events)
            orphan = micros - linked.get(name, 0.0)
            if name in parts and orphan > 1e-6 * micros:
                totals[parts[name]] += orphan / 1000
    return {part: totals.get(part, 0.0) for part in PARTS}


def profile_steps(engine, num_steps: int, device: str, warmup_steps: int = 1) -> dict[str, float]:
    """Run `warmup_steps` eager steps (kernels compiled and tuned for eager shapes outside the
    profile), then `num_steps` under the profiler → ms per step per part, plus `total` (their
    sum) and `steps`. The caller has put requests in the engine."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with labelled_engine(engine):
        for _ in range(warmup_steps):
            if engine.has_unfinished():
                engine.step()
    steps = 0
    with labelled_engine(engine), profile(activities=activities) as prof:
        while steps < num_steps and engine.has_unfinished():
            engine.step()
            steps += 1
        if device == "cuda":
            torch.cuda.synchronize()
    totals = attribute(prof.events(), device)
    per_step = {part: value / max(1, steps) for part, value in totals.items()}
    per_step["total"] = sum(per_step[p] for p in PARTS)
    per_step["steps"] = steps
    return per_step


def format_row(label: str, row: dict[str, float]) -> str:
    cells = " ".join(f"{row[p]:>10.3f}" for p in (*PARTS, "total"))
    return f"{label:<28} {cells}"


def header() -> str:
    return f"{'step (ms of kernels / step)':<28} " + " ".join(f"{p:>10}" for p in (*PARTS, "total"))


def _submit(engine, request_id: str, prompt: list[int], max_tokens: int) -> None:
    from msaserve.engine.types import GenerateRequest, SamplingParams

    engine.add_request(GenerateRequest(request_id, prompt, SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))


def agentic_rows(engine, sizes, device: str, level: int = 8) -> list[dict]:
    """Two steps of the agentic workload: `level` sequences decoding past the shared prefix, and
    one prefill chunk (≈ sizes.chunk new tokens after the cached prefix), each profiled."""
    import numpy as np
    from bench_setup import prompt_vocab
    from workloads import agentic_prefix, agentic_sessions, random_tokens, run_to_end

    vocab = prompt_vocab(engine)
    prefix = agentic_prefix(vocab, 0, sizes.prefix_len)
    run_to_end(engine, prefix)
    sessions = agentic_sessions(level, vocab, 0, sizes.prefix_len, sizes.append, sizes.output, 1)
    for i, session in enumerate(sessions):
        _submit(engine, f"decode{i}", list(session.next_turn().prompt_ids), 64)
    started: set[str] = set()
    while len(started) < level and engine.has_unfinished():
        started.update(output.request_id for output in engine.step())
    context = sum(len(s.context) for s in sessions) // level
    decode = profile_steps(engine, 6, device)
    for i in range(level):
        engine.abort(f"decode{i}")
    rng = np.random.default_rng(5)
    new = max(1, sizes.chunk - 2 * engine.page_size)  # prefix tail + new tokens fit one step's budget
    for name in ("warm", "measured"):
        _submit(engine, f"prefill_{name}", prefix + random_tokens(rng, new, vocab), 1)
    prefill = profile_steps(engine, 1, device)
    while engine.has_unfinished():
        engine.step()
    return [{"step": f"agentic decode c{level} (~{context // 1000}K context)", **decode},
            {"step": f"prefill chunk {new} tokens after {len(prefix) // 1000}K cached", **prefill}]


def part_breakdown(args, sizes, report) -> None:
    """The agentic steps' breakdown, MSA then dense (offline.py --part breakdown)."""
    from bench_setup import build_engine, free_memory

    rows = []
    for backend in ("msa", "dense"):
        engine = build_engine(args, sizes, backend, sizes.max_model_len, 8, sizes.chunk)
        rows += [{"backend": backend, **row} for row in agentic_rows(engine, sizes, args.device)]
        engine = None
        free_memory()
    msa, dense = rows[0]["total"], rows[2]["total"]
    report.add("step_breakdown", msa / dense, "x (MSA / dense kernel ms per agentic c8 decode step)",
               table=rows, note="kernel ms per step by part (attention, indexer, moe, dense_mlp, rest), "
               "eager steps under torch.profiler, module ranges (benchmarks/serving/step_breakdown.py)")
    print(f"\n{header()}")
    for row in rows:
        print(format_row(f"{row['backend']} {row['step']}"[:28], row))
