"""Images and video end to end: the official `openai` client → Gateway → Preprocess (CPU) → Model
(the `tiny` preset with its vision tower) on one real local Ray Serve app.

Media are made here (Pillow PNG/JPEG, a PyAV H.264 clip). Checked: 200 answers, prompt_tokens =
the text's tokens + each medium's placeholders (t·h·w / merge² of its patch grid), a repeated image
hits the prefix cache and another image does not, bad inputs get their 4xx with the OpenAI error
body, and the service answers normally afterwards.
"""

import asyncio
import base64
import io
from types import SimpleNamespace

import av
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from msaserve.platform import media
from msaserve.platform.app import preprocess_app
from msaserve.platform.config import ServeConfig
from msaserve.platform.errors import APIError
from msaserve.platform.openai_types import ContentPart
from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.limits import PreprocessLimits
from msaserve.preprocess.pipeline import Preprocessor

pytestmark = pytest.mark.slow

API_KEY = "mm-key"
MODEL = "msaserve/tiny"
PAGE_SIZE = 16  # tiny's
MAX_ITEMS = 4
SERVE_CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 4, "max_model_len": 2048},
    "auth": {"api_keys": [API_KEY]},
    # http(s) fetching on, so that a loopback URL is refused by the address guard, not the scheme.
    "preprocess": {"max_items_per_request": MAX_ITEMS, "allow_http_urls": True},
}
LIMITS = PreprocessLimits(**SERVE_CONFIG["preprocess"])


def photo(seed: int, width: int = 120, height: int = 90) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def h264_clip(seconds: float = 2.0, fps: int = 15, size: int = 64) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
        for i in range(int(seconds * fps)):
            frame = np.zeros((size, size, 3), np.uint8)
            frame[..., 0] = (8 * i) % 256
            frame[:, : (3 * i) % size, 1] = 255
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def video_part(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}}


def user(*parts: dict, text: str = "What is shown here?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def placeholders(*parts: dict) -> list[int]:
    """Placeholder tokens per medium, from the same pipeline and limits the app runs."""
    media = Preprocessor(PreprocessConfig(**LIMITS.model_dump())).process(list(parts)).media
    for item in media:
        t, h, w = item.grid_thw
        assert item.num_placeholder_tokens == t * h * w // 4  # 2×2 merge
    return [item.num_placeholder_tokens for item in media]


@pytest.fixture(scope="module")
def client(live_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_app.base_url + "/v1", api_key=API_KEY, max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict]):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0.0)


def text_only_tokens(client: openai.OpenAI) -> int:
    return chat(client, user()).usage.prompt_tokens


def test_images_and_video_get_answers_with_placeholder_counts(client) -> None:
    base = text_only_tokens(client)
    png = image_part(encoded(photo(1), "PNG"))
    jpeg = image_part(encoded(photo(2, 200, 150), "JPEG"), "image/jpeg")
    video = video_part(h264_clip())
    assert placeholders(png) == [12]  # 120×90 → 112×84 → grid 1×6×8
    # 2 s at 2 fps → 4 frames → 2 temporal patches; the per-frame floor of 128·28² pixels upscales
    # 64×64 to 336×336 → 24×24 patches → 144 tokens per temporal patch.
    assert placeholders(video) == [288]
    for parts in [(png,), (jpeg,), (video,), (png, video, jpeg)]:
        reply = chat(client, user(*parts))
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert reply.usage.prompt_tokens == base + sum(placeholders(*parts)), parts


def test_a_repeated_image_hits_the_prefix_cache(client) -> None:
    image = image_part(encoded(photo(10, 300, 200), "PNG"))
    other = image_part(encoded(photo(11, 300, 200), "PNG"))
    first = chat(client, user(image))
    shared_text = first.usage.prompt_tokens_details.cached_tokens  # earlier requests' text pages
    again = chat(client, user(image))
    full_pages = (again.usage.prompt_tokens - 1) // PAGE_SIZE * PAGE_SIZE
    assert shared_text < PAGE_SIZE * 3 < full_pages
    assert again.usage.prompt_tokens_details.cached_tokens == full_pages
    assert again.choices[0].message.content == first.choices[0].message.content
    # Same text, another image: only the pages before the image are shared.
    assert chat(client, user(other)).usage.prompt_tokens_details.cached_tokens == shared_text


def post(live_app, messages: list[dict]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(live_app.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_bad_media_get_their_4xx_and_the_service_stays_healthy(live_app, client) -> None:
    png = encoded(photo(20), "PNG")
    clip = h264_clip()
    tiny_png = encoded(photo(21, 8, 8), "PNG")
    corrupt_mp4 = clip[: len(clip) // 3] + bytes(200) + clip[len(clip) // 2 :]
    loopback = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}
    cases = [
        (user(image_part(png[: len(png) // 2])), 400, "corrupt_media"),
        (user(image_part(b"")), 400, "empty_media"),
        (user(loopback), 403, "url_not_allowed"),
        (user(*[image_part(tiny_png)] * 1000), 413, "too_many_media_items"),
        (user(video_part(encoded(photo(22), "JPEG"))), 415, "unsupported_media_type"),
        (user(video_part(corrupt_mp4)), 400, "corrupt_media"),
        (user(image_part(png), text="<|msaserve_media|> smuggled"), 400, "invalid_value"),
    ]
    for messages, status, code in cases:
        response = post(live_app, messages)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == code and error["message"] and error["type"], error
    with pytest.raises(openai.BadRequestError, match="corrupt"):
        chat(client, user(image_part(png[:100])))
    assert httpx.get(live_app.base_url + "/health", timeout=10).status_code == 200
    assert chat(client, user(image_part(png))).choices[0].finish_reason in ("length", "stop")


def test_streaming_with_an_image_reports_the_expanded_prompt(client) -> None:
    base = text_only_tokens(client)
    png = image_part(encoded(photo(30), "PNG"))
    stream = client.chat.completions.create(
        model=MODEL, messages=user(png), max_tokens=3, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].prompt_tokens == base + sum(placeholders(png))


def test_a_text_only_model_answers_media_with_400() -> None:
    """SmolLM2 has no vision tower: no Preprocess deployment, and the gateway's media hook says so."""
    assert preprocess_app(ServeConfig.from_dict({"model": {"spec": "smollm2"}})) is None
    assert preprocess_app(ServeConfig.from_dict(SERVE_CONFIG)) is not None
    ctx = SimpleNamespace(preprocess=None, model_name="msaserve/smollm2")
    part = ContentPart(**image_part(encoded(photo(40), "PNG")))
    with pytest.raises(APIError) as raised:
        asyncio.run(media.preprocess(ctx, [part], SimpleNamespace(image_token_id=None)))
    assert raised.value.status == 400 and "accepts text only" in raised.value.message
