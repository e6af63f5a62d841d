#!/usr/bin/env bash
# Runs the deterministic simulation over a wide range of seeds, one process
# per core, and prints seeds per second and every seed that broke an
# invariant (with the command that replays it). Exits 1 if any did.
#
#   scripts/sim-wide.sh [SEEDS] [FIRST]       default 2,000,000 seeds from 20,000,000
#   SIM_JOBS=16 scripts/sim-wide.sh ...       processes (default: nproc)
#   SIM_BIN=path scripts/sim-wide.sh ...      a simulation test binary built
#                                             already (e.g. carried to another
#                                             machine); else it is built here
#   SIM_LOGS=dir                              keep each process's output there
#
# Before resolving a change to the core or the consumer machine, run at
# least 2 million seeds and note the range and the count (the developers'
# guide). On 2 cores that is about 40 minutes; 16 cores take a few.
set -euo pipefail
cd "$(dirname "$0")/.."

seeds=${1:-2000000}
first=${2:-20000000}
jobs=${SIM_JOBS:-$(nproc)}
case "$seeds$first$jobs" in *[!0-9]*) echo "usage: $0 [SEEDS] [FIRST] (numbers)" >&2; exit 2 ;; esac
[ "$jobs" -ge 1 ] || jobs=1

bin=${SIM_BIN:-}
if [ -z "$bin" ]; then
  echo "== building the simulation (profile sim: release, debug assertions on)" >&2
  bin=$(cargo test --profile sim -p binx-core --test simulation --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "simulation":
        print(m["executable"])')
fi
[ -x "$bin" ] || { echo "no simulation binary at '$bin'" >&2; exit 2; }

logs=${SIM_LOGS:-$(mktemp -d)}
mkdir -p "$logs"
per=$(( (seeds + jobs - 1) / jobs ))
echo "== $seeds seeds from $first on $jobs processes ($per each), $(nproc) cores, $(date -u +%FT%TZ)" >&2
start=$(date +%s.%N)
pids=()
for ((k = 0; k < jobs; k++)); do
  from=$((first + k * per))
  count=$per
  left=$((first + seeds - from))
  [ "$left" -lt "$count" ] && count=$left
  [ "$count" -le 0 ] && break
  SIM_SEEDS=$count SIM_FIRST=$from SIM_KEEP_GOING=1 \
    "$bin" --ignored --nocapture --exact many_seeds >"$logs/range-$k.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {print b - a}')

failed=$(grep -h '^FAILED seed' "$logs"/range-*.log || true)
ran=$(grep -h '^simulation: ' "$logs"/range-*.log | awk '{s += $2} END {print s + 0}')
echo "seeds run: $ran of $seeds, from $first to $((first + seeds - 1))"
awk -v n="$ran" -v s="$secs" -v p="${#pids[@]}" 'BEGIN {printf "wall: %.1f s, %.0f seeds/s on %d processes\n", s, n / s, p}'
if [ -n "$failed" ]; then
  echo "$failed"
  echo "$failed" | sed -E 's/^FAILED seed ([0-9]+).*/replay: SIM_SEED=\1 SIM_TRACE=1 cargo test --profile sim -p binx-core --test simulation -- --nocapture one_seed/'
  exit 1
fi
if [ "$status" -ne 0 ] || [ "$ran" -ne "$seeds" ]; then
  echo "a process ended without its summary; its output is in $logs:" >&2
  grep -L '^simulation: ' "$logs"/range-*.log >&2 || true
  exit 1
fi
echo "every invariant held"
