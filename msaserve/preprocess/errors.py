"""The one error type of the media pipeline: a client error the gateway turns into a 4xx.

Every limit breach names the limit and its value (`max_image_bytes=20971520`), so a caller can
fix the request. Faults inside the pipeline are not MediaErrors; they surface as 5xx.
"""


class MediaError(Exception):
    """A bad or oversized medium. `status` is the HTTP status (always 4xx), `code` a stable
    machine-readable reason, `param` the offending content part (e.g. `content[2].image_url`)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        if not 400 <= status < 500:
            raise ValueError(f"MediaError status must be 4xx, got {status}")
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    def __reduce__(self):  # picklable across Ray processes with all fields
        return (MediaError, (self.status, self.code, self.message, self.param))

    def __str__(self) -> str:
        where = f" ({self.param})" if self.param else ""
        return f"{self.status} {self.code}{where}: {self.message}"

    def to_openai(self) -> dict:
        """The OpenAI-style error body the gateway returns."""
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": self.param,
                "code": self.code,
            }
        }


# Stable codes (the HTTP status each uses).
BAD_REQUEST = 400  # invalid_content_part, empty_media, corrupt_media, fetch_failed, no_video_stream
FORBIDDEN = 403  # url_not_allowed
TOO_LARGE = 413  # media_bytes_limit, image_pixels_limit, video_duration_limit, video_frames_limit,
#                  too_many_media_items
UNSUPPORTED = 415  # unsupported_media_type, unsupported_codec
UNPROCESSABLE = 422  # decode_time_limit
