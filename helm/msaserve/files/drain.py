"""preStop hook of msaserve's Ray worker pods: drain this Ray node before Kubernetes stops it.

Kubernetes runs this before SIGTERM (node drain, scale-down, the old cluster of an upgrade). It asks
the GCS to drain the node, as Ray's autoscaler does before it removes one. Ray Serve then starts
replacement replicas on other nodes and stops the ones here gracefully: each finishes its running
requests first (serveConfigV2 sets graceful_shutdown_timeout_s to request_timeout_s for the gateway and
the model), the router sends new requests elsewhere, and a session continues on another replica from
the KV cache service. The hook returns once no Serve replica is left on this node, when the budget
(the pod's terminationGracePeriodSeconds less 60 s for `ray stop`) runs out, or when the head has
been unreachable for a minute.

    python drain.py --budget-seconds 660
"""

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable

POLL_SECONDS = 5.0
# The head (GCS, Serve controller) unreachable this long: nothing can move the replicas any more
# (the whole cluster is being deleted, or the head is down without GCS fault tolerance, in which
# case Ray's raylet gives up after 60 s too), so waiting longer only holds the node.
HEAD_GONE_SECONDS = 60.0


def wait_until_gone(
    count_replicas: Callable[[], int | None],
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int | None:
    """Poll until count_replicas() is 0, the deadline passes, or the count has been unknown (None:
    the head unreachable) for HEAD_GONE_SECONDS. Returns the replicas still left (None: unknown)."""
    left = count_replicas()
    unknown_since = clock() if left is None else None
    while left != 0 and clock() < deadline:
        if unknown_since is not None and clock() - unknown_since >= HEAD_GONE_SECONDS:
            break
        sleep(min(POLL_SECONDS, max(0.0, deadline - clock())))
        left = count_replicas()
        if left is not None:
            unknown_since = None
        elif unknown_since is None:
            unknown_since = clock()
    return left


def _serve_replicas_on(node_id: str) -> int | None:
    from ray.util.state import list_actors

    try:
        actors = list_actors(filters=[("node_id", "=", node_id), ("state", "=", "ALIVE")], limit=10_000)
    except Exception as error:
        print(f"drain: cannot list actors ({error})", file=sys.stderr)
        return None
    return sum(1 for actor in actors if str(actor.class_name).startswith("ServeReplica:"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-seconds", type=int, required=True)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget_seconds
    try:
        import ray

        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
        node_id = ray.get_runtime_context().get_node_id()
    except Exception as error:
        print(f"drain: cannot reach the local Ray node ({error}); stopping without a drain", file=sys.stderr)
        return 0
    reason = f"pod {os.environ.get('HOSTNAME', '?')} is terminating"
    drained = subprocess.run(
        ["ray", "drain-node", "--node-id", node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
         "--reason-message", reason, "--deadline-remaining-seconds", str(args.budget_seconds)],
        check=False,
    )
    if drained.returncode != 0:
        print(f"drain: ray drain-node exited {drained.returncode}; waiting anyway", file=sys.stderr)
    left = wait_until_gone(lambda: _serve_replicas_on(node_id), deadline)
    print(f"drain: node {node_id[:12]}: {left} Serve replicas left after the drain", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
