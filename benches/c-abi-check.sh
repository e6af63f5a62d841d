#!/usr/bin/env bash
# Runs the C example engine (examples/c/engine.c) against a fresh binxd under
# valgrind (memcheck, leaks) and under AddressSanitizer + LeakSanitizer.
# Fails on any memory error or leak. Needs gcc; valgrind is used if present.
#
#   benches/c-abi-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --release -p binx-capi
cargo build --quiet --release --bin binxd
work=$(mktemp -d)
trap 'kill "$daemon" 2>/dev/null || true; rm -rf "$work"' EXIT
./target/release/binxd --uds-path "$work/binx.sock" --tcp-listen 127.0.0.1:0 \
    --http-listen "" 2>"$work/binxd.log" &
daemon=$!
for _ in $(seq 100); do [ -S "$work/binx.sock" ] && break; sleep 0.05; done
lib=target/release/libbinx.a
gcc -std=c11 -g -O1 -I include examples/c/engine.c "$lib" -lpthread -ldl -lm -o "$work/engine"
gcc -std=c11 -g -O1 -fsanitize=address -fno-omit-frame-pointer -I include \
    examples/c/engine.c "$lib" -lpthread -ldl -lm -o "$work/engine-asan"
if command -v valgrind >/dev/null; then
    echo "== valgrind memcheck"
    valgrind --quiet --leak-check=full --errors-for-leak-kinds=definite,indirect \
        --error-exitcode=3 "$work/engine" "$work/binx.sock" c-abi.valgrind
    echo "== valgrind memcheck, shared memory"
    valgrind --quiet --leak-check=full --errors-for-leak-kinds=definite,indirect \
        --error-exitcode=3 "$work/engine" --shm "$work/binx.sock" c-abi.valgrind.shm
else
    echo "== valgrind not installed; skipping it (AddressSanitizer still runs)"
fi
echo "== AddressSanitizer + LeakSanitizer"
ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 "$work/engine-asan" "$work/binx.sock" c-abi.asan
echo "== AddressSanitizer + LeakSanitizer, shared memory"
ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 "$work/engine-asan" --shm "$work/binx.sock" c-abi.asan.shm
echo "C ABI check passed"
