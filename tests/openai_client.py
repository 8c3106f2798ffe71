"""Drives a running Warden server with the official OpenAI Python client; prints one JSON object.

Environment: WARDEN_URL (https://host:port), WARDEN_KEY, WARDEN_CERT (the PEM to trust),
WARDEN_MODEL, WARDEN_QUESTION, WARDEN_PROMPT (a completion prompt), WARDEN_GREEDY (the id of its
greedy first token), WARDEN_FORCE (another token's id).
"""

import json
import os

import openai

url, key, cert = os.environ["WARDEN_URL"], os.environ["WARDEN_KEY"], os.environ["WARDEN_CERT"]
model, question = os.environ["WARDEN_MODEL"], os.environ["WARDEN_QUESTION"]
prompt, greedy, force = os.environ["WARDEN_PROMPT"], os.environ["WARDEN_GREEDY"], os.environ["WARDEN_FORCE"]
client = openai.OpenAI(base_url=url + "/v1", api_key=key, http_client=openai.DefaultHttpxClient(verify=cert), max_retries=0)
messages = [{"role": "user", "content": question}]
out = {"models": [m.id for m in client.models.list()]}

r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
out["chat"] = r.choices[0].message.content
out["chat_finish"] = r.choices[0].finish_reason
out["chat_usage"] = r.usage.model_dump()

parts, usage, finishes = [], None, []
for chunk in client.chat.completions.create(
    model=model, messages=messages, temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True}
):
    for c in chunk.choices:
        parts.append(c.delta.content or "")
        if c.finish_reason:
            finishes.append(c.finish_reason)
    if chunk.usage:
        usage = chunk.usage.model_dump()
out["chat_stream"] = "".join(parts)
out["stream_finishes"] = finishes
out["stream_usage"] = usage

r = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8, logprobs=2)
out["completion"] = r.choices[0].text
out["completion_finish"] = r.choices[0].finish_reason
lp = r.choices[0].logprobs
out["completion_logprobs"] = {
    "tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset,
    "top": [sorted(t.items(), key=lambda kv: -kv[1]) for t in lp.top_logprobs],
}
parts, tokens = [], []
for c in client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8, stream=True, logprobs=0):
    parts.append(c.choices[0].text)
    tokens += c.choices[0].logprobs.tokens if c.choices[0].logprobs else []
out["completion_stream"] = "".join(parts)
out["completion_stream_tokens"] = tokens
out["echo"] = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8, echo=True).choices[0].text
echo = "".join(c.choices[0].text for c in client.completions.create(
    model=model, prompt=prompt, temperature=0, max_tokens=8, echo=True, stream=True))
out["echo_stream"] = echo

# logit_bias: -100 on the greedy first token moves it; +100 on another forces that one.
r = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8, logprobs=0, logit_bias={greedy: -100})
out["banned_first"] = r.choices[0].logprobs.tokens[0]
r = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=3, logit_bias={force: 100})
out["forced"] = r.choices[0].text
out["force_text"] = client.completions.create(model=model, prompt=[int(force)], max_tokens=1, echo=True, logit_bias={force: 100}).choices[0].text
r = client.chat.completions.create(
    model=model, messages=messages, temperature=0, max_tokens=24, presence_penalty=1.5, frequency_penalty=1.0)
out["penalized"] = r.choices[0].message.content
try:
    client.chat.completions.create(model=model, messages=messages, max_tokens=4, frequency_penalty=2.5)
    out["bad_penalty"] = "accepted"
except openai.BadRequestError as e:
    out["bad_penalty"] = [e.status_code, e.code, e.body.get("param") if isinstance(e.body, dict) else None]

# Structured output: what comes back parses, and its schema accepts it.
import jsonschema

person = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de"]}, "maxItems": 3},
        "retired": {"type": "boolean"},
        "level": {"enum": ["junior", "senior"]},
    },
    "required": ["name", "age", "city", "languages", "retired", "level"],
    "additionalProperties": False,
}
fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
ask = [{"role": "user", "content": "Describe a person living in Paris as JSON."}]
structured = []
r = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=160, response_format=fmt)
structured.append((r.choices[0].message.content, r.choices[0].finish_reason))
text, finish = "", None
for chunk in client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=160, response_format=fmt, stream=True):
    for c in chunk.choices:
        text += c.delta.content or ""
        finish = c.finish_reason or finish
