package io.binx.trino;

import static org.assertj.core.api.Assertions.assertThat;

import io.binx.client.Binxd;
import io.trino.Session;
import io.trino.testing.MaterializedResult;
import io.trino.testing.QueryAssertions;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Optional;
import java.util.Set;
import org.junit.jupiter.api.Test;

/**
 * The TPC-H benchmark of the Trino exchange manager (not a test: run by benches/trino-tpch.sh, never by
 * {@code scripts/java.sh verify}, and it asserts no time). One run starts, one after the
 * other, the same three-node cluster on Trino's filesystem exchange (local disk) and on binx
 * with spool policy {@code commit} and {@code always}, and times the 22 queries on each: with
 * {@code retry-policy=NONE} and {@code TASK}, interleaved query by query so that drift of the
 * machine hits both alike. Each query's answer under TASK must equal its answer under NONE.
 * It writes a Markdown report (times, ratios, the sidecars' peak RSS against their memory
 * limit) to {@code binx.bench.out}.
 *
 * <p>System properties: {@code binx.bench.schema} (sf1; tiny in quick mode),
 * {@code binx.bench.reps} (timed runs per query and policy, the fastest kept; 1),
 * {@code binx.bench.warmup} (the 22 queries once at tiny on each cluster before timing; true),
 * {@code binx.bench.sidecar-memory} (binxd's memory_limit; 1GiB),
 * {@code binx.bench.order} (the order the clusters run in; filesystem,commit,always),
 * {@code binx.bench.queries} (which TPC-H queries, e.g. {@code 9,11,22}; all 22).
 *
 * <p>The clusters share one JVM, so the first runs on a colder JIT and each may drift; the
 * fair comparison is each cluster's TASK time over its own NONE time, measured interleaved
 * in the same run. The report gives that ratio first, and raw TASK times beside it.
 */
public class BinxTpchBench {
    /** Trino's properties under TASK: production-like, not the test helper's tiny tasks. */
    private static final Map<String, String> FTE = Map.of(
            "fault-tolerant-execution-task-memory", "1GB",
            "exchange.compression-codec", "LZ4",
            "retry-initial-delay", "50ms",
            "retry-max-delay", "100ms");

    /**
     * One cluster's query times, and the CPU seconds spent under each policy (summed over the
     * 22 queries, per timed run): Trino's JVM, and the sidecars (none on the filesystem
     * exchange). They say where TASK's extra time goes: the engine's side of the exchange or
     * binxd.
     */
    private record Times(double[] none, double[] task, double jvmNone, double jvmTask, double sidecarsNone,
            double sidecarsTask, long bytesEnqueued, long bytesSent, long objectsSpooled, int[] failedTasks) {}

    /** The queries to time (1 to 22), from {@code binx.bench.queries}. */
    static List<Integer> queries() {
        String spec = System.getProperty("binx.bench.queries", "").trim();
        if (spec.isEmpty()) {
            return java.util.stream.IntStream.rangeClosed(1, 22).boxed().toList();
        }
        List<Integer> out = new ArrayList<>();
        for (String part : spec.split(",")) {
            int n;
            try {
                n = Integer.parseInt(part.trim());
            } catch (NumberFormatException e) {
                throw new IllegalArgumentException("binx.bench.queries lists TPC-H query numbers, not " + part, e);
            }
            if (n < 1 || n > 22 || out.contains(n)) {
                throw new IllegalArgumentException("binx.bench.queries: " + n + " is not a TPC-H query (1 to 22) or is named twice");
            }
            out.add(n);
        }
        return out;
    }

