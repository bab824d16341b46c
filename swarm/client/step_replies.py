"""What a step channel does with a server's reply to a message (swarm/client/step_channel.py): each step's output
or error to its step, and the message's stage times to the stage clock."""

from __future__ import annotations

from typing import Optional

import torch

from swarm.client.stage_clock import CLOCK, now
from swarm.protocol import ServerUnavailableError, SwarmError, error_from_wire
from swarm.wire import unstacked


class MalformedOutputsError(ServerUnavailableError):
    """A server answered a hop with what cannot be its outputs (not the inputs' shape and dtype, or not finite):
    the session bans it and goes on elsewhere, and no such tensor goes further (a wrong shape in the LM head,
    which merges the rows of concurrent sessions, would fail every one of them)."""

    code = "malformed_outputs"


def blocks_of(step) -> str:
    return step.blocks.removeprefix("blocks ")


def clock_answer(sent: float, steps: list, metadata: dict) -> None:
    """A message's round trip (it left at `sent`), and what the server says it spent of it: the rest is the
    transport's (both ends' libp2p daemons, the framing, the sockets)."""
    round_trip, count, blocks = now() - sent, len(steps), blocks_of(steps[0])
    CLOCK.add("hop_round_trip", round_trip, count, blocks)
    timings = metadata.get("timings")
    if not isinstance(timings, dict):  # a server is free not to say
        return
    CLOCK.add_server_timings(timings, blocks, count)
    compute, total = timings.get("compute"), timings.get("total")
    if isinstance(compute, float) and 0.0 <= compute <= round_trip:  # once per message: a server's busy time
        CLOCK.add("server_busy", compute, 1, blocks)
    if isinstance(total, float) and 0.0 <= total <= round_trip:
        CLOCK.add("hop_transport", round_trip - total, count, blocks)


def deliver(steps: list, tensors: list[torch.Tensor], metadata: dict, peer_id: str) -> None:
    """A reply's outputs and errors to its steps, in order: the outputs of the steps that succeeded come stacked
    in one tensor."""
    errors = step_errors(metadata, len(steps), peer_id)
    try:
        outputs = unstacked(tensors, [step.shape for step, error in zip(steps, errors) if not error])
    except SwarmError as error:
        reason = f"server {peer_id} answered with outputs that are not its steps' ({error})"
        outputs, errors = [], [MalformedOutputsError(reason) for _ in steps]
    if outputs and not torch.isfinite(tensors[0]).all():  # once per message; which steps, only when it fails
        outputs = [output if torch.isfinite(output).all() else MalformedOutputsError(
            f"server {peer_id} answered with outputs that are not finite") for output in outputs]
    outputs = iter(outputs)
    results = metadata.get("results")
    results = results if isinstance(results, list) and len(results) == len(steps) else [{}] * len(steps)
    for step, error, result in zip(steps, errors, results):
        if error is not None:
            fail(step, error)
        elif isinstance(output := next(outputs), MalformedOutputsError):
            fail(step, output)
        else:
            if step.hidden is None:  # a flowing step: with what its server says its push carried
                output = (output, result.get("pushed"))
            if not step.result.done():  # else its session gave up waiting
                step.result.set_result(output)


def step_errors(metadata: dict, steps: int, peer_id: str) -> list[Optional[SwarmError]]:
    """Each step's error (None: it succeeded), one exception each (each is raised in its own session); a
    reply that does not add up fails every step."""
    refusal = error_from_wire(metadata)
    if refusal is not None:  # the whole message was refused
        return [type(refusal)(str(refusal)) for _ in range(steps)]
    results = metadata.get("results")
    well_formed = isinstance(results, list) and len(results) == steps and all(isinstance(r, dict) for r in results)
    errors = [error_from_wire(result) for result in results] if well_formed else []
    if not well_formed:
        return [ServerUnavailableError(f"server {peer_id} sent a malformed reply") for _ in range(steps)]
    return errors


def fail(step, error: Exception) -> None:
    if not step.result.done():
        step.result.set_exception(error)
