package io.binx.trino;

import static com.google.inject.multibindings.OptionalBinder.newOptionalBinder;
import static io.airlift.configuration.ConfigBinder.configBinder;
import static org.assertj.core.api.Assertions.assertThat;

import com.google.inject.Module;
import com.google.inject.Scopes;
import io.binx.client.Binxd;
import io.trino.Session;
import io.trino.execution.FailureInjector;
import io.trino.execution.FailureInjector.InjectedFailureType;
import io.trino.execution.TestingFailureInjectionConfig;
import io.trino.execution.TestingFailureInjector;
import io.trino.spi.ErrorType;
import io.trino.testing.DistributedQueryRunner;
import io.trino.testing.FaultTolerantExecutionConnectorTestHelper;
import io.trino.testing.MaterializedResult;
import io.trino.testing.QueryAssertions;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestInstance;

/**
 * A real Trino cluster (a coordinator and two workers, each with a binxd of its own on loopback,
 * one shared file:// store) with the binx plugin loaded from its plugin directory through
 * Trino's plugin class loader, running the 22 TPC-H queries under {@code retry-policy=TASK}:
 * every answer equals the same cluster's with {@code retry-policy=NONE}, also with task
 * attempts failed on purpose, and nothing is left in the sidecars' memory or storage after.
 */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
public class BinxTrinoClusterIT {
    /**
     * A release record beside a manifest: {@code <buffer>.<instance>.released}, named after the
     * process whose manifest it releases, or {@code <buffer>.released} (docs/PROTOCOL.md).
     */
    private static final java.util.regex.Pattern RELEASE_RECORD =
            java.util.regex.Pattern.compile("[0-9]+(\\.[A-Za-z0-9._:-]{1,64})?\\.released");

    private TrinoCluster cluster;
    private DistributedQueryRunner runner;
    private final Session session = TrinoCluster.tpch("tiny");

    @BeforeAll
    void start() throws Exception {
        Module failureInjection = binder -> {
            configBinder(binder).bindConfig(TestingFailureInjectionConfig.class);
            newOptionalBinder(binder, FailureInjector.class).setBinding().to(TestingFailureInjector.class).in(Scopes.SINGLETON);
        };
        cluster = TrinoCluster.binx(FaultTolerantExecutionConnectorTestHelper.getExtraProperties(),
                Map.of("exchange.binx.max-error-duration", "30s"), Optional.of(failureInjection),
                "--memory-limit", "512MiB", "--task-memory-limit", "256MiB",
                // Output of a sidecar that restarted is read from storage after this long.
                "--spool-failover-after", "3s");
        runner = cluster.runner;
    }

    @AfterAll
    void stop() throws Exception {
        if (cluster != null) {
            cluster.close();
        }
    }

    private Session policy(String policy) {
        return TrinoCluster.retryPolicy(session, policy);
    }

    private void assertSameAnswers(int n, MaterializedResult expected, MaterializedResult actual) {
        QueryAssertions.assertEqualsIgnoreOrder(actual.getMaterializedRows(), expected.getMaterializedRows(),
                "TPC-H q" + n + " under retry-policy=TASK on binx");
    }

    @Test
    void tpchAnswersMatchWithoutRetriesAndNothingIsLeftBehind() throws Exception {
        for (int n = 1; n <= 22; n++) {
            String sql = TrinoCluster.tpchQuery(n);
            MaterializedResult expected = runner.execute(policy("NONE"), sql);
            MaterializedResult actual = runner.execute(policy("TASK"), sql);
            assertSameAnswers(n, expected, actual);
        }
        // The exchange really went through the sidecars.
        long enqueued = 0;
        for (Binxd b : cluster.sidecars) {
            enqueued += b.stat("pages_enqueued");
        }
        assertThat(enqueued).isGreaterThan(0);
        // Each node's exchange manager has its counters in JMX under a name of its own (the
        // nodes share this JVM, each with the plugin in its own class loader), and they moved.
        var jmx = java.lang.management.ManagementFactory.getPlatformMBeanServer();
        var names = jmx.queryNames(new javax.management.ObjectName("io.binx.trino:type=BinxExchangeStats,*"), null);
        assertThat(names).hasSizeGreaterThanOrEqualTo(3);
        int writing = 0;
        int reading = 0;
        long exchanges = 0;
        for (var name : names) {
            writing += (Long) jmx.getAttribute(name, "SinksCommitted") > 0 ? 1 : 0;
            reading += (Long) jmx.getAttribute(name, "PagesRead") > 0 ? 1 : 0;
            exchanges += (Long) jmx.getAttribute(name, "ExchangesCreated");
        }
        // Tasks ran on both workers at least: each node's own counters moved.
        assertThat(writing).isGreaterThanOrEqualTo(2);
        assertThat(reading).isGreaterThanOrEqualTo(2);
        assertThat(exchanges).isGreaterThan(0);
        awaitNothingLeft();
    }

