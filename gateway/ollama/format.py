"""Ollama's wire format: reply lines, durations, tool calls, logprobs, models and errors as pure functions, and the
one reply of a chat or generate (chat/reply.py) in it: OllamaReply.

A generation is lines of {model, created_at, message | response, done: false}, then one last line with done: true,
its done_reason and the counts and durations (nanoseconds); a whole reply is that last line with all the text.
`shape` says which API a line belongs to: "chat" (a `message`) or "generate" (a `response`).
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timezone
from typing import Iterable, Iterator, Optional

from gateway.chat.plan import Plan
from gateway.chat.reply import CallEnded, Finished, Piece, Replies, Reply
from gateway.engine.stats import RequestStats
from gateway.errors import APIError

# Ollama's finish reasons: a tool call, or a reply the client stopped, ends as "stop" too
DONE_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop", "tool_calls": "stop"}
# the Ollama release whose API this gateway speaks (tools, format as a JSON schema, /api/embed, logprobs)
OLLAMA_VERSION = "0.12.6"
SERVING_SINCE = datetime.now(timezone.utc)  # a served model's modified_at: the swarm has no files to date
NEVER = "9999-12-31T23:59:59Z"  # a loaded model's expires_at: the gateway keeps its models while it runs


def created_at(moment: Optional[datetime] = None) -> str:
    """RFC 3339 in UTC, as Ollama writes it."""
    return (moment or datetime.now(timezone.utc)).isoformat().replace("+00:00", "Z")


def _line(shape: str, model: str, text: str, tool_calls: Optional[list[dict]] = None, thinking: str = "") -> dict:
    """`thinking`: a thinking model's reasoning (chat/reasoning.py), beside the text; left out when empty."""
    line = {"model": model, "created_at": created_at()}
    if shape == "chat":
        line["message"] = {"role": "assistant", "content": text}
        if thinking:
            line["message"]["thinking"] = thinking
        if tool_calls:
            line["message"]["tool_calls"] = tool_calls
    else:
        line["response"] = text
        if thinking:
            line["thinking"] = thinking
    return line


def part(shape: str, model: str, text: str, logprobs: Optional[list[dict]] = None,
         tool_calls: Optional[list[dict]] = None, thinking: str = "") -> dict:
    """A line of a streamed reply."""
    line = {**_line(shape, model, text, tool_calls, thinking), "done": False}
    if logprobs:
        line["logprobs"] = logprobs
    return line


def done(shape: str, model: str, text: str, finish_reason: str, durations: dict,
         tool_calls: Optional[list[dict]] = None, logprobs: Optional[list[dict]] = None,
         context: Optional[list[int]] = None, thinking: str = "") -> dict:
    """The last line of a streamed reply (empty text), or a whole reply (with its reasoning, tool calls and
    logprobs)."""
    line = {**_line(shape, model, text, tool_calls, thinking), "done": True, "done_reason": DONE_REASONS[finish_reason],
            **durations}
    if context is not None:
        line["context"] = context
    if logprobs is not None:
        line["logprobs"] = logprobs
    return line


def loaded(shape: str, model: str, unloaded: bool) -> dict:
    """The reply to a request with nothing to generate: Ollama's way to load (or, with keep_alive 0, unload) a model."""
    return {**_line(shape, model, ""), "done": True, "done_reason": "unload" if unloaded else "load"}


def durations(stats: RequestStats, load_seconds: float) -> dict:
    """Ollama's counts and durations, in nanoseconds; the stats' clock started with the request."""
    nanoseconds = lambda seconds: int(seconds * 1e9)
    return {
        "total_duration": nanoseconds(time.perf_counter() - stats.started),
        "load_duration": nanoseconds(load_seconds),
        "prompt_eval_count": stats.prompt_tokens,
        "prompt_eval_duration": nanoseconds(stats.prefill_seconds),
        "eval_count": stats.completion_tokens,
        "eval_duration": nanoseconds(stats.decode_seconds),
    }


