"""Per-socket encoders and decoders: strict, size-limited, never pickling.

Every frame starts with a 4-byte header, b"RL" + protocol version (u16 little-endian),
so a peer speaking another version is named as such instead of failing deep in decoding.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Generic, TypeVar, get_args

import msgspec

from protocol.messages import (
    PROTOCOL_VERSION,
    ClientInbound,
    ClientOutbound,
    WorkerConfig,
    WorkerInbound,
    WorkerOutbound,
)

T = TypeVar("T")

_MAGIC = b"RL"
_HEADER = struct.Struct("<2sH")
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
CLIENT_MAX_FRAME_BYTES = 4 * 1024 * 1024
# Top-level types a frame may carry; anything else (a set, a dict, an int…) is refused on encode.
_MESSAGE_TYPES = tuple(
    {t for union in (WorkerInbound, WorkerOutbound, ClientInbound, ClientOutbound) for t in get_args(union)}
)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def _refuse_unknown(obj: Any) -> Any:
    raise TypeError(f"refusing to encode {type(obj).__name__}: only protocol messages travel")


class Codec(Generic[T]):
    """Encoder + decoder for one socket's message union; one instance per socket, reused."""

    def __init__(self, decode_type: Any, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_refuse_unknown)
        self._decoder = msgspec.msgpack.Decoder(decode_type)
        self._header = _HEADER.pack(_MAGIC, PROTOCOL_VERSION)
        self.max_frame_bytes = max_frame_bytes

    def encode(self, message: Any) -> bytes:
        """Header + msgpack body."""
        if not isinstance(message, _MESSAGE_TYPES):
            raise TypeError(f"refusing to encode {type(message).__name__}: not a protocol message")
        return self._header + self._encoder.encode(message)

    def decode(self, frame: bytes | memoryview) -> T:
        """Decode one frame or raise ProtocolError saying what is wrong with it."""
        if len(frame) > self.max_frame_bytes:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {self.max_frame_bytes}")
        if len(frame) < _HEADER.size:
            raise ProtocolError(f"frame of {len(frame)} bytes is shorter than the header")
        magic, version = _HEADER.unpack_from(frame)
        if magic != _MAGIC:
            raise ProtocolError("not an rlt frame (bad magic)")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"peer speaks protocol version {version}, this process speaks {PROTOCOL_VERSION}"
            )
        try:
            return self._decoder.decode(memoryview(frame)[_HEADER.size :])
        except (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError) as exc:
            raise ProtocolError(f"malformed message: {exc}") from None


def config_hash(config: WorkerConfig) -> str:
    """A short digest of a worker config; both ends of a handshake must compute the same."""
    return hashlib.sha256(msgspec.msgpack.encode(config)).hexdigest()[:16]


def worker_side_codec() -> Codec[WorkerInbound]:
    """The worker decodes what the engine sends it."""
    return Codec(WorkerInbound)


def engine_worker_codec() -> Codec[WorkerOutbound]:
    """The engine decodes what its workers send."""
    return Codec(WorkerOutbound)


def frontend_codec() -> Codec[ClientInbound]:
    """The engine's frontend decodes what clients send (smaller frame limit)."""
    return Codec(ClientInbound, CLIENT_MAX_FRAME_BYTES)


def client_codec() -> Codec[ClientOutbound]:
    """A client decodes what the frontend sends."""
    return Codec(ClientOutbound, CLIENT_MAX_FRAME_BYTES)