    @Test
    void tpch() throws Exception {
        String schema = System.getProperty("binx.bench.schema", "sf1");
        int reps = Integer.getInteger("binx.bench.reps", 1);
        boolean warmup = Boolean.parseBoolean(System.getProperty("binx.bench.warmup", "true"));
        String sidecarMemory = System.getProperty("binx.bench.sidecar-memory", "1GiB");
        Path out = Path.of(System.getProperty("binx.bench.out", "target/bench/trino-tpch.md"));
        Instant started = Instant.now();

        Map<String, Times> results = new LinkedHashMap<>();
        List<String> memory = new ArrayList<>();
        List<String> order = List.of(System.getProperty("binx.bench.order", "filesystem,commit,always").split(","));
        if (!new HashSet<>(order).equals(Set.of("filesystem", "commit", "always")) || order.size() != 3) {
            throw new IllegalArgumentException("binx.bench.order must name filesystem, commit and always once each, not " + order);
        }
        for (String name : order) {
            if (name.equals("filesystem")) {
                try (TrinoCluster fs = TrinoCluster.filesystem(FTE)) {
                    results.put("filesystem", run(fs, List.of(), schema, reps, warmup));
                }
                continue;
            }
            Map<String, String> plugin = new java.util.HashMap<>(Map.of("exchange.binx.spool-policy", name));
            // Any plugin property, to compare settings: -Dbinx.bench.exchange.binx.<name>=<value>.
            for (String key : System.getProperties().stringPropertyNames()) {
                if (key.startsWith("binx.bench.exchange.binx.")) {
                    plugin.put(key.substring("binx.bench.".length()), System.getProperty(key));
                }
            }
            try (TrinoCluster binx = TrinoCluster.binx(FTE, plugin, Optional.empty(),
                    "--memory-limit", sidecarMemory, "--task-memory-limit", sidecarMemory)) {
                results.put("binx " + name, run(binx, binx.sidecars, schema, reps, warmup));
                long limit = parseSize(sidecarMemory);
                for (int i = 0; i < binx.sidecars.size(); i++) {
                    Binxd b = binx.sidecars.get(i);
                    long rss = b.peakRssBytes();
                    long high = b.stat("memory_high_water");
                    memory.add(String.format(Locale.ROOT, "| binx %s | node%d | %s | %s | %s | %s |", name, i,
                            mib(rss), mib(high), mib(limit + (64L << 20)), rss <= limit + (64L << 20) ? "yes" : "**no**"));
                    // Each sidecar's request latencies by type, beside the report.
                    Files.createDirectories(out.toAbsolutePath().getParent());
                    Files.writeString(out.resolveSibling(out.getFileName() + "." + name + ".node" + i + ".metrics"), b.metrics());
                }
            }
        }
        String ran = String.join(", ", results.keySet());
        String report = report(schema, reps, started, ran, results, memory, sidecarMemory);
        Files.createDirectories(out.toAbsolutePath().getParent());
        Files.writeString(out, report);
        System.out.println(report);
        assertThat(results).hasSize(3);
    }

    /** Times the 22 queries under NONE and TASK, interleaved; answers must agree. */
    private static Times run(TrinoCluster cluster, List<Binxd> sidecars, String schema, int reps, boolean warmup)
            throws Exception {
        // A query that hangs fails the run instead of holding it forever.
        Session session = Session.builder(TrinoCluster.tpch(schema)).setSystemProperty("query_max_run_time", "20m").build();
        Session none = TrinoCluster.retryPolicy(session, "NONE");
        Session task = TrinoCluster.retryPolicy(session, "TASK");
        if (warmup) {
            Session tiny = TrinoCluster.tpch("tiny");
            for (int n = 1; n <= 22; n++) {
                String sql = TrinoCluster.tpchQuery(n);
                cluster.runner.execute(TrinoCluster.retryPolicy(tiny, "NONE"), sql);
                cluster.runner.execute(TrinoCluster.retryPolicy(tiny, "TASK"), sql);
            }
        }
        double[] noneTimes = new double[22];
        double[] taskTimes = new double[22];
        double jvmNone = 0;
        double jvmTask = 0;
        double sidecarsNone = 0;
        double sidecarsTask = 0;
        long enqueued0 = sum(sidecars, "bytes_enqueued");
        long sent0 = sum(sidecars, "bytes_sent");
        long objects0 = sum(sidecars, "objects_spooled");
        int[] failedTasks = new int[22];
        for (int n : queries()) {
            String sql = TrinoCluster.tpchQuery(n);
            noneTimes[n - 1] = Double.MAX_VALUE;
            taskTimes[n - 1] = Double.MAX_VALUE;
            for (int r = 0; r < reps; r++) {
                double jvm0 = jvmCpuSeconds();
                double side0 = cpuSeconds(sidecars);
                long t0 = System.nanoTime();
                MaterializedResult expected = cluster.runner.execute(none, sql);
                long t1 = System.nanoTime();
                double jvm1 = jvmCpuSeconds();
                double side1 = cpuSeconds(sidecars);
                var withPlan = cluster.runner.executeWithPlan(task, sql);
                MaterializedResult actual = withPlan.result();
                long t2 = System.nanoTime();
                // Task attempts Trino failed and retried: each costs the query a task's time.
                var info = cluster.runner.getCoordinator().getQueryManager().getFullQueryInfo(withPlan.queryId());
                failedTasks[n - 1] += info.getQueryStats().getFailedTasks();
                if (Boolean.getBoolean("binx.bench.timeline")) {
                    System.out.print(timeline(n, info));
                }
                jvmNone += (jvm1 - jvm0) / reps;
                jvmTask += (jvmCpuSeconds() - jvm1) / reps;
                sidecarsNone += (side1 - side0) / reps;
                sidecarsTask += (cpuSeconds(sidecars) - side1) / reps;
                QueryAssertions.assertEqualsIgnoreOrder(actual.getMaterializedRows(), expected.getMaterializedRows(),
                        "TPC-H q" + n + " at " + schema + " under TASK");
                noneTimes[n - 1] = Math.min(noneTimes[n - 1], (t1 - t0) / 1e9);
                taskTimes[n - 1] = Math.min(taskTimes[n - 1], (t2 - t1) / 1e9);
            }
            System.out.printf(Locale.ROOT, "q%02d NONE %.2fs TASK %.2fs%n", n, noneTimes[n - 1], taskTimes[n - 1]);
        }
        return new Times(noneTimes, taskTimes, jvmNone, jvmTask, sidecarsNone, sidecarsTask,
                (sum(sidecars, "bytes_enqueued") - enqueued0) / reps, (sum(sidecars, "bytes_sent") - sent0) / reps,
                (sum(sidecars, "objects_spooled") - objects0) / reps, failedTasks);
    }

