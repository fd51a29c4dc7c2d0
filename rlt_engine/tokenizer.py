"""Tokenizers the engine uses for text prompts and output text (no torch).

Toy models use bytes (ids 0–255; specials above are dropped from text). A checkpoint
directory (a shipped one too) brings its own `tokenizer.json`, read with the `tokenizers` library.
`token_pieces` gives each id's bytes (what bits per byte counts) from the JSON alone, so it also
works where the `tokenizers` library is missing.
"""

from __future__ import annotations

import codecs
import functools
import json
from pathlib import Path
from typing import Protocol

from rlt_engine.checkpoints import resolve_model


class TextDecoder(Protocol):
    """Incremental detokenization of one token stream: each call costs O(its tokens)."""

    def step(self, token_id: int) -> str:
        """The text this token completes ("" while a character is incomplete)."""
        ...

    def flush(self) -> str:
        """What is still held (an incomplete character decodes to U+FFFD, as a whole decode would)."""
        ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def decode_stream(self) -> TextDecoder: ...


class _Utf8Stream:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        return self._decoder.decode(bytes((token_id,))) if 0 <= token_id < 256 else ""

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    """UTF-8 bytes as token ids; ids ≥ 256 are special and produce no text."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def decode_stream(self) -> TextDecoder:
        return _Utf8Stream()


class _HFStream:
    """`tokenizers.decoders.DecodeStream`, plus the ids it holds back (an incomplete character)."""

    def __init__(self, tokenizer: object) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._held: list[int] = []

    def step(self, token_id: int) -> str:
        text = self._stream.step(self._tokenizer, token_id)
        if text is None:
            self._held.append(token_id)
            return ""
        self._held.clear()
        return text

    def flush(self) -> str:
        held, self._held = self._held, []
        return self._tokenizer.decode(held, skip_special_tokens=True) if held else ""


class HFTokenizer:
    """A Hugging Face `tokenizer.json`."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tokenizer = _Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def decode_stream(self) -> TextDecoder:
        return _HFStream(self._tokenizer)


class NoTokenizer:
    """A checkpoint without tokenizer.json: token-id prompts only."""

    def encode(self, text: str) -> list[int]:
        raise ValueError("this checkpoint has no tokenizer.json: pass prompt_token_ids instead of text")

    def decode(self, token_ids: list[int]) -> str:
        return ""

    def decode_stream(self) -> TextDecoder:
        return _NoText()


class _NoText:
    def step(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer that belongs to `model` (a toy name, a shipped checkpoint's name or a directory)."""
    if model.startswith("toy-"):
        return ByteTokenizer()
    path = Path(resolve_model(model)) / "tokenizer.json"
    return HFTokenizer(path) if path.exists() else NoTokenizer()


def token_pieces(model: str) -> list[bytes | None]:
    """Each id's bytes, indexed by id; None for a special token (it has no text). Toy models: the
    byte itself. A checkpoint: its byte-level BPE `tokenizer.json` (`byte_level_pieces`)."""
    if model.startswith("toy-"):
        return [bytes((i,)) for i in range(256)]
    return byte_level_pieces(Path(resolve_model(model)) / "tokenizer.json")


def byte_level_pieces(path: Path) -> list[bytes | None]:
    """The bytes of every id of a byte-level BPE `tokenizer.json` (GPT-2's printable stand-ins
    mapped back), read with json alone; None for added tokens. Raises ValueError for any other
    kind of tokenizer, whose tokens are not byte strings."""
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    decoder = spec.get("decoder") or {}
    if spec.get("model", {}).get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        raise ValueError(f"{path}: not a byte-level BPE tokenizer (model {spec.get('model', {}).get('type')!r}, "
                         f"decoder {decoder.get('type')!r}), so its tokens have no byte strings")
    added = {t["id"] for t in spec.get("added_tokens", [])}
    vocab: dict[str, int] = spec["model"]["vocab"]
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    pieces: list[bytes | None] = [None] * (max([*vocab.values(), *added]) + 1)
    for token, index in vocab.items():
        if index not in added:
            pieces[index] = bytes(to_byte[c] for c in token)
    return pieces


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))
