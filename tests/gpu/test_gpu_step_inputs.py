"""A step's flat host buffer uploaded to the GPU in one pinned, asynchronous copy gives the CPU's
tensors, whether the buffer is the driver's own (writable) or a pickled step message's (read-only,
as Ray hands it over), and a host buffer overwritten right after the upload does not corrupt the
copy in flight."""

import pickle

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from msaserve.engine.parallel.messages import StepMessage
from msaserve.engine.scheduler import ScheduledBatch
from msaserve.engine.sequence import Sequence
from msaserve.engine.step_inputs import build_host_step
from msaserve.engine.types import SamplingParams

PAGE = 128
FIELDS = ("positions", "slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "logits_indices")


def decode_batch(batch: int, context: int) -> ScheduledBatch:
    pages = -(-(context + 1) // PAGE)
    seqs = []
    for i in range(batch):
        seq = Sequence(request_id=f"r{i}", token_ids=list(range(3 + i, context + 4 + i)),
                       num_prompt_tokens=context + 1, sampling=SamplingParams(max_tokens=4), arrival_time=0.0)
        seq.num_computed_tokens = context
        seq.block_table = list(range(i * pages, (i + 1) * pages))
        seqs.append(seq)
    return ScheduledBatch(seqs=seqs, num_new_tokens=[1] * batch)


@pytest.mark.parametrize("batch", [1, 32])
def test_upload_to_the_gpu_equals_the_cpu_tensors(batch):
    host = build_host_step(decode_batch(batch, 2048 + batch), PAGE)
    want_ids, want = host.upload(torch.device("cpu"))
    want_ids, want = want_ids.clone(), {name: getattr(want, name).clone() for name in FIELDS}
    received = pickle.loads(pickle.dumps(StepMessage(host, greedy=True))).step
    assert not received.buffer.flags.writeable
    for step in (received, host):
        ids, meta = step.upload(torch.device("cuda"))
        if step.buffer.flags.writeable:  # overwritten at once: the copy in flight reads pinned memory
            step.buffer.fill(-7)
        torch.cuda.synchronize()
        assert torch.equal(ids.cpu(), want_ids)
        for name in FIELDS:
            assert torch.equal(getattr(meta, name).cpu(), want[name]), name
