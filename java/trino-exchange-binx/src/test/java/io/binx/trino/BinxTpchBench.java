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
 * {@code binx.bench.order} (the clusters and the order they run in: filesystem and at least one
 * of commit and always; filesystem,commit,always),
 * {@code binx.bench.rounds} (how many times the clusters run, the order reversed every other
 * round; 1),
 * {@code binx.bench.paired} (every cluster at once, timed query by query in turn, see
 * {@link #runTogether}; false: one cluster after the other),
 * {@code binx.bench.queries} (which TPC-H queries, e.g. {@code 9,11,22}; all 22).
 *
 * <p>The clusters share one JVM, so the first runs on a colder JIT and each may drift; the
 * fair comparison is each cluster's TASK time over its own NONE time, measured interleaved
 * in the same run. The report gives that ratio first, and raw TASK times beside it. With two
 * rounds or more (A B, then B A) each cluster runs both early and late, so neither gains from
 * its place; a query's time is then its fastest over every round.
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
            double sidecarsTask, long bytesEnqueued, long bytesSent, long objectsSpooled, int[] failedTasks) {
        /**
         * Several rounds of one cluster as one: each query's fastest time, the CPU seconds and
         * bytes per round (their mean), the failed attempts of every round.
         */
        static Times of(List<Times> rounds) {
            int n = rounds.get(0).none.length;
            double[] none = new double[n];
            double[] task = new double[n];
            int[] failed = new int[n];
            java.util.Arrays.fill(none, Double.MAX_VALUE);
            java.util.Arrays.fill(task, Double.MAX_VALUE);
            double jvmNone = 0;
            double jvmTask = 0;
            double sideNone = 0;
            double sideTask = 0;
            long enqueued = 0;
            long sent = 0;
            long objects = 0;
            for (Times t : rounds) {
                for (int q = 0; q < n; q++) {
                    none[q] = Math.min(none[q], t.none[q]);
                    task[q] = Math.min(task[q], t.task[q]);
                    failed[q] += t.failedTasks[q];
                }
                jvmNone += t.jvmNone;
                jvmTask += t.jvmTask;
                sideNone += t.sidecarsNone;
                sideTask += t.sidecarsTask;
                enqueued += t.bytesEnqueued;
                sent += t.bytesSent;
                objects += t.objectsSpooled;
            }
            int r = rounds.size();
            return new Times(none, task, jvmNone / r, jvmTask / r, sideNone / r, sideTask / r, enqueued / r, sent / r,
                    objects / r, failed);
        }

        /** TASK over NONE, summed over the queries timed. */
        double ratio() {
            double n = 0;
            double t = 0;
            for (int q : queries()) {
                n += none[q - 1];
                t += task[q - 1];
            }
            return t / n;
        }
    }

    /** The clusters, from {@code binx.bench.order}: filesystem and at least one binx policy, each once. */
    static List<String> order() {
        List<String> order = new ArrayList<>();
        for (String part : System.getProperty("binx.bench.order", "filesystem,commit,always").split(",")) {
            String name = part.trim();
            if (!Set.of("filesystem", "commit", "always").contains(name) || order.contains(name)) {
                throw new IllegalArgumentException("binx.bench.order names filesystem, commit and always, each at most once, not "
                        + System.getProperty("binx.bench.order"));
            }
            order.add(name);
        }
        if (!order.contains("filesystem") || order.size() < 2) {
            throw new IllegalArgumentException("binx.bench.order must name filesystem and at least one of commit and always, not "
                    + order);
        }
        return order;
    }

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

        int rounds = Integer.getInteger("binx.bench.rounds", 1);
        if (rounds < 1) {
            throw new IllegalArgumentException("binx.bench.rounds must be at least 1, not " + rounds);
        }
        // Cluster name -> its Times, one a round.
        Map<String, List<Times>> results = new LinkedHashMap<>();
        List<String> memory = new ArrayList<>();
        List<String> ran = new ArrayList<>();
        List<String> order = order();
        boolean paired = Boolean.getBoolean("binx.bench.paired");
        for (int round = 0; round < rounds; round++) {
            List<String> thisRound = new ArrayList<>(order);
            if (round % 2 == 1) {
                java.util.Collections.reverse(thisRound);
            }
            // Side by side: the round's clusters at once; else one after the other.
            List<List<String>> groups = paired ? List.of(thisRound) : thisRound.stream().map(List::of).toList();
            for (List<String> group : groups) {
                List<Times> times = runTogether(group, schema, reps, warmup, sidecarMemory, out, memory, roundLabel(round, rounds));
                List<String> names = new ArrayList<>();
                for (int k = 0; k < group.size(); k++) {
                    String cluster = group.get(k).equals("filesystem") ? "filesystem" : "binx " + group.get(k);
                    results.computeIfAbsent(cluster, c -> new ArrayList<>()).add(times.get(k));
                    names.add(cluster);
                }
                ran.add(group.size() == 1 ? names.get(0) : "(" + String.join(" with ", group) + ", side by side)");
            }
        }
        String report = report(schema, reps, started, String.join(", ", ran), results, memory, sidecarMemory);
        Files.createDirectories(out.toAbsolutePath().getParent());
        Files.writeString(out, report);
        System.out.println(report);
        assertThat(results).hasSize(order.size());
    }

    /**
     * Every cluster of {@code order} at once in this JVM (one, when they run one after the
     * other), timed query by query in turn (which cluster goes first rotates from query to
     * query and repetition to repetition): the JIT's warm-up and the machine's drift hit them
     * all alike, and each query's times on each are taken minutes apart at most, where one
     * cluster after the other puts them 20 apart. Each binx cluster's sidecars' peak RSS goes
     * to {@code memory} and their metrics beside the report.
     */
    private static List<Times> runTogether(List<String> order, String schema, int reps, boolean warmup, String sidecarMemory,
            Path out, List<String> memory, String round) throws Exception {
        List<TrinoCluster> clusters = new ArrayList<>();
        try {
            List<ClusterTimer> timers = new ArrayList<>();
            for (String name : order) {
                TrinoCluster cluster = startCluster(name, sidecarMemory);
                clusters.add(cluster);
                timers.add(new ClusterTimer(cluster, cluster.sidecars, schema, reps));
            }
            if (warmup) {
                for (ClusterTimer t : timers) {
                    t.warmUp();
                }
            }
            for (ClusterTimer t : timers) {
                t.begin();
            }
            List<Integer> queries = queries();
            for (int i = 0; i < queries.size(); i++) {
                int n = queries.get(i);
                for (int r = 0; r < reps; r++) {
                    for (int k = 0; k < timers.size(); k++) {
                        timers.get((k + i + r) % timers.size()).time(n);
                        if (timers.size() > 1) {
                            // What a TASK query leaves to do (binxd deleting its objects, the
                            // filesystem exchange deleting its files) done before the next
                            // cluster's timing, not in it.
                            Thread.sleep(SETTLE_MILLIS);
                        }
                    }
                }
                for (int k = 0; k < timers.size(); k++) {
                    timers.get(k).print(timers.size() == 1 ? "" : order.get(k) + " ", n);
                }
            }
            List<Times> times = new ArrayList<>();
            for (ClusterTimer t : timers) {
                times.add(t.end());
            }
            for (int k = 0; k < order.size(); k++) {
                recordSidecars(order.get(k), round, clusters.get(k), sidecarMemory, out, memory);
            }
            return times;
        } finally {
            Exception first = null;
            for (TrinoCluster c : clusters) {
                try {
                    c.close();
                } catch (Exception e) {
                    if (first == null) {
                        first = e;
                    } else {
                        first.addSuppressed(e);
                    }
                }
            }
            if (first != null) {
                throw first;
            }
        }
    }

    /** The pause after each query pair when clusters run side by side. */
    private static final long SETTLE_MILLIS = 1_000;

    /** The cluster {@code name}: Trino's filesystem exchange, or binx with that spool policy. */
    private static TrinoCluster startCluster(String name, String sidecarMemory) throws Exception {
        if (name.equals("filesystem")) {
            return TrinoCluster.filesystem(FTE);
        }
        Map<String, String> plugin = new java.util.HashMap<>(Map.of("exchange.binx.spool-policy", name));
        // Any plugin property, to compare settings: -Dbinx.bench.exchange.binx.<name>=<value>.
        for (String key : System.getProperties().stringPropertyNames()) {
            if (key.startsWith("binx.bench.exchange.binx.")) {
                plugin.put(key.substring("binx.bench.".length()), System.getProperty(key));
            }
        }
        return TrinoCluster.binx(FTE, plugin, Optional.empty(), "--memory-limit", sidecarMemory, "--task-memory-limit", sidecarMemory);
    }

    /** "" with one round, else which round (for the sidecars' rows and files). */
    private static String roundLabel(int round, int rounds) {
        return rounds == 1 ? "" : ".round" + (round + 1);
    }

    /**
     * A binx cluster's sidecars' peak RSS into {@code memory}, their metrics beside the report
     * ({@code round}: "" or ".round2", in the metrics files' names and the rows).
     */
    private static void recordSidecars(String name, String round, TrinoCluster cluster, String sidecarMemory, Path out,
            List<String> memory) throws Exception {
        long limit = parseSize(sidecarMemory);
        for (int i = 0; i < cluster.sidecars.size(); i++) {
            Binxd b = cluster.sidecars.get(i);
            long rss = b.peakRssBytes();
            long high = b.stat("memory_high_water");
            memory.add(String.format(Locale.ROOT, "| binx %s%s | node%d | %s | %s | %s | %s |", name,
                    round.isEmpty() ? "" : " (" + round.substring(1).replace("round", "round ") + ")", i,
                    mib(rss), mib(high), mib(limit + (64L << 20)), rss <= limit + (64L << 20) ? "yes" : "**no**"));
            // Each sidecar's request latencies by type, beside the report.
            Files.createDirectories(out.toAbsolutePath().getParent());
            Files.writeString(out.resolveSibling(out.getFileName() + "." + name + round + ".node" + i + ".metrics"), b.metrics());
        }
    }

    /**
     * One cluster's timings: each query under NONE, then under TASK, with the JVM's and the
     * sidecars' CPU seconds over each, every TASK answer checked against NONE's.
     */
    private static final class ClusterTimer {
        private final TrinoCluster cluster;
        private final List<Binxd> sidecars;
        private final String schema;
        private final int reps;
        private final Session none;
        private final Session task;
        private final double[] noneTimes = new double[22];
        private final double[] taskTimes = new double[22];
        private final int[] failedTasks = new int[22];
        private double jvmNone;
        private double jvmTask;
        private double sidecarsNone;
        private double sidecarsTask;
        private long enqueued0;
        private long sent0;
        private long objects0;

        ClusterTimer(TrinoCluster cluster, List<Binxd> sidecars, String schema, int reps) {
            this.cluster = cluster;
            this.sidecars = sidecars;
            this.schema = schema;
            this.reps = reps;
            // A query that hangs fails the run instead of holding it forever.
            Session session = Session.builder(TrinoCluster.tpch(schema)).setSystemProperty("query_max_run_time", "20m").build();
            this.none = TrinoCluster.retryPolicy(session, "NONE");
            this.task = TrinoCluster.retryPolicy(session, "TASK");
            java.util.Arrays.fill(noneTimes, Double.MAX_VALUE);
            java.util.Arrays.fill(taskTimes, Double.MAX_VALUE);
        }

        /** The 22 queries once at tiny, under each policy, untimed. */
        void warmUp() throws Exception {
            Session tiny = TrinoCluster.tpch("tiny");
            for (int n = 1; n <= 22; n++) {
                String sql = TrinoCluster.tpchQuery(n);
                cluster.runner.execute(TrinoCluster.retryPolicy(tiny, "NONE"), sql);
                cluster.runner.execute(TrinoCluster.retryPolicy(tiny, "TASK"), sql);
            }
        }

        /** Where the sidecars' counters stand before the timed queries. */
        void begin() throws Exception {
            enqueued0 = sum(sidecars, "bytes_enqueued");
            sent0 = sum(sidecars, "bytes_sent");
            objects0 = sum(sidecars, "objects_spooled");
        }

        /** Query {@code n} once under NONE, then once under TASK. */
        void time(int n) throws Exception {
            String sql = TrinoCluster.tpchQuery(n);
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

        void print(String label, int n) {
            System.out.printf(Locale.ROOT, "%sq%02d NONE %.2fs TASK %.2fs%n", label, n, noneTimes[n - 1], taskTimes[n - 1]);
        }

        Times end() throws Exception {
            double[] none = noneTimes.clone();
            double[] taskT = taskTimes.clone();
            for (int q = 0; q < 22; q++) {
                if (none[q] == Double.MAX_VALUE) {
                    // Not timed (binx.bench.queries): counts for nothing in the sums.
                    none[q] = 0;
                    taskT[q] = 0;
                }
            }
            return new Times(none, taskT, jvmNone, jvmTask, sidecarsNone, sidecarsTask,
                    (sum(sidecars, "bytes_enqueued") - enqueued0) / reps, (sum(sidecars, "bytes_sent") - sent0) / reps,
                    (sum(sidecars, "objects_spooled") - objects0) / reps, failedTasks);
        }
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

    /** The short name of a cluster in the report's columns. */
    private static String shortName(String cluster) {
        return cluster.equals("filesystem") ? "fs" : cluster.substring("binx ".length());
    }

    private static String report(String schema, int reps, Instant started, String ran, Map<String, List<Times>> rounds,
            List<String> memory, String sidecarMemory) {
        Map<String, Times> results = new LinkedHashMap<>();
        rounds.forEach((cluster, times) -> results.put(cluster, Times.of(times)));
        List<String> binx = results.keySet().stream().filter(c -> !c.equals("filesystem")).toList();
        Times fs = results.get("filesystem");
        int roundCount = rounds.get("filesystem").size();
        StringBuilder s = new StringBuilder();
        s.append(String.format(Locale.ROOT,
                "TPC-H %s, coordinator + 2 workers in one JVM, %d CPUs, started %s, fastest of %d%s, clusters in this order: %s%n%n",
                schema, Runtime.getRuntime().availableProcessors(), started, reps * roundCount,
                roundCount > 1 ? " (" + reps + " in each of " + roundCount + " rounds, every other round in the reverse order)" : "",
                ran));
        s.append(String.format(Locale.ROOT, "Both exchanges store their files under %s (%s).%n%n", storeDirectory(), storeFileSystem()));
        s.append("Each cluster times every query under NONE and TASK, interleaved; TASK / NONE is on the same cluster.\n\n");
        StringBuilder head = new StringBuilder("| query |");
        StringBuilder rule = new StringBuilder("|---|");
        for (String c : results.keySet()) {
            head.append(' ').append(shortName(c)).append(" NONE | ").append(shortName(c)).append(" TASK |");
            rule.append("---|---|");
        }
        for (String c : results.keySet()) {
            head.append(' ').append(shortName(c)).append(" TASK/NONE |");
            rule.append("---|");
        }
        head.append(" failed task attempts (").append(String.join(", ", results.keySet().stream().map(BinxTpchBench::shortName).toList()))
                .append(") |");
        rule.append("---|");
        s.append(head).append('\n').append(rule).append('\n');
        for (int n : queries()) {
            int q = n - 1;
            s.append(String.format(Locale.ROOT, "| q%02d |", n));
            for (Times t : results.values()) {
                s.append(String.format(Locale.ROOT, " %.2f | %.2f |", t.none[q], t.task[q]));
            }
            for (Times t : results.values()) {
                s.append(String.format(Locale.ROOT, " %.2f |", t.task[q] / t.none[q]));
            }
            s.append(' ').append(String.join(", ", results.values().stream().map(t -> String.valueOf(t.failedTasks[q])).toList()))
                    .append(" |\n");
        }
        s.append("| **total** |");
        for (Times t : results.values()) {
            s.append(String.format(Locale.ROOT, " %.1f | %.1f |", total(t.none), total(t.task)));
        }
        for (Times t : results.values()) {
            s.append(String.format(Locale.ROOT, " **%.2f** |", t.ratio()));
        }
        s.append(' ').append(String.join(", ", results.values().stream()
                .map(t -> String.valueOf(java.util.Arrays.stream(t.failedTasks).sum())).toList())).append(" |\n\n");
        s.append("binx against the filesystem exchange, each as TASK / NONE on its own cluster:");
        for (String c : binx) {
            s.append(String.format(Locale.ROOT, " %s %.2f", shortName(c), results.get(c).ratio() / fs.ratio()));
            if (roundCount > 1) {
                // Each round on its own: how far one round's figure moves.
                List<String> each = new ArrayList<>();
                for (int r = 0; r < roundCount; r++) {
                    each.add(String.format(Locale.ROOT, "%.2f", rounds.get(c).get(r).ratio() / rounds.get("filesystem").get(r).ratio()));
                }
                s.append(" (rounds: ").append(String.join(", ", each)).append(')');
            }
            s.append(c.equals(binx.get(binx.size() - 1)) ? ".\n" : ",");
        }
        s.append("Raw TASK totals (cluster order and JIT warm-up included):");
        for (String c : binx) {
            s.append(String.format(Locale.ROOT, " %s / fs %.2f%s", shortName(c), total(results.get(c).task) / total(fs.task),
                    c.equals(binx.get(binx.size() - 1)) ? ".\n\n" : ","));
        }
        s.append("CPU seconds over the queries (per timed run): Trino's JVM and the sidecars, under each policy"
                + " (what a sidecar does after a TASK query ends, such as deleting its objects, counts under the next NONE"
                + (ran.contains("side by side")
                        ? "; side by side, the JVM's figure is every cluster's, the one timed and the others idle" : "")
                + "):\n\n");
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

    /** The sum over the queries timed. */
    private static double total(double[] v) {
        double t = 0;
        for (int q : queries()) {
            t += v[q - 1];
        }
        return t;
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
