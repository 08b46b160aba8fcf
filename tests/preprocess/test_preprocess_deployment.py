"""The preprocess deployment on a real local Ray Serve (loopback, no HTTP proxy): results come
back through the object store, bad media come back as MediaError, and the replica stays healthy."""

from collections.abc import Iterator

import pytest
import ray
from preprocess_media import image_part, make_image, make_video, video_part
from ray import serve

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.deployment import PreprocessDeployment
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.pipeline import PreprocessResult

pytestmark = pytest.mark.slow  # a local Ray cluster (≈ 15–30 s to start)

APP = "preprocess-test"


@pytest.fixture(scope="module")
def handle() -> Iterator:
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        configure_logging=False,
        _node_ip_address="127.0.0.1",
        namespace="msaserve-preprocess-test",
    )
    try:
        serve.start(proxy_location="Disabled")
        config = PreprocessConfig(video_min_pixels=28 * 28, video_max_pixels=28 * 28 * 16)
        app = PreprocessDeployment.options(
            autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2},
            ray_actor_options={"num_cpus": 0.5},
        ).bind(config)
        yield serve.run(app, name=APP, route_prefix=None)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_process_through_serve(handle):
    parts = [
        {"type": "text", "text": "what is this"},
        image_part(make_image(90, 60)),
        video_part(make_video()),
    ]
    result = handle.process.remote(parts).result(timeout_s=60)
    assert isinstance(result, PreprocessResult)
    image, video = result.media
    # 90×60 is upscaled to min_pixels=3136: 84×56 → 6×4 patches; 64×64 frames → 56×56 → 4×4
    assert image.grid_thw == (1, 4, 6) and video.grid_thw == (2, 4, 4)
    assert image.patches.shape == (24, 1176) and result.text_parts == [(0, "what is this")]
    assert result.num_placeholder_tokens == 6 + 8


def test_media_error_reaches_the_caller_and_replica_survives(handle):
    with pytest.raises(MediaError) as error:
        handle.process.remote([image_part(b"")]).result(timeout_s=60)
    assert (error.value.status, error.value.code, error.value.param) == (
        400,
        "empty_media",
        "content[0].image_url",
    )
    with pytest.raises(MediaError) as error:
        handle.process.remote([image_part(make_image(28, 28))] * 1000).result(timeout_s=60)
    assert error.value.status == 413 and "max_items_per_request=8" in error.value.message
    result = handle.process.remote([image_part(make_image(56, 56))]).result(timeout_s=60)
    assert result.media[0].grid_thw == (1, 4, 4)
