"""Media made inside the tests: images with Pillow, tiny videos with PyAV's encoders."""

import base64
import io
import struct
import zlib

import av
import numpy as np
from PIL import Image

av.logging.set_level(av.logging.ERROR)  # the encoders' banners are noise in test output


def photo_array(width: int, height: int, seed: int = 0) -> np.ndarray:
    """[H, W, 3] uint8 with smooth colour, texture and noise (compresses like a photo)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (height // 16 + 2, width // 16 + 2, 3), dtype=np.uint8)
    base = np.asarray(
        Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16
    )
    noise = rng.integers(-10, 10, (height, width, 1), dtype=np.int16)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def encode_image(image: Image.Image, fmt: str, **save_args) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save_args)
    return buffer.getvalue()


def make_image(width: int = 120, height: int = 90, fmt: str = "PNG", seed: int = 0, **save_args) -> bytes:
    return encode_image(Image.fromarray(photo_array(width, height, seed)), fmt, **save_args)


def with_exif_orientation(image: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode_image(image, "JPEG", exif=exif, quality=95)


def make_video(
    codec: str = "libx264",
    fmt: str = "mp4",
    width: int = 64,
    height: int = 64,
    seconds: float = 2.0,
    fps: int = 15,
    gop: int | None = None,
    display_rotation: int = 0,
) -> bytes:
    """A moving test pattern; frame i has a red level of (8·i) mod 256 (to check which frame was sampled)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if gop:
            stream.codec_context.gop_size = gop
        if display_rotation:
            stream.set_display_rotation(display_rotation)  # counter-clockwise degrees, as phones store it
        if codec == "libx265":
            stream.options = {"x265-params": "log-level=error"}
        for i in range(int(seconds * fps)):
            frame = np.zeros((height, width, 3), np.uint8)
            frame[..., 0] = (8 * i) % 256
            frame[:, : (i * 3) % width, 1] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "application/octet-stream") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def image_part(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def video_part(data: bytes, mime: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(data, mime)}}


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width × height, with one tiny IDAT: a decompression bomb's header."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00"))
        + chunk(b"IEND", b"")
    )


def claim_duration(mp4: bytes, seconds: int) -> bytes:
    """Rewrite an MP4's mvhd, tkhd, elst and mdhd (version 0) so the container claims `seconds`."""
    data = bytearray(mp4)
    movie_timescale = None
    for box, timescale_at, duration_at in (
        (b"mvhd", 12, 16),
        (b"tkhd", None, 20),
        (b"elst", None, 8),
        (b"mdhd", 12, 16),
    ):
        start = data.find(box) + 4  # payload: version(1) flags(3) ...
        assert data[start] == 0, f"{box!r} is not version 0"
        if timescale_at is not None:
            timescale = struct.unpack_from(">I", data, start + timescale_at)[0]
            movie_timescale = movie_timescale or timescale
        else:
            timescale = movie_timescale  # tkhd and elst count in the movie's timescale
        struct.pack_into(">I", data, start + duration_at, seconds * timescale)
    # FFmpeg takes a track's duration from its sample table: stretch every sample's delta too.
    start = data.find(b"stts") + 4
    (entries,) = struct.unpack_from(">I", data, start + 4)
    total_samples = sum(struct.unpack_from(">I", data, start + 8 + 8 * i)[0] for i in range(entries))
    for i in range(entries):
        struct.pack_into(">I", data, start + 12 + 8 * i, seconds * timescale // total_samples)
    return bytes(data)
