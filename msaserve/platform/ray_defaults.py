"""Ray settings msaserve applies wherever it starts Ray itself (`msaserve serve`, the local test
app); the Helm chart sets the same on the head pod (`head.gcsTaskEventsMax`).

- `RAY_task_events_max_num_task_in_gcs`: the GCS keeps this many task events for the dashboard's
  task list. At Ray's default (100,000) a 10-minute soak grew the GCS from 139 to 389 MiB and the
  whole platform's RSS by 12.4 %; at 10,000 the growth was 3.8 % (docs/reliability.md). Every
  request is a few Ray tasks, so 10,000 still shows the last minutes of traffic.

A value already in the environment wins: these are defaults, not overrides.
"""

import os

GCS_TASK_EVENTS = 10_000
"""Task events the GCS keeps (Ray's own default: 100,000)."""
GCS_TASK_EVENTS_ENV = "RAY_task_events_max_num_task_in_gcs"  # Ray's spelling (lower case after RAY_)


def apply_ray_defaults() -> dict[str, str]:
    """Set msaserve's Ray defaults in this process's environment (inherited by the Ray processes
    `ray.init` starts) unless already set; returns the settings in effect."""
    os.environ.setdefault(GCS_TASK_EVENTS_ENV, str(GCS_TASK_EVENTS))
    return {GCS_TASK_EVENTS_ENV: os.environ[GCS_TASK_EVENTS_ENV]}


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for "this machine is not part of a cluster" (named for the platforms where it is off
by default). With it off, Ray's node IP is 127.0.0.1 and every Ray server binds loopback."""


def apply_local_loopback() -> dict[str, str]:
    """A local Ray (`msaserve serve`, the live tests) whose every port listens on 127.0.0.1.

    `ray.init(_node_ip_address="127.0.0.1")` is not enough in Ray 2.60: `resolve_ip_for_localhost`
    replaces a loopback address by the machine's reachable IP, and the GCS, raylet, every worker's
    gRPC server, the dashboard agent and the metrics export port then listen on that IP, on 0.0.0.0
    or on `::` (measured: docs/reliability.md). With cluster support off, `get_node_ip_address()`
    is the loopback IP, and those servers bind 127.0.0.1. The constant is read at import, so it is
    set both in the environment (inherited by the Ray processes) and in the imported module.
    Cluster deployments (KubeRay) never call this."""
    os.environ[LOOPBACK_ENV] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    return {LOOPBACK_ENV: "0"}


def bind_replica_grpc_to_loopback() -> bool:
    """In a local loopback start, Serve replicas' inter-deployment gRPC server on 127.0.0.1.

    Ray Serve 2.60 hard-codes that server's address: `Replica._on_initialized` calls
    `add_port_to_grpc_server(self._server, "[::]:0")` (ray/serve/_private/replica.py), with no
    option or environment variable to change it, so every replica listened on all interfaces even
    with the node on loopback. Called in each deployment's constructor (before Serve starts that
    server), only when `apply_local_loopback` set the environment: it rewrites that one address.
    Returns whether the rewrite is in place."""
    if os.environ.get(LOOPBACK_ENV) != "0":
        return False
    from ray.serve._private import replica

    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None:
        return False  # another Ray version: nothing to rewrite (the loopback test says if it leaks)
    if getattr(original, "msaserve_loopback", False):
        return True

    def add_port_on_loopback(server, address: str):
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.removeprefix("[::]:")
        return original(server, address)

    add_port_on_loopback.msaserve_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port_on_loopback
    return True
