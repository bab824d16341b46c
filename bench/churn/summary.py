"""A churn run's summary: one JSON-able dict (sessions, replies equal to the local model's, server events,
failovers, chains chosen against the best possible), and its printout with the issue's targets."""

from __future__ import annotations

import argparse
import math
from typing import Sequence

from bench.churn.chains import ChoiceVerdict
from bench.churn.fleet import Fleet
from bench.churn.sessions import SessionResult, first_errors
from bench.stats import percentile

WITHIN = 1.10  # the target: chosen chains within 10% of the best expected step time
GONE_SHARE = 0.02  # the target: under 2% of chains chosen through a server already gone (killed, or stopped)


def distribution(values: Sequence[float]) -> dict:
    values = [value for value in values if value is not None and math.isfinite(value)]
    if not values:
        return {"count": 0, "median": None, "p90": None, "max": None}
    return {"count": len(values), "median": round(percentile(values, 50), 4), "p90": round(percentile(values, 90), 4),
            "max": round(max(values), 4)}


def summarize(options: argparse.Namespace, fleet: Fleet, results: Sequence[SessionResult], unfinished: int,
              counters: Sequence[dict], verdicts: Sequence[ChoiceVerdict], skipped_turns: int,
              sessions_began: float) -> dict:
    return {
        "options": {key: (str(value) if value is not None and not isinstance(value, (int, float, bool)) else value)
                    for key, value in vars(options).items()},
        "sessions": session_figures(results, unfinished),
        "servers": server_figures(fleet, skipped_turns, sessions_began),
        "failovers": {"total": sum(counter["swarm_client_failovers_total"] for counter in counters),
                      "retries": sum(counter["swarm_client_retries_total"] for counter in counters),
                      "per_gateway": list(counters)},
        "chains": chain_figures(verdicts),
    }


def session_figures(results: Sequence[SessionResult], unfinished: int) -> dict:
    completed = [result for result in results if result.ok]
    return {
        "total": len(results) + unfinished, "completed": len(completed),
        "failed": len(results) - len(completed), "unfinished": unfinished,
        "equal_to_local": sum(result.equal for result in completed),
        "per_gateway": [sum(result.ok for result in results if result.gateway == number) for number in (0, 1)],
        "seconds": distribution([result.seconds for result in completed]),
        "errors": first_errors(results),
        "mismatches": [{"prompt": result.prompt, "gateway": result.gateway, "text": result.text}
                       for result in completed if not result.equal][:3],
    }


def server_figures(fleet: Fleet, skipped_turns: int, sessions_began: float) -> dict:
    churn = [event for event in fleet.events if event.at >= sessions_began]
    joins = [event for event in churn if event.action in ("join", "rejoin")]
    return {
        "initial": sum(event.action == "start" for event in fleet.events),
        "live_at_end": len(fleet.live),
        "events": {action: sum(event.action == action for event in churn)
                   for action in ("sigterm", "kill", "join", "rejoin")},
        "skipped_turns": skipped_turns,
        "joins_ready": sum(event.outcome == "ready" for event in joins),
        "joins_failed": [f"{event.server}: {event.detail}" for event in joins if event.outcome == "failed"],
        "joins_pending": sum(event.outcome == "pending" for event in joins),
        "seconds_to_ready": distribution([event.ready_after for event in joins]),
        "timeline": [{"at": event.at, "action": event.action, "server": event.server, "outcome": event.outcome}
                     for event in fleet.events],
        "round_trips_ms": {name: plan.latency_ms for name, plan in fleet.plans.items()},
        "compute_ms_per_block": {name: round(seconds * 1000, 3) for name, seconds in fleet.seconds_per_block.items()},
    }


def chain_figures(verdicts: Sequence[ChoiceVerdict]) -> dict:
    judged = [verdict.ratio for verdict in verdicts if verdict.ratio is not None]
    gone = sum(not math.isfinite(verdict.chosen) for verdict in verdicts)
    return {
        "choices": len(verdicts),
        "judged": len(judged),
        "through_a_server_gone": gone,
        "through_a_server_gone_share": round(gone / len(verdicts), 4) if verdicts else None,
        "while_blocks_missing": sum(verdict.best is None for verdict in verdicts),
        "ratio_chosen_to_best": distribution(judged),
        "within_10_percent": round(sum(ratio <= WITHIN + 1e-9 for ratio in judged) / len(judged), 4) if judged else None,
        "hops": distribution([len(verdict.choice.hops) for verdict in verdicts]),
    }


def print_summary(summary: dict) -> None:
    sessions, servers, chains = summary["sessions"], summary["servers"], summary["chains"]
    ratio = chains["ratio_chosen_to_best"]
    print(f"\nsessions: {sessions['completed']} completed, {sessions['failed']} failed, {sessions['unfinished']} "
          f"unfinished of {sessions['total']} (per gateway: {sessions['per_gateway']}); equal to the local model: "
          f"{sessions['equal_to_local']} of {sessions['completed']}; seconds p50/p90/max: "
          f"{sessions['seconds']['median']} / {sessions['seconds']['p90']} / {sessions['seconds']['max']}")
    for error in sessions["errors"]:
        print(f"  failed: {error}")
    events = servers["events"]
    print(f"servers: {servers['initial']} at the start, {servers['live_at_end']} at the end; {events['sigterm']} "
          f"SIGTERM, {events['kill']} kill -9, {events['join']} new joins, {events['rejoin']} rejoins (same "
          f"identity); joins ready: {servers['joins_ready']}, failed: {len(servers['joins_failed'])}, "
          f"median seconds to ready: {servers['seconds_to_ready']['median']}")
    print(f"failovers: {summary['failovers']['total']:.0f} (retries {summary['failovers']['retries']:.0f})")
    if "dht" in summary:
        dht = summary["dht"]
        print(f"routing lookups: {dht['keys_per_lookup']} keys, {dht['records_per_lookup']:.0f} records "
              f"({dht['bytes_per_lookup'] / 1000:.0f} kB) each, median {dht['seconds_median'] * 1000:.0f} ms")
    if "round_trips_measured_over_real" in summary:
        seen = summary["round_trips_measured_over_real"]
        print(f"round trips the gateways measured over the real ones: median {seen['median']}, p90 {seen['p90']}, "
              f"max {seen['max']} ({seen['count']} servers x gateways)")
    print(f"chains: {chains['choices']} chosen, {chains['judged']} judged, {chains['through_a_server_gone']} through "
          f"a server already gone ({chains['through_a_server_gone_share']}); chosen/best expected step time: median {ratio['median']}, p90 {ratio['p90']}, "
          f"max {ratio['max']}; within 10%: {chains['within_10_percent']}")
    for label, passed in targets(summary):
        print(f"{'PASS' if passed else 'FAIL'}  {label}")


def targets(summary: dict) -> list[tuple[str, bool]]:
    sessions, chains = summary["sessions"], summary["chains"]
    return [
        ("every session completes", sessions["completed"] == sessions["total"] and sessions["total"] > 0),
        ("greedy outputs equal the local model's", sessions["equal_to_local"] == sessions["completed"]),
        ("chosen chains within 10% of the best expected step time",
         chains["within_10_percent"] is not None and chains["within_10_percent"] == 1.0),
        (f"under {GONE_SHARE:.0%} of chains through a server already gone",
         chains["through_a_server_gone_share"] is not None and chains["through_a_server_gone_share"] < GONE_SHARE),
    ]
