"""What the chat-shaped dialects share (OpenAI's chat and text completions, the Responses API, Anthropic's Messages,
Ollama's chat and generate): each translates its request into these terms once, and formats the replies it gets back.

In data-flow order:

    schemas.py     the shared request fields: sampling, stops, structured output, chat messages, tools
    params.py      those fields -> SamplingParams, a token budget, stops, logprobs, the ToolChoice, the grammar
    structured.py  which structured output a request asks for (response_format, grammar, vLLM's guided_*)
    prompts.py     chat messages -> a prompt with the model's chat template
    reasoning.py   a thinking model's reply split into reasoning and answer, as it comes (which templates think)
    plan.py        everything checked and the session open before a reply starts: a Plan of n choices
    tool_stream.py tool calls read out of a reply as it comes: text, then each call's name and argument fragments
    reply.py       the one reply assembly: a plan's deltas summed into replies (text and tool calls as they are
                   written, reasoning apart, finish reason, counts), told as events that each dialect only formats
"""
