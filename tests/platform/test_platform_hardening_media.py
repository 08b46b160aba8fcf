"""Hostile and careless media parts get a 4xx whose `param` is the request's own field
(`messages[2].content[1].image_url.url`) and whose message says what is allowed. In process: the
gateway app in front of a real tiny engine and a real Preprocess deployment object, no Ray."""

import base64
import io
import struct
import zlib
from collections.abc import Iterator

import pytest
from inprocess_app import InProcessGateway, inprocess_gateway
from PIL import Image

MODEL = "msaserve/tiny"
CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 4, "max_waiting": 8, "max_model_len": 512},
    # http(s) on, so that an internal address is refused by the address guard, not by the scheme.
    "preprocess": {"max_items_per_request": 4, "allow_http_urls": True},
}


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with inprocess_gateway(CONFIG, preprocess=True) as g:
        yield g


def png(width: int = 32, height: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buffer, "PNG")
    return buffer.getvalue()


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header declaring width × height pixels, with almost no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(
        b"IEND", b"")


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def post(gateway: InProcessGateway, messages: list[dict]):
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    return gateway.request("POST", "/v1/chat/completions", json=body)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def three_turns(*parts: dict) -> list[dict]:
    """The media in the third message, after a text part: their fields are messages[2].content[1..]."""
    return [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]},
    ]


CASES = {
    # name: (the bad part, status, code, words of the message)
    "truncated image": (image(data_url(png()[:60])), 400, "corrupt_media", "truncated"),
    "invalid base64": (image("data:image/png;base64,!!!"), 400, "invalid_content_part", "allowed A-Z"),
    "svg": (image(data_url(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml")), 415,
            "unsupported_media_type", "png, jpeg, webp, gif, bmp"),
    "decompression bomb": (image(data_url(bomb_png(50_000, 50_000))), 413, "image_pixels_limit",
                           "max_image_pixels"),
    "cloud metadata address": (image("http://169.254.169.254/latest/meta-data/"), 403, "url_not_allowed",
                               "non-public address"),
    "the server itself": (image("http://localhost:8000/v1/models"), 403, "url_not_allowed",
                          "non-public address"),
    "file URL": (image("file:///etc/passwd"), 403, "url_not_allowed", "allow_file_urls=False"),
    "empty URL": (image(""), 400, "invalid_content_part", "got an empty string"),
    "video of an image": ({"type": "video_url", "video_url": {"url": data_url(png(), "video/mp4")}}, 415,
                          "unsupported_media_type", "mp4, webm"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_medium_names_its_field_in_the_request(gateway, case: str) -> None:
    """`param` was the part's place among the request's media (`content[0].image_url`: here the
    second medium of the third message was reported as `content[1].image_url`)."""
    part, status, code, words = CASES[case]
    error = error_of(post(gateway, three_turns(image(data_url(png())), part)), status)
    kind = part["type"]
    assert (error["param"], error["code"]) == (f"messages[2].content[2].{kind}.url", code), error
    assert error["message"].startswith(f"messages[2].content[2].{kind}.url: ") and words in error["message"]


def test_an_unsupported_scheme_lists_only_the_schemes_this_server_takes(gateway) -> None:
    """It offered `data:, file: or http(s):` with file:// URLs off; file: was then refused."""
    error = error_of(post(gateway, three_turns(image("ftp://example.com/a.png"))), 400)
    assert error["param"] == "messages[2].content[1].image_url.url", error
    assert "'ftp'" in error["message"] and error["message"].endswith("allowed: data:, http(s):"), error


def test_too_many_media_name_the_messages(gateway) -> None:
    parts = [image(data_url(png()))] * 5
    error = error_of(post(gateway, three_turns(*parts)), 413)
    assert (error["param"], error["code"]) == ("messages", "too_many_media_items"), error
    assert "max_items_per_request=4" in error["message"]


def test_line_wrapped_base64_is_accepted(gateway) -> None:
    """MIME encoders (`base64.encodebytes`, `openssl base64`) wrap lines; browsers drop the
    whitespace (WHATWG forgiving-base64). It was a 400 'not valid base64'."""
    wrapped = "data:image/png;base64," + base64.encodebytes(png(64, 64)).decode()
    assert "\n" in wrapped
    response = post(gateway, three_turns(image(wrapped)))
    assert response.status_code == 200, response.text


def test_a_text_only_gateway_names_the_first_media_part() -> None:
    """Without a Preprocess deployment (a text-only model) the 400 named `messages` only."""
    with inprocess_gateway(CONFIG) as text_only:
        error = error_of(post(text_only, three_turns(image(data_url(png())))), 400)
    assert (error["param"], error["code"]) == ("messages[2].content[1].type", "unsupported_content"), error
