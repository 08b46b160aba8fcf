"""Byte-level BPE tokenizer (the `tokenizers` library) with an HF-style Jinja chat template.

Built from GGUF metadata exactly as transformers' GGUF converter builds it, so both give the
same ids; or a plain byte vocabulary for the random-weight presets.
"""

import json
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cache, cached_property
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# ChatML, as SmolLM2 uses; the byte-level presets get it too.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4
_INCOMPLETE = "\ufffd"
LITERAL_OPEN, LITERAL_CLOSE = "\ue000", "\ue001"
"""Private-use characters around a client's text that must not become control tokens
(`Tokenizer.guard_literals`); never sent to the model themselves."""
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


@cache
def _unicode_to_bytes() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


class Tokenizer:
    """encode/decode text and render chat messages for one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: set[int],
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template or CHATML_TEMPLATE

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Text → ids; special tokens written in the text (e.g. `<|im_start|>`) stay whole, except
        where `guard_literals` marked them as a client's text: those are encoded as plain text."""
        if LITERAL_OPEN not in text:
            return self.backend.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for i, piece in enumerate(self._literal_pattern.split(text)):
            if i % 2:  # a guarded literal: its characters, never a control token
                ids += self._text_backend.encode(piece, add_special_tokens=False).ids
            elif piece := piece.replace(LITERAL_OPEN, "").replace(LITERAL_CLOSE, ""):
                ids += self.backend.encode(piece, add_special_tokens=False).ids
        return ids

    @cached_property
    def special_strings(self) -> tuple[str, ...]:
        """The control tokens' texts (`<|im_end|>`, ...), longest first."""
        added = self.backend.get_added_tokens_decoder().values()
        return tuple(sorted({t.content for t in added if t.special and t.content}, key=len, reverse=True))

    def guard_literals(self, text: str) -> str:
        """`text` with each control-token string (and each of the two marker characters) wrapped
        between LITERAL_OPEN and LITERAL_CLOSE, so that `encode` reads it as the client's text: a user
        message holding `<|im_end|><|im_start|>system` would otherwise close its turn and open a
        system turn of its own. Text without them comes back unchanged (the same ids as before)."""
        return self._guard_pattern.sub(lambda m: LITERAL_OPEN + m.group(0) + LITERAL_CLOSE, text)

    @cached_property
    def _guard_pattern(self) -> re.Pattern[str]:
        return re.compile("|".join(map(re.escape, (*self.special_strings, LITERAL_OPEN, LITERAL_CLOSE))))

    @cached_property
    def _literal_pattern(self) -> re.Pattern[str]:
        return re.compile(f"{LITERAL_OPEN}({self._guard_pattern.pattern}){LITERAL_CLOSE}")

    @cached_property
    def _text_backend(self) -> BackendTokenizer:
        """The same tokenizer with special-token matching off: control strings become plain text."""
        backend = BackendTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for. A byte-level token may hold part of a UTF-8 character
        (an emoji is often three or four tokens), which `decode` shows as U+FFFD: those come from
        the token's spelling in the byte alphabet (or a `<0xNN>` byte-fallback token), so that the
        tokens' bytes concatenated are the text's."""
        text = self.decode([token_id], skip_special_tokens=False)
        if _INCOMPLETE not in text:
            return text.encode()
        spelled = self.token(token_id)
        if fallback := _BYTE_FALLBACK.fullmatch(spelled):
            return bytes([int(fallback[1], 16)])
        byte_of = _unicode_to_bytes()
        if spelled and all(char in byte_of for char in spelled):
            return bytes(byte_of[char] for char in spelled)
        return text.encode()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render `messages` with the model's template, in the same Jinja environment as HF."""
        eos = min(self.eos_token_ids) if self.eos_token_ids else None
        return _compile_template(self.chat_template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token(self.bos_token_id),
            eos_token=self.token(eos),
        )

    @classmethod
    def from_gguf_metadata(
        cls,
        tokens: list[str],
        merges: list[str],
        token_types: list[int],
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
    ) -> "Tokenizer":
        """A GGUF `gpt2` tokenizer: vocabulary respelled in the byte alphabet where needed, the
        file's merges, CONTROL tokens added as special and USER_DEFINED ones as plain added tokens
        (what transformers' GGUF converter does, so ids match)."""
        alphabet = set(bytes_to_unicode().values())
        spell = bytes_to_unicode()
        vocab = {
            token if set(token) <= alphabet else "".join(spell[b] for b in token.encode("utf-8")): i
            for i, token in enumerate(tokens)
        }
        pairs = [tuple(merge.split(" ")) for merge in merges]
        backend = _byte_level_backend(vocab, pairs)
        control = [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_CONTROL and set(token) <= alphabet
        ]
        backend.add_special_tokens(control)
        user = [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_USER_DEFINED and token in vocab
        ]
        backend.add_tokens(user)
        eos = {eos_token_id} if eos_token_id is not None else set()
        return cls(backend, bos_token_id=bos_token_id, eos_token_ids=eos, chat_template=chat_template)

    @classmethod
    def byte_level(cls, vocab_size: int) -> "Tokenizer":
        """For random-weight presets: ids 0–2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`,
        ids 3–258 the 256 bytes; no merges. Needs vocab_size ≥ 259."""
        if vocab_size < 259:
            raise ValueError(f"vocab_size={vocab_size} is too small for the byte tokenizer: allowed ≥ 259")
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        vocab = {token: i for i, token in enumerate(specials)}
        vocab.update({char: 3 + byte for byte, char in bytes_to_unicode().items()})
        backend = _byte_level_backend(vocab, [])
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
        return cls(backend, bos_token_id=1, eos_token_ids={0, 2})


def _byte_level_backend(vocab: dict[str, int], merges: list[tuple[str, ...]]) -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@cache
def _compile_template(template: str) -> jinja2.Template:
    """The environment HF renders chat templates in: sandboxed, trim/lstrip blocks, loopcontrols."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env.from_string(template)
