"""The text `tiny-ouro-py` learns from and is judged on: the running interpreter's standard library.

Files are the stdlib's `.py` sources, sorted by path, without tests, encoding tables and pydoc
data. A file whose path hashes to 0 mod 50 is held out: the quality benchmark reads only those,
the training script and its tokenizer never do. `load_corpus` gives the byte-vocabulary streams
(each file's bytes followed by <eos>, for byte models); `read_stdlib` the text itself, which
`prepared.py` tokenizes with a trained BPE.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EOS = 257  # <eos> of the byte vocabulary (toy models, tiny-ouro-py): ends each file
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data"})
HELD_OUT_MODULUS = 50


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint16 token ids
    held_out: np.ndarray
    files: list[str]  # every file read, relative to the stdlib root
    sha256: str  # over every path and every byte, in order

    @property
    def held_out_rule(self) -> str:
        return f"sha256(path) % {HELD_OUT_MODULUS} == 0"


def is_held_out(relative_path: str) -> bool:
    return int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % HELD_OUT_MODULUS == 0


def stdlib_files() -> tuple[Path, list[str]]:
    """The standard library's root and its .py files (sorted, relative to the root)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        str(p.relative_to(root)) for p in root.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(root).parts)
    )
    return root, files


@dataclass(frozen=True)
class StdlibText:
    """The corpus as text: every file's bytes, in path order, and which are held out."""

    files: list[str]
    texts: list[bytes]
    sha256: str  # over every path and every byte, in order

    def split(self) -> tuple[list[bytes], list[bytes]]:
        """(training texts, held-out texts)."""
        train = [t for f, t in zip(self.files, self.texts, strict=True) if not is_held_out(f)]
        held_out = [t for f, t in zip(self.files, self.texts, strict=True) if is_held_out(f)]
        return train, held_out


def read_stdlib() -> StdlibText:
    """Read the running interpreter's standard library once (the files and order of `stdlib_files`)."""
    root, files = stdlib_files()
    digest = hashlib.sha256()
    texts = []
    for relative in files:
        text = (root / relative).read_bytes()
        digest.update(relative.encode() + b"\0" + text + b"\0")
        texts.append(text)
    return StdlibText(files, texts, digest.hexdigest())


# The installed Python sources `scripts/train_tiny.py prepare` adds to the training split: the
# distributions pyproject.toml names (dependencies, the dev and bench extras), each up to
# EXTRA_MAX_BYTES of its .py files (taken in sha256(path) order, a deterministic spread over the
# package), tests left out, and no file whose bytes equal a standard-library file's (vendored
# copies: the held-out files must stay unseen).
EXTRA_DISTRIBUTIONS = (
    "torch", "triton", "pyzmq", "msgspec", "psutil", "numpy", "safetensors", "tokenizers", "tqdm", "fastapi",
    "uvicorn", "prometheus-client", "jinja2", "pytest", "pytest-timeout", "hypothesis", "openai", "httpx",
    "matplotlib",
)
EXTRA_MAX_BYTES = 10_000_000
EXTRA_SKIPPED_DIRS = SKIPPED_DIRS | {"testing", "_testing"}


@dataclass(frozen=True)
class ExtraText:
    """Training-only text beyond the standard library, with its manifest (never held out)."""

    files: list[str]  # "<distribution>/<path in site-packages>"
    texts: list[bytes]
    sha256: str  # over every path and every byte, in order
    manifest: dict  # distributions, versions, counts, the rule, the files left out as duplicates


def read_site_packages(stdlib: StdlibText, names: tuple[str, ...] = EXTRA_DISTRIBUTIONS,
                       max_bytes: int = EXTRA_MAX_BYTES) -> ExtraText:
    """The installed distributions' .py sources (see EXTRA_DISTRIBUTIONS), in a fixed order."""
    import importlib.metadata

    known = {hashlib.sha256(t).digest() for t in stdlib.texts}
    files, texts, rows, duplicates, not_utf8 = [], [], [], [], []
    digest = hashlib.sha256()
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            rows.append({"name": name, "version": None, "files": 0, "bytes": 0})
            continue
        candidates = sorted((str(f) for f in dist.files or [] if str(f).endswith(".py")
                             and not EXTRA_SKIPPED_DIRS.intersection(f.parts)),
                            key=lambda f: hashlib.sha256(f.encode()).hexdigest())
        taken, size, available = [], 0, 0
        for relative in candidates:
            path = Path(dist.locate_file(relative))
            if not path.is_file():
                continue
            text = path.read_bytes()
            available += len(text)
            if hashlib.sha256(text).digest() in known:
                duplicates.append(f"{name}/{relative}")
                continue
            try:
                text.decode("utf-8")
            except UnicodeDecodeError:
                not_utf8.append(f"{name}/{relative}")
                continue
            if size + len(text) > max_bytes:
                continue
            taken.append((relative, text))
            size += len(text)
        for relative, text in sorted(taken):
            label = f"{name}/{relative}"
            digest.update(label.encode() + b"\0" + text + b"\0")
            files.append(label)
            texts.append(text)
        rows.append({"name": name, "version": dist.version, "files": len(taken), "bytes": size,
                     "available_bytes": available})
    manifest = {
        "source": "the .py files of this machine's installed distributions named in pyproject.toml",
        "rule": f"per distribution: .py files outside {sorted(EXTRA_SKIPPED_DIRS)}, in sha256(path) order, "
                f"while the total stays <= {max_bytes} bytes; files equal to a standard-library file "
                "or not UTF-8 left out",
        "distributions": rows, "duplicates_left_out": duplicates, "not_utf8_left_out": not_utf8,
        "files": len(files), "bytes": sum(map(len, texts)), "sha256": digest.hexdigest(),
    }
    return ExtraText(files, texts, digest.hexdigest(), manifest)


def load_corpus() -> Corpus:
    """The standard library as byte-vocabulary token streams (training, held out)."""
    text = read_stdlib()
    train, held_out = text.split()
    return Corpus(_join(train), _join(held_out), text.files, text.sha256)


def _join(texts: list[bytes]) -> np.ndarray:
    parts: list[np.ndarray] = []
    for text in texts:
        parts += [np.frombuffer(text, dtype=np.uint8).astype(np.uint16), np.array([EOS], dtype=np.uint16)]
    return np.concatenate(parts)


def held_out_windows(held_out: np.ndarray, length: int, count: int) -> np.ndarray:
    """`count` evenly spaced windows of `length + 1` tokens, int64 [count, length + 1]: the fixed
    evaluation set of both the training script and `rlt-bench quality`."""
    if len(held_out) < length + 2:
        raise ValueError(f"the held-out text has {len(held_out)} tokens, fewer than a {length + 1}-token window")
    starts = np.linspace(0, len(held_out) - length - 2, count).astype(np.int64)
    return np.stack([held_out[s : s + length + 1] for s in starts]).astype(np.int64)
