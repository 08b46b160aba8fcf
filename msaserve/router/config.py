"""The `router:` section of `ServeConfig` (pydantic at the edge). Its cost-model defaults are the
policy's own (`KVAwareConfig`, the values the router benchmarks were tuned and measured with), so a
default has one value in one place; `serve_router.build_core` maps the section onto the policy."""

from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from msaserve.router.kv_aware import POLICIES, KVAwareConfig

PolicyName = Literal[POLICIES]  # the registered policies (policies.POLICY_CLASSES), an enum in the schema


def _default(name: str) -> Any:
    return next(f.default for f in fields(KVAwareConfig) if f.name == name)


class RouterConfig(BaseModel):
    """How requests pick a model replica."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    policy: PolicyName = Field(
        "kv_aware",
        description="Replica choice for the model deployment. Every policy runs through the same "
        "msaserve.router request router, so comparisons differ only in the policy class.",
    )
    w_prefill: float = Field(
        _default("w_prefill"), ge=0.0, le=1e6,
        description="Cost weight of each page the replica would have to prefill (the unit of cost).",
    )
    w_decode: float = Field(
        _default("w_decode"), ge=0.0, le=1e6,
        description="Cost weight of each active (decoding) page on the replica.",
    )
    w_queue: float = Field(
        _default("w_queue"), ge=0.0, le=1e6,
        description="Weight of the prefill pages already queued on the replica, relative to the "
        "request's own.",
    )
    queue_horizon_pages: float = Field(
        _default("queue_horizon_pages"), ge=0.0, le=1e9,
        description="Queued prefill is priced up to this many pages; past it the prefix decides.",
    )
    spill_on_full_kv: bool = Field(
        _default("spill_on_full_kv"),
        description="Whether a replica without free pages for the request counts as overloaded.",
    )
    affinity_credit: float = Field(
        _default("affinity_credit"), ge=0.0, le=1e9,
        description="Pages of prefill credited to the replica that holds the request's session.",
    )
    index_credit: float = Field(
        _default("index_credit"), ge=0.0, le=1e9,
        description="Pages credited where the session's MSA index is resident (KV cache service).",
    )
    family_credit: float = Field(
        _default("family_credit"), ge=0.0, le=1e9,
        description="Pages credited to the rendezvous home of the request's first page, so that a "
        "prefix family nobody holds yet lands where its last miss did.",
    )
    spill_load_ratio: float = Field(
        _default("spill_load_ratio"), ge=0.0, le=1e6,
        description="When the chosen replica's queue is full, another replica takes the request only "
        "if its load is at most this fraction of the chosen one's; else the request waits for it "
        "(1 or more: any replica).",
    )
    imbalance_ratio: float = Field(
        _default("imbalance_rel"), ge=1.0, le=1000.0,
        description="Relative imbalance guard: with the absolute one, fall back to power-of-two "
        "choices when the most loaded replica carries more than this times the mean load.",
    )
    imbalance_min_load: float = Field(
        _default("imbalance_abs"), ge=0, le=1_000_000,
        description="Absolute imbalance guard: max minus min replica load (running + waiting "
        "sequences) must exceed this before the relative guard can trigger.",
    )
    stats_period_s: float = Field(
        1.0, gt=0.0, le=600.0, description="How often replicas report load (record_routing_stats)."
    )
