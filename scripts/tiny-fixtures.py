#!/usr/bin/env python3
"""Makes host/tests/fixtures/tiny/: a tiny GGUF model of every architecture Warden runs in every
tensor type it reads, each with llama.cpp's greedy tokens and top-5 logprobs.

Deterministic from the seed. Needs `numpy` and `gguf` (pip install numpy gguf==0.19.0) and
llama.cpp's `llama-quantize` and `llama-server` built as docs/development.md says ("Measuring
against llama.cpp"); pass the folder holding them:

    python3 scripts/tiny-fixtures.py $B

For each architecture (llama, qwen2, qwen3, gemma3) it writes two F32 models with random weights
and a 257-token byte-level BPE vocabulary: one 64 wide, kept as F32 and converted to F16 and BF16
(float rows may have any length), and one 256 wide (K-quant rows are whole 256-element
super-blocks), quantized by llama-quantize to Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K_S, Q4_K_S,
Q5_K_S and Q6_K (llama-quantize keeps some tensors at other types, so these files mix types as
real ones do). Gemma 3 has two blocks, the first sliding over a window of 4, the second global.

Then it serves each file with llama-server on loopback (2 threads, --no-repack, temperature 0)
and records, for two prompts given as token ids, 8 greedy tokens (end of generation ignored) with
the top five logprobs at each: `<arch>-<type>.json` beside `<arch>-<type>.gguf`.
"""
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType

SEED = 20261206
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "host" / "tests" / "fixtures" / "tiny"
TMP = Path("/tmp/warden-tiny")
ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
FLOAT_TYPES = ["F32", "F16", "BF16"]
QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q4_K_S", "Q5_K_S", "Q6_K"]
PROMPTS = [[39, 68, 75, 75, 78, 11, 94, 100, 120, 130], [51, 71, 68, 94]]
STEPS = 8
PORT = 8097


def vocabulary():
    """257 byte-level BPE tokens that all decode to ASCII (so llama-server never holds one back
    as an incomplete UTF-8 sequence, and each generated token is one step): the printable ASCII
    characters, GPT-2's stand-ins for space and newline, two-letter pairs, and an end token."""
    tokens = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["\u0120", "\u010a"]
    letters = "abcdefghijklmnop"
    tokens += [a + b for a in letters for b in "abcdefghij"]
    return tokens[:256] + ["<|endoftext|>"]


def write_model(path, arch, dim, ffn, rng):
    layers = 2 if arch == "gemma3" else 1
    heads, kv_heads = 2, 1
    hd = dim // heads
    tokens = vocabulary()
    vocab = len(tokens)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6 if arch != "llama" else 1e-5)
    w.add_rope_freq_base(10000.0)
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch == "gemma3":
        w.add_sliding_window(4)
        w.add_uint32("gemma3.attention.sliding_window_pattern", 2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.NORMAL] * (vocab - 1) + [TokenType.CONTROL])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(vocab - 1)
    w.add_bos_token_id(vocab - 1)
    w.add_add_bos_token(False)

    def t(name, shape, scale):
        # ggml order: shape[0] is the row length.
        data = (rng.standard_normal(tuple(reversed(shape))) * scale).astype(np.float32)
        w.add_tensor(name, data)

    def norm(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    t("token_embd.weight", [dim, vocab], 1.0)
    norm("output_norm.weight", dim)
    t("output.weight", [dim, vocab], 3.0 / np.sqrt(dim))
    for l in range(layers):
        p = f"blk.{l}."
        norm(p + "attn_norm.weight", dim)
        t(p + "attn_q.weight", [dim, heads * hd], 1.0 / np.sqrt(dim))
        t(p + "attn_k.weight", [dim, kv_heads * hd], 1.0 / np.sqrt(dim))
        t(p + "attn_v.weight", [dim, kv_heads * hd], 1.0 / np.sqrt(dim))
        t(p + "attn_output.weight", [heads * hd, dim], 1.0 / np.sqrt(heads * hd))
        norm(p + "ffn_norm.weight", dim)
        t(p + "ffn_gate.weight", [dim, ffn], 1.0 / np.sqrt(dim))
        t(p + "ffn_up.weight", [dim, ffn], 1.0 / np.sqrt(dim))
        t(p + "ffn_down.weight", [ffn, dim], 1.0 / np.sqrt(ffn))
        if arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", (0.1 * rng.standard_normal(heads * hd)).astype(np.float32))
            w.add_tensor(p + "attn_k.bias", (0.1 * rng.standard_normal(kv_heads * hd)).astype(np.float32))
            w.add_tensor(p + "attn_v.bias", (0.1 * rng.standard_normal(kv_heads * hd)).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
        if arch == "gemma3":
            norm(p + "post_attention_norm.weight", dim)
            norm(p + "post_ffw_norm.weight", dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def oracle(bindir, model):
    server = subprocess.Popen(
        [str(bindir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(PORT),
         "-t", "2", "-c", "64", "-np", "1", "--no-repack"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        runs = []
        for prompt in PROMPTS:
            r = post("/completion", {
                "prompt": prompt, "n_predict": STEPS, "temperature": 0, "n_probs": 5,
                "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
            })
            ids = [p["id"] for p in r["completion_probabilities"]]
            assert ids == r["tokens"] and len(ids) == STEPS, (model, ids, r["tokens"])
            runs.append({
                "prompt_tokens": prompt,
                "steps": [{"id": p["id"], "top5": [[t["id"], round(t["logprob"], 5)] for t in p["top_logprobs"]]}
                          for p in r["completion_probabilities"]],
            })
        return runs
    finally:
        server.terminate()
        server.wait()


def main():
    bindir = Path(sys.argv[1])
    rng = np.random.default_rng(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    TMP.mkdir(parents=True, exist_ok=True)
    for arch in ARCHS:
        small, big = TMP / f"{arch}-small.gguf", TMP / f"{arch}-big.gguf"
        write_model(small, arch, 64, 128, rng)
        write_model(big, arch, 256, 256, rng)
        for ty in FLOAT_TYPES + QUANT_TYPES:
            dest = OUT / f"{arch}-{ty}.gguf"
            src = small if ty in FLOAT_TYPES else big
            if ty == "F32":
                dest.write_bytes(src.read_bytes())
            else:
                subprocess.run([str(bindir / "llama-quantize"), str(src), str(dest), ty],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            runs = oracle(bindir, dest)
            meta = {
                "model": dest.name,
                "reference_engine": "llama.cpp b11434 llama-server, CPU, 2 threads, --no-repack, temperature 0, f16 KV cache, flash attention auto (on)",
                "runs": runs,
            }
            dest.with_suffix(".json").write_text(json.dumps(meta, separators=(",", ":")) + "\n")
            print(dest.name, dest.stat().st_size, file=sys.stderr)


if __name__ == "__main__":
    main()
