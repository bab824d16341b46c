"""Anthropic's wire format: a message, the events of a streamed one and the error envelope as pure functions, and the
one reply of a request (chat/reply.py) in it: MessageReply.

A streamed message is, in order: message_start, then per content block content_block_start, content_block_delta
(text_delta, input_json_delta, or a thinking block's thinking_delta ... and its signature_delta) ...
content_block_stop, a ping after the first block starts, then message_delta (stop_reason, usage.output_tokens) and
message_stop. A thinking model's reasoning (chat/reasoning.py) is a thinking block before the text. An error, even mid-stream, is
`{"type": "error", "error": {"type": ..., "message": ...}}` (sse.py names each event after its `type`).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Callable, Iterator, Optional

from gateway.chat.plan import Plan
from gateway.chat.reply import CallArguments, CallBegan, CallEnded, Finished, Piece, Replies, Reply
from gateway.errors import APIError
from gateway.web.request_ids import current as current_request_id

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}  # any other 4xx is invalid, any other 5xx api_error


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str, stop_sequence: Optional[str]) -> str:
    """A text reply's end in Anthropic's words (a tool call's is "tool_use"; "cancelled": the client is gone)."""
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if finish_reason == "length" else "end_turn"


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> dict:
    """A thinking model's reasoning. Its signature is a digest of the text: clients send the block back unchanged
    in the next turn; this gateway leaves earlier reasoning out of the prompt and checks nothing."""
    return {"type": "thinking", "thinking": thinking, "signature": signature(thinking)}


def signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def tool_use_block(name: str, arguments: str) -> dict:
    """A tool call as a tool_use block; `arguments` is the call's JSON object as text."""
    return {"type": "tool_use", "id": new_id("toolu"), "name": name, "input": json.loads(arguments)}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """As Anthropic counts: input_tokens are the prompt's tokens not read from a cache. Every prompt is kept for
    reuse (engine/warm.py), with or without cache_control, and writing it costs nothing: no cache creation."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def message(message_id: str, model: str, content: list[dict], stop_reason_: Optional[str],
            stop_sequence: Optional[str], usage_: dict) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason_, "stop_sequence": stop_sequence, "usage": usage_}


def message_start(message_id: str, model: str, input_tokens: int, cached_tokens: int) -> dict:
    return {"type": "message_start",
            "message": message(message_id, model, [], None, None, usage(input_tokens, 0, cached_tokens))}


def ping() -> dict:
    return {"type": "ping"}


def block_start(index: int, block: dict) -> dict:
    """A block's opening: a text block empty, a thinking block empty and unsigned, a tool_use block with an empty
    input (their text, signature and JSON follow in deltas)."""
    empty = {"text": text_block(""), "thinking": {"type": "thinking", "thinking": "", "signature": ""}}.get(
        block["type"]) or {**block, "input": {}}
    return {"type": "content_block_start", "index": index, "content_block": empty}


def text_delta(index: int, text: str) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}


def thinking_delta(index: int, thinking: str) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": thinking}}


def signature_delta(index: int, signature_: str) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": {"type": "signature_delta",
                                                                    "signature": signature_}}


def input_json_delta(index: int, partial_json: str) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta",
                                                                    "partial_json": partial_json}}


def block_stop(index: int) -> dict:
    return {"type": "content_block_stop", "index": index}


def message_delta(stop_reason_: str, stop_sequence: Optional[str], output_tokens: int) -> dict:
    return {"type": "message_delta", "delta": {"stop_reason": stop_reason_, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output_tokens}}


def message_stop() -> dict:
    return {"type": "message_stop"}


def error_body(error: APIError) -> dict:
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}, "request_id": current_request_id.get()}


# ------------------------------------------------------------------------------------------ the reply


class MessageReply:
    """One reply in Anthropic's wire format: a message, or its events as the deltas come: a thinking block, a text
    block, then a tool_use block per call, its input as input_json_delta fragments while the call is written."""

    def __init__(self, plan: Plan, stats):
        self.replies, self.model, self.input_tokens = Replies(plan, stats), plan.model, len(plan.prompt_ids)
        self.cached_tokens = plan.cached_tokens
        self.id = new_id("msg")

    def message(self) -> dict:
        [reply] = self.replies.whole()
        blocks, stop_reason_, stop_sequence = self.finish(reply)
        return message(self.id, self.model.name, blocks, stop_reason_, stop_sequence,
                       usage(self.input_tokens, reply.tokens, self.cached_tokens))

    def events(self, cancelled: Callable[[], bool]) -> Iterator[dict]:
        streamed, plan = StreamedBlocks(), self.replies.plan
        yield message_start(self.id, self.model.name, self.input_tokens, self.cached_tokens)
        if not plan.tools and not plan.thinking.split:  # a reply that is neither calls nor thought: one text block
            yield from streamed.open("text")
        yield ping()
        reply = Reply(0)
        for event in self.replies.events(cancelled):
            if isinstance(event, Piece):
                yield from streamed.tell(event.reasoning, event.text)
            elif isinstance(event, CallBegan):
                yield from streamed.open("tool_use", {"id": new_id("toolu"), "name": event.name})
            elif isinstance(event, CallArguments):
                yield input_json_delta(streamed.index, event.fragment)
            elif isinstance(event, CallEnded):
                yield from streamed.close()
            elif isinstance(event, Finished):
                reply = event.reply
        _, stop_reason_, stop_sequence = self.finish(reply)
        yield from streamed.end()
        yield message_delta(stop_reason_, stop_sequence, reply.tokens)
        yield message_stop()

    @staticmethod
    def finish(reply: Reply) -> tuple[list[dict], str, Optional[str]]:
        """The reply's content blocks (its reasoning's thinking block first; with tool calls, any text before them and
        a tool_use block each, else a text block, unless the reply is reasoning only), stop reason and sequence."""
        thought = [thinking_block(reply.reasoning)] if reply.reasoning else []
        if reply.tool_calls:
            calls = [tool_use_block(name, arguments) for name, arguments in reply.tool_calls]
            return thought + ([text_block(reply.text)] if reply.text else []) + calls, "tool_use", None
        text = [text_block(reply.text)] if reply.text or not thought else []
        return thought + text, stop_reason(reply.finish_reason, reply.stop_sequence), reply.stop_sequence


class StreamedBlocks:
    """A streamed reply's blocks, opened as its pieces come: a thinking block for its reasoning, then a text block
    for its answer, then a tool_use block per call; a thinking block is signed as it closes. A reply that told
    nothing is one empty text block."""

    def __init__(self):
        self.index, self.kind, self.thinking = -1, None, ""

    def tell(self, reasoning: str, text: str) -> Iterator[dict]:
        if reasoning:
            if self.kind != "thinking":
                yield from self.open("thinking")
            self.thinking += reasoning
            yield thinking_delta(self.index, reasoning)
        if text:
            if self.kind != "text":
                yield from self.open("text")
            yield text_delta(self.index, text)

    def open(self, kind: str, fields: Optional[dict] = None) -> Iterator[dict]:
        """A new block of `kind`; `fields`: a tool_use block's id and name."""
        yield from self.close()
        self.index, self.kind = self.index + 1, kind
        yield block_start(self.index, {"type": kind, **(fields or {})})

    def close(self) -> Iterator[dict]:
        if self.kind == "thinking":
            yield signature_delta(self.index, signature(self.thinking))
        if self.kind is not None:
            yield block_stop(self.index)
        self.kind = None

    def end(self) -> Iterator[dict]:
        if self.index < 0:
            yield from self.open("text")
        yield from self.close()
