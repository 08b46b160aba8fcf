"""Media type from the first bytes. Headers, `data:` media types and file extensions are never
trusted: a JPEG named `.mp4` or served as `video/mp4` is still a JPEG."""

from typing import Literal

from msaserve.preprocess.errors import MediaError

MediaKind = Literal["image", "video"]

# (kind, name) for each supported container; names are what error messages show.
IMAGE_FORMATS = ("png", "jpeg", "webp", "gif", "bmp")
VIDEO_FORMATS = ("mp4", "webm")


def sniff(data: bytes) -> tuple[MediaKind | None, str]:
    """Return (kind, format) of `data`; kind is None for formats we recognise but do not accept."""
    head = data[:64]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image", "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image", "jpeg"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image", "webp"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "image", "gif"
    if head[:2] == b"BM" and len(head) >= 26:
        return "image", "bmp"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"qt  ",):
            return "video", "mp4"  # QuickTime .mov: same demuxer, codecs checked later
        if brand[:3] in (b"avi", b"hei", b"hev", b"mif", b"msf"):
            return None, f"heif/avif ({brand.decode('latin-1').strip()})"
        return "video", "mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "video", "webm"  # EBML: WebM or Matroska; codecs checked later
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return None, "avi"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return None, "tiff"
    if head[:4] == b"%PDF":
        return None, "pdf"
    return None, "unknown"


def expect_kind(data: bytes, kind: MediaKind, param: str | None = None) -> str:
    """Check that `data` is a supported medium of `kind`; return its format or raise MediaError."""
    if not data:
        raise MediaError(400, "empty_media", f"the {kind} is empty (0 bytes)", param)
    found_kind, fmt = sniff(data)
    allowed = IMAGE_FORMATS if kind == "image" else VIDEO_FORMATS
    if found_kind != kind:
        article = {"image": "an", "video": "a"}
        what = f"{article[found_kind]} {found_kind} ({fmt})" if found_kind else f"'{fmt}' data"
        raise MediaError(
            415,
            "unsupported_media_type",
            f"expected {article[kind]} {kind} but the bytes are {what}; "
            f"supported {kind} formats: {', '.join(allowed)}",
            param,
        )
    return fmt
