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
