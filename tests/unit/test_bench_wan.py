"""The churn harness's and the WAN benchmark's arithmetic (bench/churn/, bench/wan.py): spans and their cover,
the churn's choice of who leaves, the servers' timeline, chains chosen against the best, the summary and the
WAN table's targets. No process is started (tests/integration/test_churn_harness.py runs the harness)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from bench.churn.__main__ import parse_options
from bench.churn.chains import LiveServer, best_chain, judge, read_choices, step_seconds
from bench.churn.churn import Churner
from bench.churn.fleet import Fleet, FleetEvent, ServerPlan, cover, plan_latencies, plan_spans, seconds_per_block
from bench.churn.summary import chain_figures, distribution, targets
from bench.wan import TimedReply, decode_rate, identical
from swarm.client.routing import ChainLink
from bench.wan import targets as wan_targets


def test_planned_spans_hold_every_block_as_often_as_asked_and_vary():
    spans = plan_spans(16, 24, 2, random.Random(0))
    assert len(spans) == 16 and min(cover(spans, 24)) >= 2
    assert all(0 <= start < end <= 24 for start, end in spans)
    assert len({end - start for start, end in spans}) > 1 and len(set(spans)) > 8  # chains of many shapes
    assert plan_spans(16, 24, 2, random.Random(0)) == spans  # seeded
    with pytest.raises(ValueError, match="add servers"):
        plan_spans(2, 24, 3, random.Random(0))


def test_round_trips_spread_around_the_mean():
    latencies = plan_latencies(100, 50.0, 0.5, random.Random(1))
    assert all(25 <= latency <= 75 for latency in latencies) and len(set(latencies)) > 10


def fleet_of(spans: dict[str, tuple[int, int]], ready: set[str]) -> Fleet:
    """A fleet whose servers are only planned (no process): what the churn's choices look at."""
    fleet = Fleet("model", [], Path("/nonexistent"), [])
    for name, (start, end) in spans.items():
        fleet.plans[name] = ServerPlan(name, start, end, 50, Path(f"/nonexistent/{name}.key"))
        fleet.live[name] = None
        if name in ready:
            fleet.peer_ids[name] = f"peer-{name}"
            fleet.ready.add(name)
    return fleet


def test_churn_never_takes_away_the_last_server_of_a_block():
    # only "b" has a twin ("c" holds 0:8 too); "a" alone holds 8:16; "d" is not ready yet
    fleet = fleet_of({"a": (0, 16), "b": (0, 8), "c": (0, 8), "d": (0, 16)}, ready={"a", "b", "c"})
    churner = Churner(fleet, 1.0, 4, 16, (25, 75), Path("/nonexistent"), random.Random(0))
    assert {churner._leaver() for _ in range(20)} <= {"b", "c"}  # "a" would leave 8:16 unserved once "d" is not ready
    alone = fleet_of({"a": (0, 16)}, ready={"a"})
    assert Churner(alone, 1.0, 4, 16, (25, 75), Path("/nonexistent"), random.Random(0))._leaver() is None


def test_churn_keeps_the_population_near_its_target():
    fleet = fleet_of({f"s{number}": (0, 16) for number in range(2)}, ready={"s0", "s1"})
    churner = Churner(fleet, 1.0, 4, 16, (25, 75), Path("/nonexistent"), random.Random(0))
    assert churner.act("sigterm") is None and churner.act("kill") is None  # 2 live: at target - 2 already


def test_the_timeline_knows_who_was_live_when():
    fleet = fleet_of({}, ready=set())
    fleet.events = [FleetEvent(0.0, "start", "a", "ready", 5.0), FleetEvent(0.0, "start", "b", "ready", 6.0),
                    FleetEvent(10.0, "kill", "a"), FleetEvent(12.0, "rejoin", "a", "ready", 3.0),
                    FleetEvent(20.0, "join", "c", "failed")]
    assert sorted(fleet.live_runs()) == [("a", 5.0, 10.0), ("a", 15.0, math.inf), ("b", 6.0, math.inf)]


