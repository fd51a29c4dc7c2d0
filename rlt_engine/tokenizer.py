"""Tokenizers the engine uses for text prompts and output text (no torch).

Toy models use bytes (ids 0–255; specials above are dropped from text). A checkpoint
directory (a shipped one too) brings its own `tokenizer.json`, read with the `tokenizers` library.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from rlt_engine.checkpoints import resolve_model


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids; ids ≥ 256 are special and produce no text."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tokenizer = _Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


class NoTokenizer:
    """A checkpoint without tokenizer.json: token-id prompts only."""

    def encode(self, text: str) -> list[int]:
        raise ValueError("this checkpoint has no tokenizer.json: pass prompt_token_ids instead of text")

    def decode(self, token_ids: list[int]) -> str:
        return ""


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer that belongs to `model` (a toy name, a shipped checkpoint's name or a directory)."""
    if model.startswith("toy-"):
        return ByteTokenizer()
    path = Path(resolve_model(model)) / "tokenizer.json"
    return HFTokenizer(path) if path.exists() else NoTokenizer()
