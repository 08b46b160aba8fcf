"""Multi-turn session scripts with their reference tokens, shared by the live reliability tests and
the soak benchmark (benchmarks/reliability/soak.py).

A session's next turn must extend the conversation with the model's exact reply, but the `tiny`
preset's random model emits any of 512 ids while the gateway accepts only the 259 its byte
tokenizer knows, and text does not round-trip to ids (a reply's text also depends on the bytes
before it). So scripts are made up front by the replicas' own model run locally without faults
(greedy): each turn's new user tokens are drawn until the reply stays within the tokenizer. A
served turn is exact when the session's record in the KV cache service (what the engine
persisted) holds exactly the reference conversation (`record_reader`).
"""

import dataclasses
import random
import time
from dataclasses import dataclass, field

from msaserve.engine.llm_engine import LLMEngine, load_engine_model
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.platform.config import ServeConfig
from msaserve.platform.model_deployment import engine_config_from

TOKEN_RANGE = (3, 259)
"""Prompt ids the tiny preset's byte tokenizer accepts."""
FIRST_TURN_TOKENS, NEXT_TURN_TOKENS, TURN_REPLY_TOKENS = 96, 24, 4
CANDIDATES_PER_TURN = 24
"""New-turn candidates tried at once; a 4-token reply stays in range with p ≈ (259/512)^4 ≈ 1/15."""


@dataclass
class SessionScript:
    prompts: list[list[int]] = field(default_factory=list)
    """Turn k's whole prompt: the conversation so far plus the new user tokens."""
    replies: list[list[int]] = field(default_factory=list)


def reference_engine(config: ServeConfig) -> tuple[LLMEngine, object]:
    """The replicas' model and tokenizer in this process, with room for a large batch (greedy
    tokens do not depend on batch composition: docs/design.md §2, property 2)."""
    engine_config = dataclasses.replace(
        engine_config_from(config), max_num_seqs=64, max_waiting=1 << 20, num_pages=4096
    )
    model, tokenizer = load_engine_model(engine_config)
    return LLMEngine(engine_config, model, tokenizer), tokenizer


def generate_all(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    batch = time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"ref-{batch}-{i}", prompt, greedy))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
    return [outputs[f"ref-{batch}-{i}"] for i in range(len(prompts))]


def make_scripts(
    engine: LLMEngine, tokenizer, num_scripts: int, num_turns: int, seed: int
) -> list[SessionScript]:
    vocab = tokenizer.vocab_size
    rng = random.Random(seed)
    scripts = [SessionScript() for _ in range(num_scripts)]
    for turn in range(num_turns):
        pending = list(range(num_scripts))
        while pending:
            candidates: list[tuple[int, list[int]]] = []
            for s in pending:
                history = scripts[s].prompts[-1] + scripts[s].replies[-1] if turn else []
                n = NEXT_TURN_TOKENS if turn else FIRST_TURN_TOKENS
                for _ in range(CANDIDATES_PER_TURN):
                    candidates.append((s, history + [rng.randrange(*TOKEN_RANGE) for _ in range(n)]))
            replies = generate_all(engine, [p for _, p in candidates], TURN_REPLY_TOKENS)
            for (s, prompt), reply in zip(candidates, replies, strict=True):
                if s in pending and all(t < vocab for t in reply):
                    scripts[s].prompts.append(prompt)
                    scripts[s].replies.append(reply)
                    pending.remove(s)
    return scripts


def record_reader(config: ServeConfig, engine: LLMEngine):
    """session id → the token ids of its record in the platform's KV cache service (None if none).
    Call after the app has started the service."""
    from msaserve.engine.kv.pages import identity_for
    from msaserve.engine.memory import cache_dtypes
    from msaserve.kvcache.client import KVCacheClient, ServiceUnavailable
    from msaserve.kvcache.config import ServiceConfig
    from msaserve.kvcache.session_records import SessionNotFound

    kv_dtype, index_dtype = cache_dtypes(engine.config)
    identity = identity_for(engine.model.config, config.model.resolved_name(), kv_dtype, index_dtype)
    client = KVCacheClient.connect(ServiceConfig.from_settings(config.kvcache), identity)

    def read(session_id: str) -> list[int] | None:
        try:
            return list(client.get_session(session_id).token_ids)
        except (SessionNotFound, ServiceUnavailable):
            return None

    return read