SERVERS = [LiveServer("near", 0, 8, 0.025, 1e-4), LiveServer("far", 0, 8, 0.075, 1e-4),
           LiveServer("tail", 4, 8, 0.030, 1e-4), LiveServer("head", 0, 4, 0.030, 1e-4)]


def test_the_best_chain_is_the_one_with_the_least_round_trips():
    assert best_chain(SERVERS, 0, 8) == [ChainLink("near", 0, 8)]
    assert step_seconds([ChainLink("near", 0, 8)], SERVERS) == pytest.approx(0.025 + 8e-4)
    assert best_chain(SERVERS[2:], 0, 8) == [ChainLink("head", 0, 4), ChainLink("tail", 4, 8)]
    assert best_chain(SERVERS[2:3], 0, 8) is None  # nobody holds 0:4
    slow = [LiveServer("near", 0, 8, 0.025, 0.1), *SERVERS[1:]]  # compute can outweigh a round trip too
    assert best_chain(slow, 0, 8) == [ChainLink("head", 0, 4), ChainLink("tail", 4, 8)]  # 60.8 ms, not 825 nor 75.8


def test_a_server_s_compute_per_block_comes_from_its_ready_line():
    line = ("ready: blocks 0:8 of churn-16 as peer QmX, 1.2 MiB float32 on cpu, 250.0 tokens/s, cache 32768 tokens, "
            "simulated latency 50 ms")
    assert seconds_per_block(line, 8) == pytest.approx(1 / 2000)
    assert seconds_per_block("ready: something else", 8) == 0.0


def test_choices_are_judged_against_the_servers_live_at_their_time(tmp_path):
    log = tmp_path / "gateway.log"
    log.write_text(
        "2026-11-25 09:00:00,000 INFO swarm.client.swarm_client [abc] routed blocks 0:8 of m through far[0:8]\n"
        "2026-11-25 09:00:01,500 INFO swarm.client.swarm_client [-] routed blocks 0:8 of m through head[0:4] tail[4:8]\n"
        "2026-11-25 09:00:02,000 WARNING something else entirely\n"
        "2026-11-25 09:00:03,000 INFO swarm.client.swarm_client [-] routed blocks 4:8 of m through gone[4:8]\n")
    choices = read_choices(log, gateway=1)
    assert [choice.hops for choice in choices] == [(ChainLink("far", 0, 8),), (ChainLink("head", 0, 4), ChainLink("tail", 4, 8)),
                                                   (ChainLink("gone", 4, 8),)]
    assert choices[1].at - choices[0].at == pytest.approx(1.5) and choices[2].start == 4
    verdicts = judge(choices, lambda at: SERVERS)
    assert verdicts[0].ratio == pytest.approx(75.8 / 25.8)  # 75 ms where 25 ms would do
    assert verdicts[1].ratio == pytest.approx(60.8 / 25.8)
    assert verdicts[2].ratio is None and verdicts[2].chosen == math.inf  # through a server no longer live
    figures = chain_figures(verdicts)
    assert figures["judged"] == 2 and figures["through_a_server_gone"] == 1 and figures["within_10_percent"] == 0.0
    assert figures["through_a_server_gone_share"] == pytest.approx(1 / 3, abs=1e-4)
    assert figures["ratio_chosen_to_best"]["max"] == pytest.approx(75.8 / 25.8, rel=1e-3)


def test_distributions_and_the_churn_targets():
    assert distribution([1.0, 2.0, 3.0, None, math.inf]) == {"count": 3, "median": 2.0, "p90": 2.8, "max": 3.0}
    summary = {"sessions": {"completed": 3, "total": 4, "equal_to_local": 3},
               "chains": {"within_10_percent": 1.0, "through_a_server_gone_share": 0.05}}
    assert [passed for _, passed in targets(summary)] == [False, True, True, False]
    summary["chains"]["through_a_server_gone_share"] = 0.0199
    assert targets(summary)[-1] == ("under 2% of chains through a server already gone", True)


