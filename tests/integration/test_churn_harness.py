"""The churn harness (`python -m bench.churn`) in a short run: real block servers with simulated latency leaving
(SIGTERM, kill -9) and joining while sessions generate through two real gunicorn gateways. Its arithmetic is
tested in tests/unit/test_bench_wan.py; this checks that a run produces the summary it promises, with sessions
completed and equal to the local model, the churn done, and the gateways' chains read and judged."""

from __future__ import annotations

import json
import os

from bench.churn.__main__ import main


def test_a_short_churn_run_completes_sessions_and_summarises_them(tmp_path, capsys, monkeypatch):
    # the harness's local reference (transformers' generate, in this process) may have torch's inductor pin its
    # cache folder in the environment: the default it would find anyway, put back as it was when the test ends
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))  # to put back
    if not os.environ["TORCHINDUCTOR_CACHE_DIR"]:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    path = tmp_path / "summary.json"
    summary = main(["--servers", "4", "--blocks", "8", "--duration", "6", "--churn-every", "2", "--sessions", "4",
                    "--tokens", "8", "--latency", "20", "--json", str(path)])
    assert json.loads(path.read_text()) == summary
    printed = capsys.readouterr().out
    assert "sessions:" in printed and "chains:" in printed and "every session completes" in printed

    sessions, servers, chains = summary["sessions"], summary["servers"], summary["chains"]
    assert sessions["completed"] >= 4, sessions["errors"]
    assert sessions["equal_to_local"] == sessions["completed"], sessions["mismatches"]
    assert sessions["total"] == sessions["completed"] + sessions["failed"] + sessions["unfinished"]
    assert servers["initial"] == 4 and servers["events"]["sigterm"] >= 1 and servers["events"]["rejoin"] >= 1
    assert set(servers["round_trips_ms"].values()) <= set(range(10, 31))  # 20 ms +- half
    assert summary["failovers"]["total"] >= 0 and len(summary["failovers"]["per_gateway"]) == 2
    # the chains the gateways logged were read and judged against the servers live then (a warm conversation
    # may fork a new session on its chain without routing anew)
    assert chains["choices"] >= 1 and chains["judged"] >= 1
    assert set(chains["ratio_chosen_to_best"]) == {"count", "median", "p90", "max"}
    assert chains["ratio_chosen_to_best"]["median"] >= 1.0 - 1e-9  # no chain beats the best
    # the share of choices through a server already gone is reported (the target, under 2%, is a long run's)
    assert chains["through_a_server_gone_share"] == round(chains["through_a_server_gone"] / chains["choices"], 4)
    assert "of chains through a server already gone" in printed
