package io.binx.trino;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import io.airlift.slice.Slice;
import io.airlift.slice.Slices;
import io.binx.client.Binxd;
import io.binx.client.TaskWriter;
import io.trino.plugin.exchange.filesystem.TestExchangeManagerContext;
import io.trino.spi.exchange.Exchange;
import io.trino.spi.exchange.ExchangeId;
import io.trino.spi.exchange.ExchangeManager;
import io.trino.spi.exchange.ExchangeSink;
import io.trino.spi.exchange.ExchangeSinkHandle;
import io.trino.spi.exchange.ExchangeSource;
import io.trino.spi.exchange.ExchangeSourceHandle;
import io.trino.spi.exchange.ExchangeSourceOutputSelector;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

/**
 * A worker's sidecar dies after its task attempt finished: the attempt's output outlives it.
 * Three binxd processes share one {@code file://} store, as a coordinator's and two workers'
 * sidecars do: the producer's is killed (SIGKILL), and the coordinator still learns where the
 * output is, a consumer on the other worker reads every page exactly, in its writer's order,
 * from storage through its own sidecar, and closing the exchange leaves nothing in storage.
 */
public class TestBinxExchangeFailover {
    private static final String SECRET = "failover-test-secret";
    private static final int PARTITIONS = 2;
    private static final int PAGES = 1200;

    private Path store;
    private final List<Binxd> sidecars = new ArrayList<>();
    private final List<ExchangeManager> managers = new ArrayList<>();
    private Binxd coordinatorSidecar;
    private volatile Binxd producerSidecar;
    private Binxd consumerSidecar;
    private ExchangeManager coordinator;
    private ExchangeManager producer;
    private ExchangeManager consumer;

    @BeforeEach
    void start() throws Exception {
        store = Files.createTempDirectory("binx-failover-store");
        coordinatorSidecar = sidecar("coordinator");
        producerSidecar = sidecar("producer");
        consumerSidecar = sidecar("consumer");
        coordinator = manager(coordinatorSidecar, "32MB");
        producer = manager(producerSidecar, "32MB");
        // A small source buffer: most pages are still to be read when the producer dies.
        consumer = manager(consumerSidecar, "64kB");
    }

    private Binxd sidecar(String node) throws Exception {
        Binxd b = Binxd.start("--spool-stores", "file://" + store.resolve("spool"), "--spool-node-name", node,
                "--shared-secret", SECRET, "--spool-failover-after", "2s", "--memory-limit", "256MiB");
        sidecars.add(b);
        return b;
    }

    private ExchangeManager manager(Binxd sidecar, String sourceBuffer) {
        ExchangeManager m = new BinxExchangeManagerFactory().create(
                Map.of("exchange.binx.socket", sidecar.socket.toString(),
                        "exchange.binx.source-buffer-size", sourceBuffer,
                        "exchange.binx.max-error-duration", "1m"),
                new TestExchangeManagerContext());
        managers.add(m);
        return m;
    }

    @AfterEach
    void stop() throws Exception {
        TrinoCluster.stopAll(managers, sidecars, store);
    }

    private static TestingExchangeContext context(ExchangeId id) {
        return new TestingExchangeContext("q_failover", id);
    }

    /** Page i of partition p: its own bytes, 16 B to about 48 KiB, so no two pages are alike. */
    private static String page(int p, int i) {
        return "p" + p + "-" + i + "-" + "x".repeat((i * 7919) % 48_000);
    }

    /** The coordinator's exchange with one finished attempt written on the producer's node. */
    private record Written(ExchangeId id, Exchange exchange, List<ExchangeSourceHandle> handles) {}

    private Written writeOnTheProducer(boolean killBeforeHandles) throws Exception {
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = coordinator.createExchange(context(id), PARTITIONS, true);
        ExchangeSinkHandle s0 = exchange.addSink(0);
        exchange.noMoreSinks();
        // A second attempt that never finishes: it must not be read, and it dies with its node.
        ExchangeSink lost = producer.createSink(exchange.instantiateSink(s0, 1).get());
        ExchangeSink sink = producer.createSink(exchange.instantiateSink(s0, 0).get());
        for (int i = 0; i < PAGES; i++) {
            for (int p = 0; p < PARTITIONS; p++) {
                sink.add(p, Slices.utf8Slice(page(p, i)));
                lost.add(p, Slices.utf8Slice("lost-" + i));
            }
        }
        sink.finish().get(60, TimeUnit.SECONDS);
        exchange.sinkFinished(s0, 0);
        exchange.allRequiredSinksFinished();
        if (killBeforeHandles) {
            producerSidecar.kill();
        }
        List<ExchangeSourceHandle> handles = exchange.getSourceHandles().getNextBatch().get(60, TimeUnit.SECONDS).handles();
        for (ExchangeSourceHandle h : handles) {
            assertThat(h.getDataSizeInBytes()).isEqualTo(bytesOf(h.getPartitionId()));
        }
        assertThat(handles.stream().map(ExchangeSourceHandle::getPartitionId).distinct().count()).isEqualTo(PARTITIONS);
        return new Written(id, exchange, handles);
    }

