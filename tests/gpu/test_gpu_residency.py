"""Sparse residency on CUDA: pinned host memory through a UVA view, the page gather and the one-program
admission compiled, and a whole sparse-resident decode step's residency work with no host sync."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from reference_decode import SequenceState

from msaserve.engine.kv.resident_session import ResidentSession
from msaserve.kernels import get_ops
from msaserve.kernels.page_gather import gather_pages, gather_pages_naive, host_view
from msaserve.kernels.residency import admit, admit_naive
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights


def test_host_view_aliases_pinned_memory_and_the_gather_reads_it():
    host = torch.randn(12, 2, 16, 2, 32, pin_memory=True).to(torch.bfloat16).pin_memory()
    view = host_view(host, torch.device("cuda"))
    assert view is not None and view.is_cuda and view.data_ptr() == host.data_ptr()
    dst_slots = torch.tensor([3, -1, 0, 5], device="cuda")
    src_pages = torch.tensor([11, 2, 4, 7], device="cuda")
    got = torch.zeros(6, 2, 16, 2, 32, dtype=torch.bfloat16, device="cuda")
    want = got.clone()
    gather_pages(got, dst_slots, view, src_pages)
    gather_pages_naive(want, dst_slots.cpu(), host, src_pages.cpu())
    assert torch.equal(got, want) and torch.equal(got[3].cpu(), host[11])
    host[11].fill_(1)  # the view is the memory, not a copy
    assert torch.equal(view[11], torch.ones_like(view[11]))


def test_head_page_gather_compiled_reads_pinned_memory_through_the_view():
    from msaserve.kernels.page_gather import gather_head_pages, gather_head_pages_naive

    host = torch.randn(12, 2, 128, 4, 128).to(torch.bfloat16).pin_memory()
    view = host_view(host, torch.device("cuda"))
    dst_slots = torch.tensor([[3, -1, 0], [-1, 2, 3], [1, -1, -1], [5, 4, -1]], device="cuda")
    src_pages = torch.tensor([[11, 2, 4], [0, 7, 9], [8, 0, 0], [6, 5, 1]], device="cuda")
    got = torch.zeros(6, 2, 4, 128, 128, dtype=torch.bfloat16, device="cuda")
    want = got.cpu()
    gather_head_pages(got, dst_slots, view, src_pages)
    gather_head_pages_naive(want, dst_slots.cpu(), host, src_pages.cpu())
    assert torch.equal(got.cpu(), want) and torch.equal(want[3, :, 0], host[11, :, :, 0])


def test_head_page_gather_compiled_skips_absent_pages_and_names_their_slots():
    """The presence check an adopted session's graph step runs (`ResidentSession.can_speculate`)."""
    from msaserve.kernels.page_gather import gather_head_pages, gather_head_pages_naive

    host = torch.randn(12, 2, 128, 4, 128).to(torch.bfloat16).pin_memory()
    view = host_view(host, torch.device("cuda"))
    dst_slots = torch.tensor([[3, -1, 0], [-1, 2, 3], [1, -1, 5], [5, 4, -1]], device="cuda")
    src_pages = torch.tensor([[11, 2, 4], [0, 7, 9], [8, 0, 6], [6, 5, 1]], device="cuda")
    present = torch.ones(12, dtype=torch.bool, device="cuda")
    present[[4, 6]] = False
    skipped = torch.full((4, 3), 9, dtype=torch.int64, device="cuda")
    before = torch.randn(6, 2, 4, 128, 128, device="cuda").to(torch.bfloat16)
    got, want = before.clone(), before.cpu()
    gather_head_pages(got, dst_slots, view, src_pages, present, skipped)
    assert skipped.tolist() == [[-1, -1, 0], [-1, -1, -1], [-1, -1, 5], [5, -1, -1]]
    gather_head_pages_naive(want, torch.where(skipped >= 0, -1, dst_slots).cpu(), host, src_pages.cpu())
    assert torch.equal(got.cpu(), want)


