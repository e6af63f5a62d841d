#!/usr/bin/env bash
# Builds the engines' own exchange clients that tests/e2e/engines.rs drives
# against a real binxd: tests/engines/presto (Presto 0.296, Java 17+) and
# tests/engines/trino (Trino 483, Java 25). Maven fetches Presto's and
# Trino's jars from Maven Central into target/engines/m2 (about 300 MB, a
# minute the first time) and each build writes a launcher,
# target/engines/{presto,trino}/run, which runs the client with the right
# Java and classpath. Prints target/engines. Rebuilds only when a pom or a
# source changed.
#
# Java 25 is looked for in $BINX_JAVA25_HOME, then /usr/lib/jvm/*25*; Java
# 17 or later is `java` on PATH (or $BINX_JAVA17_HOME). Maven is installed
# with apt-get when missing and this runs as root.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
out="$root/target/engines"
m2="$out/m2"
mkdir -p "$out"

log() { echo "ensure-engine-clients: $*" >&2; }

if ! command -v mvn >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Maven with apt-get"
    apt-get update -qq >&2 && apt-get install -y -qq maven >&2
  else
    log "Maven (mvn) is needed to fetch Presto's and Trino's clients; install it (apt-get install maven)"
    exit 1
  fi
fi

java_major() { # java binary -> major version
  "$1" -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.specification.version = //p' | head -1
}

find_java() { # minimum major, candidate homes... -> a java home
  local want="$1"; shift
  local home
  for home in "$@"; do
    [ -n "$home" ] && [ -x "$home/bin/java" ] || continue
    if [ "$(java_major "$home/bin/java")" -ge "$want" ] 2>/dev/null; then
      echo "$home"
      return 0
    fi
  done
  return 1
}

path_java_home() {
  command -v java >/dev/null 2>&1 || return 0
  dirname "$(dirname "$(readlink -f "$(command -v java)")")"
}

# shellcheck disable=SC2046
java17="$(find_java 17 "${BINX_JAVA17_HOME:-}" "$(path_java_home)" $(ls -d /usr/lib/jvm/* 2>/dev/null))" || {
  log "no Java 17 or later found (Presto 0.296's client needs it); set BINX_JAVA17_HOME"
  exit 1
}
# shellcheck disable=SC2046
java25="$(find_java 25 "${BINX_JAVA25_HOME:-}" $(ls -d /usr/lib/jvm/*25* 2>/dev/null) "$(path_java_home)")" || {
  log "no Java 25 found (Trino 483's client needs it): install a Temurin 25 JDK or set BINX_JAVA25_HOME"
  exit 1
}

build() { # engine, java home, main class, extra JVM flags
  local engine="$1" home="$2" main="$3" flags="$4"
  local src="$root/tests/engines/$engine" dir="$out/$engine"
  local jar="$dir/$engine-exchange-client-1.jar" launcher="$dir/run"
  if [ -x "$launcher" ] && [ -f "$jar" ] && [ -f "$dir/classpath.txt" ] \
    && [ -z "$(find "$src" -newer "$jar" -type f -print -quit)" ] \
    && grep -q "$home/bin/java" "$launcher"; then
    return 0
  fi
  log "building the $engine exchange client with Maven (Java $(java_major "$home/bin/java"))"
  JAVA_HOME="$home" mvn -B -q -Dmaven.repo.local="$m2" -f "$src/pom.xml" package -DskipTests >&2
  cat >"$launcher.tmp" <<EOF
#!/bin/sh
# Written by scripts/ensure-engine-clients.sh.
exec "$home/bin/java" $flags -cp "$jar:$(cat "$dir/classpath.txt")" $main "\$@"
EOF
  chmod +x "$launcher.tmp"
  mv "$launcher.tmp" "$launcher"
}

build presto "$java17" binx.engines.PrestoExchange "-Xmx512m"
# Trino's block encodings use the Vector API.
build trino "$java25" binx.engines.TrinoExchange "-Xmx512m --add-modules=jdk.incubator.vector"
echo "$out"
