#!/usr/bin/env bash
# TPC-H on a real three-node Trino 483 (a coordinator and two workers in one
# JVM, Trino's DistributedQueryRunner): retry-policy=NONE against TASK on
# Trino's filesystem exchange (local disk) and TASK on binx, spool policy
# commit and always, each node with its own release binxd; the 22 queries,
# NONE and TASK interleaved query by query, every TASK answer checked
# against NONE's. Writes target/bench/trino-tpch.md (per-query times, the
# ratios, the sidecars' peak RSS against their memory limit + 64 MiB).
#
#   benches/trino-tpch.sh           sf1, the 22 queries once at tiny first (JIT warm-up)
#   benches/trino-tpch.sh --quick   tiny, no warm-up: checks the harness in a few minutes
#
# More settings as -D arguments after the mode: -Dbinx.bench.reps=3 (fastest
# of 3), -Dbinx.bench.sidecar-memory=2GiB, -Dbinx.bench.queries=9,22 (those
# queries only), -Dbinx.bench.order=commit,always,filesystem (which clusters,
# in which order: filesystem and at least one binx policy; the clusters share
# one JVM: the first runs on a colder JIT, so compare each cluster's
# TASK / NONE, which the report gives first), -Dbinx.bench.rounds=2 (the
# clusters twice, the second time in the reverse order, so each runs early
# and late; a query's time is its fastest over both; the report adds each
# round's ratio), -Dbinx.bench.paired=true (a round's clusters side by
# side in the JVM, timed query by query in turn, so the JIT's warm-up and
# the machine's drift hit them alike); BINX_BENCH_XMX (8g) is the heap of
# the JVM running the Trino servers (three a cluster).
#
#   benches/trino-tpch.sh -Dbinx.bench.order=commit,filesystem -Dbinx.bench.rounds=2 \
#       -Dbinx.bench.reps=2 -Dbinx.bench.paired=true
#                                   binx commit against the filesystem exchange, side
#                                   by side, both orders (about 25 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
props=()
if [ "${1:-}" = --quick ]; then
  props=(-Dbinx.bench.schema=tiny -Dbinx.bench.warmup=false)
  shift
fi
cargo build --release --bin binxd >&2
out="$PWD/target/bench/trino-tpch.md"
rm -f "$out"
BINX_BINXD="$PWD/target/release/binxd" scripts/java.sh bench -Dbinx.bench.out="$out" "${props[@]}" "$@"
cat "$out"
