"""vLLM's structured-output fields on the OpenAI API, through real gunicorn in front of the tiny swarm: the tiny
model's random weights still produce text that matches the regular expression, or is one of the choices, because
the engine holds every token to the grammar."""

import json
import re

import openai
import pytest

REGEX = r"(yes|no), [0-9]{2}-[a-z]{1,3}"
CHOICES = ["Paris", "Tokyo", "New York", "a.b (c)"]
SPELLINGS = {  # (kind, spelling) -> the request's extra fields
    ("regex", "structured_outputs"): {"structured_outputs": {"regex": REGEX}},
    ("regex", "guided"): {"guided_regex": REGEX},
    ("choice", "structured_outputs"): {"structured_outputs": {"choice": CHOICES}},
    ("choice", "guided"): {"guided_choice": CHOICES},
}


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="not-needed", max_retries=0)


def matches(kind: str, text: str) -> bool:
    return bool(re.fullmatch(REGEX, text)) if kind == "regex" else text in CHOICES


@pytest.mark.parametrize("kind, spelling", list(SPELLINGS))
@pytest.mark.parametrize("seed", [1, 2])
def test_chat_completions_match(client, kind, spelling, seed):
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Answer."}],
                                           temperature=1.0, seed=seed, max_tokens=40,
                                           extra_body=SPELLINGS[kind, spelling])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and matches(kind, choice.message.content), choice.message.content


@pytest.mark.parametrize("kind, spelling", list(SPELLINGS))
def test_completions_match(client, kind, spelling):
    reply = client.completions.create(model="tiny", prompt="The answer is", temperature=1.0, seed=4, max_tokens=40,
                                      n=2, extra_body=SPELLINGS[kind, spelling])
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and matches(kind, choice.text), choice.text


def test_streamed_regex_matches(client):
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Answer."}],
                                            temperature=1.0, seed=5, max_tokens=40, stream=True,
                                            extra_body={"guided_regex": REGEX})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert re.fullmatch(REGEX, text), text


def test_guided_json_and_grammar(client):
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}},
              "additionalProperties": False}
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        reply = client.completions.create(model="tiny", prompt="JSON:", temperature=0, max_tokens=60, extra_body=extra)
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].text  # the schema's object is complete
        data = json.loads(reply.choices[0].text)
        assert set(data) == {"ok"} and isinstance(data["ok"], bool)
    grammars = (({"guided_grammar": 'root ::= "yes" | "no"'}, ("yes", "no")),
                ({"structured_outputs": {"grammar": 'start: "on" | "off"'}}, ("on", "off")))
    for extra, words in grammars:
        reply = client.completions.create(model="tiny", prompt="Say", temperature=1.0, seed=1, max_tokens=10,
                                          extra_body=extra)
        assert reply.choices[0].text in words and reply.choices[0].finish_reason == "stop"


def nested_schema(levels: int) -> dict:
    """An object schema `levels` objects deep (twice as deep as JSON: each level is under "properties")."""
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("extra, param", [
    # nested 400 deep: a RecursionError (a 500) in the schema's rewriting once; refused with the body's JSON now
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "strict": True,
                                                                  "schema": nested_schema(400)}}}, "response_format"),
    # within the body's bound (40 objects are 81 levels of JSON): refused where the schema is compiled
    ({"guided_json": nested_schema(40)}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a{2,1}"}}, "structured_outputs.regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_bad_structured_outputs_are_400s_naming_the_field(client, extra, param, route):
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "chat":
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], extra_body=extra)
        else:
            client.completions.create(model="tiny", prompt="x", extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and error["message"].startswith(param) and error["type"] == "invalid_request_error"
    assert "Traceback" not in json.dumps(error)


def test_forced_tool_parameters_nested_400_deep_are_a_400_naming_tools(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": nested_schema(400)}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], tools=[tool],
                                       tool_choice="required")
    assert caught.value.body["param"] == "tools" and "nested deeper than" in caught.value.body["message"]
