"""Audits after the fact: now and then, once a session has ended, another server recomputes one of its hops.

Nothing in the protocol shows that a server ran the right weights: it may hold a quantized copy, another
checkpoint, skip a layer, add noise, or lie now and then. The client keeps every hop's inputs (for failover
replays) and, where audits are on, every output the hop returned. When a session closes, each of its hops is
audited with probability `rate`: on a thread of its own, never on a session's path, another server of the hop's
blocks recomputes the hop's whole sequence in one prefill, and the judge (swarm/client/audit_judge.py, calibrated
on honest servers of other dtypes and batches) compares fingerprints of the two.

A server cannot tell an audit from ordinary traffic: it is a new session whose first step is a long prompt, from
the same client as every other session; nor can it know, when it answers, which sessions will be audited: that
is drawn after the session ends. Two servers that disagree do not say which of them lies: a third one referees,
and the one it contradicts is distrusted (banned from routing for a day), logged, counted (metrics.AUDITS) and
listed (`caught`, for the swarm page); the sessions open on it leave it at their next step, replaying their
inputs onto other servers (remote_session.py). With no referee, the disagreement is only logged and counted.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Optional

import torch

from swarm.client.routing import ChainLink
from swarm.client.spot_check import LIAR_BAN_SECONDS
from swarm.protocol import SwarmError

logger = logging.getLogger(__name__)

QUANTIZED = "quantized"  # a server whose weights are (--quantize): not judged, see Auditor.audit
AUDITS_WAITING = 64  # audits queued at most; past that, a session's audits are dropped (counted), never waited for
CAUGHT_LISTED = 100  # liars the swarm page lists, the newest


@dataclass(frozen=True)
class Audit:
    """One hop of an ended session to recompute: all it was sent, all it returned."""

    link: ChainLink
    inputs: torch.Tensor  # (rows, positions, hidden)
    claimed: torch.Tensor  # (rows, positions, hidden)
    prefix: str
    num_blocks: int
    adapter: Optional[str] = None


class Auditor:
    """A client's audits (see the module's docstring); `rate` 0 turns them off, and sessions then record no
    outputs."""

    def __init__(self, client, rate: float, rng: Optional[random.Random] = None):
        self.client, self.rate = client, rate
        self.rng = rng or random.Random()
        self.caught: deque = deque(maxlen=CAUGHT_LISTED)  # {"peer_id", "blocks", "at"} of each liar caught
        self._waiting: queue.Queue = queue.Queue(AUDITS_WAITING)
        self._worker: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def consider(self, prefix: str, num_blocks: int, adapter: Optional[str], hops: Iterable) -> None:
        """A session ends: each of its hops (swarm/client/hops.py Hop) is audited with probability `rate`, later."""
        from swarm.client import metrics

        for hop in hops:
            if self.rate <= 0 or self.rng.random() >= self.rate:
                continue
            inputs, claimed = hop.inputs, hop.outputs
            if inputs is None or claimed is None or claimed.shape[:2] != inputs.shape[:2]:
                continue  # a fork's hop whose first outputs are its source's, or nothing stepped
            try:
                self._waiting.put_nowait(Audit(hop.link, inputs, claimed, prefix, num_blocks, adapter))
            except queue.Full:
                metrics.AUDITS.labels("dropped").inc()
                continue
            self._start()

    def drain(self, timeout: float) -> bool:
        """Wait until every audit queued so far is done (tests, shutdown); whether they all were in time."""
        deadline = time.monotonic() + timeout
        while self._waiting.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._waiting.unfinished_tasks

    def close(self) -> None:
        if self._worker is not None:
            self._waiting.put(None)

    def _start(self) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._audit_until_closed, name="audits", daemon=True)
                self._worker.start()

    def _audit_until_closed(self) -> None:
        from swarm.client import metrics

        while (audit := self._waiting.get()) is not None:
            try:
                metrics.AUDITS.labels(self.audit(audit)).inc()
            except Exception:  # a bug here must not end the audits, nor reach any session
                logger.exception("an audit of server %s failed", audit.link.peer_id)
                metrics.AUDITS.labels("failed").inc()
            finally:
                self._waiting.task_done()

    def audit(self, audit: Audit) -> str:
        """Recompute the hop on other servers and judge it: "passed", "caught" (a liar distrusted: the hop's server
        or, refereed, the auditor), "unresolved", "no_auditor" (no other server holds its blocks), or "quantized"
        (its server says its weights are: the judge's thresholds are for unquantized ones, see the module)."""
        link = audit.link
        hop_dtype = self._dtype(link.peer_id)
        if hop_dtype == QUANTIZED:
            return "quantized"
        auditors = [(peer, dtype) for peer in self._auditors(audit) if (dtype := self._dtype(peer)) != QUANTIZED]
        if not auditors:
            return "no_auditor"
        # the inputs as the hop's server saw them: one computing in bfloat16 rounded them first, and the judge's
        # calibration compares servers given the same inputs
        if hop_dtype in ("bfloat16", "float16"):
            audit = replace(audit, inputs=audit.inputs.to(getattr(torch, hop_dtype)))
        opinions = ((peer, self._recompute(peer, audit), dtype) for peer, dtype in auditors)
        outcome, liar = referee(link.peer_id, (audit.claimed, hop_dtype), opinions)
        blocks = f"blocks {link.start}:{link.end}"
        if outcome == "unresolved":
            logger.warning("audit of %s on server %s: another server disagreed, and no referee sided with either",
                           blocks, link.peer_id)
        if liar is not None:
            logger.warning("audit of %s: server %s returned wrong outputs; distrusted", blocks, liar)
            self.client.bans.ban(liar, LIAR_BAN_SECONDS, distrust=True)
            self.caught.append({"peer_id": liar, "blocks": [link.start, link.end], "at": time.time()})
        return outcome

    def _auditors(self, audit: Audit) -> list[str]:
        """Other servers of the hop's blocks (and adapter) that this client trusts now, in a random order."""
        link, excluded = audit.link, self.client.bans.current()
        # from the client's shared view, as a session's opening takes it: an audit makes no lookup of its own
        servers = self.client.servers(audit.prefix, audit.num_blocks, audit.adapter, max_age=None)
        peers = [server.peer_id for server in servers
                 if server.peer_id != link.peer_id and server.peer_id not in excluded
                 and server.info.start <= link.start and link.end <= server.info.end]
        return self.rng.sample(peers, len(peers))

    def _dtype(self, peer: str) -> str:
        """What a server says it computes in (rpc_info): a dtype's name, "unknown" (the judge's loosest), or
        QUANTIZED."""
        try:
            info = self.client.server_info(peer)
        except SwarmError:
            return "unknown"
        if info.get("quantization"):
            return QUANTIZED
        return str(info.get("dtype", "unknown"))

    def _recompute(self, peer: str, audit: Audit) -> Optional[torch.Tensor]:
        """The hop's outputs for all its positions as `peer` computes them in one prefill, or None if it fails."""
        try:
            return self.client.loop.run(self._prefill(peer, audit))
        except SwarmError as error:
            logger.info("audit: server %s could not recompute: %s", peer, error)
            return None

    async def _prefill(self, peer: str, audit: Audit) -> torch.Tensor:
        """As any session whose first step is a prompt: opened, stepped once, closed."""
        from swarm.client.stubs import STEP_SECONDS_PER_TOKEN, InferenceStream

        client, link = self.client, audit.link
        rows, positions = audit.inputs.shape[:2]
        stream = InferenceStream(client.node.p2p, peer, link.start, link.end, client.timeout, client.step_channels)
        try:
            await stream.open(positions, rows, adapter=audit.adapter, next_positions=positions)
            timeout = client.session_step_timeout() + STEP_SECONDS_PER_TOKEN * positions
            return await stream.step(audit.inputs, 0, timeout)
        finally:
            await stream.close()


Outputs = tuple[torch.Tensor, str]  # (rows, positions, hidden), and the dtype its server says it computes in


def referee(hop: str, claimed: Outputs, opinions: Iterator[tuple[str, Optional[torch.Tensor], str]]
            ) -> tuple[str, Optional[str]]:
    """(outcome, liar) of a hop's `claimed` outputs against other servers' recomputations (peer, outputs, dtype),
    asked lazily (referees only after a disagreement): "passed" when the first agrees; "caught" and the hop's
    server when two others agree with each other against it; "caught" and the first auditor when another sides
    with the hop against it; else "unresolved". An opinion of None (that server failed to answer) says nothing."""
    opinions = ((peer, (theirs, dtype)) for peer, theirs, dtype in opinions if theirs is not None)
    first = next(opinions, None)
    if first is None:
        return "unresolved", None
    if agree(claimed, first[1]):
        return "passed", None
    dissenters = [first[1]]  # each disagrees with the hop; two that agree with each other convict it
    for _, theirs in opinions:
        if agree(claimed, theirs):
            return "caught", first[0]
        if any(agree(earlier, theirs) for earlier in dissenters):
            return "caught", hop
        dissenters.append(theirs)
    return "unresolved", None


def agree(candidate: Outputs, reference: Outputs) -> bool:
    """Whether `candidate` passes the judge against `reference`, row by row, at the coarser of their dtypes
    (swarm/client/audit_judge.py: two float32 servers must agree far more closely than a bfloat16 one)."""
    from swarm.client.audit_judge import coarser, fingerprint, judge

    (ours, our_dtype), (theirs, their_dtype) = candidate, reference
    if ours.shape != theirs.shape:
        return False
    precision = coarser(our_dtype, their_dtype)
    return all(judge(fingerprint(row), fingerprint(other), precision).honest for row, other in zip(ours, theirs))
