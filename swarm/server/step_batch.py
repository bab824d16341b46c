"""A message's steps on a block server, as one unit: many sessions' steps (swarm/server/handler.py's rpc_steps
and rpc_push) planned on the event loop without a task, a lock or a wake-up of their own, and submitted to the
compute thread as one batch (swarm/server/batching.py), whose one future brings back every step's outputs.

Only the rare steps wait apart: a step whose session has a pushed step still running waits for it (steps of a
session never overlap; its result may answer the step), and a step whose pages need room the cache budget does
not have now waits for it (ServerSession.begin_step_after_room). Those go in a second batch.
"""

from __future__ import annotations

import asyncio

from typing import Optional

import torch

from swarm.protocol import SwarmError
from swarm.server.batching import Job
from swarm.server.pushes import awaited_push
from swarm.server.sessions import RoomNeeded, ServerSession


async def run_steps(submit_batch, items: list[tuple[ServerSession, Optional[torch.Tensor], dict]]) -> list:
    """Each step's outputs (rows, length, hidden), or its error, in order. `submit_batch(jobs, on_settled)` is
    the scheduler's. A flowing step (hidden None: its inputs come pushed, see pushes.awaited_push) waits for its
    push beside the others."""
    results: list = [None] * len(items)
    flowing = [index for index, (_, hidden, _) in enumerate(items) if hidden is None]
    if not flowing:
        await _run_sent(submit_batch, items, list(range(len(items))), results)
        return results
    sent = [index for index, (_, hidden, _) in enumerate(items) if hidden is not None]
    outputs = await asyncio.gather(_run_sent(submit_batch, items, sent, results),
                                   *(awaited_push(items[index][0], items[index][2]) for index in flowing),
                                   return_exceptions=True)
    for index, output in zip(flowing, outputs[1:]):
        results[index] = output
    if isinstance(outputs[0], BaseException):
        raise outputs[0]
    return results


async def _run_sent(submit_batch, all_items: list, indices: list[int], all_results: list) -> None:
    """The steps whose inputs came with them, their results into `all_results` at their indices."""
    items = [all_items[index] for index in indices]
    results: list = [None] * len(items)
    await _run_planned(submit_batch, items, results)
    for index, result in zip(indices, results):
        all_results[index] = result


async def _run_planned(submit_batch, items: list, results: list) -> None:
    planned, apart = _plan(items, results)
    if planned:
        await _computed(submit_batch, planned, results)
    if apart:
        later = await _after_waiting(items, apart, results)
        if later:
            await _computed(submit_batch, later, results)


def start_pushed(enqueue_batch, items: list[tuple[ServerSession, torch.Tensor, dict]]) -> list:
    """Pushed steps started at once as early steps, in one batch, without waiting for them; each push's
    refusal, or None (taken, or left to the client's copy)."""
    refusals, started = [], []
    for session, hidden, metadata in items:
        try:
            early = session.pushed(hidden, metadata)
        except SwarmError as error:
            refusals.append(error)
            continue
        refusals.append(None)
        if early is not None:
            started.append((session, early))
    if started:
        enqueue_batch([early.job for _, early in started],
                      lambda outputs: [session.early_settled(early, result)
                                       for (session, early), result in zip(started, outputs)])
    return refusals


def _plan(items, results: list) -> tuple[list, list]:
    """(index, session, job) of the steps that start now, and (index, the pushed step it waits for or None) of
    those that wait apart."""
    planned, apart = [], []
    for index, (session, hidden, metadata) in enumerate(items):
        try:
            early = session.take_early(metadata)
            if early is not None:
                apart.append((index, early))
                continue
            planned.append((index, session, session.begin_step(hidden, metadata)))
        except RoomNeeded:
            apart.append((index, None))
        except SwarmError as error:
            results[index] = error
    return planned, apart


async def _after_waiting(items, apart: list, results: list) -> list:
    """The steps that waited: for a pushed step (whose result may answer them), or for room."""
    pending = [early.result for _, early in apart if early is not None and not early.result.done()]
    if pending:
        await asyncio.wait(pending)
    waits = []
    for index, early in apart:
        session, hidden, metadata = items[index]
        if early is not None and early.step_id == metadata.get("step_id") and early.answers(hidden, metadata):
            results[index] = early.result.result()
        else:
            waits.append((index, session, _begin(session, hidden, metadata)))
    began = await asyncio.gather(*(begin for _, _, begin in waits), return_exceptions=True)
    planned = []
    for (index, session, _), job in zip(waits, began):
        if isinstance(job, Job):
            planned.append((index, session, job))
        else:
            results[index] = job
    return planned


async def _begin(session: ServerSession, hidden: torch.Tensor, metadata: dict) -> Job:
    try:
        return session.begin_step(hidden, metadata)
    except RoomNeeded:
        return await session.begin_step_after_room(hidden, metadata)


async def _computed(submit_batch, planned: list, results: list) -> None:
    sessions, jobs = [session for _, session, _ in planned], [job for _, _, job in planned]

    def settled(outputs: list) -> None:  # on the event loop, also when the caller stopped waiting
        for session, job, output in zip(sessions, jobs, outputs):
            session.step_settled(job, output)

    for (index, _, _), output in zip(planned, await submit_batch(jobs, settled)):
        results[index] = output
