"""Which tool-call format a model uses: the one its chat template defines, else Hermes."""

from typing import Any

from msaserve.platform.tools import HERMES, ToolFormat
from msaserve.platform.tools_minimax import MINIMAX

_TEMPLATE_FORMATS = (MINIMAX,)
"""Formats recognised by their opening marker appearing in a chat template."""


def tool_format_of(tokenizer: Any) -> ToolFormat:
    template = getattr(tokenizer, "chat_template", None) or ""
    for fmt in _TEMPLATE_FORMATS:
        if fmt.open in template:
            return fmt
    return HERMES
