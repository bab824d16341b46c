"""Streaming text: stop sequences matched on decoded text across token boundaries, never shown half.

A StopMatcher sits after the incremental detokenizer (swarm.client.IncrementalDetokenizer, which never
splits a UTF-8 character): it holds back any tail of the text that could still grow into a stop sequence,
and releases it as soon as it cannot.
"""

from __future__ import annotations

from typing import Optional, Sequence


class StopMatcher:
    def __init__(self, stop_sequences: Sequence[str], include_stop: bool):
        self.stops = [stop for stop in stop_sequences if stop]
        self.include_stop = include_stop  # Petals clients expect the stop sequence in the text; OpenAI's don't
        self.held = ""

    def push(self, text: str) -> tuple[str, Optional[str]]:
        """Add new text; return (text safe to show now, the stop sequence if one just completed)."""
        self.held += text
        found = [(self.held.find(stop), stop) for stop in self.stops if stop in self.held]
        if found:
            index, stop = min(found)
            shown = self.held[: index + len(stop)] if self.include_stop else self.held[:index]
            self.held = ""
            return shown, stop
        keep = self._longest_partial_stop()
        shown, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return shown, None

    def flush(self) -> str:
        """The end of the reply: whatever was held back is text after all."""
        shown, self.held = self.held, ""
        return shown

    def _longest_partial_stop(self) -> int:
        """Length of the longest tail of the held text that is a proper prefix of some stop sequence."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(self.held)), best, -1):
                if self.held.endswith(stop[:length]):
                    best = length
                    break
        return best
