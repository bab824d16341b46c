"""A request's output stream: what the engine loop hands over per token, and the reader that turns it into text.

    engine loop --put(Token), ..., finish(reason) / fail(error)--> OutputStream --read()--> ReplyReader --> Delta

The loop only appends token ids (with their logprobs, if asked) and never waits for a reader. Everything that is a
request's own work happens in the request's thread, off the tick's path: detokenizing, matching stop sequences,
formatting logprobs. A reader that lags finds several tokens at once, and makes one delta of them.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from gateway.engine.stops import StopMatcher
from swarm.client import stage_clock

DETOKENIZER_CONTEXT = 8  # tokens of history that let the first new token decode as it would mid-text
MERGE_BACKLOG = 16  # tokens a reader may lag behind by before it gets them as one delta
IDLE_POLL_SECONDS = 0.25  # how often a reader waiting for tokens asks whether its client is gone


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the likeliest tokens at this step, best first


@dataclass(frozen=True)
class Delta:
    text: str
    token_count: int  # tokens generated for this piece of text
    finish_reason: Optional[str] = None  # "stop" (end of sequence or a stop sequence), "length", "cancelled"
    logprobs: tuple[TokenLogprob, ...] = ()
    stop_sequence: Optional[str] = None  # which of the request's stop sequences ended the reply (Anthropic says)


@dataclass(frozen=True)
class Token:
    """One generated token, as the engine loop hands it over."""

    id: int
    logprob: Optional[TokenLogprob] = None
    finish_reason: Optional[str] = None  # the reply ends with it: "stop" (a stop token, a finished grammar), "length"
    stop_token: bool = False  # an end-of-sequence token: it ends the reply and shows no text


class OutputStream:
    """Tokens from the engine loop to one request's reader; safe between those two threads."""

    def __init__(self):
        self._items: deque = deque()
        self._ready = threading.Condition()
        self.error: Optional[BaseException] = None
        self.ended = False
        self._put_at = 0.0  # when the oldest unread token came (stage_clock.py: "reader_wake")

    def put(self, *tokens: Token) -> None:
        with self._ready:
            self._items.extend(tokens)
            self._put_at = self._put_at or stage_clock.now()
            self._ready.notify()

    def fail(self, error: BaseException) -> None:
        with self._ready:
            self.error, self.ended = error, True
            self._ready.notify()

    def end(self) -> None:
        with self._ready:
            self.ended = True
            self._ready.notify()

    def read(self, timeout: float) -> list[Token]:
        """Every token that has come (none after `timeout` seconds); raises the loop's error once they are read."""
        with self._ready:
            if not self._items and not self.ended:
                self._ready.wait(timeout)
            tokens = list(self._items)
            self._items.clear()
            if tokens:
                stage_clock.CLOCK.add("reader_wake", stage_clock.now() - self._put_at)
                self._put_at = 0.0
            if not tokens and self.error is not None:
                raise self.error
            return tokens


class ReplyReader:
    """A reply's text from its tokens: detokenized, its stop sequences matched across tokens and never shown half.
    `abort(kept)` tells the engine loop where the reply ends when the reader ends it (a stop sequence, a client
    gone, a stop message): it is called exactly once in that case, and the loop settles the session there."""

    def __init__(self, stream: OutputStream, detokenizer, stopper: StopMatcher, abort: Callable[..., None],
                 cancelled: Callable[[], bool], on_token: Callable[[bool], None]):
        self.stream, self.detokenizer, self.stopper = stream, detokenizer, stopper
        self.abort, self.cancelled, self.on_token = abort, cancelled, on_token
        self.count = 0  # tokens read
        self._cancelled = False

    def deltas_of(self, session, sequence) -> Iterator[Delta]:
        """deltas(), then the session forgets the reply (unless it is still settling: its next use waits)."""
        try:
            yield from self.deltas()
        finally:
            if sequence.settled.is_set():
                session.abort_reply = None

    def deltas(self) -> Iterator[Delta]:
        """A delta per token while the reader keeps up; one delta of all of them once it lags by more than
        MERGE_BACKLOG tokens (a slow client: fewer, larger frames)."""
        backlog: deque[Token] = deque()
        while True:
            if not backlog:
                backlog.extend(self.stream.read(IDLE_POLL_SECONDS))
                if not backlog:
                    if self.stream.ended:
                        return  # ended by the loop with no token after the last delta
                    if self.cancelled():
                        yield self._cancel()
                        return
                    continue
            taken = len(backlog) if len(backlog) > MERGE_BACKLOG else 1
            delta = self._merged([backlog.popleft() for _ in range(taken)])
            if delta.token_count or delta.finish_reason is not None:
                try:
                    yield delta
                except GeneratorExit:  # the caller stops reading: the session ends at the last token it got
                    if delta.finish_reason is None:  # (settled in the loop: the session's next use waits for it)
                        self.abort(self.count, wait=False)
                    raise
                if delta.finish_reason is not None:
                    return
            if self._cancelled:
                yield self._cancel()
                return

    def _cancel(self) -> Delta:
        self.abort(self.count)
        return Delta(self._remaining_text(), 0, "cancelled")

    def _merged(self, tokens: list[Token]) -> Delta:
        """The tokens a lagging reader found at once, as one delta: up to one that ends the reply, or up to a
        cancel (asked before each token, as a reader of one token at a time would)."""
        texts, logprobs = [], []
        for token in tokens:
            if self.cancelled():
                self._cancelled = True
                break
            self.count += 1
            self.on_token(self.count == 1)
            if token.logprob is not None:
                logprobs.append(token.logprob)
            text, finish, matched = self._text_of(token)
            texts.append(text)
            if finish is not None:
                if matched is not None:  # the reader ends the reply: the loop may have gone past it
                    self.abort(self.count)
                return Delta("".join(texts), len(texts), finish, tuple(logprobs), stop_sequence=matched)
        return Delta("".join(texts), len(texts), None, tuple(logprobs))

    def _text_of(self, token: Token) -> tuple[str, Optional[str], Optional[str]]:
        """(text, finish reason, matched stop sequence) of one token."""
        if token.stop_token:
            return self._remaining_text(), "stop", None
        text, matched = self.stopper.push(self.detokenizer.push(token.id))
        if matched:
            return text, "stop", matched
        if token.finish_reason is not None:
            return text + self._remaining_text(), token.finish_reason, None
        return text, None, None

    def _remaining_text(self) -> str:
        """At the end of a reply, the text held back for an incomplete character or a possible stop sequence."""
        text, matched = self.stopper.push(self.detokenizer.flush())
        return text if matched else text + self.stopper.flush()


def inputs_taken(sequence) -> Iterator[Delta]:
    """A reply of no tokens: its inputs taken into the servers' caches, then one delta that says so."""
    sequence.wait()
    yield Delta("", 0, "length")


def detokenizer(tokenizer, context: list[int]):
    """Text of new tokens, as it reads after `context` (its last few tokens)."""
    from swarm.client import IncrementalDetokenizer

    return IncrementalDetokenizer(tokenizer, context=context[-DETOKENIZER_CONTEXT:])
