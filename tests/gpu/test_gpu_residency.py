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


def test_head_page_gather_compiled_reads_leased_pages_at_offsets_through_uva():
    """Leased pages: the gather reads pages of a second pinned allocation (an arena segment of the
    KV cache service), at element offsets from the first's view, and pages of the first alike."""
    from msaserve.kernels.page_gather import gather_head_pages, gather_head_pages_naive

    shape, elems = (2, 128, 4, 128), 2 * 128 * 4 * 128
    host = torch.randn(3, *shape).to(torch.bfloat16).pin_memory()
    arena = torch.randn(9 * elems + 5).to(torch.bfloat16).pin_memory()
    view = host_view(host, torch.device("cuda"))
    starts = [5, 3 * elems + 5, 8 * elems + 5, elems + 5, 6 * elems + 5, 2 * elems + 5]  # unaligned to pages
    pages = [arena[s : s + elems].view(shape) for s in starts] + [host[2], host[0]]
    offsets = torch.tensor([(p.data_ptr() - host.data_ptr()) // 2 for p in pages], dtype=torch.int64)
    dst_slots = torch.tensor([[3, -1, 0], [-1, 2, 3], [1, -1, 5], [5, 4, -1]])
    src_pages = torch.tensor([[7, 2, 4], [0, 1, 6], [5, -1, 3], [6, 0, 1]])
    present = torch.ones(8, dtype=torch.bool)
    present[3] = False
    for check in (False, True):
        before = torch.randn(6, 2, 4, 128, 128).to(torch.bfloat16)
        got, want = before.cuda(), before.clone()
        flags = (present, torch.zeros(4, 3, dtype=torch.int64)) if check else (None, None)
        skipped = flags[1].cuda() if check else None
        gather_head_pages(got, dst_slots.cuda(), view, src_pages.cuda(), flags[0].cuda() if check else None,
                          skipped, src_offsets=offsets.cuda())
        gather_head_pages_naive(want, dst_slots, host, src_pages, *flags, src_offsets=offsets)
        assert torch.equal(got.cpu(), want)
        assert torch.equal(want[3, :, 0], host[0, :, :, 0]) and torch.equal(want[4, :, 3], pages[0][:, :, 3])
        if check:
            assert skipped.cpu().tolist() == flags[1].tolist() == [[-1, -1, -1], [-1, -1, -1], [-1, -1, 5],
                                                                   [-1, -1, -1]]


def test_verify_pages_compiled_checks_pinned_pages_through_uva():
    """The check of leased M3 pages (256 KiB) where they lie in pinned memory, read through a UVA
    view: as the host spec finds on the CPU tensors, one corrupt page counted and named."""
    import numpy as np
    import xxhash

    from msaserve.kernels.checksum import verify_pages, verify_pages_naive

    page_bytes = 262144
    generator = torch.Generator().manual_seed(7)
    arena = torch.randint(0, 256, (7 * page_bytes + 4096,), dtype=torch.uint8, generator=generator)
    arena = arena.pin_memory()
    host = torch.randint(0, 256, (2, page_bytes), dtype=torch.uint8, generator=generator).pin_memory()
    view = host_view(host, torch.device("cuda"))
    starts = [4096, 5 * page_bytes + 64, 2 * page_bytes + 512, 6 * page_bytes + 4032, 3 * page_bytes + 8]
    pages = [arena[s : s + page_bytes] for s in starts] + [host[1], host[0]]
    offsets = torch.tensor([p.data_ptr() - host.data_ptr() for p in pages], dtype=torch.int64)
    expected = torch.from_numpy(np.array([xxhash.xxh3_64_intdigest(p.numpy()) for p in pages],
                                         dtype=np.uint64).view(np.int64))
    expected[2] ^= 1 << 40
    verified = torch.tensor([0, 0, 0, 0, 1, 0, 0], dtype=torch.uint8)
    pages_of = torch.tensor([[0, 2, 6, 0], [4, 3, 5, -1]])
    wanted = torch.tensor([[1, 2, 3, 0], [4, -1, 0, 6]])
    want = (verified.clone(), torch.zeros(2, dtype=torch.int64))
    verify_pages_naive(host, offsets, expected, *want, pages_of, wanted, page_bytes)
    got = (verified.cuda(), torch.zeros(2, dtype=torch.int64, device="cuda"))
    verify_pages(view, offsets.cuda(), expected.cuda(), *got, pages_of.cuda(), wanted.cuda(), page_bytes)
    assert want[0].tolist() == [1, 0, 0, 0, 1, 1, 1] and want[1].tolist() == [1, 2]
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    with pytest.raises(ValueError, match="page_bytes is 1000 on CUDA: allowed a multiple of 64"):
        verify_pages(view, offsets.cuda(), expected.cuda(), *got, pages_of.cuda(), wanted.cuda(), 1000)


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


@pytest.mark.parametrize("corrupt", [False, True])
def test_an_adopted_session_reads_its_leased_kv_in_place_through_cuda_graphs(corrupt):
    """Shards in this process keep K/V in pinned arenas: the adopted session leases every stored
    page, replays its step from the third token on (no fill, no service read), checks each leased
    page on the GPU at its first copy on a side stream joined into the captured step, and gives the
    fully resident tokens; a corrupt page voids the step that copied it."""
    from msaserve.engine.kv.host_tier import PageLostInService
    from msaserve.engine.kv.pages import identity_for
    from msaserve.engine.kv.persist import SessionWriter
    from msaserve.engine.kv.pinned_segments import segment_allocators
    from msaserve.engine.kv.resident_graph import WARMUP_STEPS, SparseDecodeGraph
    from msaserve.kvcache.client import KVCacheClient
    from msaserve.kvcache.config import ServiceConfig
    from msaserve.kvcache.keys import kv_key, shard_of_page

    model = init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).cuda().eval()
    prompt = torch.randint(3, 512, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    ops, steps = get_ops("msa", torch.device("cuda")), 40
    with torch.inference_mode():
        state = SequenceState(model, 600 + steps + 1)
        tokens = [int(torch.argmax(model.compute_logits(state.prefill(prompt, chunk_size=128)[-1:])[0]))]
        dtype = state.caches[0].k_cache.dtype
        client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20),
                                          identity_for(model.config, "tiny@seed0", dtype),
                                          segment_allocators=segment_allocators("cuda", ("index", "kv")))
        SessionWriter(client, "long").sync([*prompt, tokens[0]], state.caches, range(state.max_pages),
                                           600, tail=True)
        for step in range(steps):
            hidden = state.forward([tokens[-1]], 600 + step, True)
            tokens.append(int(torch.argmax(model.compute_logits(hidden)[0])))
    record = client.get_session("long")
    if corrupt:  # page 0 (an init page, selected by every step) of layer 1
        shard = client.shards[shard_of_page(record.page_hashes[0], 2)]
        shard.stores["kv"].memory.get(kv_key(client.model_key, record.page_hashes[0], 1)).payload[9] ^= 2
    session, covered = ResidentSession.adopt(client, record, model.config, budget_pages=12,
                                             max_pages=state.max_pages, device=torch.device("cuda"),
                                             dtype=dtype)
    assert covered == 600 and session.host.leased[:, : 600 // 16].all() and not session.synced_steps
    graphed = SparseDecodeGraph(session, model, ops)
    if corrupt:
        with pytest.raises(PageLostInService, match=r"\(0, 1\)"):
            graphed.step(tokens[0], 600)
        assert shard.stats()["kv"]["corruptions"] == 1
        return
    got = [tokens[0]]
    for step in range(steps):
        got.append(graphed.step(got[-1], 600 + step))
    assert got == tokens
    assert graphed.replays == steps - WARMUP_STEPS and graphed.host_steps == 0
    assert session.host.service_reads == 0 and int(session._verified.sum()) > 0
    assert not session._failures.any()


def test_a_session_adopted_into_an_ended_one_replays_its_graph_from_the_first_token():
    """`ResidentSession.adopt(into=)`: a second stored session adopted into the first one's device
    memory is stepped by the first one's `SparseDecodeGraph`: every step of it a replay of the graph
    captured for the first (no warm-up, no capture), with its own fully resident tokens; then a
    session offloaded into the same memory, likewise."""
    from msaserve.engine.kv.pages import identity_for
    from msaserve.engine.kv.persist import SessionWriter
    from msaserve.engine.kv.pinned_segments import segment_allocators
    from msaserve.engine.kv.resident_graph import WARMUP_STEPS, SparseDecodeGraph
    from msaserve.kvcache.client import KVCacheClient
    from msaserve.kvcache.config import ServiceConfig

    model = init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).cuda().eval()
    ops, steps = get_ops("msa", torch.device("cuda")), 40
    client = None
    sessions = {}
    with torch.inference_mode():
        for name, seed in (("a", 5), ("b", 6), ("c", 7)):
            prompt = torch.randint(3, 512, (600,), generator=torch.Generator().manual_seed(seed)).tolist()
            state = SequenceState(model, 600 + steps + 1)
            tokens = [int(torch.argmax(model.compute_logits(state.prefill(prompt, chunk_size=128)[-1:])[0]))]
            dtype = state.caches[0].k_cache.dtype
            if client is None:
                allocators = segment_allocators("cuda", ("index", "kv"))
                client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20),
                                                  identity_for(model.config, "tiny@seed0", dtype),
                                                  segment_allocators=allocators)
            SessionWriter(client, name).sync([*prompt, tokens[0]], state.caches, range(state.max_pages),
                                             600, tail=True)
            snapshot = [(c.k_cache.clone(), c.v_cache.clone(), c.index_cache.clone()) for c in state.caches]
            for step in range(steps):
                hidden = state.forward([tokens[-1]], 600 + step, True)
                tokens.append(int(torch.argmax(model.compute_logits(hidden)[0])))
            for cache, (k, v, index) in zip(state.caches, snapshot, strict=True):
                cache.k_cache.copy_(k)
                cache.v_cache.copy_(v)
                cache.index_cache.copy_(index)
            sessions[name] = (state, tokens)
    max_pages = sessions["a"][0].max_pages

    def adopt(name, into=None):
        session, covered = ResidentSession.adopt(client, client.get_session(name), model.config,
                                                 budget_pages=12, max_pages=max_pages,
                                                 device=torch.device("cuda"), dtype=dtype, into=into)
        assert covered == 600
        return session

    def decode(graphed, name):
        tokens = sessions[name][1]
        got = [tokens[0]]
        for step in range(steps):
            got.append(graphed.step(got[-1], 600 + step))
        assert got == tokens, name

    session = adopt("a")
    graphed = SparseDecodeGraph(session, model, ops)
    decode(graphed, "a")
    assert graphed.replays == steps - WARMUP_STEPS
    graph = graphed.graph
    assert adopt("b", into=session) is session
    decode(graphed, "b")
    assert graphed.graph is graph and graphed.replays == steps and graphed.captures == 0
    state_c = sessions["c"][0]
    assert ResidentSession.offload(model.config, state_c.caches, 600, 12, max_pages, into=session) is session
    decode(graphed, "c")
    assert graphed.graph is graph and graphed.replays == steps and graphed.captures == 0
