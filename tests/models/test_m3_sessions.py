"""An M3 conversation moved between replicas through the KV cache service (in-process shards):
the adopting engine gives the unmoved run's greedy tokens. M3 mixes full_attention layers (which
read every page) with MSA layers (which read the pages they select), so adoption must not leave a
dense layer's pages to the lazy per-selection fetch."""

import pytest
import torch
from m3_checkpoint import one_cpu_thread, write_m3_checkpoint

from msaserve.engine.config import EngineConfig
from msaserve.engine.kv.pages import identity_for
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig
from msaserve.models.loader import load_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures(one_cpu_thread.__name__)

PROMPT_LEN, TURN_TOKENS = 200, 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory, _ = write_m3_checkpoint(tmp_path_factory.mktemp("m3") / "text", vl=False, seed=4)
    return load_model(str(directory), attention_backend="msa", progress=False).model


def new_engine(model, client: KVCacheClient | None) -> LLMEngine:
    config = EngineConfig(model="m3", attention_backend="msa", num_pages=64, max_num_seqs=2,
                          max_num_batched_tokens=64, max_model_len=512)
    engine = LLMEngine(config, model=model, kv_client=client)
    if engine.sessions is not None:
        engine.sessions.sync_every = 4
        engine.sessions.prefetch_pages = 0  # nothing in the background: only what adoption fetches
    return engine


def run(engine: LLMEngine, request_id: str, prompt: list[int], session_id: str | None = None) -> list[int]:
    sampling = SamplingParams(max_tokens=TURN_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest(request_id, prompt, sampling, session_id=session_id))
    out: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            out.extend(output.token_ids)
    return out


def test_moved_m3_session_gives_the_unmoved_tokens(model) -> None:
    first = torch.randint(3, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = new_engine(model, None)
    out1 = run(reference, "ref-1", first)
    second = first + out1 + [40, 41, 42]
    out2 = run(reference, "ref-2", second)

    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20),
                                      identity_for(model.config, "m3-tiny", torch.float32))
    assert run(new_engine(model, client), "t1", first, session_id="chat") == out1
    other = new_engine(model, client)
    assert run(other, "t2", second, session_id="chat") == out2
    assert other.sessions.stats.adopted == 1