    private static long bytesOf(int partition) {
        long total = 0;
        for (int i = 0; i < PAGES; i++) {
            total += page(partition, i).getBytes(StandardCharsets.UTF_8).length;
        }
        return total;
    }

    /** Reads one partition on the consumer's node; kills the producer's sidecar after {@code killAt} pages. */
    private List<String> read(Written w, int partition, int attempt, int killAt) throws Exception {
        return read(consumer, w, partition, attempt, killAt);
    }

    private List<String> read(ExchangeManager reader, Written w, int partition, int attempt, int killAt) throws Exception {
        return read(reader, w, partition, attempt, killAt, producerSidecar::kill);
    }

    /** Something done to a sidecar in the middle of a read. */
    private interface Fault {
        void apply() throws Exception;
    }

    /** Reads one partition on {@code reader}'s node; {@code fault} after {@code at} pages. */
    private List<String> read(ExchangeManager reader, Written w, int partition, int attempt, int at, Fault fault)
            throws Exception {
        ExchangeSourceOutputSelector selector = ExchangeSourceOutputSelector.builder(Set.of(w.id()))
                .include(w.id(), 0, attempt).setPartitionCount(w.id(), 1).setFinal().build();
        List<String> out = new ArrayList<>();
        try (ExchangeSource source = reader.createSource()) {
            source.addSourceHandles(w.handles().stream().filter(h -> h.getPartitionId() == partition).toList());
            source.noMoreSourceHandles();
            source.setOutputSelector(selector);
            while (!source.isFinished()) {
                Slice s = source.read();
                if (s != null) {
                    out.add(s.toStringUtf8());
                    if (out.size() == at) {
                        fault.apply();
                    }
                } else {
                    source.isBlocked().get(60, TimeUnit.SECONDS);
                }
            }
        }
        return out;
    }

    private void readEveryPartitionExactly(Written w, int killAt) throws Exception {
        for (int p = 0; p < PARTITIONS; p++) {
            assertExactly(p, read(w, p, 0, p == 0 ? killAt : -1));
        }
        assertThat(producerSidecar.alive()).isFalse();
        assertThat(consumerSidecar.log()).contains("reading the committed buffer from storage");
        assertThat(consumerSidecar.stat("objects_read")).isGreaterThan(0);
    }

    /** Partition p's pages, every one, in order (compared one by one: a failure prints no megabytes). */
    private static void assertExactly(int p, List<String> got) {
        assertThat(got.size()).as("pages of partition %d", p).isEqualTo(PAGES);
        for (int i = 0; i < PAGES; i++) {
            if (!got.get(i).equals(page(p, i))) {
                throw new AssertionError("partition " + p + " page " + i + " differs: "
                        + got.get(i).substring(0, Math.min(40, got.get(i).length())));
            }
        }
    }

    /** Closing the exchange deletes the attempt from storage, through the coordinator's sidecar's failover. */
    private void closeAndAwaitEmptyStorage(Written w) throws Exception {
        w.exchange().close();
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(30);
        while (true) {
            List<Path> left = TrinoCluster.storedFiles(store);
            long memory = coordinatorSidecar.stat("memory_used") + consumerSidecar.stat("memory_used");
            if (left.isEmpty() && memory == 0) {
                return;
            }
            if (System.nanoTime() > deadline) {
                throw new AssertionError("after close: memory_used " + memory + ", left in storage " + left);
            }
            Thread.sleep(100);
        }
    }

