"""A sparse-resident session's decode step replayed as one CUDA graph.

Once a session's host tier holds every page (an offloaded session from its first step, an adopted
one once the background reads are done), its decode step has no host synchronisation: the
indexer, the admission (`kernels/residency`, reading the step number from the device), the miss
fill through the UVA view (`kernels/page_gather`, a fixed-length list) and the sparse attention all
run in stream order. So the whole step — the model's forward, the logits and the greedy token —
can be captured once and replayed, as the engine does for its batched decode (`cuda_graphs.py`);
eager, a step of m3-mini at 1M tokens is launch bound (~15 ms against ~3 ms replayed).

`SparseDecodeGraph(session, model, ops).step(token, position)` → the greedy next token. Its inputs
live in static buffers, filled before each replay; the page-boundary work (`ResidentSession.advance`:
the filled page written back, the new page placed in its ring slot) runs outside the graph. The
first `WARMUP_STEPS` sync-free steps run eagerly through the same buffers (Triton's first-call
compilation and autotuning must not happen under capture); the next one is captured and replayed,
and every later one replays. A step that must go through the host (an adopted session whose host
tier is still filling) runs eagerly on the plain path (`eager_host_steps=True`, the default) or is
refused; so an adopted session decodes from its first token and switches to replays as soon as its
host tier holds every page. With `speculate` (the default, where `ResidentSession.can_speculate`:
per head, with room in the budget) such steps replay too: the miss fill skips the pages the host
tier lacks and names their slots, and after the step `ResidentSession.repair` reads the first
affected layer's pages in and the step runs again (at most layers + 2 runs; its writes are the
same each time), so only steps that selected absent pages cost more than one replay.
Off CUDA (or `capture=False`) every step runs eagerly, which is what
the CPU tests check against the plain path.

A session object outlives its session: `ResidentSession.adopt(into=)` / `offload(into=)` put the
next session in its device memory, and the same `SparseDecodeGraph` replays that session's steps
from its first (an adoption's first token is then one replay, not an eager step of ~100 launches).
The graph reads the session's tensors by address, so it is captured again (after the warm-up)
whenever a tensor set outside the step changed (`ResidentSession.graph_inputs`).
"""

from collections.abc import Callable

import torch

from msaserve.engine.kv.resident_session import ResidentSession
from msaserve.kernels import AttentionOps
from msaserve.models.metadata import AttentionMetadata
from msaserve.models.transformer import MSATransformer

WARMUP_STEPS = 2


class CapturedStep:
    """`body()` (a step whose inputs live in static buffers) run eagerly for the first WARMUP_STEPS
    calls, then captured once as a CUDA graph and replayed at every later call; eager at every call
    without `capture`. `run()` → the body's output tensor (the graph's static output once replayed)."""

    def __init__(self, body: Callable[[], torch.Tensor], capture: bool) -> None:
        self.body, self.capture = body, capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        self.calls = 0
        self.replays = 0

    def run(self) -> torch.Tensor:
        self.calls += 1
        if not self.capture or self.calls <= WARMUP_STEPS:
            return self.body()
        if self.graph is None:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.output = self.body()
            self.graph = graph
        self.graph.replay()
        self.replays += 1
        return self.output


