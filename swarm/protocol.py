"""What travels between peers: the DHT key scheme, the server record, RPC metadata and the error tree.

DHT layout (swarm/directory.py): one key per transformer block, ``"{prefix}.{index}"``; each server stores its
ServerInfo once, under the key of the block its span starts at, with its own owner marker as the subkey (signed:
see swarm/trust.py), so servers never overwrite each other, no peer can forge another's record, and a lookup of
the N keys returns each server once, whatever its span (servers of the layout before announced under every block
they hold: readers keep each server's newest record). A key keeps a bounded number of records (the best by
announced capacity, and a sample). The catalogue, one more key (CATALOGUE_KEY), holds the ModelRecord of each
server's model under its owner marker (a few per model): what a client needs to serve a model it was not
configured with.

Errors (every one a SwarmError, each with a stable ``code`` that crosses the wire)::

    SwarmError
    ├── UnknownModelError        name is neither a known model, a local Hugging Face folder, nor a Hub model
    │                            this process can fetch (swarm/hub.py: unknown, gated, no such revision, ...)
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
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

PROTOCOL_VERSION = "0.6.0"  # 0.2: signed records under owner subkeys; 0.3: multiplexed steps (rpc_steps), 16-position pages; 0.4: a message's steps stacked in one tensor
# 0.5: openings and steps declare their next step's positions (next_positions): servers compute pushes only within
# it; 0.6: flowing steps (a step's entry may await its inputs pushed by the previous server: 'await_push')
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


class SessionClosedError(ServerUnavailableError):
    """The server closed the session itself (idle too long, or its cache reclaimed): no fault of the server,
    so the client goes on elsewhere (or there again) without holding it against the server."""

    code = "session_closed"


class NoPushError(SwarmError):
    """A step that waited for its inputs to be pushed by the previous server (a flowing step) got none in time:
    the client sends them itself."""

    code = "no_push"


class NotAllowedError(SwarmError):
    code = "not_allowed"


class InternalServerError(SwarmError):
    """The server failed on its own (a bug, out of memory): no fault of the request, so clients go elsewhere."""

    code = "internal_error"


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


# a Hugging Face Hub id: a namespace and a name, letters, digits and . _ - (no "--", which the Hub's cache uses)
HUB_ID = re.compile(r"(?!.*--)[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def dht_prefix(model_name: str) -> str:
    """A DHT-safe prefix for a model name or folder, odd characters dashed: a folder's last path component; a Hub
    id's namespace and name joined by "--", so that two organizations' models of one name, or a Hub model and the
    known model converted from its quantized GGUF, never share blocks (their weights differ). A Hub id that is also
    a local folder is that folder, as everywhere."""
    name = model_name.rstrip("/")
    if HUB_ID.fullmatch(name) and not os.path.isdir(name):
        name = name.replace("/", "--")
    name = name.rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_-]+", "-", name) or "model"


def block_key(prefix: str, index: int) -> str:
    return f"{prefix}.{index}"


class ServerState(enum.IntEnum):
    OFFLINE = 0
    JOINING = 1
    ONLINE = 2


# Bounds of what a record may say: a record is written by any peer, so a value outside them (inf, NaN, 1e300, a
# negative cache, a block past any model's end, a megabyte of version string) makes the record be ignored,
# never win routing. They are far above anything real: a decode step through a span takes microseconds at best.
MAX_THROUGHPUT = 1e6  # tokens per second through a span
MAX_CACHE_TOKENS = 1 << 31  # token slots of a server's attention cache
MAX_BLOCKS = 1 << 16  # blocks of a model
MAX_VERSION_CHARS = 32
MAX_NAME_CHARS = 1024  # a model's name, DHT prefix or source (a known name or a folder path)
MAX_STARTED = 1e11  # a server's start, in seconds since the epoch: past the year 5000
# LoRA adapters one server announces: a server refuses more at start (--adapters), so a record naming more is
# malformed, and one hostile record lists no more names than a client keeps per model
MAX_ADAPTERS = 32
# an adapter's name (its folder's name on the server): clients ask for it as "model:adapter", so never a colon
ADAPTER_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# round trips a server announces to the servers it pushes to (ServerInfo.round_trips): at most this many, each
# under a peer id of base58 characters of bounded length, in seconds within [0, MAX_ROUND_TRIP_SECONDS]
MAX_ROUND_TRIPS = 16
MAX_ROUND_TRIP_SECONDS = 60.0
PEER_ID_PATTERN = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}")


@dataclass(frozen=True)
class ServerInfo:
    """The record a server announces, under the key of its first block."""

    state: ServerState
    start: int  # first block held
    end: int  # one past the last block held
    throughput: float  # tokens per second through the whole span, measured at start (0 while joining)
    cache_tokens_free: int
    version: str = PROTOCOL_VERSION
    # the most tokens (max_length x batch_size) one session may hold there: min(its --max-session-tokens, its
    # whole cache); None in records of servers older than the field
    max_session_tokens: Optional[int] = None
    # when the server's process started (seconds since the epoch): a newer one under the same peer id is the
    # server restarted (a client lifts its ban); None in records of servers older than the field
    started: Optional[float] = None
    # the LoRA adapters it applies on request (--adapters), by name; () in records of servers older than the field
    adapters: tuple[str, ...] = ()
    # (peer id, seconds) of the round trips it measured to the servers it pushes to (swarm/server/round_trips.py):
    # what flowing steps' server-to-server hops are priced by; () in records of servers older than the field
    round_trips: tuple[tuple[str, float], ...] = ()
    # reachable only through a relay (it joined with --relay-through: behind a NAT or a firewall): every message to
    # and from it takes a detour through the relay, which clients price in routing; False in older records
    relayed: bool = False

    def to_wire(self) -> dict:
        wire = {**asdict(self), "state": int(self.state), "adapters": list(self.adapters),
                "round_trips": dict(self.round_trips)}
        for optional in ("max_session_tokens", "started"):
            if wire[optional] is None:  # as older servers wrote it
                del wire[optional]
        for collection in ("adapters", "round_trips"):
            if not wire[collection]:
                del wire[collection]
        if not self.relayed:  # as older servers wrote it: a direct server's record is unchanged
            del wire["relayed"]
        return wire

    @classmethod
    def from_wire(cls, value, num_blocks: Optional[int] = None) -> "ServerInfo | None":
        """Parse a record found in the DHT; None for anything malformed or out of bounds (a stranger may have
        written it), or for blocks past `num_blocks`, the model's, when given."""
        if not isinstance(value, dict):
            return None
        try:
            info = cls(
                state=ServerState(_bounded_int(value["state"], 0, max(ServerState))),
                start=_bounded_int(value["start"], 0, MAX_BLOCKS),
                end=_bounded_int(value["end"], 1, MAX_BLOCKS if num_blocks is None else num_blocks),
                throughput=_bounded_float(value["throughput"], 0.0, MAX_THROUGHPUT),
                cache_tokens_free=_bounded_int(value["cache_tokens_free"], 0, MAX_CACHE_TOKENS),
                version=_bounded_str(value.get("version", ""), MAX_VERSION_CHARS),
                max_session_tokens=_optional(value.get("max_session_tokens"), _bounded_int, 0, MAX_CACHE_TOKENS),
                started=_optional(value.get("started"), _bounded_float, 0.0, MAX_STARTED),
                adapters=_adapter_names(value.get("adapters", [])),
                round_trips=_round_trips(value.get("round_trips", {})),
                relayed=_strict_bool(value.get("relayed", False)),
            )
        except (KeyError, TypeError, ValueError):
            return None
        # an online server has measured its speed; only a joining or leaving one announces 0
        sane = info.start < info.end and (info.throughput > 0 or info.state != ServerState.ONLINE)
        return info if sane else None


