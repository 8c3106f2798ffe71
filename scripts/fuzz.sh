#!/bin/sh
# Runs Warden's cargo-fuzz targets (fuzz/fuzz_targets) on the nightly toolchain, installing
# cargo-fuzz if it is missing. Each target starts from its committed seeds (fuzz/seeds/<target>)
# and writes what it finds to fuzz/corpus/<target>; a crash leaves its input in
# fuzz/artifacts/<target> and fails the script.
#
#   scripts/fuzz.sh                 every target for FUZZ_SECONDS (default 5) each: CI's smoke run
#   scripts/fuzz.sh tokenizer gguf  those targets only
#   FUZZ_RUNS=1000000 scripts/fuzz.sh gguf   a million executions instead of a time
set -eu
cd "$(dirname "$0")/.."
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    cargo +nightly install cargo-fuzz --locked
fi
targets="$*"
if [ -z "$targets" ]; then
    targets=$(cargo +nightly fuzz list --fuzz-dir fuzz)
fi
seconds="${FUZZ_SECONDS:-5}"
for t in $targets; do
    mkdir -p "fuzz/corpus/$t"
    if [ -n "${FUZZ_RUNS:-}" ]; then
        limit="-runs=$FUZZ_RUNS"
    else
        limit="-max_total_time=$seconds"
    fi
    echo "fuzz: $t ($limit)"
    log="fuzz/corpus/$t.log"
    if ! cargo +nightly fuzz run --fuzz-dir fuzz "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
        "$limit" -timeout=30 -rss_limit_mb=4096 -max_len=65536 >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "fuzz: $t failed (a build error, or a failing input in fuzz/artifacts/$t); log in $log" >&2
        exit 1
    fi
    grep -E '^(#[0-9]+.*DONE|Done [0-9]+ runs)' "$log" || tail -n 3 "$log"
done
