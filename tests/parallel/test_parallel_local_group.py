"""The group path at TP 1 in one process (a RankWorker in a gloo group of one behind LocalGroup,
every call pickled as Ray would): the step message's fixed layout carries every step (prefill
chunks, partial sample rows, decode) intact, greedy steps are sampled on the rank (only token ids
come back) and sampled / logprob requests still get the rank's logits — tokens and logprobs equal
the plain engine's."""

import dataclasses
import pickle

import pytest
import torch
from m3_tiny import prompt, random_m3

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.parallel.local import LocalGroup
from msaserve.engine.parallel.messages import StepMessage
from msaserve.engine.parallel.runner import GroupRunner
from msaserve.engine.parallel.worker import RankWorker, free_address
from msaserve.engine.scheduler import ScheduledBatch
from msaserve.engine.step_inputs import build_host_step, build_step_inputs
from msaserve.engine.types import GenerateRequest, SamplingParams


class RecordingGroup(LocalGroup):
    """LocalGroup that keeps each step message's `greedy` flag (what crossed to the rank)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.greedy_flags: list[bool] = []

    def call_all(self, method, *args):
        if method == "execute":
            self.greedy_flags.append(args[0].greedy)
        return super().call_all(method, *args)


def engine_config(**overrides) -> EngineConfig:
    return EngineConfig(model="tiny-m3", attention_backend="naive", num_pages=64, max_num_seqs=4,
                        max_num_batched_tokens=48, max_model_len=512, **overrides)


@pytest.fixture
def group_engine():
    config = engine_config()
    worker = RankWorker(config, 0)
    worker.join(free_address())
    info = worker.take_model(random_m3(0), None)
    group = RecordingGroup(worker, info, serialize=True)
    try:
        runner = GroupRunner(group, config)
        yield LLMEngine(config, model=runner.model, runner=runner), group
    finally:
        group.shutdown()


def generate(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, list]:
    for i, (request_id, sampling) in enumerate(requests.items()):
        engine.add_request(GenerateRequest(request_id, prompt((70, 9, 33, 20)[i], seed=10 + i), sampling))
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens = out.setdefault(output.request_id, [])
            tokens.extend(output.token_ids)
    return out


def test_group_of_one_rank_gives_the_plain_engines_tokens(group_engine):
    torch.set_num_threads(1)
    engine, group = group_engine
    plain = LLMEngine(engine_config(), model=random_m3(0))
    greedy = {f"g{i}": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True) for i in range(3)}
    assert generate(engine, greedy) == generate(plain, greedy)
    assert group.greedy_flags and all(group.greedy_flags)  # every step sampled on the rank

    group.greedy_flags.clear()
    mixed = {"g": SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
             "s": SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True),
             "lp": SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2,
                                  ignore_eos=True)}
    assert generate(engine, mixed) == generate(plain, mixed)
    assert group.greedy_flags and not any(group.greedy_flags)  # logits came back to the driver


def test_step_message_round_trip_keeps_every_tensor():
    """A pickled message (the buffer arrives read-only, as from a zero-copy transport) uploads to
    the plain runner's own inputs; a decode step sends no sample rows (every row samples) and still
    arrives with all of them."""
    config = engine_config()
    plain = LLMEngine(config, model=random_m3(0))
    for i, length in enumerate((9, 70)):
        plain.add_request(GenerateRequest(f"r{i}", prompt(length, seed=i), SamplingParams(max_tokens=4)))
    prefill = plain.scheduler.schedule()  # r0 whole, r1 mid-prefill (48-token budget): r0 alone samples
    last = dataclasses.replace(prefill.seqs[0], num_computed_tokens=8)  # r0's last prompt token alone
    decode = ScheduledBatch(seqs=[last], num_new_tokens=[1])  # as a decode step
    for batch, rows in ((prefill, [0]), (decode, [0])):
        inputs = build_step_inputs(batch, plain.page_size, torch.device("cpu"))
        sent = StepMessage(build_host_step(batch, plain.page_size), greedy=True)
        wire = sent.__reduce__()[1]
        assert wire[6] == (None if batch is decode else rows)  # the sample rows on the wire
        message = pickle.loads(pickle.dumps(sent))
        assert not message.step.buffer.flags.writeable and message.greedy
        assert message.step.sample_rows == inputs.sample_rows == rows
        ids, meta = message.step.upload(torch.device("cpu"))
        assert torch.equal(ids, inputs.input_ids)
        for name in ("positions", "slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q",
                     "logits_indices"):
            assert torch.equal(getattr(meta, name), getattr(inputs.meta, name)), name
        assert (meta.max_query_len, meta.decode_query_len) == (inputs.meta.max_query_len,
                                                               inputs.meta.decode_query_len)


def test_local_group_takes_one_rank_only():
    worker = RankWorker(engine_config(tensor_parallel_size=2), 0)
    with pytest.raises(ValueError, match="LocalGroup world_size=2 is invalid"):
        LocalGroup(worker, {})
