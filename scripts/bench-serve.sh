#!/usr/bin/env bash
# Starts `warden serve` on a fresh data dir and drives it with the load generator
# (host/examples/serve_load.rs): 16 concurrent streaming chat clients while 1,000 idle TLS
# connections are held open. Prints the load generator's JSON.
#
#   scripts/bench-serve.sh [CLIENTS] [REQUESTS_PER_CLIENT] [MAX_TOKENS] [IDLE]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin warden --example serve_load
DIR=$(mktemp -d target/bench-serve.XXXXXX)
cat > "$DIR/warden.toml" <<TOML
listen = "127.0.0.1:0"
# Relative paths in a config file are its directory's.
data_dir = "data"
policies = "$PWD/policies"
TOML
target/release/warden serve --config "$DIR/warden.toml" > "$DIR/serve.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    grep -q ' serving .* on ' "$DIR/serve.log" && break
    sleep 0.5
done
URL=$(sed -n 's/.* serving .* on //p' "$DIR/serve.log")
KEY=$(sed -n 's/.*API key (shown only now): //p' "$DIR/serve.log")
[ -n "$URL" ] && [ -n "$KEY" ] || { cat "$DIR/serve.log" >&2; exit 1; }
target/release/examples/serve_load "$URL" "$DIR/data/tls/cert.pem" "$KEY" "${1:-16}" "${2:-4}" "${3:-128}" "${4:-1000}"
