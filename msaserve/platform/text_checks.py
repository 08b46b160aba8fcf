"""Text a request may carry: valid Unicode only.

JSON allows `"\ud800"` (an unpaired UTF-16 surrogate); Python decodes it to a `str` that no UTF-8
encoder accepts, so the tokenizer (TypeError) or any JSON re-serialisation (a tool definition in the
system prompt) fails deep inside the request: a 500 for what is the client's error. The gateway
checks the parsed body once, before anything encodes it, and answers 400 naming the field.
"""

from typing import Any

from msaserve.platform.errors import APIError


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_bad_string(value: Any, path: str) -> tuple[str, str] | None:
    """(dotted path, the offending string) of the first string holding a lone surrogate."""
    if isinstance(value, str):
        return None if _is_valid_unicode(value) else (path, value)
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _is_valid_unicode(key):
                return (path or "body", key)
            found = _first_bad_string(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _first_bad_string(item, f"{path}[{i}]")
            if found:
                return found
    return None


def reject_lone_surrogates(data: Any) -> None:
    """400 `invalid_unicode` for the first string (or key) in `data` that is not valid Unicode."""
    found = _first_bad_string(data, "")
    if found is None:
        return
    param, text = found
    shown = text.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")[:80]
    raise APIError(
        400,
        f"{param} holds an unpaired UTF-16 surrogate ({shown!r}): allowed only valid Unicode text "
        "(escape a character outside the BMP as a surrogate pair, e.g. \\ud83d\\ude00)",
        param=param,
        code="invalid_unicode",
    )