def tool_call(index: int, name: str, arguments: str) -> dict:
    """A call as Ollama sends it: arguments as an object (chat/tool_stream.py gives them as JSON text)."""
    return {"function": {"index": index, "name": name, "arguments": json.loads(arguments)}}


def logprobs(tokenizer, items: Iterable, top: int) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**entry(item.token_id, item.logprob),
             **({"top_logprobs": [entry(token, value) for token, value in item.top]} if top else {})}
            for item in items]


def embeddings(model: str, vectors: list[list[float]], stats: RequestStats, load_seconds: float,
               prompt_tokens: int) -> dict:
    timing = durations(stats, load_seconds)
    return {"model": model, "embeddings": vectors, "total_duration": timing["total_duration"],
            "load_duration": timing["load_duration"], "prompt_eval_count": prompt_tokens}


# ------------------------------------------------------------------------------------------ models


def details(remote_config) -> dict:
    """What Ollama says of a model's files; `remote_config` (transformers') is None for a model not connected yet."""
    family = getattr(remote_config, "model_type", "") or ""
    return {"parent_model": "", "format": "safetensors", "family": family, "families": [family] if family else [],
            "parameter_size": "", "quantization_level": ""}


def model_entry(config, remote_config) -> dict:
    """A model in /api/tags. `digest` is stable for as long as the model's name, checkpoint and swarm are."""
    identity = f"{config.name}\0{config.path}\0{config.dht_prefix or ''}".encode()
    return {"name": config.name, "model": config.name, "modified_at": created_at(SERVING_SINCE), "size": 0,
            "digest": hashlib.sha256(identity).hexdigest(), "details": details(remote_config)}


def embedding_model_entry(name: str, folder: str, family: str) -> dict:
    """An embedding model (EMBEDDING_MODELS) in /api/tags: run in the gateway, so no swarm in its digest."""
    digest = hashlib.sha256(f"{name}\0{folder}".encode()).hexdigest()
    return {"name": name, "model": name, "modified_at": created_at(SERVING_SINCE), "size": 0, "digest": digest,
            "details": _encoder_details(family)}


def embedding_model_show(name: str, family: str, dimension: int, context_length: int) -> dict:
    """/api/show for an embedding model: as Ollama shows its own, capability "embedding" and no template."""
    arch = family or "unknown"
    info = {"general.architecture": arch, f"{arch}.context_length": context_length,
            f"{arch}.embedding_length": dimension}
    return {"license": "", "modelfile": f"# run in the gateway (sentence-transformers)\nFROM {name}\n",
            "parameters": f"num_ctx {context_length}", "template": "", "details": _encoder_details(family),
            "model_info": info, "capabilities": ["embedding"], "modified_at": created_at(SERVING_SINCE)}


def _encoder_details(family: str) -> dict:
    return {"parent_model": "", "format": "safetensors", "family": family, "families": [family] if family else [],
            "parameter_size": "", "quantization_level": ""}


def running_entry(config, remote_config) -> dict:
    """A model in /api/ps: its client half is loaded in this gateway; its blocks run on the swarm's servers."""
    return {**model_entry(config, remote_config), "expires_at": NEVER, "size_vram": 0,
            "context_length": config.max_session_length}


def model_info(config, remote_config) -> dict:
    """/api/show's model_info, in GGUF's key names, from the checkpoint's config."""
    arch = getattr(remote_config, "model_type", "") or "unknown"
    known = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
             "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
             "vocab_size": "vocab_size"}
    info = {"general.architecture": arch, f"{arch}.context_length": config.max_session_length}
    for key, name in known.items():
        if getattr(remote_config, name, None) is not None:
            info[f"{arch}.{key}"] = getattr(remote_config, name)
    return info


