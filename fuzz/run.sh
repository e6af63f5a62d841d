#!/usr/bin/env bash
# Runs the codec fuzz target for a bounded time (default 60 s).
# Needs cargo-fuzz (installed here if missing) and a compiler that accepts
# -Z flags: a nightly toolchain, or stable with RUSTC_BOOTSTRAP=1.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-60}"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
if ! rustc --version | grep -q nightly; then
  export RUSTC_BOOTSTRAP=1
fi
mkdir -p corpus/frame_decoder
cargo fuzz run frame_decoder corpus/frame_decoder -- -max_total_time="$seconds" -max_len=4096