structured.append((text, finish))
r = client.chat.completions.create(model=model, messages=ask, temperature=0.9, seed=3, n=2, max_tokens=160, response_format=fmt)
structured += [(c.message.content, c.finish_reason) for c in r.choices]
for content, _ in structured:
    jsonschema.validate(json.loads(content), person)
out["structured"] = structured
r = client.completions.create(model=model, prompt="A JSON object describing a cat:", temperature=0, max_tokens=80, extra_body={"response_format": {"type": "json_object"}})
out["json_object"] = [type(json.loads(r.choices[0].text)).__name__, r.choices[0].finish_reason]
for name, bad in [("bad_schema", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frog"}}}),
                  ("bad_format", {"type": "xml"})]:
    try:
        client.chat.completions.create(model=model, messages=ask, max_tokens=4, response_format=bad)
        out[name] = "accepted"
    except openai.BadRequestError as e:
        out[name] = [e.status_code, e.code, e.body.get("param") if isinstance(e.body, dict) else None]

# Tools: a named function's call validates against its parameters; the client sends its result
# back with the assistant message as the SDK returned it; the model answers. `required`, streamed,
# assembles from tool-call deltas as clients do.
weather = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ask_weather = [{"role": "user", "content": "What is the weather in Paris?"}]
r = client.chat.completions.create(model=model, messages=ask_weather, tools=[weather], temperature=0, max_tokens=80,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
m = r.choices[0].message
for c in m.tool_calls:
    jsonschema.validate(json.loads(c.function.arguments), weather["function"]["parameters"])
out["tool_call"] = [[c.function.name for c in m.tool_calls], r.choices[0].finish_reason, m.tool_calls[0].id[:5], m.content]
history = ask_weather + [m, {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "18 C and sunny"}]
r = client.chat.completions.create(model=model, messages=history, tools=[weather], temperature=0, max_tokens=24)
out["tool_answer"] = r.choices[0].finish_reason
r = client.chat.completions.create(model=model, messages=history, tools=[weather], tool_choice="none", temperature=0, max_tokens=24)
out["tool_answer_text"] = [r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason]
calls, finish = {}, None
for chunk in client.chat.completions.create(model=model, messages=ask_weather, tools=[weather], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=80, stream=True):
    for c in chunk.choices:
        for d in c.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = c.finish_reason or finish
for call in calls.values():
    jsonschema.validate(json.loads(call["arguments"]), weather["function"]["parameters"])
out["tool_stream"] = [[c["name"] for c in calls.values()], finish]
for name, tools, choice in [
    ("bad_tool", [{"type": "function", "function": {"name": "get weather"}}], "auto"),
    ("bad_tool_choice", [weather], {"type": "function", "function": {"name": "launch"}}),
]:
    try:
        client.chat.completions.create(model=model, messages=ask_weather, max_tokens=4, tools=tools, tool_choice=choice)
        out[name] = "accepted"
    except openai.BadRequestError as e:
        out[name] = [e.status_code, e.code, e.body.get("param") if isinstance(e.body, dict) else None]

# Fields this server does not know, as SDKs and proxies add them: served, and named.
raw = client.chat.completions.with_raw_response.create(
    model=model, messages=messages + [{"role": "assistant", "content": "Paris.", "refusal": None}, {"role": "user", "content": "Sure?"}],
    temperature=0, max_tokens=4, store=False, metadata={"trace": "x"}, extra_body={"vendor_knob": 3})
out["ignored_header"] = raw.headers.get("x-warden-ignored-fields")
out["ignored_served"] = raw.parse().choices[0].finish_reason

r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3)
out["logprobs"] = [
    {"token": t.token, "logprob": t.logprob, "top": [(a.token, a.logprob) for a in t.top_logprobs]}
    for t in r.choices[0].logprobs.content
]

r = client.chat.completions.create(model=model, messages=messages, temperature=0.9, seed=7, max_tokens=6, n=2)
out["n"] = sorted(c.index for c in r.choices)

try:
    client.completions.create(model=model, prompt=[100] * 9000, max_tokens=4)
    out["over_length"] = "accepted"
except openai.BadRequestError as e:
    out["over_length"] = [e.status_code, e.code]

try:
    openai.OpenAI(base_url=url + "/v1", api_key="wdn-wrong", http_client=openai.DefaultHttpxClient(verify=cert), max_retries=0).models.list()
    out["bad_key"] = "accepted"
except openai.AuthenticationError as e:
    out["bad_key"] = [e.status_code, e.code]

print(json.dumps(out))
