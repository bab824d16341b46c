"""Who an audit convicts (swarm/client/audits.py referee), on outputs made up here: the judge's verdicts decide (at
the coarser of two servers' dtypes), opinions are asked lazily, and a liar among the auditors neither convicts an
honest hop nor shields a lying one."""

import torch

from swarm.client.audits import referee

HONEST = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(0))
LIE = HONEST + torch.randn(HONEST.shape, generator=torch.Generator().manual_seed(1))  # far from the honest outputs
OTHER_LIE = HONEST * -1.0


class Opinions:
    """Other servers' recomputations (peer, outputs, dtype), counting how many were asked."""

    def __init__(self, *opinions):
        self.opinions, self.asked = list(opinions), 0

    def __iter__(self):
        for peer, outputs in self.opinions:
            self.asked += 1
            yield peer, outputs, "float32"


def judged(claimed, *opinions, dtype="float32"):
    return referee("hop", (claimed, dtype), iter(Opinions(*opinions)))


def test_an_honest_hop_passes_on_the_first_opinion_alone():
    opinions = Opinions(("auditor", HONEST.clone()), ("referee", HONEST.clone()))
    assert referee("hop", (HONEST, "float32"), iter(opinions)) == ("passed", None)
    assert opinions.asked == 1  # a referee only after a disagreement


def test_two_opinions_agreeing_against_the_hop_convict_it():
    assert judged(LIE, ("auditor", HONEST), ("referee", HONEST)) == ("caught", "hop")


def test_a_lying_auditor_is_convicted_by_a_referee_siding_with_the_hop():
    assert judged(HONEST, ("auditor", LIE), ("referee", HONEST)) == ("caught", "auditor")


def test_a_lying_auditor_against_a_lying_hop_waits_for_two_honest_opinions():
    opinions = Opinions(("liar", OTHER_LIE), ("honest", HONEST), ("honest2", HONEST))
    assert referee("hop", (LIE, "float32"), iter(opinions)) == ("caught", "hop") and opinions.asked == 3


def test_no_agreement_or_no_answer_is_unresolved():
    assert judged(LIE, ("auditor", HONEST), ("referee", OTHER_LIE)) == ("unresolved", None)
    assert judged(LIE, ("auditor", None), ("referee", None)) == ("unresolved", None)
    assert judged(LIE, ("gone", None), ("auditor", HONEST), ("referee", HONEST)) == ("caught", "hop")


def test_outputs_of_another_shape_or_not_finite_never_agree():
    assert judged(HONEST[:, :-1], ("auditor", HONEST), ("referee", HONEST)) == ("caught", "hop")
    nan = HONEST.clone()
    nan[0, 3, 0] = float("nan")
    assert judged(nan, ("auditor", HONEST), ("referee", HONEST)) == ("caught", "hop")


def test_a_bfloat16_servers_rounding_passes_where_float32_servers_must_agree_closer():
    rounded = HONEST.bfloat16().float()  # what a bfloat16 server's outputs differ by: about 0.4% per value
    assert judged(rounded, ("auditor", HONEST), dtype="bfloat16") == ("passed", None)
    assert judged(rounded, ("auditor", HONEST), ("referee", HONEST), dtype="float32") == ("caught", "hop")


def test_the_audit_rate_is_read_checked_and_off_by_default():
    import pytest

    from config import SwarmSettings

    assert SwarmSettings.from_env({}).audit_rate == 0.0
    assert SwarmSettings.from_env({"AUDIT_RATE": "0.3"}).audit_rate == 0.3
    for bad in ("2", "-0.1", "nan"):
        with pytest.raises(ValueError, match="AUDIT_RATE"):
            SwarmSettings.from_env({"AUDIT_RATE": bad})
