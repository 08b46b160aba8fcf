"""A replica of 2 ranks on a local Ray (placement group of 2 CPU bundles, a RankWorker actor
each, gloo): greedy tokens equal one rank's; its session is persisted to the KV cache service
through the gathered pages; a rank killed mid-generation fails the replica with
ReplicaGroupFailed within the collective timeout (no hang); and the session is then re-placed on
another replica from the KV cache service, giving the unmoved run's tokens."""

import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from m3_tiny import prompt, write_m3_directory

from msaserve.engine.config import EngineConfig
from msaserve.engine.kv.pages import identity_for
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.parallel.engine import group_llm_engine
from msaserve.engine.parallel.errors import ReplicaGroupFailed
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig

TIMEOUT_S = 20.0
TURN_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(write_m3_directory(tmp_path_factory.mktemp("m3") / "tiny"))


@pytest.fixture(scope="module")
def ray_cluster():
    root = Path(__file__).resolve().parents[2]  # the ranks import this checkout's msaserve
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False,
             _node_ip_address="127.0.0.1", namespace="msaserve-parallel-test",
             runtime_env={"env_vars": {"PYTHONPATH": str(root)}})
    yield
    ray.shutdown()


def config(checkpoint: str, tp: int) -> EngineConfig:
    return EngineConfig(model=checkpoint, attention_backend="naive", num_pages=64, max_num_seqs=2,
                        max_num_batched_tokens=48, max_model_len=512, tensor_parallel_size=tp,
                        collective_timeout_s=TIMEOUT_S)


def run(engine: LLMEngine, request_id: str, ids: list[int], session_id: str | None = None,
        max_tokens: int = TURN_TOKENS) -> list[int]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest(request_id, ids, sampling, session_id=session_id))
    out: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            out.extend(output.token_ids)
    return out


def test_group_replica_serves_persists_fails_cleanly_and_its_session_moves(ray_cluster, checkpoint):
    torch.set_num_threads(1)
    first = prompt(70, seed=3)
    reference = LLMEngine(config(checkpoint, tp=1))
    out1 = run(reference, "ref-1", first)
    second = first + out1 + [40, 41, 42]
    out2 = run(reference, "ref-2", second)

    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20),
                                      identity_for(reference.model.config, "m3-tiny", torch.float32))
    group = group_llm_engine(config(checkpoint, tp=2))
    group.attach_kv_client(client)
    group.sessions.sync_every = 4
    assert run(group, "g-1", first, session_id="chat") == out1  # 2 ranks: one rank's tokens

    # A rank dies while the replica generates: the step fails fast and names the cause.
    failure: list[BaseException] = []

    def generate() -> None:
        try:
            run(group, "g-long", prompt(20, seed=9), max_tokens=400)
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(1.0)
    killed_at = time.monotonic()
    ray.kill(group.runner.group.workers[1], no_restart=True)
    thread.join(timeout=TIMEOUT_S + 30)
    assert not thread.is_alive(), "the replica hung on a dead rank"
    assert time.monotonic() - killed_at < TIMEOUT_S + 30
    assert failure and isinstance(failure[0], ReplicaGroupFailed), failure
    assert failure[0].status == 503 and "execute failed" in str(failure[0])
    with pytest.raises(ReplicaGroupFailed, match="failed earlier"):
        group.runner.group.call_all("ping")

    # The session lives on in the KV cache service: another replica adopts it.
    other = LLMEngine(config(checkpoint, tp=1), kv_client=client)
    assert run(other, "t2", second, session_id="chat") == out2
    assert other.sessions.stats.adopted == 1
