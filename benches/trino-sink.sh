#!/usr/bin/env bash
# One task attempt's output through Trino's exchange SPI, without a query
# engine around it (BinxSinkBench): the sink's add and finish(), the
# coordinator's steps to the source handles, one source reading it all back;
# Trino's filesystem exchange against binx (spool policy commit and always,
# one release binxd; and commit read back through a second binxd, as a
# consumer on another node reads through its own sidecar's forwarder), the
# cases in turn each round. Writes target/bench/trino-sink.md (medians and
# ratios against the filesystem exchange in the same run) and binxd's
# request latency histograms beside it (trino-sink.md.metrics). Both stores go under java.io.tmpdir: set
# JAVA_TOOL_OPTIONS=-Djava.io.tmpdir=/dev/shm to compare them in memory.
#
#   benches/trino-sink.sh           60 rounds of 16 partitions x 4 pages of 32 KiB
#   benches/trino-sink.sh --quick   5 rounds: checks the harness
#
# More settings as -D arguments after the mode: -Dbinx.bench.rounds=,
# -Dbinx.bench.partitions=, -Dbinx.bench.pages=, -Dbinx.bench.page-size=;
# any property of the binx plugin as -Dbinx.bench.exchange.binx.<name>=
# (e.g. -Dbinx.bench.exchange.binx.source-concurrent-readers=16).
set -euo pipefail
cd "$(dirname "$0")/.."
props=()
if [ "${1:-}" = --quick ]; then
  props=(-Dbinx.bench.rounds=5 -Dbinx.bench.warmup-rounds=3)
  shift
fi
cargo build --release --bin binxd >&2
out="$PWD/target/bench/trino-sink.md"
rm -f "$out"
BINX_BINXD="$PWD/target/release/binxd" BINX_BENCH_TEST=BinxSinkBench \
  scripts/java.sh bench -Dbinx.bench.out="$out" ${props[@]+"${props[@]}"} "$@"
cat "$out"