    /**
     * When each stage's tasks ran, in ms from the query's creation (first task created, first
     * started, last ended), their count and blocked times: where a TASK query's time goes
     * between stages ({@code binx.bench.timeline=true}).
     */
    private static String timeline(int n, io.trino.execution.QueryInfo info) {
        StringBuilder s = new StringBuilder();
        Instant t0 = info.getQueryStats().getCreateTime();
        Instant end = info.getQueryStats().getEndTime();
        s.append(String.format(Locale.ROOT, "q%02d timeline: query ends at %d ms%n", n,
                end == null ? -1 : Duration.between(t0, end).toMillis()));
        if (info.getStages().isEmpty()) {
            return s.toString();
        }
        for (io.trino.execution.StageInfo stage : info.getStages().get().getStages()) {
            long created = Long.MAX_VALUE;
            long started = Long.MAX_VALUE;
            long ended = -1;
            double inBlocked = 0;
            double outBlocked = 0;
            double elapsed = 0;
            for (io.trino.execution.TaskInfo t : stage.tasks()) {
                var st = t.stats();
                created = Math.min(created, Duration.between(t0, st.createTime()).toMillis());
                if (st.firstStartTime() != null) {
                    started = Math.min(started, Duration.between(t0, st.firstStartTime()).toMillis());
                }
                if (st.endTime() != null) {
                    ended = Math.max(ended, Duration.between(t0, st.endTime()).toMillis());
                }
                inBlocked += st.inputBlockedTime().toMillis();
                outBlocked += st.outputBlockedTime().toMillis();
                elapsed += st.elapsedTime().toMillis();
            }
            s.append(String.format(Locale.ROOT,
                    "  stage %s: %d tasks, created %d, started %d, ended %d ms; task elapsed %.0f, input blocked %.0f, output blocked %.0f ms%n",
                    stage.stageId(), stage.tasks().size(), created, started, ended, elapsed, inBlocked, outBlocked));
        }
        return s.toString();
    }

    /** The CPU seconds this JVM (the three Trino servers) has used so far. */
    private static double jvmCpuSeconds() {
        return ProcessHandle.current().info().totalCpuDuration().orElse(Duration.ZERO).toNanos() / 1e9;
    }

    /** A counter of binxd's /v1/stats, summed over the sidecars. */
    private static long sum(List<Binxd> sidecars, String key) throws Exception {
        long total = 0;
        for (Binxd b : sidecars) {
            total += b.stat(key);
        }
        return total;
    }

    private static double cpuSeconds(List<Binxd> sidecars) {
        double total = 0;
        for (Binxd b : sidecars) {
            total += b.cpuTime().toNanos() / 1e9;
        }
        return total;
    }

