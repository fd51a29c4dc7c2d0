"""The pre-tokenized corpus `tiny-ouro-py` trains on, readable where `tokenizers` is missing.

`prepare(data_dir, vocab_size)` runs where the `tokenizers` library is (the CPU machine): it reads
the standard library (corpus.py: its files, its held-out rule), trains a byte-level BPE tokenizer
on the training files only and writes into `data_dir`:

    tokenizer.json   the tokenizer; the trainer copies it into every checkpoint it writes
    train.npy        uint16 token ids of the training files, each document (a file, or a part of one:
                     DOCUMENT_RULES) followed by <eos>
    held_out.npy     the same for the held-out files
    prepared.json    corpus SHA-256, files, Python version, tokenizer SHA-256 and settings,
                     token and byte counts, and the ids of the greedy check's prompts

`load_prepared(data_dir)` reads them back with numpy and json alone (the GPU machine's trainer,
`rlt-bench quality --data`). Bytes per token come from the tokenizer's own pieces, so bits per
byte is computed the same way everywhere.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlt_engine.bench.corpus import HELD_OUT_MODULUS, SKIPPED_DIRS, ExtraText, StdlibText, read_stdlib
from rlt_engine.bench.greedy import PROMPTS
from rlt_engine.bench.training_text import definition_documents, summary_docstrings
from rlt_engine.tokenizer import byte_level_pieces

SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")  # ids 0, 1, 2 (the trainer puts them first)
BOS, EOS, PAD = 0, 1, 2
FORMAT = 1
# What `prepare` does to the training split (training_text.py says why); held-out text is never changed.
DOCSTRING_RULES = {"summary": summary_docstrings, "keep": lambda text: text}
DOCUMENT_RULES = {"file": lambda text: [text], "definition": definition_documents}  # each document ends with <eos>


@dataclass(frozen=True)
class Prepared:
    directory: Path
    train: np.ndarray  # uint16 token ids
    held_out: np.ndarray  # uint16 token ids
    meta: dict  # prepared.json
    pieces: list[bytes | None]  # each id's bytes (None: a special token)

    @property
    def tokenizer_path(self) -> Path:
        return self.directory / "tokenizer.json"

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def byte_counts(self) -> np.ndarray:
        """Bytes of each id's text [vocab], int64; a special token (the <eos> ending a file) counts as one."""
        return np.array([1 if p is None else len(p) for p in self.pieces], dtype=np.int64)

    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (specials print nothing), without the `tokenizers` library."""
        return b"".join(self.pieces[t] or b"" for t in token_ids).decode("utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts`: <bos> <eos> <pad> at 0–2, all 256
    bytes, then merges; GPT-2's pre-tokenizer split, no normalizer, so decode(encode(t)) == t."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _ids(tokenizer, texts: list[str]) -> np.ndarray:
    """Each text's ids followed by <eos>, uint16; checks every text round-trips."""
    parts = []
    for text, encoding in zip(texts, tokenizer.encode_batch(texts, add_special_tokens=False), strict=True):
        if tokenizer.decode(encoding.ids, skip_special_tokens=False) != text:
            raise ValueError("the tokenizer does not round-trip a corpus file")
        parts += [np.asarray(encoding.ids, dtype=np.uint16), np.array([EOS], dtype=np.uint16)]
    return np.concatenate(parts)


def prepare(data_dir: str | Path, vocab_size: int, corpus: StdlibText | None = None,
            extra: ExtraText | None = None, docstrings: str = "keep", documents: str = "file") -> Prepared:
    """Train the tokenizer on the training split and write the data directory (see the module doc).
    `extra` (corpus.read_site_packages) joins the training split only, after the stdlib's files;
    the held-out split stays the stdlib's held-out files. `docstrings` and `documents` name a
    DOCSTRING_RULES and a DOCUMENT_RULES entry, applied to the training split only, in that order."""
    import tokenizers

    if not 256 + len(SPECIAL_TOKENS) < vocab_size <= 2**16:
        raise ValueError(f"vocab_size {vocab_size} must exceed the 259 bytes and specials and fit uint16")
    corpus = corpus or read_stdlib()
    stdlib_train, held_out_bytes = corpus.split()
    uncut = [*stdlib_train, *([] if extra is None else extra.texts)]
    cut = [DOCSTRING_RULES[docstrings](t) for t in uncut]
    stdlib_train_bytes = sum(map(len, cut[: len(stdlib_train)]))
    train_bytes = [document for text in cut for document in DOCUMENT_RULES[documents](text)]
    train_texts = [t.decode("utf-8") for t in train_bytes]
    held_out_texts = [t.decode("utf-8") for t in held_out_bytes]
    tokenizer = train_tokenizer(train_texts, vocab_size)
    out = Path(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    train, held_out = _ids(tokenizer, train_texts), _ids(tokenizer, held_out_texts)
    np.save(out / "train.npy", train)
    np.save(out / "held_out.npy", held_out)
    meta = {
        "format": FORMAT,
        "corpus": {"source": "the Python standard library", "python": sys.version.split()[0],
                   "sha256": corpus.sha256, "files": corpus.files,
                   "held_out_rule": f"sha256(path) % {HELD_OUT_MODULUS} == 0",
                   "skipped_dirs": sorted(SKIPPED_DIRS),
                   "train_bytes": sum(map(len, train_bytes)), "stdlib_train_bytes": stdlib_train_bytes,
                   "held_out_bytes": sum(map(len, held_out_bytes)),
                   "docstrings": {"training_split": docstrings, "held_out": "keep",
                                  "train_bytes_before": sum(map(len, uncut))},
                   "documents": {"training_split": documents, "held_out": "file", "train_documents": len(train_bytes)},
                   "extra": None if extra is None else {**extra.manifest, "file_list": extra.files}},
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "tokenizers": tokenizers.__version__,
                      "vocab_size": tokenizer.get_vocab_size(), "asked_vocab_size": vocab_size,
                      "special_tokens": dict(zip(SPECIAL_TOKENS, (BOS, EOS, PAD), strict=True)),
                      "trained_on": "the training files only",
                      "sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()},
        "train_tokens": len(train), "held_out_tokens": len(held_out),
        "greedy_prompts": [{"text": p, "ids": tokenizer.encode(p, add_special_tokens=False).ids} for p in PROMPTS],
    }
    (out / "prepared.json").write_text(json.dumps(meta, indent=1) + "\n")
    return load_prepared(out)


def load_prepared(data_dir: str | Path) -> Prepared:
    """Read a data directory written by `prepare` (numpy and json only)."""
    directory = Path(data_dir)
    meta_path = directory / "prepared.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory}: no prepared.json (run `scripts/train_tiny.py prepare` first)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT}")
    tokenizer_sha = hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest()
    if tokenizer_sha != meta["tokenizer"]["sha256"]:
        raise ValueError(f"{directory}/tokenizer.json is not the tokenizer prepared.json records (its ids would "
                         "mean other text): run prepare again")
    pieces = byte_level_pieces(directory / "tokenizer.json")
    data = Prepared(directory, np.load(directory / "train.npy"), np.load(directory / "held_out.npy"), meta, pieces)
    if len(data.train) != meta["train_tokens"] or len(data.held_out) != meta["held_out_tokens"]:
        raise ValueError(f"{directory}: the .npy files do not match prepared.json's token counts")
    return data
