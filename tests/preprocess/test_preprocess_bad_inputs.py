"""The bad-input corpus: each input gets the right 4xx MediaError naming the limit and its value,
and the preprocessor keeps working afterwards."""

import pytest
from PIL import Image
from preprocess_media import (
    claim_duration,
    data_url,
    encode_image,
    image_part,
    make_image,
    make_video,
    png_header_only,
    video_part,
)

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.pipeline import Preprocessor

CONFIG = PreprocessConfig(video_min_pixels=28 * 28, video_max_pixels=28 * 28 * 16)


def truncated_png() -> bytes:
    data = make_image(200, 200, "PNG", seed=1)
    return data[: len(data) // 2]


def corrupt_mp4() -> bytes:
    data = bytearray(make_video("libx264", "mp4", seconds=2))
    start = data.find(b"mdat") + 8
    data[start : start + 2000] = bytes(range(256)) * 7 + bytes(208)  # overwrite the coded frames
    return bytes(data)


def mpeg4_part2_mp4() -> bytes:
    return make_video("mpeg4", "mp4", seconds=1)


CORPUS = [
    # (name, content parts, status, code, text the message must contain)
    ("truncated png", lambda: [image_part(truncated_png())], 400, "corrupt_media", "truncated"),
    (
        "png header 100000x100000",
        lambda: [image_part(png_header_only(100_000, 100_000))],
        413,
        "image_pixels_limit",
        "max_image_pixels=50000000",
    ),
    (
        "png header 8000x8000 (under Pillow's guard, over ours)",
        lambda: [image_part(png_header_only(8000, 8000))],
        413,
        "image_pixels_limit",
        "8000×8000 = 64000000 pixels; max_image_pixels=50000000",
    ),
    ("zero bytes image", lambda: [image_part(b"")], 400, "empty_media", "0 bytes"),
    ("zero bytes video", lambda: [video_part(b"")], 400, "empty_media", "0 bytes"),
    (
        "jpeg served as video/mp4",
        lambda: [video_part(make_image(64, 64, "JPEG"), "video/mp4")],
        415,
        "unsupported_media_type",
        "expected a video but the bytes are an image (jpeg)",
    ),
    (
        "mp4 sent as image",
        lambda: [image_part(make_video(), "image/png")],
        415,
        "unsupported_media_type",
        "video (mp4)",
    ),
    ("corrupt mp4", lambda: [video_part(corrupt_mp4())], 400, "corrupt_media", "corrupt"),
    ("truncated mp4 (no moov)", lambda: [video_part(make_video()[:1500])], 400, "corrupt_media", "video"),
    (
        "video claiming an hour",
        lambda: [video_part(claim_duration(make_video(), 3600))],
        413,
        "video_duration_limit",
        "3600.0 s long; video_max_duration_s=600.0",
    ),
    (
        "1,000 images in one request",
        lambda: [image_part(make_image(28, 28))] * 1000,
        413,
        "too_many_media_items",
        "1000 images/videos; max_items_per_request=8",
    ),
    ("mpeg-4 part 2 codec", lambda: [video_part(mpeg4_part2_mp4())], 415, "unsupported_codec", "'mpeg4'"),
    (
        "tiff image",
        lambda: [image_part(encode_image(Image.new("RGB", (8, 8)), "TIFF"))],
        415,
        "unsupported_media_type",
        "tiff",
    ),
    ("garbage bytes", lambda: [image_part(b"hello world" * 10)], 415, "unsupported_media_type", "unknown"),
    (
        "aspect ratio 1:300",
        lambda: [image_part(make_image(3, 900))],
        400,
        "aspect_ratio_limit",
        "aspect ratio must be ≤ 200",
    ),
    (
        "invalid base64",
        lambda: [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
        400,
        "invalid_content_part",
        "base64",
    ),
    (
        "unknown part type",
        lambda: [{"type": "audio_url", "audio_url": {"url": "x"}}],
        400,
        "invalid_content_part",
        "'audio_url'",
    ),
    (
        "image_url without url",
        lambda: [{"type": "image_url", "image_url": {}}],
        400,
        "invalid_content_part",
        "url",
    ),
    (
        "http url while disabled",
        lambda: [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/a.png"}}],
        403,
        "url_not_allowed",
        "allow_http_urls=False",
    ),
    (
        "file url while disabled",
        lambda: [{"type": "video_url", "video_url": {"url": "file:///etc/passwd"}}],
        403,
        "url_not_allowed",
        "allow_file_urls=False",
    ),
]


@pytest.fixture(scope="module")
def pre() -> Preprocessor:
    return Preprocessor(CONFIG)


@pytest.mark.parametrize("name,parts,status,code,text", CORPUS, ids=[c[0] for c in CORPUS])
def test_bad_input_is_a_named_4xx(pre, name, parts, status, code, text):
    with pytest.raises(MediaError) as error:
        pre.process(parts())
    assert (error.value.status, error.value.code) == (status, code), str(error.value)
    assert text in error.value.message
    body = error.value.to_openai()["error"]
    assert body["code"] == code and body["message"] == error.value.message
    # still healthy afterwards
    assert pre.process([image_part(make_image(56, 56))]).media[0].grid_thw == (1, 4, 4)


def test_bytes_limit_names_the_limit():
    pre = Preprocessor(PreprocessConfig(max_image_bytes=2048))
    big = make_image(300, 300, "PNG", seed=2)
    with pytest.raises(MediaError) as error:
        pre.process([image_part(big)])
    assert error.value.status == 413 and error.value.code == "media_bytes_limit"
    assert "limit is 2048 bytes" in error.value.message


def test_error_names_the_part(pre):
    parts = [{"type": "text", "text": "a"}, image_part(make_image(28, 28)), image_part(b"")]
    with pytest.raises(MediaError) as error:
        pre.process(parts)
    assert error.value.param == "content[2].image_url"


def test_jpeg_named_mp4_from_file(tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(make_image(64, 64, "JPEG"))
    pre = Preprocessor(PreprocessConfig(allow_file_urls=True, file_roots=(str(tmp_path),)))
    with pytest.raises(MediaError) as error:
        pre.process([{"type": "video_url", "video_url": {"url": path.as_uri()}}])
    assert error.value.status == 415 and "image (jpeg)" in error.value.message
    # the same file as an image is fine: the bytes decide, not the name
    item = pre.process([{"type": "image_url", "image_url": {"url": path.as_uri()}}]).media[0]
    assert item.kind == "image"


def test_file_outside_roots_refused(tmp_path):
    pre = Preprocessor(PreprocessConfig(allow_file_urls=True, file_roots=(str(tmp_path / "media"),)))
    (tmp_path / "secret.png").write_bytes(make_image(28, 28))
    url = (tmp_path / "media" / ".." / "secret.png").as_uri()
    with pytest.raises(MediaError) as error:
        pre.process([{"type": "image_url", "image_url": {"url": url}}])
    assert error.value.status == 403 and "file_roots" in error.value.message


def test_data_url_media_type_is_ignored(pre):
    png = make_image(56, 56, "PNG")
    item = pre.process([{"type": "image_url", "image_url": {"url": data_url(png, "video/mp4")}}]).media[0]
    assert item.kind == "image"
