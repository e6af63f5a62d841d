package io.binx.trino;

import static org.assertj.core.api.Assertions.assertThat;

import io.airlift.slice.Slice;
import io.airlift.slice.Slices;
import io.binx.client.Binxd;
import io.trino.plugin.exchange.filesystem.FileSystemExchangeManagerFactory;
import io.trino.plugin.exchange.filesystem.TestExchangeManagerContext;
import io.trino.spi.exchange.Exchange;
import io.trino.spi.exchange.ExchangeId;
import io.trino.spi.exchange.ExchangeManager;
import io.trino.spi.exchange.ExchangeSink;
import io.trino.spi.exchange.ExchangeSinkHandle;
import io.trino.spi.exchange.ExchangeSource;
import io.trino.spi.exchange.ExchangeSourceHandle;
import io.trino.spi.exchange.ExchangeSourceOutputSelector;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;

/**
 * One task attempt's output through the exchange SPI, without a query engine around it: the
 * sink's {@code add} of every page and its {@code finish()}, the coordinator's steps from
 * {@code sinkFinished} to the source handles, then one source reading every partition back.
 * Trino's filesystem exchange (files in the same directory the sidecar's store is in) against
 * binx with spool policy {@code commit} and {@code always}, through one release binxd, and
 * {@code commit} read back through a second binxd (a consumer on another node: its sidecar
 * forwards to the producer's over TCP), round by round in turn so drift hits each alike.
 * binxd's request latency histograms go beside the report ({@code <out>.metrics}). Not a test: run by benches/trino-sink.sh, never
 * by {@code scripts/java.sh verify}; it asserts no time, only that every byte came back.
 *
 * <p>System properties: {@code binx.bench.rounds} (timed rounds per case; 60),
 * {@code binx.bench.warmup-rounds} (30),
 * {@code binx.bench.partitions} (output partitions; 16), {@code binx.bench.pages} (pages per
 * partition; 4), {@code binx.bench.page-size} (bytes; 32768), {@code binx.bench.out} (the
 * Markdown report).
 */
public class BinxSinkBench {

    /** One case's times per round, in milliseconds. */
    private record Rounds(double[] write, double[] finish, double[] handles, double[] read) {
        Rounds(int n) {
            this(new double[n], new double[n], new double[n], new double[n]);
        }
    }

