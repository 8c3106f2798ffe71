#!/usr/bin/env bash
# Creates .venv-e2e with the official OpenAI Python client, which the end-to-end tests drive
# against the real server, the jsonschema package they validate structured output with, and
# PyYAML, which reads the Kubernetes manifests `kubectl kustomize` renders (tests/deploy.rs).
# Idempotent: an existing venv with the pinned packages is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-e2e
PIN=("openai==3.60.0" "jsonschema==4.23.0" "pyyaml==6.0.3")
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("openai") != "3.60.0" or m.version("jsonschema") != "4.23.0" or m.version("pyyaml") != "6.0.3")' 2>/dev/null; then
    exit 0
fi
if ! command -v python3 >/dev/null; then
    echo "e2e-venv: python3 is needed for the end-to-end tests (the OpenAI client runs in a venv)" >&2
    exit 1
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "${PIN[@]}"
echo "e2e-venv: $VENV has ${PIN[*]}"
