"""Conversations kept on the servers (gateway/engine/warm.py), through real gunicorn and the official clients: a
request continuing an earlier one computes only its new tokens, reports what it reused, and answers exactly as a
recomputation would; reuse goes by whole cache pages, never crosses clients or salts, and a history edited in the
middle is computed again from where it differs."""

import json
import re

import anthropic
import openai
import pytest
import requests
import torch
import transformers

from gunicorn_gateway import running_gateway
from shared_gateways import STRICT_KEYS
from shared_swarm import TINY_PREFIX
from swarm.protocol import PAGE_TOKENS

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers every question in one sentence."}


@pytest.fixture(scope="module")
def local(tiny_llama):
    return (transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval(),
            transformers.AutoTokenizer.from_pretrained(tiny_llama))


def prompt_ids(local, messages) -> list[int]:
    tokenizer = local[1]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def local_greedy(local, messages, count):
    """The local model's greedy reply to the chat as the gateway renders it, and the prompt's length."""
    text, ids, _ = local_reply(local, messages, count)
    return text, len(ids)


def local_reply(local, messages, count) -> tuple[str, list[int], list[int]]:
    """(reply text, prompt ids, generated ids) of the local model's greedy reply."""
    model, tokenizer = local
    ids = prompt_ids(local, messages)
    with torch.no_grad():
        generated = model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False)[0, len(ids):].tolist()
    return tokenizer.decode([token for token in generated if token != tokenizer.eos_token_id]), ids, generated


def whole_pages(tokens: int) -> int:
    return tokens - tokens % PAGE_TOKENS


def expected_reuse(earlier_prompt: list[int], earlier_reply: list[int], prompt: list[int]) -> int:
    """What a request may reuse of the earlier one's session, by whole pages: the servers hold its prompt and its
    reply but for the last token (sampled, never sent), and the prompt's last token is always sent again. The random
    tiny model's replies are not valid UTF-8 throughout, so a reply rendered back into a prompt may differ from its
    tokens."""
    held, shared = earlier_prompt + earlier_reply[:-1], 0
    while shared < min(len(held), len(prompt)) and held[shared] == prompt[shared]:
        shared += 1
    return whole_pages(min(shared, len(prompt) - 1))


@pytest.fixture(scope="module")
def reuse_gateway(tiny_swarm, tiny_llama, tmp_path_factory):
    """A gateway of this module's own, with two API keys: what it keeps warm is only this module's doing."""
    models = [{"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX, "max_session_length": 1024}]
    env = {"INITIAL_PEERS": " ".join(tiny_swarm.initial_peers), "MODELS": json.dumps(models),
           "API_KEYS": "key-a,key-b", "MAX_NEW_TOKENS": "64"}
    with running_gateway(env, tmp_path_factory.mktemp("reuse-gateway")) as server:
        yield server


def openai_client(gateway, key="key-a"):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def chat(client, messages, cache_salt=None):
    reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                           extra_body={"cache_salt": cache_salt} if cache_salt else None)
    return reply.choices[0].message.content, reply.usage


def test_a_multi_turn_chat_reuses_every_earlier_turn_and_answers_as_recomputed(reuse_gateway, local):
    client, messages = openai_client(reuse_gateway), [SYSTEM]
    earlier_prompt, earlier_reply = [], []
    for question in ["What is the capital of France?", "And of Italy?", "Which is older?", "Why?"]:
        messages.append({"role": "user", "content": question})
        text, usage = chat(client, messages, cache_salt="multi-turn")
        expected, ids, generated = local_reply(local, messages, 12)
        assert text == expected and usage.prompt_tokens == len(ids)
        # the earlier turns were in the servers' caches: all of them reused, and nothing else
        assert usage.prompt_tokens_details.cached_tokens == expected_reuse(earlier_prompt, earlier_reply, ids)
        if earlier_prompt:
            assert usage.prompt_tokens_details.cached_tokens > 16 + len(earlier_prompt) // 2
        again = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                               extra_body={"cache_salt": "timings"})
        timings = again.model_extra["timings"]  # llama.cpp's: reused and computed prompt tokens, tokens generated
        assert timings["cache_n"] == again.usage.prompt_tokens_details.cached_tokens
        assert timings["cache_n"] + timings["prompt_n"] == len(ids)
        assert timings["predicted_n"] == again.usage.completion_tokens
        earlier_prompt, earlier_reply = ids, generated
        messages.append({"role": "assistant", "content": text})
    metrics = requests.get(reuse_gateway.url + "/metrics", headers={"Authorization": "Bearer key-a"}, timeout=30).text
    assert re.search(r'^gateway_cached_prompt_tokens_total\{model="tiny"\} ([1-9]\d*)', metrics, re.MULTILINE)
    assert re.search(r"^gateway_warm_sessions [1-9]", metrics, re.MULTILINE)


