"""The held-out text `rlt-bench quality` scores, as the model's token ids, and the bytes of each id.

Bits per byte = nats over a window's scored tokens / (ln 2 × the UTF-8 bytes of their text).
Every id's bytes come from its tokenizer's pieces (`rlt_engine.tokenizer.token_pieces`), so the
count is exact even where a window starts or ends inside a character; the <eos> that ends each
file counts as one byte (for a byte model every token is then one byte, as before).

Three sources, the first that applies:

    --data DIR       a directory written by `scripts/train_tiny.py prepare`: its held-out ids,
                     which must come from the model's own tokenizer.json (same SHA-256)
    a toy model      the standard library's held-out bytes (byte vocabulary, <eos> = 257)
    a checkpoint     the standard library's held-out files tokenized with its tokenizer.json
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlt_engine.bench.corpus import load_corpus, read_stdlib
from rlt_engine.checkpoints import resolve_model
from rlt_engine.tokenizer import load_tokenizer, token_pieces


@dataclass(frozen=True)
class HeldOut:
    ids: np.ndarray  # token ids of the held-out files, each followed by <eos>
    byte_counts: np.ndarray  # bytes of each id's text [vocab], int64; a special token counts one
    corpus_sha256: str  # of the whole corpus the split was taken from (corpus.py)
    source: str  # where the ids came from, for the report

    def bytes_of(self, token_ids: list[int]) -> int:
        """UTF-8 bytes of these tokens' text."""
        return int(self.byte_counts[np.asarray(token_ids, dtype=np.int64)].sum())


def byte_counts(model: str, vocab_size: int) -> np.ndarray:
    """Bytes of every id below `vocab_size` (ids the tokenizer lacks, and specials, count one)."""
    pieces = token_pieces(model)
    counts = np.ones(max(vocab_size, len(pieces)), dtype=np.int64)
    counts[: len(pieces)] = [1 if p is None else len(p) for p in pieces]
    return counts


def held_out_for(model: str, vocab_size: int, eos_token_id: int, data_dir: str | None = None) -> HeldOut:
    """The held-out ids of `model` from the first source that applies (see the module doc)."""
    counts = byte_counts(model, vocab_size)
    if data_dir is not None:
        from rlt_engine.bench.prepared import load_prepared

        data = load_prepared(data_dir)
        _check_same_tokenizer(model, data.tokenizer_path)
        return HeldOut(data.held_out.astype(np.int64), counts, data.meta["corpus"]["sha256"],
                       f"{data_dir} (Python {data.meta['corpus']['python']} standard library, pre-tokenized)")
    if model.startswith("toy-"):
        corpus = load_corpus()
        return HeldOut(corpus.held_out.astype(np.int64), counts, corpus.sha256,
                       f"this interpreter's standard library as bytes ({corpus.held_out_rule})")
    text = read_stdlib()
    tokenizer = load_tokenizer(model)
    parts: list[int] = []
    for held in text.split()[1]:
        parts += [*tokenizer.encode(held.decode("utf-8")), eos_token_id]
    return HeldOut(np.asarray(parts, dtype=np.int64), counts, text.sha256,
                   "this interpreter's standard library, tokenized with the model's tokenizer.json")


def trained_on(model: str) -> str | None:
    """The corpus SHA-256 the checkpoint's training.json records, if it has one."""
    if model.startswith("toy-"):
        return None
    path = Path(resolve_model(model)) / "training.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("corpus", {}).get("sha256")


def _check_same_tokenizer(model: str, prepared_tokenizer: Path) -> None:
    ours = Path(resolve_model(model)) / "tokenizer.json"
    if not ours.is_file() or _sha256(ours) != _sha256(prepared_tokenizer):
        raise ValueError(f"--data's tokenizer ({prepared_tokenizer}) is not the model's ({ours}): "
                         "its ids would mean other text")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
