"""What a session uses of its client, and which model it runs (SwarmClient builds both; remote_session.py never
imports swarm_client.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from swarm.client.audits import Auditor
from swarm.client.peers import Bans, PeerLoad
from swarm.client.routing import ChainLink
from swarm.client.spot_check import SpotChecker
from swarm.client.stubs import StepChannels
from swarm.dht import EventLoop


@dataclass(frozen=True)
class Route:
    """Which model a session runs: what it needs to find servers again after a failure."""

    prefix: str
    num_blocks: int
    model_name: str  # "model:adapter" for a session through a LoRA adapter
    adapter: Optional[str] = None  # the LoRA adapter every server of its chain applies (and announces)


@dataclass(frozen=True)
class ClientServices:
    """What a session uses of its client."""

    loop: EventLoop  # runs the network calls, from the session's thread
    p2p: object  # the client's libp2p endpoint, which streams to servers open through
    step_channels: StepChannels  # the steps of all the client's sessions on one server travel together
    bans: Bans  # shared by the client's sessions: a server one of them saw fail, the others avoid too
    load: PeerLoad
    spot_checks: SpotChecker
    audits: Auditor  # hops of ended sessions recomputed elsewhere (they record their outputs while it is on)
    # SwarmClient.chain and wait_for_chain: the best chain over some blocks, at once or waiting for missing ones
    find_chain: Callable[..., list[ChainLink]]
    wait_for_chain: Callable[..., list[ChainLink]]
    wire_dtype: torch.dtype  # what hidden states travel as
    open_timeout: float  # for opening a stream
    step_timeout: float  # for a step, plus STEP_SECONDS_PER_TOKEN per position
    max_retries: int  # replacements tried for a failed server
    block_wait: float  # how long routing waits for missing blocks (0: it fails at once)
