"""Sparse residency on the device (engine/kv/device_working_set.py, kernels/page_gather): the tensor
working set makes exactly the numpy reference policy's choices, the page gather equals its reference
(Triton under the interpreter), and an M3 model (m3-mini's block, CPU widths) decodes the same
greedy tokens sparse-resident as fully resident."""

import random

import pytest
import torch
from kernel_testing import import_interpreted
from reference_decode import SequenceState

from msaserve.engine.kv.device_working_set import DeviceWorkingSet
from msaserve.engine.kv.residency import WorkingSet
from msaserve.engine.kv.resident_graph import SparseDecodeGraph
from msaserve.engine.kv.resident_session import ResidentSession
from msaserve.kernels import get_ops
from msaserve.kernels.page_gather import gather_head_pages_naive, gather_pages_naive, host_view
from msaserve.kernels.residency import admit_naive
from msaserve.models.minimax_m3.model import M3ForCausalLM
from msaserve.models.minimax_m3.random_weights import init_m3_random_weights
from msaserve.models.presets import M3_MINI_SMALL, get_preset


def test_device_working_set_chooses_the_reference_policys_slots():
    """Random selections (sorted distinct pages, as the reference admits them) and ring moves:
    every step fills the same (page, slot) pairs and evicts the same pages."""
    num_slots, ring, max_pages, per_step = 14, 3, 60, 8
    rng = random.Random(0)
    ref = WorkingSet(num_slots, ring)
    dev = DeviceWorkingSet(1, num_slots, ring, max_pages, torch.device("cpu"))
    write = 20
    for page in (write,):
        assert ref.place_write_page(page)[0] == dev.place_write_page(page)
    for step in range(1, 60):
        if step % 5 == 0:
            write += 1
            assert ref.place_write_page(write)[0] == dev.place_write_page(write)
        pages = sorted(rng.sample(range(write + 1), rng.randint(1, per_step)))
        selected = torch.full((1, 1, 2, per_step // 2 + 2), -1)
        selected.view(-1)[: len(pages)] = torch.tensor(pages)
        want = ref.admit(pages, step)
        dst, src = dev.admit(0, selected, step)
        got = [(p, s) for p, s in zip(src.tolist(), dst.tolist(), strict=True) if s >= 0]
        assert got == want, step
        assert dev.resident_pages(0) == ref.resident_pages()
    assert int(dev.evictions[0]) == ref.evictions > 0


def test_device_working_set_counts_a_page_selected_twice_once():
    dev = DeviceWorkingSet(1, 8, 2, 16, torch.device("cpu"))
    dev.place_write_page(9)
    dst, src = dev.admit(0, torch.tensor([[3, 5, 9, -1], [5, 3, 9, 4]]), step=1)
    filled = {p: s for p, s in zip(src.tolist(), dst.tolist(), strict=True) if s >= 0}
    assert sorted(filled) == [3, 4, 5] and sorted(filled.values()) == [2, 3, 4]
    assert int(dev.fetched[0]) == 3 and dev.table(0)[0, 9] == 9 % 2


def test_page_gather_triton_matches_the_reference():
    (module,) = import_interpreted("msaserve.kernels.page_gather.triton")
    module.BLOCK = 64  # several programs per page under the interpreter
    src = torch.randn(10, 2, 4, 3, 8)
    want, got = torch.zeros(6, 2, 4, 3, 8), torch.zeros(6, 2, 4, 3, 8)
    dst_slots, src_pages = torch.tensor([4, -1, 0, -1, 2]), torch.tensor([7, 1, 9, 0, 3])
    gather_pages_naive(want, dst_slots, src, src_pages)
    module.gather_pages_triton(got, dst_slots, src, src_pages)
    assert torch.equal(got, want)
    assert torch.equal(want[4], src[7]) and torch.equal(want[0], src[9]) and not want[1].any()


def test_head_page_gather_triton_matches_the_reference():
    """Per-head miss fill: head h's K and V columns of a [2, P, H, D] page into a head-major slot."""
    (module,) = import_interpreted("msaserve.kernels.page_gather.triton")
    module.BLOCK = 64  # several programs per column under the interpreter
    src = torch.randn(10, 2, 16, 4, 8)
    want, got = torch.zeros(6, 2, 4, 16, 8), torch.zeros(6, 2, 4, 16, 8)
    dst_slots = torch.tensor([[4, -1, 0], [-1, 2, 4], [1, -1, -1], [5, 3, -1]])
    src_pages = torch.tensor([[7, 1, 9], [0, 3, 2], [8, 0, 0], [6, 5, 1]])
    gather_head_pages_naive(want, dst_slots, src, src_pages)
    module.gather_head_pages_triton(got, dst_slots, src, src_pages)
    assert torch.equal(got, want)
    assert torch.equal(want[4, :, 0], src[7, :, :, 0]) and torch.equal(want[4, :, 1], src[2, :, :, 1])
    assert not want[4, :, 2:].any()  # the other heads' columns of slot 4 untouched
    with pytest.raises(ValueError, match="allowed two \\[4, M\\] tensors"):
        module.gather_head_pages_triton(got, dst_slots[:2], src, src_pages[:2])


def test_host_view_refuses_what_it_cannot_map():
    assert host_view(torch.zeros(4), torch.device("cpu")) is None
    assert host_view(torch.zeros(4), torch.device("cuda")) is None  # not pinned


@pytest.fixture(scope="module")
def m3() -> M3ForCausalLM:
    config = get_preset("m3-mini", num_hidden_layers=2, **M3_MINI_SMALL)
    return init_m3_random_weights(M3ForCausalLM(config), seed=0).eval()


def resident_then_offloaded(m3, prompt_len: int, steps: int, seed: int, per_head: bool):
    """→ (the fully resident greedy tokens after a random prompt, a sparse-resident session
    offloaded from the prompt's caches with a working set of one selection plus one page)."""
    prompt = torch.randint(3, 512, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.inference_mode():
        state = SequenceState(m3, prompt_len + steps + 1)
        want = [int(torch.argmax(m3.compute_logits(state.prefill(prompt, chunk_size=64)[-1:])[0]))]
        session = ResidentSession.offload(m3.config, state.caches, prompt_len, budget_pages=2 + 2 * 4 + 1,
                                          max_pages=state.max_pages, per_head=per_head)
        for step in range(steps):
            hidden = state.forward([want[-1]], prompt_len + step, decode=True)
            want.append(int(torch.argmax(m3.compute_logits(hidden)[0])))
    return want, session


@pytest.mark.parametrize("per_head", [False, True])
def test_m3_sparse_resident_session_decodes_the_resident_tokens(m3, per_head):
    """Before M3 attention wrote K/V through kv_slot_mapping it wrote them at the logical slot,
    past the small K/V pool: this failed."""
    prompt_len, steps = 300, 20  # page 16 (P 16) at 320 is entered while decoding
    want, session = resident_then_offloaded(m3, prompt_len, steps, 5, per_head)
    with torch.inference_mode():
        ops, got = session.wrap_ops(get_ops("msa", "cpu")), [want[0]]
        for step in range(steps):
            hidden = m3(torch.tensor([got[-1]]), session.decode_metadata(prompt_len + step), session.caches,
                        ops=ops)
            got.append(int(torch.argmax(m3.compute_logits(hidden)[0])))
    assert got == want
    assert session.stats.pages_fetched > steps and session.stats.evictions > 0


@pytest.mark.parametrize("step_on_device", [False, True])
def test_admit_triton_matches_the_reference_tables_and_slots(step_on_device):
    """The one-program admission (interpreted) against the tensor-op reference, step by step, on
    selections with repeats and -1, through evictions; the step given as an int (reference) and as
    an int or a one-element tensor (the form a captured CUDA graph reads at replay) to the kernel."""
    (module,) = import_interpreted("msaserve.kernels.residency.triton")
    num_slots, ring, max_pages = 20, 3, 70
    tables = []
    step_tensor = torch.zeros(1, dtype=torch.int64)
    for _ in range(2):
        page_in = torch.full((num_slots + 1,), -1, dtype=torch.int64)
        page_in[1] = 50  # the write page in its ring slot
        slot_of = torch.full((max_pages + 1,), -1, dtype=torch.int32)
        slot_of[50] = 1
        tables.append((slot_of, page_in, torch.full((num_slots + 1,), -1, dtype=torch.int64),
                       torch.zeros(3, dtype=torch.int64)))
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 30):
        selected = torch.randint(-1, 51, (1, 1, 4, 4), generator=gen)
        want = admit_naive(selected, *tables[0], step, ring)
        step_tensor.fill_(step)
        got = module.admit_triton(selected, *tables[1], step_tensor if step_on_device else step, ring)
        hit = want[0] >= 0
        assert torch.equal(got[0], want[0]) and torch.equal(got[1][hit], want[1][hit]), step
        for a, b in zip(tables[0], tables[1], strict=True):
            assert torch.equal(a[:-1], b[:-1]), step  # the spare entries take any value
    assert tables[1][3][1] > 0  # evictions happened


@pytest.mark.parametrize("interpreted", [False, True])
def test_admitting_rows_at_once_equals_admitting_each_row_alone(interpreted):
    """R working sets admitted in one call (a layer's KV heads; on CUDA one launch of R programs):
    each row's slots and tables are exactly those of admitting that row by itself (1-D tables)."""
    admit_rows = admit_naive
    if interpreted:
        (module,) = import_interpreted("msaserve.kernels.residency.triton")
        admit_rows = module.admit_triton
    rows, num_slots, ring, max_pages = 3, 12, 2, 40

    def tables() -> tuple[torch.Tensor, ...]:
        return (torch.full((rows, max_pages + 1), -1, dtype=torch.int32),
                torch.full((rows, num_slots + 1), -1, dtype=torch.int64),
                torch.full((rows, num_slots + 1), -1, dtype=torch.int64),
                torch.zeros(rows, 3, dtype=torch.int64))

    together, alone = tables(), tables()
    gen = torch.Generator().manual_seed(4)
    for step in range(1, 16):
        selected = torch.randint(-1, max_pages, (rows, 6), generator=gen)
        dst, src = admit_rows(selected, *together, step, ring)
        assert dst.shape == src.shape == (rows, 6)
        for r in range(rows):
            want = admit_naive(selected[r], *(t[r] for t in alone), step, ring)
            hit = want[0] >= 0
            assert torch.equal(dst[r], want[0]) and torch.equal(src[r][hit], want[1][hit]), (step, r)
        for a, b in zip(together, alone, strict=True):
            assert torch.equal(a[:, :-1], b[:, :-1]), step
    assert (together[3][:, 1] > 0).all()  # every row evicted


def test_admitting_rows_refuses_tables_of_other_row_counts():
    slot_of = torch.full((2, 9), -1, dtype=torch.int32)
    page_in = last_used = torch.full((3, 7), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"page_in is \(3, 7\) with slot_of \(2, 9\)"):
        admit_naive(torch.zeros(2, 4, dtype=torch.int64), slot_of, page_in, last_used,
                    torch.zeros(2, 3, dtype=torch.int64), 1, 2)


@pytest.mark.parametrize("per_head", [False, True])
def test_the_graph_steps_body_decodes_the_resident_tokens_from_static_buffers(m3, per_head):
    """`SparseDecodeGraph`'s step (on CUDA captured once and replayed; here its body run eagerly
    through the same static buffers and device step number) gives the fully resident tokens,
    across a page boundary, with evictions; a session whose steps need the host is refused."""
    prompt_len, steps = 300, 24
    want, session = resident_then_offloaded(m3, prompt_len, steps, 6, per_head)
    graphed = SparseDecodeGraph(session, m3, get_ops("msa", "cpu"))
    assert not graphed.capture
    got = [want[0]]
    for step in range(steps):
        got.append(graphed.step(got[-1], prompt_len + step))
    assert got == want
    assert int(session.step_number) == steps and session.stats.evictions > 0
    with torch.inference_mode():  # as an adopted session whose pages are still in the service
        session.host.present[:, 0] = False
    session._host_complete = False
    strict = SparseDecodeGraph(session, m3, get_ops("msa", "cpu"), eager_host_steps=False)
    with pytest.raises(ValueError, match="goes through the host"):
        strict.step(got[-1], prompt_len + steps)
    with pytest.raises(ValueError, match="capture=True on cpu"):
        SparseDecodeGraph(session, m3, get_ops("msa", "cpu"), capture=True)


@pytest.mark.parametrize("interpreted", [False, True])
def test_head_page_gather_skips_pages_not_present_and_names_their_slots(interpreted):
    """With `present`, an entry whose page is not in the host tier is not copied and its slot is
    written to `skipped` (-1 for the others); the rest is copied as without it."""
    gather = gather_head_pages_naive
    if interpreted:
        (module,) = import_interpreted("msaserve.kernels.page_gather.triton")
        module.BLOCK = 64
        gather = module.gather_head_pages_triton
    src = torch.randn(10, 2, 16, 4, 8)
    before = torch.randn(6, 2, 4, 16, 8)
    got, want = before.clone(), before.clone()
    dst_slots = torch.tensor([[4, -1, 0], [-1, 2, 5], [1, -1, 3], [5, 3, -1]])
    src_pages = torch.tensor([[7, 1, 9], [0, 3, 2], [8, 0, 6], [6, 5, 1]])
    present = torch.ones(10, dtype=torch.bool)
    present[[9, 6]] = False
    skipped = torch.full((4, 3), 7, dtype=torch.int64)
    gather(got, dst_slots, src, src_pages, present, skipped)
    assert skipped.tolist() == [[-1, -1, 0], [-1, -1, -1], [-1, -1, 3], [5, -1, -1]]
    copy = torch.where(skipped >= 0, -1, dst_slots)
    gather_head_pages_naive(want, copy, src, src_pages)
    assert torch.equal(got, want)
    assert torch.equal(got[0], before[0]) and torch.equal(got[4, :, 0], src[7, :, :, 0])