def test_an_edit_in_the_middle_of_a_history_is_computed_again_from_there(reuse_gateway, local):
    client = openai_client(reuse_gateway)
    first = [SYSTEM, {"role": "user", "content": "Name a large animal that lives in the sea."},
             {"role": "assistant", "content": "A blue whale."}, {"role": "user", "content": "How large is it?"}]
    chat(client, first, cache_salt="edit")
    _, first_ids, first_reply = local_reply(local, first, 12)
    edited = [*first[:2], {"role": "assistant", "content": "A giant squid."}, first[3]]
    text, usage = chat(client, edited, cache_salt="edit")
    expected, ids, _ = local_reply(local, edited, 12)
    assert text == expected
    # the system prompt, the first question and the answer's first characters are shared: reused up to the edit only
    shared = expected_reuse(first_ids, first_reply, ids)
    assert usage.prompt_tokens_details.cached_tokens == shared < len(ids) - 20


def test_reuse_never_crosses_api_keys_or_salts(reuse_gateway, local):
    messages = [SYSTEM, {"role": "user", "content": "Tell me a secret about the moon."}]
    chat(openai_client(reuse_gateway, "key-a"), messages, cache_salt="secret")
    again = [*messages, {"role": "assistant", "content": "It is made of rock."}, {"role": "user", "content": "More!"}]
    expected, _ = local_greedy(local, again, 12)
    text, usage = chat(openai_client(reuse_gateway, "key-b"), again, cache_salt="secret")
    assert usage.prompt_tokens_details.cached_tokens == 0 and text == expected  # another key: nothing reused
    text, usage = chat(openai_client(reuse_gateway, "key-a"), again, cache_salt="another salt")
    assert usage.prompt_tokens_details.cached_tokens == 0 and text == expected  # another salt: nothing reused
    text, usage = chat(openai_client(reuse_gateway, "key-a"), again, cache_salt="secret")
    assert usage.prompt_tokens_details.cached_tokens > 0 and text == expected