    /** Task attempts fail on purpose at several stages; the answers stay exact. */
    @Test
    void failedTaskAttemptsAreRetriedExactly() throws Exception {
        for (int n : new int[] {3, 5, 9, 18}) {
            String sql = TrinoCluster.tpchQuery(n);
            MaterializedResult expected = runner.execute(policy("NONE"), sql);
            for (int stage = 1; stage <= 3; stage++) {
                String token = UUID.randomUUID().toString();
                runner.injectTaskFailure(token, stage, 0, 0, InjectedFailureType.TASK_FAILURE, Optional.of(ErrorType.INTERNAL_ERROR));
                Session failing = Session.builder(policy("TASK")).setTraceToken(Optional.of(token)).build();
                assertSameAnswers(n, expected, runner.execute(failing, sql));
            }
        }
        awaitNothingLeft();
    }

    /**
     * A worker's sidecar is killed mid-query and restarted at its address (its container
     * restarted in the pod), every page it held gone: attempts writing into it fail and are
     * retried, committed output it held is read from storage through failover, and every answer
     * stays exact; nothing is left after.
     */
    @Test
    void aWorkersSidecarRestartedMidQueryLosesNoRow() throws Exception {
        restartMidQuery(1, 9, 18, 21);
    }

    /**
     * The same for the coordinator's sidecar: the coordinator also runs tasks here, and asks its
     * sidecar where each finished attempt's output is (COMMITTED) and to free an exchange's
     * output when it closes; those requests are retried on the restarted sidecar, which reads
     * the manifests from storage.
     */
    @Test
    void theCoordinatorsSidecarRestartedMidQueryLosesNoRow() throws Exception {
        restartMidQuery(0, 9, 21);
    }

    /**
     * Runs each TPC-H query under TASK twice to time it (the faster kept: the first TASK query
     * of a cluster also warms its exchange path), then twice more while sidecar {@code index}
     * is killed and restarted a quarter and 60% into that time. A query on this cluster takes
     * well under a second, so a fixed delay could restart the sidecar after the query ended and
     * test nothing: at least one of a query's two kills must land while it runs, and at least
     * one kill of the test must find the sidecar holding tasks.
     */
    private void restartMidQuery(int index, int... queries) throws Exception {
        int holding = 0;
        for (int n : queries) {
            String sql = TrinoCluster.tpchQuery(n);
            MaterializedResult expected = runner.execute(policy("NONE"), sql);
            long took = Long.MAX_VALUE;
            for (int run = 0; run < 2; run++) {
                long started = System.nanoTime();
                assertSameAnswers(n, expected, runner.execute(policy("TASK"), sql));
                took = Math.min(took, System.nanoTime() - started);
            }
            int midQuery = 0;
            for (double fraction : new double[] {0.25, 0.6}) {
                long delayNanos = (long) (took * fraction);
                AtomicLong killedAt = new AtomicLong(Long.MAX_VALUE);
                AtomicLong tasksHeld = new AtomicLong();
                CompletableFuture<Void> restart = CompletableFuture.runAsync(() -> {
                    try {
                        TimeUnit.NANOSECONDS.sleep(delayNanos);
                        Binxd old = cluster.sidecars.get(index);
                        tasksHeld.set(old.stat("tasks"));
                        old.kill();
                        killedAt.set(System.nanoTime());
                        long dead = System.currentTimeMillis();
                        kills.add(new Kill("node" + index, runStarted.getOrDefault(index, 0L), dead));
                        runStarted.put(index, dead);
                        cluster.sidecars.set(index, old.restart());
                    } catch (Exception e) {
                        throw new IllegalStateException("restarting sidecar " + index + " failed", e);
                    }
                });
                MaterializedResult actual;
                try {
                    actual = runner.execute(policy("TASK"), sql);
                } catch (RuntimeException e) {
                    // The restart ends before the cluster is closed, and its own failure is told.
                    try {
                        restart.get(60, TimeUnit.SECONDS);
                    } catch (Exception restartFailed) {
                        e.addSuppressed(restartFailed);
                    }
                    throw e;
                }
                long finishedAt = System.nanoTime();
                restart.get(60, TimeUnit.SECONDS);
                assertSameAnswers(n, expected, actual);
                if (killedAt.get() < finishedAt) {
                    midQuery++;
                    holding += tasksHeld.get() > 0 ? 1 : 0;
                }
            }
            assertThat(midQuery).as("kills of sidecar %d that landed while TPC-H q%d ran (%d ms unhurt)", index, n,
                    took / 1_000_000).isGreaterThan(0);
        }
        assertThat(holding).as("kills of sidecar %d mid-query while it held tasks", index).isGreaterThan(0);
        awaitNothingLeft(true);
    }

