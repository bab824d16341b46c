"""OpenAI's wire format: completions, chunks, logprobs, usage, errors as pure functions, and the replies of a chat or
text completion (chat/reply.py) in it: ChatCompletionReplies and TextCompletionReplies.

Two shapes of everything: chat (`chat.completion`, `chat.completion.chunk`, logprobs as `{content: [...]}`)
and text (`text_completion`, logprobs as parallel lists `tokens / token_logprobs / top_logprobs / text_offset`).
"""

from __future__ import annotations

import time
import uuid
from typing import Callable, Iterable, Iterator, Optional, Sequence

from gateway.chat.plan import Plan
from gateway.chat.reply import Began, CallArguments, CallBegan, Finished, Piece, Replies, Reply
from gateway.engine.generation import Engine, TokenLogprob
from gateway.errors import APIError

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop", "tool_calls": "tool_calls"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer, logprobs: Iterable[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(item.token_id, item.logprob), "top_logprobs": [entry(token, value) for token, value in item.top]}
            for item in logprobs
        ]
    }


def completion_logprobs(tokenizer, logprobs: Sequence[Optional[TokenLogprob]], token_ids: Sequence[int],
                        text_offset: int = 0) -> dict:
    """The text-completion shape; an entry of None (the first echoed prompt token) has no logprob."""
    tokens, offsets, offset = [], [], text_offset
    for token_id in token_ids:
        tokens.append(token_text(tokenizer, token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob if item else None for item in logprobs],
        "top_logprobs": [
            {token_text(tokenizer, token): value for token, value in item.top} if item else None for item in logprobs
        ],
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int, timing: Optional[dict] = None, cached_tokens: int = 0,
          reasoning_tokens: Optional[int] = None) -> dict:
    """`cached_tokens`: of the prompt, held by the servers already from an earlier request (engine/warm.py);
    `reasoning_tokens`: of the completion, a thinking model's reasoning (None: a model that does not think)."""
    details = {} if reasoning_tokens is None else {"completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        **details,
        **(timing or {}),
    }


def chat_completion(request_id: str, model: str, choices: list[dict], usage_: dict,
                    timings: Optional[dict] = None) -> dict:
    """`timings`: llama.cpp server's (stats.RequestStats.llama_timings), beside OpenAI's usage."""
    return {"id": request_id, "object": "chat.completion", "created": now(), "model": model,
            "choices": choices, "usage": usage_, **({"timings": timings} if timings else {})}


def chat_choice(index: int, content: Optional[str], finish_reason: str, logprobs: Optional[dict] = None,
                tool_calls: Optional[list[dict]] = None, reasoning: Optional[str] = None) -> dict:
    """`reasoning`: a thinking model's, as vLLM and DeepSeek send it (None: a model that does not think)."""
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning or None
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": FINISH_REASONS[finish_reason]}


def chat_chunk(request_id: str, model: str, index: int, delta: dict, finish_reason: Optional[str] = None,
               logprobs: Optional[dict] = None, with_usage_field: bool = False) -> dict:
    chunk = {
        "id": request_id, "object": "chat.completion.chunk", "created": now(), "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": FINISH_REASONS[finish_reason] if finish_reason else None}],
    }
    if with_usage_field:
        chunk["usage"] = None  # OpenAI sets it on every chunk when include_usage is on; only the last has it
    return chunk


def usage_chunk(request_id: str, model: str, object_: str, usage_: dict) -> dict:
    return {"id": request_id, "object": object_, "created": now(), "model": model, "choices": [], "usage": usage_}


def text_completion(request_id: str, model: str, choices: list[dict], usage_: dict,
                    timings: Optional[dict] = None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": now(), "model": model,
            "choices": choices, "usage": usage_, **({"timings": timings} if timings else {})}


