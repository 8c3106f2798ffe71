#!/bin/sh
# `warden bench` with its tags-off figures (the price of invariant 2's tag checks). The switch
# that turns the checks off exists only in builds with the `bench-tags-off` feature, so this
# builds one in its own target folder (target/bench) — no release build ever has it — and runs
# it with the arguments given (see `warden bench --help`).
set -eu
cd "$(dirname "$0")/.."
cargo build --release --features bench-tags-off --target-dir target/bench
exec target/bench/release/warden bench "$@"
