"""What travels between peers: the DHT key scheme, the server record, RPC metadata and the error tree.

DHT layout: one key per transformer block, ``"{prefix}.{index}"``; each server that holds the block stores
its ServerInfo under that key, with its own owner marker as the subkey (signed: see swarm/trust.py), so
servers never overwrite each other, no peer can forge another's record, and a lookup of N keys returns
every server of every block. The catalogue, one more key (CATALOGUE_KEY), holds the ModelRecord of each
server's model under its owner marker: what a client needs to serve a model it was not configured with.

Errors (every one a SwarmError, each with a stable ``code`` that crosses the wire)::

    SwarmError
    ├── UnknownModelError        name is neither a known model nor a local Hugging Face folder
    ├── MissingBlocksError       no chain of servers covers these blocks
    ├── CacheFullError           a server has no room for the session's attention cache
    │   └── ServerLimitError     a server's limit on one client (sessions per peer, tokens per session)
    ├── SessionLengthError       a step would go past the session's max_length
    ├── BadRequestError          a server refused a malformed request
    ├── ServerUnavailableError   a server did not answer, or broke the stream
    └── NotAllowedError          a private server refused a peer that is not on its list of clients

A client routes around a server that raises CacheFullError (ServerLimitError included) or NotAllowedError
when a session opens, without banning it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import asdict, dataclass
from typing import Iterable

PROTOCOL_VERSION = "0.3.0"  # 0.2: signed records under owner subkeys; 0.3: multiplexed steps (rpc_steps), 16-position pages
# servers keep attention caches in pages of this many positions, and grow a session's cache a page at a time:
# a new session needs room for one page (what the client asks of the servers it routes to), not its max_length
PAGE_TOKENS = 16


# ---------------------------------------------------------------------------------------------- errors


class SwarmError(Exception):
    code = "swarm_error"


class UnknownModelError(SwarmError):
    code = "unknown_model"


class MissingBlocksError(SwarmError):
    code = "missing_blocks"


class CacheFullError(SwarmError):
    code = "cache_full"


class ServerLimitError(CacheFullError):
    code = "server_limit"


class SessionLengthError(SwarmError):
    code = "session_length_exceeded"


class BadRequestError(SwarmError):
    code = "bad_request"


class ServerUnavailableError(SwarmError):
    code = "server_unavailable"


class NotAllowedError(SwarmError):
    code = "not_allowed"


def _error_classes(cls: type) -> list[type]:
    return [cls, *(sub for subclass in cls.__subclasses__() for sub in _error_classes(subclass))]


_ERRORS_BY_CODE = {cls.code: cls for cls in _error_classes(SwarmError)}


def error_to_wire(error: SwarmError) -> dict:
    return {"error": {"code": error.code, "message": str(error)}}


def error_from_wire(metadata: dict) -> SwarmError | None:
    """The SwarmError a server reported in a reply's metadata, or None for a successful reply."""
    error = metadata.get("error")
    if not isinstance(error, dict):
        return None
    cls = _ERRORS_BY_CODE.get(error.get("code"), SwarmError)
    return cls(str(error.get("message", "server error")))


# ---------------------------------------------------------------------------------------------- records


def dht_prefix(model_name: str) -> str:
    """A DHT-safe prefix for a model name or folder: its last path component with odd characters dashed."""
    name = model_name.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_-]+", "-", name) or "model"


def block_key(prefix: str, index: int) -> str:
    return f"{prefix}.{index}"


class ServerState(enum.IntEnum):
    OFFLINE = 0
    JOINING = 1
    ONLINE = 2


@dataclass(frozen=True)
class ServerInfo:
    """The record a server announces under each of its blocks."""

    state: ServerState
    start: int  # first block held
    end: int  # one past the last block held
    throughput: float  # tokens per second through the whole span, measured at start
    cache_tokens_free: int
    version: str = PROTOCOL_VERSION

    def to_wire(self) -> dict:
        return {**asdict(self), "state": int(self.state)}

    @classmethod
    def from_wire(cls, value) -> "ServerInfo | None":
        """Parse a record found in the DHT; None for anything malformed (a stranger may have written it)."""
        try:
            info = cls(
                state=ServerState(int(value["state"])),
                start=int(value["start"]),
                end=int(value["end"]),
                throughput=float(value["throughput"]),
                cache_tokens_free=int(value["cache_tokens_free"]),
                version=str(value.get("version", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None
        return info if 0 <= info.start < info.end else None


CATALOGUE_KEY = "_swarm.models"


@dataclass(frozen=True)
class ModelRecord:
    """A model some servers serve: its name, DHT prefix, number of blocks, and where its client-side weights
    come from (a known model name, or a Hugging Face folder path on the servers' machines)."""

    name: str
    prefix: str
    num_blocks: int
    source: str

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, value) -> "ModelRecord | None":
        try:
            record = cls(str(value["name"]), str(value["prefix"]), int(value["num_blocks"]), str(value["source"]))
        except (KeyError, TypeError, ValueError):
            return None
        return record if record.num_blocks > 0 and record.prefix else None


@dataclass(frozen=True)
class RemoteServer:
    """A server as seen by a client: who it is, and what it announced."""

    peer_id: str  # base58
    info: ServerInfo


def format_block_ranges(ranges: list[tuple[int, int]]) -> str:
    """[(15, 30)] -> "15..29"; half-open ranges printed inclusively, as people count blocks."""
    return ", ".join(f"{start}..{end - 1}" if end - start > 1 else f"{start}" for start, end in ranges)


# ------------------------------------------------------------------------------- coverage of the blocks


def servers_per_block(servers: Iterable[RemoteServer], num_blocks: int) -> list[int]:
    """How many of `servers` hold each block of [0, num_blocks)."""
    counts = [0] * num_blocks
    for server in servers:
        for index in range(server.info.start, min(server.info.end, num_blocks)):
            counts[index] += 1
    return counts


def missing_ranges(servers: Iterable[RemoteServer], num_blocks: int, start: int = 0) -> list[tuple[int, int]]:
    """Half-open ranges of blocks in [start, num_blocks) that no server holds."""
    covered = [index < start for index in range(num_blocks)]
    for server in servers:
        for index in range(server.info.start, min(server.info.end, num_blocks)):
            covered[index] = True
    ranges, start = [], None
    for index, is_covered in enumerate([*covered, True]):
        if not is_covered and start is None:
            start = index
        elif is_covered and start is not None:
            ranges.append((start, index))
            start = None
    return ranges
