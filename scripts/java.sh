#!/usr/bin/env bash
# Builds and tests binx's JVM side (java/): the BinX client and the Trino
# exchange plugin, with Java 25 (Trino 483 needs it) and Maven from Maven
# Central only. Maven's repository is kept under target/m2, so a later run
# needs no network (it goes offline once that repository is there).
#
#   scripts/java.sh            verify: unit tests, Trino's exchange SPI suite,
#                              the multi-node Trino TPC-H test (needs binxd:
#                              cargo build first)
#   scripts/java.sh package    the plugin directory only (no tests)
#   scripts/java.sh bench [-Dbinx.bench.*=...]
#                              the TPC-H benchmark (BinxTpchBench; run it with
#                              benches/trino-tpch.sh), or the one BINX_BENCH_TEST
#                              names (BinxSinkBench: benches/trino-sink.sh)
#
# Java 25 is looked for in $BINX_JAVA25_HOME, then /usr/lib/jvm/*25*.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
goal="${1:-verify}"
shift || true

log() { echo "java.sh: $*" >&2; }

if ! command -v mvn >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Maven with apt-get"
    apt-get update -qq >&2 && apt-get install -y -qq maven >&2
  else
    log "Maven (mvn) is needed; install it (apt-get install maven)"
    exit 1
  fi
fi

java25=""
for home in "${BINX_JAVA25_HOME:-}" /usr/lib/jvm/*25*; do
  if [ -n "$home" ] && [ -x "$home/bin/java" ]; then
    java25="$home"
    break
  fi
done
if [ -z "$java25" ]; then
  log "no Java 25 found (Trino 483 needs it): install a Temurin 25 JDK or set BINX_JAVA25_HOME"
  exit 1
fi

m2="$root/target/m2"
offline=()
# Offline once a previous run fetched everything this build needs.
if [ -f "$m2/.binx-java-$goal" ] || { [ "$goal" = bench ] && [ -f "$m2/.binx-java-verify" ]; }; then
  offline=(-o)
fi
args=(-B -q "${offline[@]}" -Dmaven.repo.local="$m2" -f "$root/java/pom.xml")
export JAVA_HOME="$java25"
export MAVEN_OPTS="${MAVEN_OPTS:-} --sun-misc-unsafe-memory-access=allow"
case "$goal" in
  verify)
    binxd="${BINX_BINXD:-$root/target/debug/binxd}"
    [ -x "$binxd" ] || { log "$binxd is missing: run cargo build first (or set BINX_BINXD)"; exit 1; }
    log "building and testing java/ with Java $("$java25/bin/java" -version 2>&1 | head -1), binxd $binxd"
    mvn "${args[@]}" -Dbinx.binxd="$binxd" verify
    ;;
  package)
    mvn "${args[@]}" -DskipTests package
    ;;
  bench)
    binxd="${BINX_BINXD:-$root/target/release/binxd}"
    [ -x "$binxd" ] || { log "$binxd is missing: run cargo build --release first (or set BINX_BINXD)"; exit 1; }
    mvn "${args[@]}" -Dbinx.binxd="$binxd" -pl trino-exchange-binx -am verify \
      -Dtest=NONE -Dsurefire.failIfNoSpecifiedTests=false -Dit.test="${BINX_BENCH_TEST:-BinxTpchBench}" \
      -Dit.xmx="${BINX_BENCH_XMX:-8g}" "$@"
    ;;
  *)
    log "usage: $0 [verify|package|bench]"
    exit 2
    ;;
esac
touch "$m2/.binx-java-$goal"
