"""Drives a running Warden server with the official OpenAI Python client; prints one JSON object.

Environment: WARDEN_URL (https://host:port), WARDEN_KEY, WARDEN_CERT (the PEM to trust),
WARDEN_MODEL, WARDEN_QUESTION.
"""

import json
import os

import openai

url, key, cert = os.environ["WARDEN_URL"], os.environ["WARDEN_KEY"], os.environ["WARDEN_CERT"]
model, question = os.environ["WARDEN_MODEL"], os.environ["WARDEN_QUESTION"]
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

r = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=8)
out["completion"] = r.choices[0].text
out["completion_finish"] = r.choices[0].finish_reason
parts = [c.choices[0].text for c in client.completions.create(
    model=model, prompt="The capital of France is", temperature=0, max_tokens=8, stream=True)]
out["completion_stream"] = "".join(parts)

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