    /** Every SIGKILL of a sidecar in this class's tests, which share one store. */
    private final List<Kill> kills = new java.util.concurrent.CopyOnWriteArrayList<>();
    /** Per sidecar index, the wall-clock time its running process started (absent: with the cluster). */
    private final Map<Integer, Long> runStarted = new java.util.concurrent.ConcurrentHashMap<>();

    /** A sidecar's run ended by SIGKILL: its spool node name, when it started, and when it was dead by (reaped). */
    private record Kill(String node, long startedMillis, long deadByMillis) {
        /** Whether {@code manifest} is a commit manifest this run wrote: it names its node, written while it ran. */
        boolean wrote(Path manifest, String text) throws java.io.IOException {
            long written = Files.getLastModifiedTime(manifest).toMillis();
            return written >= startedMillis && written <= deadByMillis
                    && text.matches("(?s).*\"node\"\\s*:\\s*\"" + java.util.regex.Pattern.quote(node) + "\".*");
        }
    }

    /** As {@link #awaitNothingLeft(boolean)}, excusing what the kills of an earlier test of the class left. */
    private void awaitNothingLeft() throws Exception {
        awaitNothingLeft(!kills.isEmpty());
    }

    /**
     * When {@code manifest} is one a killed run wrote (see {@link #leftByAKill()}), adds it and
     * its release records to {@code out}, and to {@code named} the segments its buffers name (a
     * packed one by its pack), less those of buffers whose release a run that was not killed
     * after recorded.
     */
    private void cutDelete(Path manifest, List<Path> files, List<Path> out, java.util.Set<String> named) {
        String text;
        try {
            text = Files.readString(manifest);
            boolean killedRun = false;
            for (Kill kill : kills) {
                killedRun |= kill.wrote(manifest, text);
            }
            if (!killedRun) {
                return;
            }
        } catch (java.io.IOException gone) {
            return;
        }
        Path task = manifest.getParent();
        // Buffers whose release a live run recorded: their segments must be gone. One recorded
        // by a run killed later may have been cut before its segments went.
        java.util.Set<Long> released = new java.util.HashSet<>();
        for (Path p : files) {
            String name = p.getFileName().toString();
            if (p.getParent().equals(task) && RELEASE_RECORD.matcher(name).matches()) {
                out.add(p);
                try {
                    long at = Files.getLastModifiedTime(p).toMillis();
                    if (kills.stream().noneMatch(k -> at >= k.startedMillis() && at <= k.deadByMillis())) {
                        released.add(Long.parseLong(name.substring(0, name.indexOf('.'))));
                    }
                } catch (java.io.IOException gone) {
                    // Deleted meanwhile, with the manifest: the next look sees.
                }
            }
        }
        out.add(manifest);
        com.fasterxml.jackson.databind.JsonNode markers;
        try {
            markers = new com.fasterxml.jackson.databind.ObjectMapper().readTree(text).path("markers");
        } catch (java.io.IOException unreadable) {
            throw new AssertionError("a manifest a killed sidecar left is not JSON: " + manifest, unreadable);
        }
        for (com.fasterxml.jackson.databind.JsonNode entry : markers) {
            if (released.contains(entry.path("buffer_id").asLong(-1))) {
                continue;
            }
            for (com.fasterxml.jackson.databind.JsonNode segment : entry.path("segments")) {
                String name = segment.path("name").asText();
                int at = name.indexOf('@');
                named.add(at < 0 ? name : name.substring(0, at));
            }
        }
    }

