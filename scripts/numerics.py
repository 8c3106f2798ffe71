#!/usr/bin/env python3
"""The numerics study: how far Warden's and llama.cpp's logprobs are from a higher-precision
reference, for every tensor type Warden reads.

For each type, the default model (SmolLM2-135M-Instruct) is requantized to it with llama.cpp's
`llama-quantize --allow-requantize`; the reference is the same weights dequantized to F32, run by
llama.cpp with an F32 KV cache and flash attention off. Over 8 chat prompts, at the first
generated position and the 15 after it (the reference's own greedy continuation fed back, so
every engine sees the same contexts: 128 positions), the reference's 10 most likely tokens are
scored by Warden and by llama.cpp (its defaults: f16 KV cache, flash attention on) on the
quantized file, and the mean absolute difference from the reference's logprobs is printed per
type, with which engine is closer. (One position's error is dominated by which activations sit
a hair from an 8-bit rounding boundary, so few positions make a noisy figure.)

Needs llama.cpp built as docs/development.md says ("Measuring against llama.cpp"; pass the
folder holding llama-server and llama-quantize) and Warden's example built:

    cargo build --release -p warden --example numerics
    python3 scripts/numerics.py $B [TYPE ...]

With types named, only those are measured (the mean row then covers them alone).
"""
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
WARDEN = ROOT / "target" / "release" / "examples" / "numerics"
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "F16", "BF16"]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 23?",
    "Name three primary colors.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to code.",
]
TOP = 10
POSITIONS = 16
PORT = 8098


def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


class Server:
    def __init__(self, bindir, model, *extra):
        self.p = subprocess.Popen(
            [str(bindir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(PORT),
             "-t", "2", "-c", "2048", "-np", "1", "--no-repack", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"llama-server did not start on {model}")

    def first_position(self, prompt, n):
        r = post("/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0, "n_probs": n, "cache_prompt": False})
        return {t["id"]: t["logprob"] for t in r["completion_probabilities"][0]["top_logprobs"]}

    def close(self):
        self.p.terminate()
        self.p.wait()


def quantize(bindir, src, dest, ty):
    subprocess.run([str(bindir / "llama-quantize"), "--allow-requantize", str(src), str(dest), ty],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main():
    bindir = Path(sys.argv[1])
    types = sys.argv[2:] or TYPES
    unknown = [t for t in types if t not in TYPES]
    if unknown:
        sys.exit(f"not a type this study covers: {unknown} (the types: {TYPES})")
    tmp = Path(tempfile.mkdtemp(prefix="warden-numerics-"))
    s = Server(bindir, BASE)
    prompts = []
    for q in QUESTIONS:
        text = post("/apply-template", {"messages": [{"role": "user", "content": q}]})["prompt"]
        prompts.append(post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"])
    s.close()
    print("| type | Warden | llama.cpp | closer |")
    print("|---|---|---|---|")
    totals = {"warden": [], "llama": []}
    for ty in types:
        model, ref = tmp / f"{ty}.gguf", tmp / f"{ty}-f32.gguf"
        quantize(bindir, BASE, model, ty)
        quantize(bindir, model, ref, "F32")
        s = Server(bindir, ref, "-ctk", "f32", "-ctv", "f32", "-fa", "off")
        contexts, refs = [], []
        for p in prompts:
            ctx = list(p)
            for _ in range(POSITIONS):
                r = s.first_position(ctx, TOP)
                contexts.append(list(ctx))
                refs.append(r)
                ctx.append(max(r, key=r.get))
        s.close()
        s = Server(bindir, model)
        llama = [s.first_position(c, 100) for c in contexts]
        s.close()
        ids = [list(r) for r in refs]
        got = subprocess.run([str(WARDEN), "--model", str(model)], input=json.dumps({"prompts": contexts, "ids": ids}),
                             capture_output=True, text=True, check=True).stdout
        warden = json.loads(got)
        ew, el = [], []
        for r, w, l in zip(refs, warden, llama):
            for (tid, want), lw in zip(r.items(), w):
                ew.append(abs(lw - want))
                # A reference token outside llama.cpp's top 100 counts at its 100th logprob.
                el.append(abs(l.get(tid, min(l.values())) - want))
        mw, ml = sum(ew) / len(ew), sum(el) / len(el)
        totals["warden"].append(mw)
        totals["llama"].append(ml)
        print(f"| {ty} | {mw:.4f} | {ml:.4f} | {'Warden' if mw <= ml else 'llama.cpp'} |", flush=True)
        model.unlink()
        ref.unlink()
    mw = sum(totals["warden"]) / len(types)
    ml = sum(totals["llama"]) / len(types)
    print(f"| mean | {mw:.4f} | {ml:.4f} | {'Warden' if mw <= ml else 'llama.cpp'} |")


if __name__ == "__main__":
    main()
