"""Grammar specs → llguidance matchers, compiled once per spec hash.

A `GrammarSpec` (JSON schema, any JSON object, regex or Lark) is turned into llguidance's grammar
text; the first request with a given spec builds a template matcher (the compile: lexer and parser
tables), later ones `deep_copy()` it. A spec llguidance cannot compile raises `InvalidParameter`
naming the request field and the library's message (which names the unsupported construct).
"""

import hashlib
import json
import re
import threading
from collections import OrderedDict

import llguidance

from msaserve.engine.types import GrammarSpec, InvalidParameter

_JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON (`{"a": 1}` separators): small models otherwise pad with unbounded whitespace."""


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar text for `spec` (not yet checked)."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if spec.kind == "json_schema":
        schema = json.loads(spec.source)
        if not spec.strict:  # non-strict: keywords llguidance does not enforce are ignored, not a 400
            schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "lenient": True}}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    raise InvalidParameter(spec.param, spec.kind, "json_object, json_schema, regex or lark")


def spec_hash(spec: GrammarSpec) -> str:
    key = json.dumps([spec.kind, spec.source, spec.strict])
    return hashlib.sha256(key.encode()).hexdigest()


def llg_tokenizer(tokenizer: object, vocab_size: int, eos_token_ids: set[int]) -> llguidance.LLTokenizer:
    """llguidance's view of our tokenizer: the `tokenizers` backend's JSON, the model's vocab width
    (logits may be wider than the tokenizer's vocabulary) and its end-of-sequence ids."""
    backend = tokenizer.backend  # type: ignore[attr-defined]
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids))


_EXCERPT_LINE = re.compile(r"^\s*\d+ \| ")
_CARET_LINE = re.compile(r"^\s*\^+\s*$")


def _without_excerpt(message: str | None) -> str:
    """llguidance's message less its excerpt of the grammar text (`   2 | call: ...` and the caret
    under it): that text is the server's (the Lark rule around a regex, the tool-call wrapper with its
    layout keywords), not what the client wrote; the line and column it names stay."""
    kept: list[str] = []
    in_excerpt = False
    for line in (message or "").splitlines():
        in_excerpt = bool(_EXCERPT_LINE.match(line) or (in_excerpt and _CARET_LINE.match(line)))
        if not in_excerpt:
            kept.append(line)
    return "\n".join(kept).strip()


class GrammarCompiler:
    """Compiled grammars of one tokenizer, cached by spec hash (LRU, `capacity` entries)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, capacity: int = 256) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the gateway thread and the engine thread both compile
        self.num_compiles = 0

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `spec`'s grammar; compiles on the first use of a spec."""
        key = spec_hash(spec)
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template.deep_copy()
        template = self._compile(spec)
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > self.capacity:
                self._templates.popitem(last=False)
            self.num_compiles += 1
        return template.deep_copy()

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError) as e:  # not JSON, or not an object
            shown = spec.shown or spec.source
            raise InvalidParameter(spec.param, shown, f"a valid {spec.kind}: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        matcher = None if error else llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher is not None and matcher.is_error():
            error = matcher.get_error()
        if error or matcher is None:
            allowed = f"a {spec.kind} llguidance supports: {_without_excerpt(error)}"
            raise InvalidParameter(spec.param, spec.shown or spec.source, allowed)
        return matcher
