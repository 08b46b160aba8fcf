"""Engine sessions through the KV cache service (in-process shards, no Ray): a conversation
persisted by one engine continues on another that adopts it — index first, K/V pages as the
indexer selects them — with exactly the greedy tokens of a run that never moved.

tiny: P=16, K=4, so K·P = 64 and these 300-token sessions attend sparsely."""

import pytest
import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.kv.pages import identity_for
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights

PROMPT_LEN, TURN_TOKENS = 300, 12


@pytest.fixture(scope="module")
def model() -> MSATransformer:
    return init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).eval()


def new_client(model: MSATransformer) -> KVCacheClient:
    identity = identity_for(model.config, "tiny@seed0", torch.float32)
    return KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20), identity)


def new_engine(model: MSATransformer, client: KVCacheClient | None, prefetch_pages: int = 64,
               num_pages: int = 96) -> LLMEngine:
    config = EngineConfig(model="tiny", attention_backend="msa", num_pages=num_pages, max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=1024)
    engine = LLMEngine(config, model=model, kv_client=client)
    if engine.sessions is not None:
        engine.sessions.sync_every = 4
        engine.sessions.prefetch_pages = prefetch_pages
    return engine


def tokens(length: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int,
        session_id: str | None = None, stop_after: int | None = None) -> list[int]:
    """Greedy tokens of one request (stepping stops after `stop_after` tokens: a replica dying)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest(request_id, prompt, sampling, session_id=session_id))
    out: list[int] = []
    while engine.has_unfinished() and (stop_after is None or len(out) < stop_after):
        for output in engine.step():
            out.extend(output.token_ids)
    return out


@pytest.fixture(scope="module")
def conversation(model):
    """Two turns on one engine without the service: the unmoved reference."""
    engine = new_engine(model, None)
    first = tokens(PROMPT_LEN, seed=1)
    out1 = run(engine, "ref-1", first, TURN_TOKENS)
    second = first + out1 + tokens(5, seed=2)
    out2 = run(engine, "ref-2", second, TURN_TOKENS)
    return first, out1, second, out2


def test_session_moved_between_turns_gives_identical_tokens_fetching_pages_lazily(model, conversation):
    first, out1, second, out2 = conversation
    client = new_client(model)
    home = new_engine(model, client)
    assert run(home, "t1", first, TURN_TOKENS, session_id="chat") == out1
    record = client.get_session("chat")  # in process: the shard's own object, so read it now
    assert record.token_ids == first + out1  # persisted at the end of the turn, tail included
    stored = len(first + out1) - 1
    assert record.num_stored_tokens == stored

    other = new_engine(model, client, prefetch_pages=0)  # no prefetch: only what the indexer selects
    assert run(other, "t2", second, TURN_TOKENS, session_id="chat") == out2
    assert other.sessions.stats.adopted == 1
    assert other.sessions.stats.adopted_tokens == stored
    stats = other.sessions.adoptions["t2"]
    adopted_pages = -(-stored // model.config.page_size)
    assert stats.index_bytes > 0  # the whole index came first
    # Sparse decode fetched the selected pages of each layer, not every page of every layer.
    assert 0 < stats.kv_pages_on_demand < adopted_pages * model.config.num_layers
    kinds = {kind for kind, _ in other.sessions.latencies}  # what the replica's metrics export
    assert kinds == {"index_load", "page_fetch"}
    # The new home persisted turn 2 on top of the adopted record.
    assert client.get_session("chat").token_ids == second + out2
    other.block_manager.check_consistency()


def test_session_moved_mid_generation_continues_with_identical_tokens(model, conversation):
    first, out1, _, _ = conversation
    client = new_client(model)
    dying = new_engine(model, client)
    partial = run(dying, "m1", first, TURN_TOKENS, session_id="mid", stop_after=7)
    recorded = list(client.get_session("mid").token_ids)  # synced after the prefill, every 4 steps
    done = len(recorded) - len(first)
    assert 1 <= done < len(partial) and recorded == first + out1[:done]
    dying.sessions.release("mid")  # what a move asks of the old home: the record is current now
    recorded = list(client.get_session("mid").token_ids)
    done = len(recorded) - len(first)
    assert done == len(partial) and recorded == first + out1[:done]

    adopter = new_engine(model, client)  # with background prefetch
    rest = run(adopter, "m2", recorded, TURN_TOKENS - done, session_id="mid")
    assert out1[:done] + rest == out1
    assert adopter.sessions.stats.adopted == 1


def test_a_page_missing_in_the_service_is_recomputed_from_the_token_ids(model, conversation):
    first, _, second, out2 = conversation
    client = new_client(model)
    run(new_engine(model, client), "l1", first, TURN_TOKENS, session_id="lost")
    # Page 1's index-K and K/V: adoption stops before it, and the rest is recomputed.
    client.delete_pages(client.get_session("lost").page_hashes[1:2])
    adopter = new_engine(model, client, prefetch_pages=0)
    assert run(adopter, "l2", second, TURN_TOKENS, session_id="lost") == out2
    assert adopter.sessions.stats.adopted_tokens == model.config.page_size  # page 0 only
    adopter.block_manager.check_consistency()


def test_a_rewritten_conversation_starts_a_fresh_record(model, conversation):
    first = conversation[0]
    client = new_client(model)
    engine = new_engine(model, client)
    run(engine, "w1", first, 3, session_id="edit")
    rewritten = tokens(80, seed=9)
    run(engine, "w2", rewritten, 3, session_id="edit")
    assert client.get_session("edit").token_ids[: len(rewritten)] == rewritten


def test_two_engines_share_an_evicted_prefix_through_the_service(model):
    prompt = tokens(300, seed=11)
    expected = run(new_engine(model, None), "ref", [*prompt, 7, 8, 9], TURN_TOKENS)
    client = new_client(model)
    first = new_engine(model, client, num_pages=24)  # too small to keep both prompts' pages
    run(first, "a", prompt, 2)
    for i, seed in enumerate((12, 13)):  # evict every page of the first prompt: they go to the service
        run(first, f"b{i}", tokens(300, seed=seed), 2)
    assert first.sessions.prefix.io.bytes_stored > 0

    second = new_engine(model, client)
    assert run(second, "c", [*prompt, 7, 8, 9], TURN_TOKENS) == expected
    full_pages = len(prompt) // model.config.page_size
    assert second.sessions.prefix.num_loaded_pages == full_pages  # loaded, not prefilled
    assert second.stats().prefix_hit_rate > 0.9
    second.block_manager.check_consistency()
