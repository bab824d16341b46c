"""A thinking model's reasoning, told apart from its answer where each official client expects it: OpenAI's
reasoning_content (and its own streamed deltas), Anthropic's thinking blocks, the Responses API's reasoning item,
Ollama's thinking; streamed and not; and thinking turned off by each API's switch.

The model is a tiny Llama with a Qwen3-style template (tests/thinking_model.py), trained in the fixture to say a
known reply, on one server of its own in the tiny swarm, behind real gunicorn. Its greedy reply, generated locally
by transformers, is what every API must split: "<think>\\nREASONING\\n</think>\\n\\nANSWER"."""


import anthropic
import ollama
import openai
import pytest
import requests

from gunicorn_gateway import gateway_of_another_model
from thinking_model import ANSWER, PROMPT, REASONING, build_thinking_model, greedy_reply

PREFIX = "thinker"
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="session")
def thinking_model(tmp_path_factory):
    return build_thinking_model(tmp_path_factory.mktemp("thinking-llama"))


@pytest.fixture(scope="module")
def thinking_gateway(tiny_swarm, thinking_model, tmp_path_factory):
    with gateway_of_another_model(tiny_swarm, PREFIX, thinking_model, PREFIX, "0:2",
                                  tmp_path_factory.mktemp("thinking-gateway")) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def local_replies(thinking_model):
    """The local transformers model's greedy replies, as text, thinking and not (the template's switch)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(thinking_model)
    model = transformers.AutoModelForCausalLM.from_pretrained(thinking_model)
    replies = {}
    for enable_thinking in (True, False):
        prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                               enable_thinking=enable_thinking)
        ids = greedy_reply(model, tokenizer.encode(prompt, add_special_tokens=False), 40)
        replies[enable_thinking] = tokenizer.decode(ids, skip_special_tokens=True)
    return replies


def test_the_local_model_thinks_and_the_switch_turns_it_off(local_replies):
    assert local_replies == {True: f"<think>\n{REASONING}\n</think>\n\n{ANSWER}", False: ANSWER}


@pytest.fixture(scope="module")
def openai_client(thinking_gateway):
    return openai.OpenAI(base_url=thinking_gateway.url + "/v1", api_key="any", max_retries=0, timeout=120)


def test_openai_chat_has_reasoning_content_whole_and_streamed(openai_client):
    whole = openai_client.chat.completions.create(model=PREFIX, messages=MESSAGES, temperature=0)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)
    assert 0 < whole.usage.completion_tokens_details.reasoning_tokens < whole.usage.completion_tokens
    stream = openai_client.chat.completions.create(model=PREFIX, messages=MESSAGES, temperature=0, stream=True)
    deltas = [(getattr(chunk.choices[0].delta, "reasoning_content", None), chunk.choices[0].delta.content)
              for chunk in stream if chunk.choices]
    reasoning = [text for text, _ in deltas if text]
    content = [text for _, text in deltas if text]
    assert "".join(reasoning) == REASONING and "".join(content) == ANSWER
    assert len(reasoning) > 1 and not any(text and answer for text, answer in deltas)  # apart, in their own deltas
    last_reasoning = max(number for number, (text, _) in enumerate(deltas) if text)
    assert last_reasoning < min(number for number, (_, answer) in enumerate(deltas) if answer)


@pytest.mark.parametrize("switch", [{"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False},
                                    {"reasoning_effort": "none"}], ids=["vllm", "top-level", "effort"])
def test_openai_chat_turns_thinking_off(openai_client, switch):
    whole = openai_client.chat.completions.create(model=PREFIX, messages=MESSAGES, temperature=0, extra_body=switch)
    message = whole.choices[0].message
    assert message.content == ANSWER and message.reasoning_content is None
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0


def test_anthropic_messages_have_thinking_blocks_whole_and_streamed(thinking_gateway):
    client = anthropic.Anthropic(base_url=thinking_gateway.url, api_key="any", max_retries=0)
    settings = dict(model=PREFIX, messages=MESSAGES, max_tokens=64, extra_body={"temperature": 0})
    message = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **settings)
    thinking, text = message.content
    assert (thinking.type, thinking.thinking, text.type, text.text) == ("thinking", REASONING, "text", ANSWER)
    assert thinking.signature
    with client.messages.stream(**settings) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert [block.model_dump() for block in streamed.content] == [block.model_dump() for block in message.content]
    assert [event.content_block.type for event in events if event.type == "content_block_start"] == [
        "thinking", "text"]
    deltas = [event.delta.type for event in events if event.type == "content_block_delta"]
    thinking_deltas = deltas.index("signature_delta")  # the thinking block's last delta: its signature
    assert set(deltas[:thinking_deltas]) == {"thinking_delta"} and set(deltas[thinking_deltas + 1:]) == {"text_delta"}
    off = client.messages.create(thinking={"type": "disabled"}, **settings)
    assert [(block.type, block.text) for block in off.content] == [("text", ANSWER)]


def test_responses_have_a_reasoning_item_whole_and_streamed(openai_client):
    response = openai_client.responses.create(model=PREFIX, input=PROMPT, temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and [part.text for part in reasoning.content] == [REASONING]
    assert message.type == "message" and response.output_text == ANSWER
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(openai_client.responses.create(model=PREFIX, input=PROMPT, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert "".join(event.delta for event in events if event.type == "response.reasoning_text.delta") == REASONING
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    off = openai_client.responses.create(model=PREFIX, input=PROMPT, temperature=0, reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"] and off.output_text == ANSWER


def test_ollama_has_thinking_in_chat_and_generate_whole_and_streamed(thinking_gateway):
    client = ollama.Client(host=thinking_gateway.url, timeout=120)
    greedy = {"temperature": 0}
    reply = client.chat(model=PREFIX, messages=MESSAGES, think=True, options=greedy)
    assert (reply.message.thinking, reply.message.content) == (REASONING, ANSWER)
    lines = list(client.chat(model=PREFIX, messages=MESSAGES, think=True, options=greedy, stream=True))
    assert "".join(line.message.thinking or "" for line in lines) == REASONING
    assert "".join(line.message.content for line in lines) == ANSWER
    off = client.chat(model=PREFIX, messages=MESSAGES, think=False, options=greedy)
    assert (off.message.thinking, off.message.content) == (None, ANSWER)
    generated = client.generate(model=PREFIX, prompt=PROMPT, think=True, options=greedy)
    assert (generated.thinking, generated.response) == (REASONING, ANSWER)
    streamed = list(client.generate(model=PREFIX, prompt=PROMPT, options=greedy, stream=True))
    assert "".join(line.thinking or "" for line in streamed) == REASONING
    assert "thinking" in client.show(PREFIX).capabilities


def test_the_petals_api_gets_the_text_as_it_is(thinking_gateway, thinking_model, local_replies):
    """The Petals API has no field for reasoning: its text is the model's, tags and all."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(thinking_model)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    reply = requests.post(thinking_gateway.url + "/api/v1/generate", timeout=60,
                          json={"model": PREFIX, "inputs": prompt, "max_new_tokens": 40, "do_sample": False})
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"] == local_replies[True]
