#!/usr/bin/env bash
# How binxd scales with the cores it is given: every figure is a ratio
# within this one run (the machine's noise cancels), printed as markdown
# with the date, the core count and the commit.
#
#   benches/scaling.sh                 full run (about 6 minutes on 2 cores)
#   QUICK=1 benches/scaling.sh         each case once, briefly (CI's quick mode)
#   BINX_BIN_DIR=dir benches/scaling.sh  binxd and binx built already (e.g.
#                                      release binaries carried to another
#                                      machine); else built here (release)
#   SCALING_PROCESSES="1 2 4 8"        client process counts for part 2
#   SCALING_BULK=0                     skip part 4 (it builds the bulk bench)
#
# Parts:
#   1. `binx bench`: BinX against binxd's own HTTP exchange, same binxd,
#      alternating, at 1/8/64/256 parallel for 32 B, 1 KiB, 32 KiB, 128 KiB
#      and 1 MiB chunks (BinX/HTTP per case).
#   2. N `binx bench` processes at once (BinX only, 64 parallel each, 32 B
#      and 1 MiB): the total, and the total against one process; then one
#      process over 1, 2, 4 and 8 BinX sockets (`--connections`: the
#      stripes of its one connection; elsewhere the client's default, one
#      per two cores, at most 8).
#   3. binxd's CPU-seconds per GB served (BinX, 1 MiB chunks, 64 parallel)
#      and per million requests served (32 B), from /proc and /v1/stats.
#   4. One ExchangeSource reading a buffer to its end against one hot TCP
#      stream (`benches/bulk.rs`: raw, binx-default).
set -euo pipefail
cd "$(dirname "$0")/.."

quick=${QUICK:-0}
processes=${SCALING_PROCESSES:-1 2 4 8}
if [ "$quick" = 1 ]; then
  per_case=0.2s
  parallel=1,8,64,256
  bulk=${SCALING_BULK:-0}
else
  per_case=2s
  parallel=1,8,64,256
  bulk=${SCALING_BULK:-1}
fi

bin=${BINX_BIN_DIR:-}
if [ -z "$bin" ]; then
  echo "== building binxd and binx (release)" >&2
  cargo build --release --locked --bin binxd --bin binx >&2
  bin=target/release
fi
[ -x "$bin/binxd" ] && [ -x "$bin/binx" ] || { echo "no binxd and binx in '$bin'" >&2; exit 2; }

work=$(mktemp -d)
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
tcp=$(free_port)
http=$(free_port)
export BINX_TCP_LISTEN=127.0.0.1:$tcp
export BINX_HTTP_LISTEN=127.0.0.1:$http
export BINX_UDS_PATH=$work/binx.sock
export BINX_DATA_DIR=$work/data
export BINX_MEMORY_LIMIT=${SCALING_MEMORY_LIMIT:-6GiB}
export BINX_TASK_MEMORY_LIMIT=512MiB
export BINX_SPOOL_STORES=
export BINX_LOG_LEVEL=warn
"$bin/binxd" >"$work/binxd.log" 2>&1 &
pid=$!
for _ in $(seq 100); do
  [ -S "$BINX_UDS_PATH" ] && break
  kill -0 "$pid" 2>/dev/null || { cat "$work/binxd.log" >&2; exit 1; }
  sleep 0.1
done
[ -S "$BINX_UDS_PATH" ] || { echo "binxd did not start" >&2; cat "$work/binxd.log" >&2; exit 1; }

ticks=$(getconf CLK_TCK)
cpu_seconds() { awk -v t="$ticks" '{printf "%.3f\n", ($14 + $15) / t}' "/proc/$pid/stat"; }
stat_of() {
  python3 - "$http" "$1" <<'EOF'
import json, sys, urllib.request
stats = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v1/stats"))
key = sys.argv[2]
if key == "data_requests":
    print(sum(v for k, v in stats["requests"].items() if k.startswith("DATA")))
else:
    print(stats[key])
EOF
}
bench() {
  "$bin/binx" bench --remote "127.0.0.1:$tcp" --uds "$BINX_UDS_PATH" "$@"
}

cores=$(nproc)
echo "# binxd scaling, $(date -u +%F) $(date -u +%H:%MZ), $cores cores ($(uname -m), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo
echo "Command: \`${QUICK:+QUICK=$QUICK }benches/scaling.sh\`. Every figure is a ratio within this run."
echo "binxd's core runs as $(stat_of shards) shard(s) (the shards setting; BINX_SHARDS=1 puts every task behind one lock)."
echo

echo "## 1. BinX against binxd's HTTP exchange (one client process)"
echo
bench --http "127.0.0.1:$http" --sizes 32B,1KiB,32KiB,128KiB,1MiB --parallel "$parallel" \
  --time-per-case "$per_case" --max-task-bytes 64MiB
echo

