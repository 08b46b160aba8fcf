"""Grammar libraries for structured outputs, measured on the SmolLM2 tokenizer (49152 tokens):
llguidance vs xgrammar. Written to benchmarks/results/structured_grammars.json.

1. Compile time of five real tool schemas (cold: a fresh compiler, no cache), median of 5.
2. Mask time per decode step at batch 32: 32 matchers (the five schemas round-robin) each walk a
   valid instance token by token; each step fills the batch's bitmask in one call (llguidance
   `LLExecutor`, xgrammar `BatchGrammarMatcher`); median and p90 over the steps.

    .venv/bin/python benchmarks/platform/bench_grammars.py
"""

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import gguf
import llguidance
import torch

from msaserve.engine.structured.bitmask import BatchMasker, allocate
from msaserve.models.gguf_loader import read_tokenizer, smollm2_gguf_path

RESULTS = Path(__file__).resolve().parents[1] / "results" / "structured_grammars.json"
BATCH, REPEATS = 32, 5

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"], "additionalProperties": False,
    },
    "web_search": {
        "type": "object",
        "properties": {"query": {"type": "string", "minLength": 1}, "max_results": {
            "type": "integer", "minimum": 1, "maximum": 50}, "site": {"type": ["string", "null"]}},
        "required": ["query", "max_results", "site"], "additionalProperties": False,
    },
    "create_event": {
        "type": "object",
        "properties": {
            "title": {"type": "string"}, "start": {"type": "string", "format": "date-time"},
            "duration_minutes": {"type": "integer"},
            "attendees": {"type": "array", "items": {"type": "object", "properties": {
                "email": {"type": "string"}, "optional": {"type": "boolean"}},
                "required": ["email", "optional"], "additionalProperties": False}},
        },
        "required": ["title", "start", "duration_minutes", "attendees"], "additionalProperties": False,
    },
    "create_issue": {
        "type": "object",
        "properties": {
            "repo": {"type": "string", "pattern": "^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$"},
            "title": {"type": "string", "maxLength": 120}, "body": {"type": "string"},
            "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs", "question"]}},
            "assignee": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": ["repo", "title", "body", "labels", "assignee"], "additionalProperties": False,
    },
    "run_sql": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "params": {"type": "array", "items": {
            "anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]}},
            "timeout_s": {"type": "number", "minimum": 0}},
        "required": ["query", "params", "timeout_s"], "additionalProperties": False,
    },
}
INSTANCES = {
    "get_weather": {"location": "Paris, France", "unit": "celsius"},
    "web_search": {"query": "msaserve block sparse attention", "max_results": 5, "site": None},
    "create_event": {"title": "Design review", "start": "2026-12-03T10:00:00Z", "duration_minutes": 45,
                     "attendees": [{"email": "a@example.com", "optional": False},
                                   {"email": "b@example.com", "optional": True}]},
    "create_issue": {"repo": "org/msaserve", "title": "Grammar masks", "body": "Measure them.",
                     "labels": ["feature"], "assignee": None},
    "run_sql": {"query": "select * from t where a = ? and b > ?", "params": ["x", 3], "timeout_s": 2.5},
}


