"""Messages shared by every rlt process (msgspec, no torch)."""

from protocol.codec import (
    Codec,
    ProtocolError,
    client_codec,
    config_hash,
    engine_worker_codec,
    frontend_codec,
    worker_side_codec,
)
from protocol.columns import pack, unpack
from protocol.messages import *  # noqa: F403
from protocol.messages import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION", "Codec", "ProtocolError", "client_codec", "config_hash", "engine_worker_codec",
    "frontend_codec", "worker_side_codec", "pack", "unpack",
]
