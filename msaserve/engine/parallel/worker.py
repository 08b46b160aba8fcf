"""One rank of a multi-rank replica (a Ray actor, one per GPU): joins the torch.distributed group
(NCCL on GPUs, gloo on CPUs), loads the model, keeps its shard and its part of the page pool, and
runs each step the driver sends, in lockstep with the other ranks (the collectives inside the
layers keep them in step; their timeout keeps a dead rank from hanging the others)."""

import dataclasses
import datetime
import logging
import socket

import torch
import torch.distributed as dist

from msaserve.engine.config import EngineConfig
from msaserve.engine.model_runner import ModelRunner
from msaserve.engine.parallel.comm import build_groups
from msaserve.engine.parallel.layout import ParallelLayout
from msaserve.engine.parallel.messages import StepMessage
from msaserve.engine.parallel.shard import shard_m3_model
from msaserve.engine.parallel.tp import head_shard

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 1800.0
"""How long joining the group waits for every rank (ranks start and import at their own pace)."""


def free_address() -> str:
    """tcp://<this node's IP>:<a free port>: where rank 0 hosts the group's rendezvous."""
    try:
        import ray

        host = ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        host = "127.0.0.1"
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class RankWorker:
    """Plain class; `WorkerGroup` runs it as a Ray actor (`ray.remote(RankWorker)`)."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config, self.rank = config, rank
        self.layout = ParallelLayout(config.tensor_parallel_size, config.expert_parallel_size)
        self.runner: ModelRunner | None = None
        self.groups = None
        self.full_config = None
        self.tokenizer = None

    def rendezvous_address(self) -> str:
        return free_address()

    def setup(self, init_method: str) -> dict:
        """Join the group, load and shard the model, allocate this rank's pages → what the driver
        needs to know of this rank."""
        from msaserve.engine.llm_engine import load_engine_model  # the loaders: only where a rank loads

        self.join(init_method)
        model, tokenizer = load_engine_model(self.config)
        return self.take_model(model, tokenizer)

    def join(self, init_method: str) -> None:
        """Join the torch.distributed group (NCCL on CUDA, gloo on CPU) and build its subgroups."""
        device = torch.device(self.config.device)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        # Joining waits for the slowest rank to start (LOAD_TIMEOUT_S); the layers' collectives then
        # run on subgroups with the step's timeout.
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=self.rank,
            world_size=self.layout.world_size, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S),
        )
        self.groups = build_groups(self.layout, self.rank,
                                   timeout=datetime.timedelta(seconds=self.config.collective_timeout_s))

    def take_model(self, model, tokenizer) -> dict:
        """Keep this rank's shard of the loaded `model` and allocate its pages."""
        groups = self.groups
        self.full_config, self.tokenizer = model.config, tokenizer
        shard_m3_model(model, groups)
        config = self.config
        if self.layout.ep > 1:  # the all-to-all's split sizes go through the host: no CUDA graphs
            config = dataclasses.replace(config, cuda_graphs=False)
        self.runner = ModelRunner(model, config)
        shard = head_shard(self.full_config, self.layout.tp, groups.tp_rank)
        logger.info("rank %d of %d ready: %d pages", self.rank, self.layout.world_size, self.runner.num_pages)
        return {"rank": self.rank, "num_pages": self.runner.num_pages, "kv_heads": (shard.kv_heads.start,
                shard.kv_heads.stop), "index_scale": self.runner.caches[0].index_scale is not None}

    def describe(self) -> tuple:
        """(the whole model's config, the tokenizer): the driver schedules with them."""
        return self.full_config, self.tokenizer

    @torch.inference_mode()
    def execute(self, message: StepMessage) -> torch.Tensor | list[int] | list[list[int]] | None:
        """Run one step (or a decode round) → on rank 0: the sampled rows' logits [N, vocab] on the
        host, or their greedy tokens [N] (`message.greedy`: sampled here, only ids travel), or a
        round's tokens [steps][B]; None on the others."""
        runner, sample_rows = self.runner, message.step.sample_rows
        ids, meta = message.step.upload(runner.device)  # as the plain runner's build_step_inputs
        if message.decode_steps > 1:
            tokens = runner.decode_round(ids, meta, message.decode_steps)
            return tokens if self.rank == 0 else None
        hidden = runner.forward(ids, meta)
        if self.rank != 0:
            return None
        if len(sample_rows) == meta.num_seqs and meta.is_decode:
            rows = hidden  # one row per sequence, every one samples (as ModelRunner.execute)
        else:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=runner.device)
            rows = hidden[meta.logits_indices[rows]]
        logits = runner.model.compute_logits(rows)
        if message.greedy:
            return torch.argmax(logits, dim=-1).tolist()
        return logits.cpu()

    def read_pages(self, layer: int, name: str, pages: torch.Tensor) -> torch.Tensor:
        """This rank's [n, P, heads, D] of cache `name` (k_cache, v_cache, index_cache,
        index_scale) of `layer` at physical `pages`."""
        tensor = getattr(self.runner.caches[layer], name)
        return tensor[pages.to(tensor.device)].cpu()

    def write_pages(self, layer: int, name: str, pages: torch.Tensor, value: torch.Tensor) -> None:
        tensor = getattr(self.runner.caches[layer], name)
        tensor[pages.to(tensor.device)] = value.to(tensor.device, tensor.dtype)

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