    private static String report(String schema, int reps, Instant started, String ran, Map<String, Times> results,
            List<String> memory, String sidecarMemory) {
        Times fs = results.get("filesystem");
        Times commit = results.get("binx commit");
        Times always = results.get("binx always");
        StringBuilder s = new StringBuilder();
        s.append(String.format(Locale.ROOT,
                "TPC-H %s, coordinator + 2 workers in one JVM, %d CPUs, started %s, fastest of %d, clusters in this order: %s%n%n",
                schema, Runtime.getRuntime().availableProcessors(), started, reps, ran));
        s.append(String.format(Locale.ROOT, "Both exchanges store their files under %s (%s).%n%n", storeDirectory(), storeFileSystem()));
        s.append("Each cluster times every query under NONE and TASK, interleaved; TASK / NONE is on the same cluster.\n\n");
        s.append("| query | fs NONE | fs TASK | commit NONE | commit TASK | always NONE | always TASK"
                + " | fs TASK/NONE | commit TASK/NONE | always TASK/NONE | failed task attempts (fs, commit, always) |\n");
        s.append("|---|---|---|---|---|---|---|---|---|---|---|\n");
        for (int n : queries()) {
            int q = n - 1;
            s.append(String.format(Locale.ROOT, "| q%02d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %d, %d, %d |%n", n,
                    fs.none[q], fs.task[q], commit.none[q], commit.task[q], always.none[q], always.task[q],
                    fs.task[q] / fs.none[q], commit.task[q] / commit.none[q], always.task[q] / always.none[q],
                    fs.failedTasks[q], commit.failedTasks[q], always.failedTasks[q]));
        }
        double fsRatio = sum(fs.task) / sum(fs.none);
        double commitRatio = sum(commit.task) / sum(commit.none);
        double alwaysRatio = sum(always.task) / sum(always.none);
        s.append(String.format(Locale.ROOT, "| **total** | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | **%.2f** | **%.2f** | **%.2f** |%n%n",
                sum(fs.none), sum(fs.task), sum(commit.none), sum(commit.task), sum(always.none), sum(always.task),
                fsRatio, commitRatio, alwaysRatio));
        s.append(String.format(Locale.ROOT,
                "binx against the filesystem exchange, each as TASK / NONE on its own cluster: commit %.2f, always %.2f.%n",
                commitRatio / fsRatio, alwaysRatio / fsRatio));
        s.append(String.format(Locale.ROOT,
                "Raw TASK totals (cluster order and JIT warm-up included): commit / fs %.2f, always / fs %.2f.%n%n",
                sum(commit.task) / sum(fs.task), sum(always.task) / sum(fs.task)));
        s.append("CPU seconds over the queries (per timed run): Trino's JVM and the sidecars, under each policy"
                + " (what a sidecar does after a TASK query ends, such as deleting its objects, counts under the next NONE):\n\n");
        s.append("| cluster | JVM NONE | JVM TASK | sidecars NONE | sidecars TASK | all TASK / all NONE"
                + " | GiB enqueued | GiB sent | objects written | sidecars' CPU-s per GiB enqueued |\n|---|---|---|---|---|---|---|---|---|---|\n");
        for (var e : results.entrySet()) {
            Times t = e.getValue();
            double enqueued = t.bytesEnqueued / (double) (1L << 30);
            s.append(String.format(Locale.ROOT, "| %s | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %.2f | %d | %s |%n", e.getKey(),
                    t.jvmNone, t.jvmTask, t.sidecarsNone, t.sidecarsTask, (t.jvmTask + t.sidecarsTask) / (t.jvmNone + t.sidecarsNone),
                    enqueued, t.bytesSent / (double) (1L << 30), t.objectsSpooled,
                    enqueued > 0 ? String.format(Locale.ROOT, "%.1f", t.sidecarsTask / enqueued) : "-"));
        }
        s.append('\n');
        s.append("binxd peak RSS (VmHWM) against its memory limit (").append(sidecarMemory).append(") + 64 MiB:\n\n");
        s.append("| cluster | sidecar | peak RSS | memory_high_water | limit + 64 MiB | within |\n|---|---|---|---|---|---|\n");
        for (String line : memory) {
            s.append(line).append('\n');
        }
        return s.toString();
    }

    /** Where TrinoCluster makes the stores: java.io.tmpdir. */
    private static Path storeDirectory() {
        return Path.of(System.getProperty("java.io.tmpdir"));
    }

    /**
     * The stores' file system type: it matters (on a journal-less ext4 every file created scans
     * past the inodes deleted in the last minutes, and binx creates more files than the
     * filesystem exchange; see BENCHMARKS.md).
     */
    private static String storeFileSystem() {
        try {
            return Files.getFileStore(storeDirectory()).type();
        } catch (java.io.IOException e) {
            return "file system unknown: " + e.getMessage();
        }
    }

    private static double sum(double[] v) {
        double t = 0;
        for (double x : v) {
            t += x;
        }
        return t;
    }

    private static String mib(long bytes) {
        return String.format(Locale.ROOT, "%.0f MiB", bytes / 1048576.0);
    }

    private static long parseSize(String s) {
        Map<String, Long> units = new HashMap<>(Map.of("KiB", 1L << 10, "MiB", 1L << 20, "GiB", 1L << 30));
        for (var e : units.entrySet()) {
            if (s.endsWith(e.getKey())) {
                return Long.parseLong(s.substring(0, s.length() - 3)) * e.getValue();
            }
        }
        return Long.parseLong(s);
    }
}