    @Test
    void sinkAndSource() throws Exception {
        int rounds = Integer.getInteger("binx.bench.rounds", 60);
        int warmup = Integer.getInteger("binx.bench.warmup-rounds", 30);
        int partitions = Integer.getInteger("binx.bench.partitions", 16);
        int pages = Integer.getInteger("binx.bench.pages", 4);
        int pageSize = Integer.getInteger("binx.bench.page-size", 32768);
        Path out = Path.of(System.getProperty("binx.bench.out", "target/bench/trino-sink.md"));
        Instant started = Instant.now();
        Path dir = Files.createTempDirectory("binx-sink-bench");
        Slice[] data = new Slice[pages];
        for (int i = 0; i < pages; i++) {
            byte[] bytes = new byte[pageSize];
            ThreadLocalRandom.current().nextBytes(bytes);
            data[i] = Slices.wrappedBuffer(bytes);
        }
        Map<String, ExchangeManager> managers = new LinkedHashMap<>();
        // The readers' managers where they are not the writers' (a consumer on another node).
        Map<String, ExchangeManager> readers = new LinkedHashMap<>();
        Binxd binxd = Binxd.start("--spool-stores", "file://" + dir.resolve("spool"), "--shared-secret", TrinoCluster.SECRET,
                "--spool-node-name", "node0", "--memory-limit", "1GiB", "--task-memory-limit", "1GiB");
        // A second sidecar, the consumer's on another node: it reads the producer's buffers
        // through its forwarder over TCP, as a Trino worker's sidecar reads another worker's.
        Binxd other = Binxd.start("--spool-stores", "file://" + dir.resolve("spool"), "--shared-secret", TrinoCluster.SECRET,
                "--spool-node-name", "node1", "--memory-limit", "1GiB", "--task-memory-limit", "1GiB");
        try {
            managers.put("filesystem", new FileSystemExchangeManagerFactory().create(
                    Map.of("exchange.base-directories", dir.resolve("fs").toUri().toString()), new TestExchangeManagerContext()));
            for (String policy : List.of("commit", "always")) {
                Map<String, String> config = new LinkedHashMap<>(
                        Map.of("exchange.binx.socket", binxd.socket.toString(), "exchange.binx.spool-policy", policy));
                // Any plugin property, to compare settings: -Dbinx.bench.exchange.binx.<name>=<value>.
                for (String key : System.getProperties().stringPropertyNames()) {
                    if (key.startsWith("binx.bench.exchange.binx.")) {
                        config.put(key.substring("binx.bench.".length()), System.getProperty(key));
                    }
                }
                managers.put("binx " + policy, new BinxExchangeManagerFactory().create(config,
                        new TestExchangeManagerContext()));
                if (policy.equals("commit")) {
                    String remote = "binx commit, read on another node";
                    managers.put(remote, new BinxExchangeManagerFactory().create(config, new TestExchangeManagerContext()));
                    Map<String, String> otherConfig = new LinkedHashMap<>(config);
                    otherConfig.put("exchange.binx.socket", other.socket.toString());
                    readers.put(remote, new BinxExchangeManagerFactory().create(otherConfig, new TestExchangeManagerContext()));
                }
            }
            Map<String, Rounds> results = new LinkedHashMap<>();
            managers.keySet().forEach(name -> results.put(name, new Rounds(rounds)));
            List<String> names = new ArrayList<>(managers.keySet());
            for (int round = -warmup; round < rounds; round++) {
                // Each case goes first, second and third in turn.
                java.util.Collections.rotate(names, 1);
                for (String name : names) {
                    ExchangeManager writer = managers.get(name);
                    roundTrip(writer, readers.getOrDefault(name, writer), partitions, data,
                            round < 0 ? null : results.get(name), Math.max(round, 0));
                    // binx deletes a closed exchange's output in the background (the filesystem
                    // exchange inside close()): it ends before the next case is timed.
                    awaitIdle(binxd);
                    awaitIdle(other);
                }
            }
            String report = report(started, rounds, warmup, partitions, pages, pageSize, results, binxd.peakRssBytes());
            Files.createDirectories(out.toAbsolutePath().getParent());
            Files.writeString(out, report);
            Files.writeString(out.resolveSibling(out.getFileName() + ".metrics"), binxd.metrics());
            System.out.println(report);
        } finally {
            for (ExchangeManager m : managers.values()) {
                m.shutdown();
            }
            for (ExchangeManager m : readers.values()) {
                m.shutdown();
            }
            binxd.close();
            other.close();
            TrinoCluster.delete(dir);
        }
    }

    /** One attempt's output written and read back; times go to {@code times[round]} unless warming up. */
    private static void roundTrip(ExchangeManager manager, ExchangeManager readers, int partitions, Slice[] data,
            Rounds times, int round)
            throws Exception {
        ExchangeId id = ExchangeId.createRandomExchangeId();
        long written = 0;
        java.util.BitSet seen = new java.util.BitSet();
        try (Exchange exchange = manager.createExchange(new TestingExchangeContext("q_sink_bench", id), partitions, false)) {
            ExchangeSinkHandle handle = exchange.addSink(0);
            exchange.noMoreSinks();
            long t0 = System.nanoTime();
            ExchangeSink sink = manager.createSink(exchange.instantiateSink(handle, 0).get(30, TimeUnit.SECONDS));
            for (int i = 0; i < data.length; i++) {
                for (int p = 0; p < partitions; p++) {
                    // The sink owns what it is given: a new page per add, as the engine hands
                    // over pages it built, each numbered in its first bytes.
                    Slice page = Slices.wrappedBuffer(data[i].getBytes());
                    page.setInt(0, i * partitions + p);
                    if (!sink.isBlocked().isDone()) {
                        sink.isBlocked().get(30, TimeUnit.SECONDS);
                    }
                    sink.add(p, page);
                    written += page.length();
                }
            }
            long added = System.nanoTime();
            sink.finish().get(30, TimeUnit.SECONDS);
            long t1 = System.nanoTime();
            exchange.sinkFinished(handle, 0);
            exchange.allRequiredSinksFinished();
            List<ExchangeSourceHandle> handles = new ArrayList<>();
            try (var source = exchange.getSourceHandles()) {
                while (true) {
                    var batch = source.getNextBatch().get(30, TimeUnit.SECONDS);
                    handles.addAll(batch.handles());
                    if (batch.lastBatch()) {
                        break;
                    }
                }
            }
            long t2 = System.nanoTime();
            long read = 0;
            try (ExchangeSource reader = readers.createSource()) {
                reader.addSourceHandles(handles);
                reader.noMoreSourceHandles();
                reader.setOutputSelector(ExchangeSourceOutputSelector.builder(Set.of(id)).include(id, 0, 0)
                        .setPartitionCount(id, 1).setFinal().build());
                while (!reader.isFinished()) {
                    Slice s = reader.read();
                    if (s != null) {
                        read += s.length();
                        int number = s.getInt(0);
                        assertThat(seen.get(number)).as("page %d read twice", number).isFalse();
                        seen.set(number);
                    } else {
                        reader.isBlocked().get(30, TimeUnit.SECONDS);
                    }
                }
            }
            long t3 = System.nanoTime();
            assertThat(read).as("bytes read back from %s", manager.getClass().getSimpleName()).isEqualTo(written);
            assertThat(seen.cardinality()).as("pages read back").isEqualTo(data.length * partitions);
            if (times != null) {
                times.write[round] = (t1 - t0) / 1e6;
                times.finish[round] = (t1 - added) / 1e6;
                times.handles[round] = (t2 - t1) / 1e6;
                times.read[round] = (t3 - t2) / 1e6;
            }
        }
    }