def show(model, capabilities: list[str]) -> dict:
    """/api/show for a served model (engine.ServedModel): its defaults as a Modelfile's PARAMETERs, its template."""
    config, remote_config = model.config, model.remote.config
    defaults = config.defaults
    parameters = "\n".join(f"{name} {value}" for name, value in (
        ("temperature", defaults.temperature), ("top_k", defaults.top_k), ("top_p", defaults.top_p),
        ("repeat_penalty", defaults.repetition_penalty), ("num_ctx", config.max_session_length)))
    modelfile = f"# served by a swarm of block servers\nFROM {config.path}\n" + "".join(
        f"PARAMETER {line}\n" for line in parameters.splitlines())
    return {"license": "", "modelfile": modelfile, "parameters": parameters,
            "template": model.tokenizer.chat_template or "{{ .Prompt }}", "details": details(remote_config),
            "model_info": model_info(config, remote_config), "capabilities": capabilities,
            "modified_at": created_at(SERVING_SINCE)}


def error_body(error: APIError) -> dict:
    return {"error": error.message}


# ------------------------------------------------------------------------------------------ the reply


class OllamaReply:
    """One reply (Ollama has no n) in Ollama's wire format: whole, or a line per delta and a last line with the counts
    and durations. A tool call is a line of its own once it is whole, as Ollama streams calls (its arguments an
    object); a call cut short is not sent: its text is, at the end, as the whole reply's content. A client that leaves closes the lines' generator, and so the session."""

    def __init__(self, shape: str, plan: Plan, stats: RequestStats, load_seconds: float, top: Optional[int] = None,
                 context: Optional[list[int]] = None):
        self.shape, self.model, self.stats, self.load_seconds = shape, plan.model, stats, load_seconds
        self.replies, self.top, self.prompt_ids = Replies(plan, stats), top, context

    def whole(self) -> dict:
        [reply] = self.replies.whole()
        content, calls = self.message(reply)
        return done(self.shape, self.model.name, content, reply.ended_by, self.durations(), tool_calls=calls,
                    logprobs=self.logprobs(reply.logprobs), context=self.context(reply), thinking=reply.reasoning)

    def lines(self) -> Iterator[dict]:
        reply, told, called = Reply(0), "", False
        for event in self.replies.events():
            if isinstance(event, Piece):
                logprobs, told = self.logprobs(event.delta.logprobs), told + event.text
                if event.text or event.reasoning or logprobs:
                    yield part(self.shape, self.model.name, event.text, logprobs, thinking=event.reasoning)
            elif isinstance(event, CallEnded) and event.complete:
                call, called = tool_call(event.number, event.name, event.arguments), True
                yield part(self.shape, self.model.name, "", tool_calls=[call])
            elif isinstance(event, Finished):
                reply = event.reply
        if not called and reply.text.startswith(told) and len(reply.text) > len(told):
            # a call cut short (max_tokens) was held, never sent: the reply is its text, as the whole reply says
            yield part(self.shape, self.model.name, reply.text[len(told):])
        yield done(self.shape, self.model.name, "", reply.ended_by, self.durations(), context=self.context(reply))

    @staticmethod
    def message(reply: Reply) -> tuple[str, Optional[list[dict]]]:
        """(content, tool calls) of a whole reply: with calls, the text before them."""
        if reply.tool_calls:
            calls = [tool_call(index, name, arguments) for index, (name, arguments) in enumerate(reply.tool_calls)]
            return reply.text, calls
        return reply.text, None

    def logprobs(self, items) -> Optional[list[dict]]:
        return logprobs(self.model.tokenizer, items, self.top) if self.top is not None else None

    def context(self, reply: Reply) -> Optional[list[int]]:
        """/api/generate's `context`: the prompt's and the reply's token ids to continue from (no stop token)."""
        if self.prompt_ids is None:
            return None
        return self.prompt_ids + [token for token in reply.token_ids if token not in self.model.stop_ids]

    def durations(self) -> dict:
        return durations(self.stats, self.load_seconds)