def _bounded_int(value, low: int, high: int) -> int:
    """An int (not a bool, not a float) in [low, high], else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"expected an integer in [{low}, {high}], got {value!r:.40}")
    return value


def _bounded_float(value, low: float, high: float) -> float:
    """A finite number in [low, high] (NaN fails the comparison), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"expected a number in [{low}, {high}], got {value!r:.40}")
    return float(value)


def _strict_bool(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r:.40}")
    return value


def _bounded_str(value, max_chars: int) -> str:
    if not isinstance(value, str) or len(value) > max_chars:
        raise ValueError(f"expected a string of at most {max_chars} characters")
    return value


def _adapter_names(value) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_ADAPTERS:
        raise ValueError(f"expected a list of at most {MAX_ADAPTERS} adapter names")
    if not all(isinstance(name, str) and ADAPTER_NAME_PATTERN.fullmatch(name) for name in value):
        raise ValueError("expected adapter names")
    return tuple(value)


def _round_trips(value) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, dict) or len(value) > MAX_ROUND_TRIPS:
        raise ValueError(f"expected a map of at most {MAX_ROUND_TRIPS} round trips")
    if not all(isinstance(peer, str) and PEER_ID_PATTERN.fullmatch(peer) for peer in value):
        raise ValueError("expected peer ids")
    return tuple(sorted((peer, _bounded_float(seconds, 0.0, MAX_ROUND_TRIP_SECONDS)) for peer, seconds in value.items()))


def _optional(value, parse, *bounds):
    return None if value is None else parse(value, *bounds)


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
        """Parse a catalogue entry; None for anything malformed or out of bounds (a stranger may have written it)."""
        if not isinstance(value, dict):
            return None
        try:
            name, prefix, source = (_bounded_str(value[key], MAX_NAME_CHARS) for key in ("name", "prefix", "source"))
            record = cls(name, prefix, _bounded_int(value["num_blocks"], 1, MAX_BLOCKS), source)
        except (KeyError, TypeError, ValueError):
            return None
        return record if record.prefix and record.name else None


@dataclass(frozen=True)
class RemoteServer:
    """A server as seen by a client: who it is, and what it announced."""

    peer_id: str  # base58
    info: ServerInfo
    # when the record read expires (DHT time: time.time()); a dead server's never moves on (swarm/client/peers.py)
    expires: float = field(default=float("inf"), compare=False)


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
