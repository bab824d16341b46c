"""The flowing-steps benchmark's arithmetic (bench/flowing.py): its chains' spans, its map (a valid network map,
every link the same), the network floors it prints beside the figures, and its table. No process is started."""

import pytest

from bench.flowing import floors, link_map, spans, table
from swarm.network_map import parse_network_map


def test_the_chains_split_the_blocks_evenly():
    assert spans(2) == [(0, 4), (4, 8)]
    assert spans(8) == [(index, index + 1) for index in range(8)]
    with pytest.raises(ValueError, match="--hops: 3 does not divide"):
        spans(3)


def test_every_link_of_the_map_is_the_same():
    network_map = parse_network_map(link_map(50))
    assert network_map.regions == {"net"} and network_map.default_region == "net"
    assert network_map.round_trip_ms("net", "net") == 50


def test_the_floors_and_the_table():
    assert floors(8, 50) == pytest.approx({"relayed": 0.4, "flowing": 0.225})
    result = {"hops": 4, "link_ms": 50.0, "relayed_tok_s": 4.0, "flowing_tok_s": 6.0, "floor_s": floors(4, 50),
              "speculative relayed_tok_s": 8.0, "speculative flowing_tok_s": 10.0, "identical": True,
              "pushes_missed": 0}
    assert "| 4 | 50 | 4.00 | 6.00 | 1.50x | 8.00 / 10.00 | 1.25x | 200 / 125 | yes | 0 |" in table([result])