echo "## 2. Client processes at once (BinX, 64 parallel each)"
echo
echo "| processes | 32 B requests/s | vs 1 process | 1 MiB MB/s | vs 1 process |"
echo "|---|---|---|---|---|"
base_small=
base_large=
for n in $processes; do
  clients=()
  for i in $(seq "$n"); do
    bench --http "" --sizes 32B,1MiB --parallel 64 --time-per-case "$per_case" \
      --max-task-bytes 32MiB >"$work/proc-$n-$i.md" 2>"$work/proc-$n-$i.err" &
    clients+=($!)
  done
  for c in "${clients[@]}"; do
    wait "$c" || { echo "a client process failed:" >&2; cat "$work"/proc-"$n"-*.err >&2; exit 1; }
  done
  read -r small large < <(cat "$work"/proc-"$n"-*.md | awk -F'|' '
    $3 ~ /64/ && $2 ~ / 32 B / { small += $5 }
    $3 ~ /64/ && $2 ~ /MiB/ { large += $5 }
    END { printf "%.3f %.1f\n", small, large }')
  requests=$(awk -v mb="$small" 'BEGIN { printf "%.0f", mb * 1e6 / 32 }')
  base_small=${base_small:-$requests}
  base_large=${base_large:-$large}
  awk -v n="$n" -v r="$requests" -v l="$large" -v bs="$base_small" -v bl="$base_large" \
    'BEGIN { printf "| %d | %d | %.2f | %.0f | %.2f |\n", n, r, (bs > 0 ? r / bs : 0), l, (bl > 0 ? l / bl : 0) }'
done
echo

echo "## 2b. One client process over several sockets (BinX, 64 parallel; --connections, the stripes of one connection)"
echo
echo "| connections | 32 B requests/s | vs 1 | 128 KiB MB/s | vs 1 | 1 MiB MB/s | vs 1 |"
echo "|---|---|---|---|---|---|---|"
base=
for c in 1 2 4 8; do
  bench --http "" --sizes 32B,128KiB,1MiB --parallel 64 --time-per-case "$per_case" \
    --max-task-bytes 32MiB --connections "$c" >"$work/conn-$c.md"
  row=$(awk -F'|' '
    $3 ~ /64/ && $2 ~ / 32 B / { s = $5 }
    $3 ~ /64/ && $2 ~ /128/ { m = $5 }
    $3 ~ /64/ && $2 ~ /1.0 MiB/ { l = $5 }
    END { printf "%.0f %.1f %.1f\n", s * 1e6 / 32, m, l }' "$work/conn-$c.md")
  base=${base:-$row}
  awk -v c="$c" -v row="$row" -v base="$base" 'BEGIN {
    split(row, r, " "); split(base, b, " ")
    printf "| %d | %d | %.2f | %.0f | %.2f | %.0f | %.2f |\n", c, r[1], r[1] / b[1], r[2], r[2] / b[2], r[3], r[3] / b[3]
  }'
done
echo

echo "## 3. binxd's CPU per byte and per request (BinX, 64 parallel)"
echo
cpu0=$(cpu_seconds); bytes0=$(stat_of bytes_served)
bench --http "" --sizes 1MiB --parallel 64 --time-per-case "$per_case" --max-task-bytes 64MiB >/dev/null
cpu1=$(cpu_seconds); bytes1=$(stat_of bytes_served)
req0=$(stat_of data_requests)
bench --http "" --sizes 32B --parallel 64 --time-per-case "$per_case" >/dev/null
cpu2=$(cpu_seconds); req1=$(stat_of data_requests)
awk -v c0="$cpu0" -v c1="$cpu1" -v c2="$cpu2" -v b0="$bytes0" -v b1="$bytes1" -v r0="$req0" -v r1="$req1" -v cores="$cores" 'BEGIN {
  gb = (b1 - b0) / 1e9; req = r1 - r0
  printf "| measure | value |\n|---|---|\n"
  printf "| CPU-seconds per GB served (1 MiB chunks) | %.3f (%.1f GB served) |\n", (gb > 0 ? (c1 - c0) / gb : 0), gb
  printf "| CPU-seconds per million DATA requests (32 B chunks) | %.2f (%d requests) |\n", (req > 0 ? (c2 - c1) * 1e6 / req : 0), req
  printf "| DATA requests per CPU-second of binxd (32 B) | %.0f (on %d cores) |\n", (c2 > c1 ? req / (c2 - c1) : 0), cores
}'
echo

if [ "$bulk" = 1 ]; then
  echo "## 4. One ExchangeSource against one hot TCP stream"
  echo
  if [ "$quick" = 1 ]; then
    cargo test --release --locked --bench bulk >&2
  else
    cargo bench --locked --bench bulk -- 'bulk/1MiB/(raw|binx-default)$' >&2
  fi
  cat target/criterion/bulk-summary.md 2>/dev/null || echo "(no bulk summary written)"
fi
