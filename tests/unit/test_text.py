from gateway.engine.stops import StopMatcher


def feed(matcher, pieces):
    shown, stop = [], None
    for piece in pieces:
        text, stop = matcher.push(piece)
        shown.append(text)
        if stop:
            break
    return shown, stop


def test_stop_across_token_boundaries_is_never_shown_half():
    shown, stop = feed(StopMatcher(["\n\nHuman:"], include_stop=True), ["Hi", " there", "\n", "\nHu", "man", ":", " more"])
    assert stop == "\n\nHuman:"
    assert shown == ["Hi", " there", "", "", "", "\n\nHuman:"]


def test_stop_can_be_excluded():
    shown, stop = feed(StopMatcher(["END"], include_stop=False), ["abc E", "N", "D tail"])
    assert "".join(shown) == "abc " and stop == "END"


def test_held_text_is_released_when_it_diverges():
    matcher = StopMatcher(["\n\nHuman:"], include_stop=True)
    assert matcher.push("a\n\nHu") == ("a", None)
    assert matcher.push("go") == ("\n\nHugo", None)
    assert matcher.push("\n") == ("", None)
    assert matcher.flush() == "\n"


def test_earliest_of_several_stops_wins():
    shown, stop = feed(StopMatcher(["xyz", "b"], include_stop=True), ["a xyz b"])
    assert shown == ["a xyz"] and stop == "xyz"


def test_no_stops_passes_text_through():
    matcher = StopMatcher([], include_stop=True)
    assert matcher.push("abc") == ("abc", None)
    assert matcher.flush() == ""