def test_anthropic_reports_what_it_read_from_the_cache_and_accepts_cache_control(reuse_gateway, local):
    client = anthropic.Anthropic(base_url=reuse_gateway.url, api_key="key-a", max_retries=0)
    system = [{"type": "text", "text": SYSTEM["content"], "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    first = client.messages.create(model="tiny", system=system, messages=messages, max_tokens=8,
                                   extra_body={"temperature": 0})
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens == 0
    messages += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Really?"}]
    second = client.messages.create(model="tiny", system=system, messages=messages, max_tokens=8,
                                    extra_body={"temperature": 0})
    expected, prompt_length = local_greedy(local, [SYSTEM, *messages], 8)
    assert second.content[0].text == expected
    assert second.usage.cache_read_input_tokens > first.usage.input_tokens - 2 - PAGE_TOKENS
    assert second.usage.cache_read_input_tokens % PAGE_TOKENS == 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == prompt_length


def test_ollama_counts_only_the_prompt_tokens_it_evaluated(reuse_gateway, local):
    headers = {"Authorization": "Bearer key-a"}
    messages = [SYSTEM, {"role": "user", "content": "Count to three."}]
    body = {"model": "tiny", "messages": messages, "stream": False, "options": {"temperature": 0, "num_predict": 8}}
    first = requests.post(reuse_gateway.url + "/api/chat", json=body, headers=headers, timeout=60).json()
    messages += [first["message"], {"role": "user", "content": "Now to four."}]
    second = requests.post(reuse_gateway.url + "/api/chat", json=body, headers=headers, timeout=60).json()
    expected, prompt_length = local_greedy(local, messages, 8)
    assert second["message"]["content"] == expected
    assert second["prompt_eval_count"] < prompt_length - first["prompt_eval_count"] + 4 + PAGE_TOKENS


def test_mlc_chats_stateful_routes_keep_the_conversation_on_the_server(reuse_gateway, local):
    headers, url = {"Authorization": "Bearer key-b"}, reuse_gateway.url
    requests.post(url + "/chat/reset", headers=headers, timeout=30).raise_for_status()
    body = {"model": "tiny", "temperature": 0, "max_tokens": 8}
    first = requests.post(url + "/chat/completions", headers=headers, timeout=60,
                          json={**body, "messages": [SYSTEM, {"role": "user", "content": "Hello there."}]}).json()
    reply = first["choices"][0]["message"]["content"]
    # the next turn sends only its new message, streamed this time: the server holds the rest
    with requests.post(url + "/chat/completions", headers=headers, timeout=60, stream=True,
                       json={**body, "stream": True, "stream_options": {"include_usage": True},
                             "messages": [{"role": "user", "content": "And again?"}]}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    text = "".join(choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"])
    whole = [SYSTEM, {"role": "user", "content": "Hello there."}, {"role": "assistant", "content": reply},
             {"role": "user", "content": "And again?"}]
    expected, prompt_length = local_greedy(local, whole, 8)
    assert text == expected and chunks[-1]["usage"]["prompt_tokens"] == prompt_length
    reused = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert reused > first["usage"]["prompt_tokens"] - 2 - PAGE_TOKENS
    # another client has a conversation of its own; a reset starts this one over
    other = requests.post(url + "/chat/completions", headers={"Authorization": "Bearer key-a"}, timeout=60,
                          json={**body, "messages": [{"role": "user", "content": "And again?"}]}).json()
    assert other["usage"]["prompt_tokens"] < prompt_length // 2
    requests.get(url + "/chat/reset", headers=headers, timeout=30).raise_for_status()
    alone = requests.post(url + "/chat/completions", headers=headers, timeout=60,
                          json={**body, "messages": [{"role": "user", "content": "And again?"}]}).json()
    assert alone["usage"]["prompt_tokens"] == other["usage"]["prompt_tokens"]


def test_a_saved_state_is_forked_by_every_request_that_starts_with_it(reuse_gateway, local):
    headers, url = {"Authorization": "Bearer key-b"}, reuse_gateway.url
    preamble = [{"role": "system", "content": "You know these tools: " + "search, fetch, summarize. " * 6}]
    saved = requests.post(url + "/v1/states", headers=headers, timeout=60,
                          json={"name": "tools", "model": "tiny", "messages": preamble}).json()
    assert saved["name"] == "tools" and saved["kind"] == "messages" and saved["tokens"] > 100
    client = openai_client(reuse_gateway, "key-b")
    for question in ("What can you do?", "Fetch the news."):  # two conversations, each forking the state
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8,
                                               extra_body={"state": "tools"})
        expected, prompt_length = local_greedy(local, preamble + messages, 8)
        assert reply.choices[0].message.content == expected and reply.usage.prompt_tokens == prompt_length
        # the state, and past it what the first conversation shares with the second (the user's header)
        assert whole_pages(saved["tokens"]) <= reply.usage.prompt_tokens_details.cached_tokens < saved["tokens"] + 8
    # the same prefix without naming the state forks it too; another client's never does
    text, usage = chat(client, preamble + [{"role": "user", "content": "Hi."}])
    assert whole_pages(saved["tokens"]) <= usage.prompt_tokens_details.cached_tokens < saved["tokens"] + 8
    text, usage = chat(openai_client(reuse_gateway, "key-a"), preamble + [{"role": "user", "content": "Hi."}])
    assert usage.prompt_tokens_details.cached_tokens == 0
    listed = requests.get(url + "/v1/states", headers=headers, timeout=30).json()["data"]
    assert [state["name"] for state in listed] == ["tools"]
    assert requests.get(url + "/v1/states", headers={"Authorization": "Bearer key-a"}, timeout=30).json()["data"] == []
    assert requests.delete(url + "/v1/states/tools", headers=headers, timeout=30).json()["deleted"] is True
    missing = requests.post(url + "/v1/chat/completions", headers=headers, timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "state": "tools"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "state"


def test_saving_a_state_checks_its_fields(reuse_gateway):
    headers, url = {"Authorization": "Bearer key-a"}, reuse_gateway.url
    for body, field in (({"name": "x"}, "messages"), ({"name": "a b", "prompt": "hi"}, "name"),
                        ({"name": "x", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
                        ({"name": "x", "prompt": [10 ** 9]}, "prompt")):
        response = requests.post(url + "/v1/states", headers=headers, json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == field, body


def test_a_seeded_sample_is_the_same_whether_its_prefix_was_reused_or_not(reuse_gateway):
    history = [SYSTEM, {"role": "user", "content": "Write me a poem about rain."}]
    warm = openai_client(reuse_gateway, "key-a")
    first = warm.chat.completions.create(model="tiny", messages=history, max_tokens=12, seed=5, temperature=1,
                                         extra_body={"cache_salt": "seeded"})
    turn = [*history, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Another one."}]
    fields = dict(model="tiny", messages=turn, max_tokens=16, seed=7, temperature=1.0)
    reused = warm.chat.completions.create(**fields, extra_body={"cache_salt": "seeded"})
    recomputed = openai_client(reuse_gateway, "key-b").chat.completions.create(**fields,
                                                                               extra_body={"cache_salt": "seeded"})
    assert reused.usage.prompt_tokens_details.cached_tokens > 0 == recomputed.usage.prompt_tokens_details.cached_tokens
    assert reused.choices[0].message.content == recomputed.choices[0].message.content


def test_a_responses_follow_up_continues_the_stored_conversations_caches(reuse_gateway, local):
    client = openai_client(reuse_gateway, "key-a")
    first = client.responses.create(model="tiny", instructions=SYSTEM["content"], input="Name three rivers.",
                                    temperature=0, max_output_tokens=8)
    follow_up = client.responses.create(model="tiny", instructions=SYSTEM["content"], input="Which is longest?",
                                        previous_response_id=first.id, temperature=0, max_output_tokens=8)
    messages = [SYSTEM, {"role": "user", "content": "Name three rivers."},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Which is longest?"}]
    expected, prompt_length = local_greedy(local, messages, 8)
    assert follow_up.output_text == expected and follow_up.usage.input_tokens == prompt_length
    assert follow_up.usage.input_tokens_details.cached_tokens > first.usage.input_tokens - 2 - PAGE_TOKENS
