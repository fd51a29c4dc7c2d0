"""Packed columns: how per-row fields travel (one little-endian array per field, as bytes).

A batch of 256 rows costs one `bytes` per field instead of 256 Python ints per field,
which keeps encode + decode in the microseconds (SPEC §6).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

I32 = "<i4"
I64 = "<i8"
U64 = "<u8"
F64 = "<f8"


def pack(values: Any, dtype: str) -> bytes:
    """Pack a sequence or array into the little-endian bytes of `dtype`."""
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def unpack(data: bytes, dtype: str) -> np.ndarray:
    """A read-only array view of packed bytes (no copy)."""
    return np.frombuffer(data, dtype=dtype)


class Columnar:
    """Mixin for Structs whose per-row fields are packed columns.

    Subclasses list `COLUMNS = {"field": dtype}`; every listed field is `bytes` and all must
    describe the same number of rows (except those in `RAGGED`, whose length is checked by the
    subclass). `__post_init__` runs on construction and on decode, so a malformed frame fails
    in the decoder.
    """

    __slots__ = ()
    COLUMNS: ClassVar[dict[str, str]] = {}
    RAGGED: ClassVar[frozenset[str]] = frozenset()

    def col(self, name: str) -> np.ndarray:
        """The named column as an array."""
        return unpack(getattr(self, name), self.COLUMNS[name])

    @property
    def num_rows(self) -> int:
        first = next(n for n in self.COLUMNS if n not in self.RAGGED)
        return len(getattr(self, first)) // np.dtype(self.COLUMNS[first]).itemsize

    def _check_columns(self) -> None:
        rows: int | None = None
        for name, dtype in self.COLUMNS.items():
            size = len(getattr(self, name))
            itemsize = np.dtype(dtype).itemsize
            if size % itemsize:
                raise ValueError(f"column {name!r}: {size} bytes is not a whole number of {dtype}")
            if name in self.RAGGED:
                continue
            if rows is None:
                rows = size // itemsize
            elif size // itemsize != rows:
                raise ValueError(f"column {name!r} has {size // itemsize} rows, expected {rows}")

    def _check_min(self, name: str, minimum: int | float) -> None:
        values = self.col(name)
        if values.size and values.min() < minimum:
            raise ValueError(f"column {name!r} holds {values.min()}, below its minimum {minimum}")
