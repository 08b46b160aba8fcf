"""The step's inputs built in one flat host buffer (`build_host_step`) and uploaded as views of one
tensor equal a per-token reference built the obvious way, for decode steps, prefill chunks that
start mid-page, rows that do not sample yet and block tables of different widths; the buffer's
int32 part starts 16-byte aligned."""

import random

import pytest
import torch

from msaserve.engine.scheduler import ScheduledBatch
from msaserve.engine.sequence import Sequence
from msaserve.engine.step_inputs import build_host_step, build_step_inputs
from msaserve.engine.types import SamplingParams

PAGE = 16


def make_batch(rows: list[tuple[int, int, int]], seed: int = 0) -> ScheduledBatch:
    """rows: (tokens computed, new tokens this step, tokens of the sequence) per sequence; pages
    are drawn at random (distinct), the table long enough for the step's tokens."""
    rng = random.Random(seed)
    free = list(range(1000))
    rng.shuffle(free)
    batch = ScheduledBatch()
    for i, (computed, new, total) in enumerate(rows):
        seq = Sequence(request_id=f"r{i}", token_ids=[rng.randrange(3, 500) for _ in range(total)],
                       num_prompt_tokens=total, sampling=SamplingParams(max_tokens=4), arrival_time=0.0)
        seq.num_computed_tokens = computed
        seq.block_table = [free.pop() for _ in range(-(-(computed + new) // PAGE) + rng.randrange(2))]
        batch.add(seq, new)
    return batch


def reference(batch: ScheduledBatch) -> dict[str, list]:
    """Every input, token by token, as plain lists."""
    out: dict[str, list] = {k: [] for k in ("ids", "positions", "slots", "logits", "seq_lens", "tables")}
    cu, width = [0], max(len(seq.block_table) for seq in batch.seqs)
    for seq, new in zip(batch.seqs, batch.num_new_tokens, strict=True):
        for position in range(seq.num_computed_tokens, seq.num_computed_tokens + new):
            out["ids"].append(seq.token_ids[position])
            out["positions"].append(position)
            out["slots"].append(seq.block_table[position // PAGE] * PAGE + position % PAGE)
        cu.append(cu[-1] + new)
        out["logits"].append(cu[-1] - 1)
        out["seq_lens"].append(seq.num_computed_tokens + new)
        out["tables"].append(seq.block_table + [-1] * (width - len(seq.block_table)))
    out["cu"] = cu
    out["sample_rows"] = [row for row in range(len(batch)) if batch.samples(row)]
    return out


CASES = {
    "decode": [(40, 1, 41), (15, 1, 16), (16, 1, 17), (130, 1, 131)],
    "one sequence": [(0, 1, 1)],
    "prefill chunks mid-page": [(0, 37, 37), (21, 30, 80), (5, 1, 6)],  # r1 does not sample yet
    "odd longs": [(3, 2, 5), (0, 1, 9)],  # 3T + B odd: the int32 part starts one padding word on
}


@pytest.mark.parametrize("name", CASES)
def test_host_step_uploads_the_reference_inputs(name):
    batch = make_batch(CASES[name], seed=len(name))
    want = reference(batch)
    host = build_host_step(batch, PAGE)
    assert host.layout.int_start % 2 == 0  # the int32 part 16-byte aligned in the buffer
    inputs = build_step_inputs(batch, PAGE, torch.device("cpu"))
    meta = inputs.meta
    assert inputs.input_ids.tolist() == want["ids"] and inputs.input_ids.dtype == torch.int64
    assert meta.positions.tolist() == want["positions"]
    assert meta.slot_mapping.tolist() == want["slots"] and meta.slot_mapping.dtype == torch.int64
    assert meta.logits_indices.tolist() == want["logits"]
    assert meta.block_tables.tolist() == want["tables"] and meta.block_tables.dtype == torch.int32
    assert meta.seq_lens.tolist() == want["seq_lens"] and meta.seq_lens.dtype == torch.int32
    assert meta.cu_seqlens_q.tolist() == want["cu"] and meta.cu_seqlens_q.dtype == torch.int32
    assert inputs.sample_rows == host.sample_rows == want["sample_rows"]
    lengths = batch.num_new_tokens
    assert meta.max_query_len == max(lengths)
    assert meta.decode_query_len == (1 if all(n == 1 for n in lengths) else None)
    assert meta.selections is None


def test_recording_selections_gives_an_empty_list():
    batch = make_batch(CASES["decode"])
    assert build_step_inputs(batch, PAGE, torch.device("cpu"), record_selections=True).meta.selections == []


def test_block_tables_follow_appends_and_replacements_across_steps() -> None:
    """The block-table mirror (`TableMirror`) across a sequence's life: appends in place (past the
    array's capacity too), a replaced list (swap-in, adoption), a shorter one (preemption) and a new
    list of the same length with a different last page each give the reference's tables."""
    batch = make_batch([(40, 1, 41), (130, 1, 131)], seed=3)
    seq = batch.seqs[0]

    def check() -> None:
        host = build_host_step(batch, PAGE)
        tables = host.layout.split(host.buffer)[4]
        assert tables.tolist() == reference(batch)["tables"]

    check()
    for grow in (1, 5, 40):  # in place, as BlockManager does; 40 pages pass the mirror's capacity
        seq.block_table.extend(range(2000 + len(seq.block_table), 2000 + len(seq.block_table) + grow))
        check()
    seq.block_table = [7, 8, 9]  # a new list, shorter
    check()
    seq.block_table = [7, 8, 10]  # a new list, same length, other last page
    check()
    table = seq.block_table
    seq.block_table = list(table)  # an equal copy
    check()
