"""msaserve's Ray defaults: applied before Ray starts, never over a value the user set."""

from msaserve.platform import ray_defaults


def test_the_gcs_task_event_cap_is_set_unless_the_user_set_one(monkeypatch):
    monkeypatch.delenv(ray_defaults.GCS_TASK_EVENTS_ENV, raising=False)
    assert ray_defaults.apply_ray_defaults() == {ray_defaults.GCS_TASK_EVENTS_ENV: "10000"}
    monkeypatch.setenv(ray_defaults.GCS_TASK_EVENTS_ENV, "50000")
    assert ray_defaults.apply_ray_defaults() == {ray_defaults.GCS_TASK_EVENTS_ENV: "50000"}