class SparseDecodeGraph:
    def __init__(self, session: ResidentSession, model: MSATransformer, ops: AttentionOps,
                 capture: bool | None = None, eager_host_steps: bool = True, speculate: bool = True) -> None:
        self.session, self.model = session, model
        self.capture = session.device.type == "cuda" if capture is None else capture
        if self.capture and session.device.type != "cuda":
            raise ValueError(f"capture=True on {session.device}: allowed only on CUDA")
        self.ops = session.wrap_ops(ops)
        device = session.device
        self.token = torch.zeros(1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(1, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(1, dtype=torch.int64, device=device)
        self.kv_slot_mapping = torch.zeros(1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(1, dtype=torch.int32, device=device)
        self.meta = AttentionMetadata(
            positions=self.positions, slot_mapping=self.slot_mapping, kv_slot_mapping=self.kv_slot_mapping,
            block_tables=session.index_table, seq_lens=self.seq_lens,
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=device),
            max_query_len=1, decode_query_len=1,
            logits_indices=torch.zeros(1, dtype=torch.long, device=device),
        )
        self.eager_host_steps = eager_host_steps
        self.speculate = speculate and session.can_speculate
        """Steps of a session whose host tier lacks pages run as the graph step too, skipping the
        absent pages and running again after `ResidentSession.repair` (else they go eagerly through
        the host)."""
        if self.capture and session.check_stream is None:
            session.check_stream = torch.cuda.Stream(device)
        self.captured = CapturedStep(self._body, self.capture)
        """Its calls are the sync-free steps (the warm-up counts them)."""
        self._inputs = session.graph_inputs()
        self._generation = session.generation
        self.captures = 0
        """Graphs captured before the current one (the session's step inputs moved)."""
        self.host_steps = 0
        """Steps that went through the host, eagerly (see `eager_host_steps`): this session's."""
        self.reruns = 0
        """Runs of a step again after `ResidentSession.repair` read in pages it had to skip: this
        session's."""
        self._replays_before = 0

    def _body(self) -> torch.Tensor:
        hidden = self.model(self.token, self.meta, self.session.caches, ops=self.ops)
        token = torch.argmax(self.model.compute_logits(hidden)[0])
        self.session.join_checks()  # the leased pages' checks, run beside the step
        return token

    @torch.inference_mode()
    def step(self, token: int, position: int) -> int:
        """Decode `token` at `position` → the greedy next token."""
        session = self.session
        self._follow(session)
        session.check_host_complete()
        if session.synced_steps and not self.speculate:
            if not self.eager_host_steps:
                raise ValueError("a step of this session goes through the host (its host tier lacks "
                                 "pages, or there is no UVA view): decode it with decode_metadata until "
                                 "synced_steps is False, or allow eager_host_steps")
            self.host_steps += 1
            meta = session.decode_metadata(position)
            hidden = self.model(torch.tensor([token], device=session.device), meta, session.caches,
                                ops=self.ops)
            next_token = int(torch.argmax(self.model.compute_logits(hidden)[0]))
            session.check_pages()
            return next_token
        kv_slot = session.advance(position)
        self.token.fill_(token)
        self.positions.fill_(position)
        self.slot_mapping.fill_(position)  # the index cache's logical page = its physical page
        self.kv_slot_mapping.fill_(kv_slot)
        self.seq_lens.fill_(position + 1)
        if not self.speculate:
            next_token = int(self.captured.run())
            session.check_pages()  # a leased page that failed its check voids the token
            return next_token
        # The same step on the device whether or not the host tier is complete: pages it selects
        # that are not there yet are skipped; `repair` reads them in and the step runs again (its
        # K/V and index-K writes are the same each time). Each run settles at least one more layer.
        session.refresh_presence()
        session.speculating = True
        try:
            for _ in range(len(session.caches) + 2):
                next_token = int(self.captured.run())
                session.check_pages()
                if not session.repair():
                    return next_token
                self.reruns += 1
        finally:
            session.speculating = False
        raise RuntimeError(f"decode step at position {position}: pages still missing after "
                           f"{len(session.caches) + 2} runs of the step")

    def _follow(self, session: ResidentSession) -> None:
        """The session object holds another session (counters start again), and if the tensors the
        graph reads moved with it, the graph is captured again after the warm-up. (They are set only
        where a session starts, `adopt` / `offload`, so a step of the same session checks nothing.)"""
        if session.generation == self._generation:
            return
        self._generation = session.generation
        self.host_steps = self.reruns = 0
        self._replays_before = self.captured.replays
        inputs = session.graph_inputs()
        if inputs != self._inputs:
            self._inputs = inputs
            if self.captured.graph is not None:
                self.captures += 1
            self.captured = CapturedStep(self._body, self.capture)
            self._replays_before = 0

    @property
    def steps(self) -> int:
        """Sync-free steps run."""
        return self.captured.calls

    @property
    def replays(self) -> int:
        """Steps of this session replayed."""
        return self.captured.replays - self._replays_before

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        return self.captured.graph