def text_choice(index: int, text: str, finish_reason: Optional[str], logprobs: Optional[dict] = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": FINISH_REASONS[finish_reason] if finish_reason else None}


def text_chunk(request_id: str, model: str, choice: dict, with_usage_field: bool = False) -> dict:
    chunk = {"id": request_id, "object": "text_completion", "created": now(), "model": model, "choices": [choice]}
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_call_delta(number: int, name: Optional[str], arguments: str) -> dict:
    """A chunk's delta of call `number`: its first (id, type and name, as OpenAI sends them with empty arguments), or
    a fragment of its arguments (`name` None)."""
    if name is not None:
        return {"tool_calls": [{"index": number, **tool_call(name, arguments)}]}
    return {"tool_calls": [{"index": number, "function": {"arguments": arguments}}]}


ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error",
               503: "service_unavailable"}  # any other 4xx is an invalid_request_error, any other 5xx a server_error


def error_body(error: APIError) -> dict:
    code = error.code
    if error.status == 404 and error.field == "model":
        code = "model_not_found"
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.field, "code": code}}


# ------------------------------------------------------------------------------------------ replies


class ChatCompletionReplies:
    """A chat completion's n choices in OpenAI's wire format: one completion, or chunks as the deltas come."""

    def __init__(self, plan: Plan, top: Optional[int], include_usage: bool, stats):
        self.replies, self.model, self.top, self.stats = Replies(plan, stats), plan.model, top, stats
        self.prompt_tokens, self.include_usage = len(plan.prompt_ids), include_usage
        self.cached_tokens = plan.cached_tokens
        self.request_id = new_id("chatcmpl")

    def completion(self) -> dict:
        choices = []
        for reply in self.replies.whole():
            content, calls = self.message(reply)
            choices.append(chat_choice(reply.index, content, reply.ended_by, self.logprobs(reply.logprobs), calls,
                                       self.reasoning(reply)))
        usage_ = usage(self.prompt_tokens, self.replies.tokens, self.stats.timing(), self.cached_tokens,
                       self.replies.reasoning_tokens)
        return chat_completion(self.request_id, self.model.name, choices, usage_,
                               self.stats.llama_timings(self.cached_tokens))

    def chunks(self, cancelled: Callable[[], bool]) -> Iterator[dict]:
        for event in self.replies.events(cancelled):
            if isinstance(event, Began):
                yield self.chunk(event.index, {"role": "assistant", "content": ""})
            elif isinstance(event, Piece):
                yield from self.piece_chunks(event)
            elif isinstance(event, CallBegan):
                yield self.chunk(event.index, tool_call_delta(event.number, event.name, ""))
            elif isinstance(event, CallArguments):
                yield self.chunk(event.index, tool_call_delta(event.number, None, event.fragment))
            elif isinstance(event, Finished):
                yield self.chunk(event.reply.index, {}, finish_reason=event.reply.ended_by)
        if self.include_usage:
            usage_ = usage(self.prompt_tokens, self.stats.completion_tokens, self.stats.timing(), self.cached_tokens,
                           self.replies.reasoning_tokens)
            yield usage_chunk(self.request_id, self.model.name, "chat.completion.chunk", usage_)

    def piece_chunks(self, piece: Piece) -> Iterator[dict]:
        """A piece's reasoning as a reasoning_content delta, its answer as a content delta (with its logprobs)."""
        logprobs = self.logprobs(piece.delta.logprobs) if piece.delta.logprobs else None
        if piece.reasoning:
            yield self.chunk(piece.index, {"reasoning_content": piece.reasoning},
                             logprobs=None if piece.text else logprobs)
        if piece.text or (logprobs and not piece.reasoning):
            yield self.chunk(piece.index, {"content": piece.text}, logprobs=logprobs)

    @staticmethod
    def message(reply: Reply) -> tuple[Optional[str], Optional[list[dict]]]:
        """(content, tool calls) of a whole reply: with calls, the text before them (None for none)."""
        if reply.tool_calls:
            return reply.text or None, [tool_call(name, arguments) for name, arguments in reply.tool_calls]
        return reply.text, None

    def reasoning(self, reply: Reply) -> Optional[str]:
        """A reply's reasoning_content: None for a model that does not think, as vLLM leaves it out."""
        return reply.reasoning if self.replies.plan.thinking.split else None

    def logprobs(self, items: list) -> Optional[dict]:
        return chat_logprobs(self.model.tokenizer, items) if self.top is not None else None

    def chunk(self, index: int, delta: dict, finish_reason: Optional[str] = None,
              logprobs: Optional[dict] = None) -> dict:
        return chat_chunk(self.request_id, self.model.name, index, delta, finish_reason, logprobs,
                          with_usage_field=self.include_usage)


