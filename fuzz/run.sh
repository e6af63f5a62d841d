#!/usr/bin/env bash
# Runs each fuzz target (frame decoder, segment reader, HTTP exchange
# request, the consumer machine fed hostile DATA replies) for a bounded
# time (default 60 s each).
# Needs cargo-fuzz (installed here if missing) and a compiler that accepts
# -Z flags: a nightly toolchain, or stable with RUSTC_BOOTSTRAP=1.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-60}"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
if ! rustc --version | grep -q nightly; then
  export RUSTC_BOOTSTRAP=1
fi
for target in frame_decoder segment_reader http_request data_reply; do
  mkdir -p "corpus/$target"
  cargo fuzz run "$target" "corpus/$target" -- -max_total_time="$seconds" -max_len=4096
done