def test_admit_compiled_matches_the_reference():
    num_slots, ring, max_pages = 300, 3, 1000
    tables = [(torch.full((max_pages + 1,), -1, dtype=torch.int32, device="cuda"),
               torch.full((num_slots + 1,), -1, dtype=torch.int64, device="cuda"),
               torch.full((num_slots + 1,), -1, dtype=torch.int64, device="cuda"),
               torch.zeros(3, dtype=torch.int64, device="cuda")) for _ in range(2)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(1, 40):
        selected = torch.randint(-1, max_pages, (1, 1, 4, 16), generator=gen, device="cuda",
                                 dtype=torch.int32)
        want = admit_naive(selected, *tables[0], step, ring)
        got = admit(selected, *tables[1], step, ring)
        assert torch.equal(got[0], want[0]), step
        for a, b in zip(tables[0], tables[1], strict=True):
            assert torch.equal(a[:-1], b[:-1]), step
    assert tables[1][3][1] > 0


def test_admit_of_rows_compiled_matches_the_reference():
    """A layer's KV heads admitted in one launch (per-head residency), 4 rows of 819 slots."""
    rows, num_slots, ring, max_pages = 4, 819, 3, 8192

    def tables(device: str) -> tuple[torch.Tensor, ...]:
        return (torch.full((rows, max_pages + 1), -1, dtype=torch.int32, device=device),
                torch.full((rows, num_slots + 1), -1, dtype=torch.int64, device=device),
                torch.full((rows, num_slots + 1), -1, dtype=torch.int64, device=device),
                torch.zeros(rows, 3, dtype=torch.int64, device=device))

    want_tables, got_tables = tables("cpu"), tables("cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    step_number = torch.zeros(1, dtype=torch.int64, device="cuda")
    for step in range(1, 120):
        selected = torch.randint(-1, max_pages, (rows, 16), generator=gen, device="cuda")
        step_number.fill_(step)
        got = admit(selected, *got_tables, step_number, ring)
        want = admit_naive(selected.cpu(), *want_tables, step, ring)
        assert torch.equal(got[0].cpu(), want[0]), step
        for a, b in zip(want_tables, got_tables, strict=True):
            assert torch.equal(a[:, :-1], b[:, :-1].cpu()), step
    assert (got_tables[3][:, 1] > 0).all()


def test_sparse_resident_decode_needs_no_host_sync_and_keeps_the_tokens():
    model = init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).cuda().eval()
    prompt = torch.randint(3, 512, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    ops = get_ops("msa", torch.device("cuda"))
    with torch.inference_mode():
        state = SequenceState(model, 640)
        tokens = [int(torch.argmax(model.compute_logits(state.prefill(prompt, chunk_size=128)[-1:])[0]))]
        session = ResidentSession.offload(model.config, state.caches, 600, budget_pages=10,
                                          max_pages=state.max_pages)
        for step in range(16):
            hidden = state.forward([tokens[-1]], 600 + step, True)
            tokens.append(int(torch.argmax(model.compute_logits(hidden)[0])))
        original = session.make_resident

        def no_sync(layer, selected):  # any host sync in the residency work raises
            torch.cuda.set_sync_debug_mode("error")
            try:
                original(layer, selected)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        session.make_resident = no_sync
        wrapped, got = session.wrap_ops(ops), [tokens[0]]
        assert not session.synced_steps
        for step in range(16):
            meta = session.decode_metadata(600 + step)
            hidden = model(torch.tensor([got[-1]], device="cuda"), meta, session.caches, ops=wrapped)
            got.append(int(torch.argmax(model.compute_logits(hidden)[0])))
    assert got == tokens
    assert session.stats.pages_fetched > 16


@pytest.mark.parametrize("per_head", [False, True])
def test_sparse_resident_decode_replayed_as_a_cuda_graph_keeps_the_tokens(per_head):
    """`SparseDecodeGraph`: two eager warm-up steps, one capture, then replays — across page
    boundaries (tiny's pages are 16 tokens) and evictions — give the fully resident tokens."""
    from msaserve.engine.kv.resident_graph import WARMUP_STEPS, SparseDecodeGraph

    model = init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).cuda().eval()
    prompt = torch.randint(3, 512, (600,), generator=torch.Generator().manual_seed(4)).tolist()
    ops, steps = get_ops("msa", torch.device("cuda")), 40
    with torch.inference_mode():
        state = SequenceState(model, 600 + steps + 1)
        tokens = [int(torch.argmax(model.compute_logits(state.prefill(prompt, chunk_size=128)[-1:])[0]))]
        session = ResidentSession.offload(model.config, state.caches, 600, budget_pages=10,
                                          max_pages=state.max_pages, per_head=per_head)
        for step in range(steps):
            hidden = state.forward([tokens[-1]], 600 + step, True)
            tokens.append(int(torch.argmax(model.compute_logits(hidden)[0])))
    graphed, got = SparseDecodeGraph(session, model, ops), [tokens[0]]
    for step in range(steps):
        got.append(graphed.step(got[-1], 600 + step))
    assert got == tokens
    assert graphed.graph is not None and graphed.replays == steps - WARMUP_STEPS
    assert session.stats.pages_fetched > steps and session.stats.evictions > 0
