"""The sessions of a churn run: `--sessions` workers, each generating one greedy reply after another through the
gateways' OpenAI API (streamed, with the official `openai` client), alternating gateways, until the run's time is
up; each reply is compared with the local model's."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Sequence

from bench.churn.model import ReferenceReply

SESSION_TIMEOUT = 180.0  # a reply not finished by then counts as failed (the openai client's read timeout)


@dataclass
class SessionResult:
    worker: int
    gateway: int
    prompt: int
    began: float  # seconds since the run began
    seconds: float
    ok: bool  # the reply came (no error, some tokens)
    equal: bool  # its text equals the local model's greedy reply
    tokens: int = 0
    error: str = ""
    text: str = ""  # the reply, kept only when it differs from the local model's


class SessionWorkers:
    """`--sessions` threads generating until `deadline` (monotonic); `join()` waits for their last replies."""

    def __init__(self, count: int, gateway_urls: Sequence[str], model: str, replies: Sequence[ReferenceReply],
                 tokens: int, began: float, deadline: float):
        self.gateway_urls, self.model, self.replies, self.tokens = list(gateway_urls), model, list(replies), tokens
        self.began, self.deadline = began, deadline
        self.results: list[SessionResult] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._work, args=(worker,), daemon=True, name=f"session-{worker}")
                        for worker in range(count)]

    def start(self) -> "SessionWorkers":
        for thread in self.threads:
            thread.start()
        return self

    def join(self, timeout: float) -> int:
        """Wait for every worker's last reply, at most `timeout` seconds; the number still running after it."""
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))
        return sum(thread.is_alive() for thread in self.threads)

    def _work(self, worker: int) -> None:
        turn = 0
        while time.monotonic() < self.deadline:
            gateway, prompt = (worker + turn) % len(self.gateway_urls), (worker + turn) % len(self.replies)
            result = self.one_reply(worker, gateway, prompt)
            with self.lock:
                self.results.append(result)
            turn += 1

    def one_reply(self, worker: int, gateway: int, prompt: int) -> SessionResult:
        from openai import OpenAI

        reference = self.replies[prompt]
        sent = time.monotonic()
        client = OpenAI(base_url=self.gateway_urls[gateway], api_key="unused", timeout=SESSION_TIMEOUT, max_retries=0)
        pieces, tokens, error = [], 0, ""
        try:
            for chunk in client.chat.completions.create(model=self.model, messages=reference.messages, stream=True,
                                                        max_tokens=self.tokens, temperature=0,
                                                        stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
        except Exception as failure:  # any failure of the reply is the finding, whatever its kind
            error = f"{type(failure).__name__}: {failure}"[:300]
        finally:
            client.close()
        text = "".join(pieces)
        ok = not error and tokens > 0  # a reply cut short shows as not equal to the local one
        equal = ok and text == reference.text
        return SessionResult(worker, gateway, prompt, round(sent - self.began, 2), round(time.monotonic() - sent, 2),
                             ok, equal, tokens, error or ("" if ok else "no tokens"), "" if equal else text)


def first_errors(results: Sequence[SessionResult], limit: int = 5) -> list[str]:
    """The distinct errors of failed replies, most frequent first."""
    counts: dict[str, int] = {}
    for result in results:
        if not result.ok:
            counts[result.error] = counts.get(result.error, 0) + 1
    return [f"{count}x {error}" for error, count in sorted(counts.items(), key=lambda item: -item[1])[:limit]]