def llg_compile(tok: llguidance.LLTokenizer, schema: dict) -> llguidance.LLMatcher:
    text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(tok, text, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def median_s(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def walk(fill, consume, matchers: list, token_paths: list[list[int]]) -> list[float]:
    """Per-step batch mask time while every matcher follows its token path."""
    times = []
    for step in range(max(len(p) for p in token_paths)):
        live = [i for i, p in enumerate(token_paths) if step < len(p)]
        start = time.perf_counter()
        fill([matchers[i] for i in live])
        times.append(time.perf_counter() - start)
        for i in live:
            consume(matchers[i], token_paths[i][step])
    return times


def bench_llguidance(tokenizer, vocab: int, eos: list[int], paths: list[list[int]], names: list[str]) -> dict:
    start = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - start
    compile_s = {name: median_s(lambda s=s: llg_compile(tok, s)) for name, s in SCHEMAS.items()}
    templates = {name: llg_compile(tok, s) for name, s in SCHEMAS.items()}
    matchers = [templates[n].deep_copy() for n in names]
    masker = BatchMasker(vocab)
    times = walk(masker.fill, lambda m, t: _accepted(m.consume_token(t)), matchers, paths)
    assert all(m.is_accepting() for m in matchers)
    return {"tokenizer_setup_s": setup, "compile_s": compile_s, "mask_step_s": times}


def bench_xgrammar(tokenizer, vocab: int, eos: list[int], paths: list[list[int]], names: list[str]) -> dict:
    import xgrammar as xgr  # imports transformers: a benchmark-only candidate, never in msaserve/

    vocab_strings = [tokenizer.backend.id_to_token(i) or "" for i in range(vocab)]
    start = time.perf_counter()
    info = xgr.TokenizerInfo(vocab_strings, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=eos)
    setup = time.perf_counter() - start

    def compile_one(schema: dict):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    compile_s = {name: median_s(lambda s=s: compile_one(s)) for name, s in SCHEMAS.items()}
    compiled = {name: compile_one(s) for name, s in SCHEMAS.items()}
    matchers = [xgr.GrammarMatcher(compiled[n]) for n in names]
    batch = xgr.BatchGrammarMatcher()
    bitmask = allocate(BATCH, vocab)
    times = walk(lambda ms: batch.batch_fill_next_token_bitmask(ms, bitmask[: len(ms)]),
                 lambda m, t: _accepted(m.accept_token(t)), matchers, paths)
    assert all(m.is_terminated() for m in matchers)
    return {"tokenizer_setup_s": setup, "compile_s": compile_s, "mask_step_s": times}


def _accepted(ok: bool) -> None:
    assert ok, "the grammar refused a token of a valid instance"


def summarize(result: dict) -> dict:
    steps = sorted(result.pop("mask_step_s"))
    result["mask_step_ms_median"] = 1e3 * statistics.median(steps)
    result["mask_step_ms_p90"] = 1e3 * steps[int(0.9 * (len(steps) - 1))]
    result["mask_us_per_row_median"] = 1e6 * statistics.median(steps) / BATCH
    result["compile_ms"] = {k: 1e3 * v for k, v in result.pop("compile_s").items()}
    result["compile_ms_max"] = max(result["compile_ms"].values())
    return result


def main() -> None:
    torch.set_num_threads(1)
    tokenizer = read_tokenizer(gguf.GGUFReader(smollm2_gguf_path()))
    vocab, eos = tokenizer.vocab_size, sorted(tokenizer.eos_token_ids)
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(BATCH)]
    paths = [tokenizer.encode(json.dumps(INSTANCES[n], separators=(",", ":"))) + eos[:1] for n in names]
    results = {lib: summarize(fn(tokenizer, vocab, eos, paths, names))
               for lib, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar))}
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "hardware": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_revision": revision.strip(),
        "tokenizer": "SmolLM2-135M-Instruct", "vocab_size": vocab, "batch": BATCH,
        "versions": {"llguidance": llguidance.__version__, "xgrammar": _xgrammar_version()},
        "results": results,
    }
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    header = f"{'library':<11} {'tok setup s':>11} {'compile ms (max)':>17} {'mask ms/step p50':>17} " \
             f"{'p90':>7} {'us/row':>7}"
    print(header)
    for lib, r in results.items():
        print(f"{lib:<11} {r['tokenizer_setup_s']:>11.2f} {r['compile_ms_max']:>17.1f} "
              f"{r['mask_step_ms_median']:>17.3f} {r['mask_step_ms_p90']:>7.3f} "
              f"{r['mask_us_per_row_median']:>7.1f}")


def _xgrammar_version() -> str:
    from importlib.metadata import version

    return version("xgrammar")


if __name__ == "__main__":
    main()
