"""Router: KV-aware replica choice as a Ray Serve RequestRouter, with prefix and session state.

    state.py         RouterState / ReplicaState: page hashes per replica (reported + estimated), load,
                     sessions. Pure Python; the simulator and the live router share it.
    policies.py      round_robin, pow2, prefix_affinity: `choose(request, replicas, now) -> Decision`.
    kv_aware.py      the cost model (KVAwareConfig, KVAwarePolicy) and `make_policy(name, state)`.
    stats.py         the routing-stats payload a model replica returns from `record_routing_stats()`
                     (RoutingStatsRecorder + routing_stats_payload) and its parser.
    core.py          RouterCore: the request view from a call's argument, stats refresh, ranking.
    serve_router.py  MSARequestRouter (Ray Serve RequestRouter), request_router_config(), metrics.

Only serve_router.py imports Ray; nothing here imports models or torch.
"""
