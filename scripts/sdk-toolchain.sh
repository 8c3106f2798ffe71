#!/bin/sh
# Installs the toolchain the SDK's rust-version names (guest-sdk/Cargo.toml), with the
# wasm32-wasip2 target: the oldest a plugin author may build with, so the test suite builds a new
# plugin and the SDK's doc examples with it. Idempotent.
set -eu
cd "$(dirname "$0")/.."
version=$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' guest-sdk/Cargo.toml)
[ -n "$version" ] || { echo "guest-sdk/Cargo.toml names no rust-version" >&2; exit 1; }
rustup toolchain install "$version" --profile minimal --target wasm32-wasip2