    /**
     * What a SIGKILLed sidecar may leave (see {@link #awaitNothingLeft(boolean)}): staging files
     * of cut puts, the files of commits cut short (a task directory under {@code commit/} with
     * markers and no {@code task.json}; or release records left when a kill came between a
     * task's manifest going and its records following) with the segments their markers name (a packed segment,
     * {@code <pack>@<offset>}, by its pack), and the durable
     * segments ({@code -a-} in the name) of a commit cut before its manifest folded their markers
     * in, which nothing stored names; and a deletion cut short: a manifest a killed run of a
     * sidecar wrote (it names that node, written while that run lived), with its release records
     * and the segments its buffers name, less those of buffers whose release record a run that
     * still lives wrote (it deletes them right after). A live sidecar frees a
     * committed task's storage once every buffer of it was deleted, keeping in memory which
     * were; a kill after it answered some of those DELETEs loses that, and the restarted sidecar,
     * asked for the rest, records their release and deletes their segments, no more (the spool
     * e2e test {@code deletes_a_producer_answered_before_a_crash_are_not_known_to_its_next_run}
     * pins that), so the manifest and what the buffers deleted before the kill name stay for the
     * storage TTL.
     */
    private List<Path> leftByAKill() throws Exception {
        List<Path> files = cluster.storedFiles();
        List<Path> out = new java.util.ArrayList<>(
                files.stream().filter(p -> p.getFileName().toString().matches(".+#[0-9]+")).toList());
        java.util.Set<String> named = new java.util.HashSet<>();
        java.util.regex.Pattern segment = java.util.regex.Pattern.compile("\"name\"\\s*:\\s*\"([^\"@]+)(?:@[0-9]+)?\"");
        for (Path f : files) {
            Path task = f.getParent();
            boolean inCommit = task.getParent() != null && task.getParent().getFileName().toString().equals("commit");
            if (inCommit && f.getFileName().toString().equals("task.json")) {
                cutDelete(f, files, out, named);
                continue;
            }
            // A marker of a commit cut short, or a release record whose manifest went before
            // the kill let the records follow it.
            boolean cutCommit = inCommit && (f.getFileName().toString().matches("[0-9]+\\.json") || RELEASE_RECORD.matcher(f.getFileName().toString()).matches())
                    && !Files.exists(task.resolve("task.json"));
            if (cutCommit) {
                out.add(f);
                String text;
                try {
                    text = Files.readString(f);
                } catch (java.io.IOException gone) {
                    continue;
                }
                java.util.regex.Matcher m = segment.matcher(text);
                while (m.find()) {
                    named.add(m.group(1));
                }
            }
        }
        files.stream().filter(p -> named.contains(p.getFileName().toString())).forEach(out::add);
        java.util.Set<String> namedByAny = new java.util.HashSet<>();
        for (Path f : files) {
            if (!f.getFileName().toString().endsWith(".json")) {
                continue;
            }
            try {
                java.util.regex.Matcher m = segment.matcher(Files.readString(f));
                while (m.find()) {
                    namedByAny.add(m.group(1));
                }
            } catch (java.io.IOException gone) {
                // Deleted meanwhile: names nothing.
            }
        }
        files.stream()
                .filter(p -> p.getFileName().toString().matches(".+-a-[0-9a-f]{16}\\.bxs"))
                .filter(p -> !namedByAny.contains(p.getFileName().toString()))
                .forEach(out::add);
        return out;
    }

    /**
     * Every sidecar holds no memory and no task, and the store no object or directory, within a
     * minute. {@code killed}: a sidecar was SIGKILLed, so the staging file of a put it was in the
     * middle of ({@code <name>#<digits>}, which object_store writes before renaming and hides
     * from listing) may stay, with its directories, until the spool's pruner deletes it after
     * ten minutes (binx-spool's {@code the_pruner_deletes_the_staging_files_of_puts_cut_short});
     * an empty directory the kill left (made for a put, or emptied by a delete before its
     * cleanup) is not excused: the restarted sidecar's startup prune removes it;
     * and a commit it was in the middle of (some of a task's markers written, not its manifest,
     * and the segments those markers name) stays until the storage TTL, the rule for what a
     * crashed sidecar leaves: that attempt failed, so nothing reads it (without a manifest
     * COMMITTED finds nothing) and Trino retried it; so does a committed task's output whose
     * deletion the kill cut short (see {@link #leftByAKill()}).
     */
    private void awaitNothingLeft(boolean killed) throws Exception {
        long deadline = System.nanoTime() + 60_000_000_000L;
        while (true) {
            StringBuilder left = new StringBuilder();
            for (int i = 0; i < cluster.sidecars.size(); i++) {
                Binxd b = cluster.sidecars.get(i);
                long memory = b.stat("memory_used");
                long tasks = b.stat("tasks");
                if (memory != 0 || tasks != 0) {
                    left.append("sidecar ").append(i).append(": ").append(memory).append(" bytes, ").append(tasks).append(" tasks; ");
                }
            }
            List<Path> cutPuts = killed ? leftByAKill() : List.of();
            List<Path> objects = cluster.storedFiles().stream().filter(p -> !cutPuts.contains(p)).toList();
            if (!objects.isEmpty()) {
                left.append(objects.size()).append(" objects in storage: ")
                        .append(objects.stream().limit(40).map(o -> cluster.store.relativize(o).toString()).toList()).append("; ");
            }
            List<Path> directories = cluster.storedDirectories().stream()
                    .filter(d -> cutPuts.stream().noneMatch(p -> p.startsWith(d)))
                    .toList();
            if (!directories.isEmpty()) {
                left.append(directories.size()).append(" directories in storage, e.g. ").append(directories.get(0));
            }
            if (left.isEmpty()) {
                return;
            }
            if (System.nanoTime() > deadline) {
                throw new AssertionError("left behind after the queries: " + left);
            }
            Thread.sleep(200);
        }
    }
}
