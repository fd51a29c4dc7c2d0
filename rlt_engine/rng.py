"""The RngRegistry: one seed per live request, nothing else (SPEC §5).

Randomness is counter-based: the worker derives every draw from (seed, purpose, index), so
the registry never holds a generator, only the seed each plan row carries as its ticket.
"""

from __future__ import annotations

import secrets


class RngRegistry:
    """Seeds of live requests, keyed by the engine's internal request key."""

    def __init__(self) -> None:
        self._seeds: dict[int, int] = {}

    def register(self, key: int, seed: int | None) -> int:
        """Record the request's seed, drawing a fresh 64-bit one when none is given."""
        if key in self._seeds:
            raise KeyError(f"request key {key} already holds a seed")
        chosen = secrets.randbits(64) if seed is None else seed
        self._seeds[key] = chosen
        return chosen

    def seed(self, key: int) -> int:
        """The seed a plan row of this request carries."""
        return self._seeds[key]

    def drop(self, key: int) -> None:
        """The request's life ended: forget its seed."""
        self._seeds.pop(key, None)

    def __len__(self) -> int:
        return len(self._seeds)