class TextCompletionReplies:
    """A text completion's choices, n per prompt, in OpenAI's wire format: one completion, or chunks as the deltas
    come. With `echo`, each choice starts with its prompt (and with logprobs, the prompt tokens' logprobs)."""

    def __init__(self, engine: Engine, plans: list[Plan], top: Optional[int], echo: bool, include_usage: bool,
                 stats):
        self.engine, self.plans, self.top, self.echo, self.stats = engine, plans, top, echo, stats
        self.model, self.include_usage = plans[0].model, include_usage
        self.request_id = new_id("cmpl")
        self.prompt_tokens = sum(len(plan.prompt_ids) for plan in plans)
        self.cached_tokens = sum(plan.cached_tokens for plan in plans)

    def completion(self) -> dict:
        choices = []
        for number, plan in enumerate(self.plans):
            echo_text, echoed = self.echoed(plan.prompt_ids)
            for reply in Replies(plan, self.stats).whole():
                logprobs = self.logprobs_of(plan.prompt_ids if self.echo else [], echoed, reply.logprobs)
                choices.append(text_choice(number * plan.n + reply.index, echo_text + reply.text, reply.ended_by,
                                           logprobs))
        usage_ = usage(self.prompt_tokens, self.stats.completion_tokens, self.stats.timing(), self.cached_tokens)
        return text_completion(self.request_id, self.model.name, choices, usage_,
                               self.stats.llama_timings(self.cached_tokens))

    def chunks(self, cancelled: Callable[[], bool]) -> Iterator[dict]:
        for number, plan in enumerate(self.plans):
            yield from self.prompt_chunks(number, plan, cancelled)
        if self.include_usage:
            usage_ = usage(self.prompt_tokens, self.stats.completion_tokens, self.stats.timing(), self.cached_tokens)
            yield usage_chunk(self.request_id, self.model.name, "text_completion", usage_)

    def prompt_chunks(self, number: int, plan: Plan, cancelled: Callable[[], bool]) -> Iterator[dict]:
        """The chunks of one prompt's n choices; a choice's first chunk carries the echoed prompt."""
        echo_text, echoed = self.echoed(plan.prompt_ids)
        beginning = set()  # the choices whose echo is still to be sent
        for event in Replies(plan, self.stats).events(cancelled):
            if isinstance(event, Began):
                beginning.add(event.index)
            if not isinstance(event, Piece):
                continue
            delta, text, prefix_ids, prefix_items = event.delta, event.delta.text, [], []
            if event.index in beginning:
                beginning.discard(event.index)
                text, prefix_ids, prefix_items = echo_text + text, plan.prompt_ids if self.echo else [], echoed
            choice = text_choice(number * plan.n + event.index, text, delta.finish_reason,
                                 self.logprobs_of(prefix_ids, prefix_items, delta.logprobs))
            if text or delta.finish_reason or choice["logprobs"]:
                yield text_chunk(self.request_id, self.model.name, choice, with_usage_field=self.include_usage)

    def echoed(self, ids: list[int]) -> tuple[str, list]:
        """The prompt's text, and its tokens' logprobs when asked for, to prepend to each choice."""
        if not self.echo:
            return "", []
        text = self.model.tokenizer.decode(ids)
        return text, self.engine.token_logprobs(self.model.name, ids, self.top) if self.top is not None else []

    def logprobs_of(self, prefix_ids: list[int], prefix_items: list, generated) -> Optional[dict]:
        if self.top is None:
            return None
        token_ids = prefix_ids + [item.token_id for item in generated]
        if not token_ids:
            return None
        return completion_logprobs(self.model.tokenizer, prefix_items + list(generated), token_ids)