    /**
     * The producer's sidecar restarts while a sink writes (its container restarted in the
     * pod): the new one knows nothing of the attempt. The sink's add never throws, its finish
     * fails naming the attempt's task, and nothing is committed; the engine's next attempt of
     * the same partition, on the restarted sidecar, is read exactly, and nothing of the first.
     */
    @Test
    void aSinkWhoseSidecarRestartsMidWriteFailsItsFinishAndTheRetryIsReadExactly() throws Exception {
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = coordinator.createExchange(context(id), PARTITIONS, true);
        ExchangeSinkHandle s0 = exchange.addSink(0);
        exchange.noMoreSinks();
        BinxSinkInstanceHandle first = (BinxSinkInstanceHandle) exchange.instantiateSink(s0, 0).get();
        ExchangeSink sink = producer.createSink(first);
        long empty = sink.getMemoryUsage();
        long added = 0;
        for (int i = 0; i < PAGES; i++) {
            if (i == PAGES / 2) {
                // Some pages were confirmed to the sink by the binxd that restarts (it keeps
                // pages until then). That binxd counting pages is not enough: if it dies before
                // its replies arrive, the sink resends every page to the new one, exactly.
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
                while (sink.getMemoryUsage() - empty >= added) {
                    assertThat(System.nanoTime()).as("the producer's sidecar confirms pages").isLessThan(deadline);
                    Thread.sleep(10);
                }
                Binxd restarted = producerSidecar.restart();
                sidecars.add(restarted);
                producerSidecar = restarted;
            }
            for (int p = 0; p < PARTITIONS; p++) {
                Slice slice = Slices.utf8Slice("first-" + page(p, i));
                added += slice.length() + TaskWriter.PAGE_OVERHEAD;
                sink.add(p, slice);
            }
        }
        assertThatThrownBy(() -> sink.finish().get(90, TimeUnit.SECONDS))
                .hasMessageContaining(first.taskId())
                .hasMessageContaining("binxd restarted");

        ExchangeSink retry = producer.createSink(exchange.instantiateSink(s0, 1).get());
        for (int i = 0; i < PAGES; i++) {
            for (int p = 0; p < PARTITIONS; p++) {
                retry.add(p, Slices.utf8Slice(page(p, i)));
            }
        }
        retry.finish().get(60, TimeUnit.SECONDS);
        exchange.sinkFinished(s0, 1);
        exchange.allRequiredSinksFinished();
        List<ExchangeSourceHandle> handles = exchange.getSourceHandles().getNextBatch().get(60, TimeUnit.SECONDS).handles();
        Written w = new Written(id, exchange, handles);
        for (int p = 0; p < PARTITIONS; p++) {
            assertExactly(p, read(w, p, 1, -1));
        }
        closeAndAwaitEmptyStorage(w);
    }

    /**
     * The producer's sidecar restarts at its address (same socket and ports, as a container
     * restarted in its pod) after the attempt finished: a reader on that node, whose sidecar
     * lost the buffer, and a reader on another node, whose sidecar finds the producer's
     * address answering for a task it does not know, both read every page from storage.
     */
    @Test
    void aSidecarRestartedAtItsAddressAfterTheFinishServesTheOutputFromStorage() throws Exception {
        Written w = writeOnTheProducer(false);
        Binxd restarted = producerSidecar.restart();
        sidecars.add(restarted);
        producerSidecar = restarted;
        assertExactly(0, read(producer, w, 0, 0, -1));
        assertExactly(1, read(consumer, w, 1, 0, -1));
        assertThat(producerSidecar.log()).contains("reading the committed buffer from storage");
        assertThat(consumerSidecar.log()).contains("reading the committed buffer from storage");
        w.exchange().close();
    }

    @Test
    void theCoordinatorAndAConsumerFindTheOutputOfAWorkerWhoseSidecarDiedAfterTheFinish() throws Exception {
        Written w = writeOnTheProducer(true);
        readEveryPartitionExactly(w, -1);
        closeAndAwaitEmptyStorage(w);
    }

    @Test
    void aConsumerFinishesFromStorageWhenTheProducersSidecarDiesMidRead() throws Exception {
        Written w = writeOnTheProducer(false);
        readEveryPartitionExactly(w, 100);
        closeAndAwaitEmptyStorage(w);
    }

    /**
     * The producer's sidecar stops answering mid-read (SIGSTOP: alive, its sockets open,
     * silent; a wedged process or a paused container). The consumer's sidecar finds it silent
     * and fails over to storage: every page is read, once and in order; closing the exchange
     * deletes the output through the coordinator's sidecar's failover the same way.
     */
    @Test
    void aConsumerFinishesFromStorageWhenTheProducersSidecarStopsAnsweringMidRead() throws Exception {
        Written w = writeOnTheProducer(false);
        Binxd stopped = producerSidecar;
        assertExactly(0, read(consumer, w, 0, 0, 100, stopped::suspend));
        assertExactly(1, read(consumer, w, 1, 0, -1, () -> {}));
        assertThat(stopped.alive()).isTrue();
        assertThat(consumerSidecar.log()).contains("reading the committed buffer from storage");
        closeAndAwaitEmptyStorage(w);
        stopped.resume();
    }
}
