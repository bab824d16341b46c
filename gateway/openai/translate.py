"""OpenAI's requests in the engine's terms: a chat's messages and tools, a completion's prompts, planned once.

    plan_chat(engine, fields)            a chat completion (and a Responses request, translated into one): the model,
                                         the tool choice, the prompt rendered with the model's chat template, the plan
    prompt_token_lists(model, prompt)    a completion's (or embedding's) prompt: text, texts, ids or lists of ids
    saved_state(engine, model, name)     the saved state a request's `state` field names (engine/saved_states.py)
"""

from __future__ import annotations

from gateway.chat.params import offered_tools
from gateway.chat.plan import Plan, chat_prompt_ids, plan_generation
from gateway.chat.reasoning import reply_thinking, requested_thinking, template_kwargs
from gateway.engine.generation import Engine
from gateway.engine.served import ServedModel
from gateway.engine.saved_states import SavedState
from gateway.errors import BadRequest
from gateway.openai.schemas import ChatCompletionRequest
from gateway.web.access import check_caller_state, client_id


def plan_chat(engine: Engine, fields: ChatCompletionRequest, logprobs=None) -> Plan:
    """A chat request planned: its messages rendered with the model's chat template, then checked and its session
    opened (chat/plan.py); `logprobs`: None, or how many alternatives each token comes with."""
    model = engine.model(fields.model)
    if fields.state is not None:
        state = saved_state(engine, model, fields.state, chat=True)
        fields = fields.model_copy(update={"messages": state.messages + list(fields.messages),
                                           "cache_salt": state.key.salt})
    tool_choice = offered_tools(fields.tool_choice, fields.tools, fields.parallel_tool_calls)
    thinking = requested_thinking(fields)
    prompt_ids = chat_prompt_ids(model, fields.messages, tool_choice.tools,
                                 template_kwargs=template_kwargs(thinking, fields.chat_template_kwargs))
    return plan_generation(engine, model, fields, prompt_ids, "messages", tool_choice, logprobs,
                           reply_thinking(model.tokenizer, prompt_ids, thinking))


def saved_state(engine: Engine, model: ServedModel, name: str, chat: bool) -> SavedState:
    """The client's saved state named by a request's `state` field, for this model and this kind of request."""
    check_caller_state("saved states", field="state")
    state = engine.saved_state(client_id(), name)
    if state.key.model != model.name:
        raise BadRequest(f"state: {name!r} was saved for model {state.key.model}, not {model.name}", field="state")
    if chat and state.messages is None:
        raise BadRequest(f"state: {name!r} was saved from a prompt, not messages: use it on /v1/completions",
                         field="state")
    return state


def prompt_token_lists(model: ServedModel, prompt) -> list[list[int]]:
    """The token ids of each prompt of a completion: a text, a list of texts, a list of ids or a list of lists."""
    if isinstance(prompt, str):
        return [model.encode(prompt, at_start=True)]
    if prompt and all(isinstance(item, int) for item in prompt):
        lists = [list(prompt)]
    elif prompt and all(isinstance(item, list) for item in prompt):
        lists = [list(item) for item in prompt]
    else:
        lists = [model.encode(item, at_start=True) for item in prompt]
    if not lists:
        raise BadRequest("prompt: must not be empty", field="prompt")
    for ids in lists:
        model.check_token_ids(ids, "prompt")
    return lists