    /** Waits until binxd holds no task: the deletes of the last closed exchange are done. */
    private static void awaitIdle(Binxd binxd) throws Exception {
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(30);
        while (binxd.stat("tasks") != 0 || binxd.stat("memory_used") != 0) {
            assertThat(System.nanoTime()).as("binxd idle after a round").isLessThan(deadline);
            Thread.sleep(1);
        }
    }

    private static double median(double[] values) {
        double[] sorted = values.clone();
        Arrays.sort(sorted);
        int n = sorted.length;
        return n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
    }

    private static double sumMedian(Rounds r) {
        double[] total = new double[r.write.length];
        for (int i = 0; i < total.length; i++) {
            total[i] = r.write[i] + r.handles[i] + r.read[i];
        }
        return median(total);
    }

    private static String report(Instant started, int rounds, int warmup, int partitions, int pages, int pageSize,
            Map<String, Rounds> results, long binxdRss) {
        StringBuilder s = new StringBuilder();
        s.append("# One task attempt through the exchange SPI\n\n");
        s.append(String.format(Locale.ROOT, "Started %s; %d cores; %d timed rounds per case after %d warm-up rounds,"
                + " the cases in turn each round; one attempt of %d partitions x %d pages of %d bytes (%d KiB).%n%n",
                started, Runtime.getRuntime().availableProcessors(), rounds, warmup, partitions, pages, pageSize,
                (long) partitions * pages * pageSize / 1024));
        s.append("Medians in ms: `add` of every page and `finish()` (and `finish()` alone: from the last `add`"
                + " returning to its future's completion); `sinkFinished` to the last batch of source"
                + " handles; one source reading every partition; the three in one round. Ratios against the"
                + " filesystem exchange in the same run. Both write every page to storage before `finish()`"
                + " resolves (binx: its sidecar's store, under `commit` at the finish, under `always` as pages"
                + " come); neither syncs to disk. The filesystem exchange reads its files back (from the page"
                + " cache), binx's source reads from its sidecar's memory (\"read on another node\": through"
                + " a second sidecar, which forwards to the producer's over TCP).\n\n");
        s.append("| exchange | add + finish | of it finish | handles | read | round | round / filesystem |\n"
                + "|---|---|---|---|---|---|---|\n");
        double fs = sumMedian(results.get("filesystem"));
        for (var e : results.entrySet()) {
            Rounds r = e.getValue();
            double total = sumMedian(r);
            s.append(String.format(Locale.ROOT, "| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |%n", e.getKey(),
                    median(r.write), median(r.finish), median(r.handles), median(r.read), total, total / fs));
        }
        s.append(String.format(Locale.ROOT, "%nbinxd's peak RSS: %d MiB.%n", binxdRss >> 20));
        return s.toString();
    }
}