def test_quick_mode_shortens_the_run_but_flags_win():
    options = parse_options(["--quick", "--servers", "6"])
    assert (options.servers, options.duration, options.blocks) == (6, 60.0, 16)
    assert parse_options([]).servers == 16 and parse_options([]).duration == 300.0
    with pytest.raises(SystemExit):
        parse_options(["--servers", "2"])


def reply(text: str, tokens: int, first: float, last: float) -> dict:
    return {"text": text, "tokens": tokens, "sent": 0.0, "first": first, "last": last, "error": ""}


def wan_result(latency: int, plain_rate: float, speculative_rate: float, same: bool = True) -> dict:
    single = {workload: {"plain": {"decode_tok_s": plain_rate, "replies": [reply("a", 9, 0, 1)]},
                         "speculative": {"decode_tok_s": speculative_rate,
                                         "replies": [reply("a" if same else "b", 9, 0, 1)]}}
              for workload in ("copy-heavy", "chat")}
    return {"latency_ms": latency, "single": single,
            "concurrency": {"plain": {"aggregate_tok_s": 40.0 if latency == 0 else 34.0}}}


def test_decode_rate_counts_the_tokens_after_the_first_over_their_time():
    replies = [TimedReply("", 11, 0.0, 1.0, 3.0), TimedReply("", 5, 0.0, 1.0, 2.0), TimedReply("", 1, 0.0, 1.0, 1.0)]
    assert decode_rate(replies) == pytest.approx((10 + 4) / 3.0)
    assert decode_rate([]) == 0.0


def test_the_wan_targets_compare_speculation_at_50_ms_and_check_outputs_are_identical():
    results = [wan_result(0, 10.0, 12.0), wan_result(50, 4.0, 8.5)]
    verdicts = {label: (passed, figure) for label, passed, figure in wan_targets(results)}
    assert verdicts["speculation >= 2.0x on copy-heavy at 50 ms per hop"] == (True, "2.12x")
    assert verdicts["speculation >= 1.3x on chat at 50 ms per hop"][0] is True
    assert verdicts["outputs identical with and without speculation"][0] is True
    assert verdicts["plain: sessions' aggregate tok/s at 50 ms >= 0.8x at 0 ms"] == (True, "0.85x")
    assert verdicts["speculative: sessions' aggregate tok/s at 50 ms >= 0.8x at 0 ms"][0] is None  # not run
    assert identical(wan_result(50, 4.0, 8.5, same=False)) == ["50 ms, copy-heavy, reply 0", "50 ms, chat, reply 0"]


def test_routing_cost_measures_a_real_signed_record_and_routes_synthetic_swarms():
    from bench.routing_cost import choose_chain_seconds, servers_searched, signed_record_bytes, synthetic_swarm
    from swarm.client.routing import choose_chain
    from swarm.protocol import missing_ranges
    from swarm.trust import MAX_VALUE_BYTES

    assert 500 < signed_record_bytes() < MAX_VALUE_BYTES  # an RSA owner key and signature, and the record
    for servers, blocks in ((16, 24), (100, 80)):
        remote, rtt, measured = synthetic_swarm(servers, blocks, 0.3, random.Random(0))
        assert len(remote) == servers and not missing_ranges(remote, blocks)
        chain = choose_chain(remote, blocks, "synthetic", measured=measured, rtt=rtt)
        assert chain[0].start == 0 and chain[-1].end == blocks
    assert choose_chain_seconds(16, 24, 0.3, repeats=2) > 0
    assert choose_chain_seconds(16, 24, 0.3, repeats=1, flowing=True) > 0
    assert 2 <= servers_searched(16, 24, 0.3) <= 16  # no single server of the 16 holds every block
