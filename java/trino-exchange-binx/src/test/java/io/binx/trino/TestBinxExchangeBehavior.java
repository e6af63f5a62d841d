package io.binx.trino;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import com.fasterxml.jackson.databind.ObjectMapper;
import io.airlift.json.ObjectMapperProvider;
import io.airlift.slice.Slice;
import io.airlift.slice.Slices;
import io.binx.client.Binxd;
import io.trino.plugin.exchange.filesystem.TestExchangeManagerContext;
import io.trino.spi.TrinoException;
import io.trino.spi.exchange.Exchange;
import io.trino.spi.exchange.ExchangeId;
import io.trino.spi.exchange.ExchangeManager;
import io.trino.spi.exchange.ExchangeSink;
import io.trino.spi.exchange.ExchangeSinkHandle;
import io.trino.spi.exchange.ExchangeSource;
import io.trino.spi.exchange.ExchangeSourceHandle;
import io.trino.spi.exchange.ExchangeSourceOutputSelector;
import java.lang.management.ManagementFactory;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.TimeUnit;
import java.util.logging.Handler;
import java.util.logging.Level;
import java.util.logging.LogRecord;
import java.util.logging.Logger;
import javax.management.ObjectName;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestInstance;

/** What the SPI asks of an exchange beyond Trino's own suite, against a real binxd. */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
public class TestBinxExchangeBehavior {
    private Binxd binxd;
    private ExchangeManager manager;

    @BeforeAll
    void start() throws Exception {
        binxd = Binxd.start("--memory-limit", "128MiB");
        manager = new BinxExchangeManagerFactory().create(
                Map.of("exchange.binx.socket", binxd.socket.toString(), "exchange.binx.max-page-size", "1MB"),
                new TestExchangeManagerContext());
    }

    @AfterAll
    void stop() throws Exception {
        manager.shutdown();
        binxd.close();
    }

    /** One of a manager's counters, read the way an operator's JMX client reads it. */
    private static long jmx(ExchangeManager manager, String attribute) throws Exception {
        ObjectName name = ((BinxExchangeManager) manager).stats().objectName();
        return (Long) ManagementFactory.getPlatformMBeanServer().getAttribute(name, attribute);
    }

    private static TestingExchangeContext context(ExchangeId id) {
        return new TestingExchangeContext("q_behavior", id);
    }

    private List<String> read(List<ExchangeSourceHandle> handles, ExchangeSourceOutputSelector selector) throws Exception {
        return read(manager, handles, selector, 40L << 20);
    }

    private static List<String> read(ExchangeManager manager, List<ExchangeSourceHandle> handles,
            ExchangeSourceOutputSelector selector, long peakBound) throws Exception {
        List<String> out = new ArrayList<>();
        long peak = 0;
        try (ExchangeSource source = manager.createSource()) {
            source.addSourceHandles(handles);
            source.noMoreSourceHandles();
            // Nothing is read before the final selector.
            assertThat(source.read()).isNull();
            assertThat(source.isFinished()).isFalse();
            source.setOutputSelector(selector);
            peak = drain(source, out);
            assertThat(source.getMemoryUsage()).isLessThan(4096);
        }
        // The source's buffer (32MB by default) and its readers' replies in flight bound what
        // it holds.
        assertThat(peak).isLessThan(peakBound);
        return out;
    }

    /** Reads {@code source} to its end into {@code out}; returns the most memory it reported. */
    private static long drain(ExchangeSource source, List<String> out) throws Exception {
        long peak = 0;
        while (!source.isFinished()) {
            Slice s = source.read();
            peak = Math.max(peak, source.getMemoryUsage());
            if (s != null) {
                out.add(s.toStringUtf8());
            } else {
                source.isBlocked().get(60, TimeUnit.SECONDS);
            }
        }
        return peak;
    }

    /** A manager of this class's binxd whose sources buffer 64 kB (the least allowed). */
    private ExchangeManager smallSourceManager() {
        return new BinxExchangeManagerFactory().create(
                Map.of("exchange.binx.socket", binxd.socket.toString(), "exchange.binx.source-buffer-size", "64kB"),
                new TestExchangeManagerContext());
    }

    /** An exchange of {@code partitions} output partitions, its one sink's attempt 0 writing. */
    private record OneSink(ExchangeId id, Exchange exchange, ExchangeSinkHandle handle, ExchangeSink sink) {
        static OneSink open(ExchangeManager manager, int partitions) throws Exception {
            ExchangeId id = ExchangeId.createRandomExchangeId();
            Exchange exchange = manager.createExchange(context(id), partitions, true);
            ExchangeSinkHandle s0 = exchange.addSink(0);
            exchange.noMoreSinks();
            return new OneSink(id, exchange, s0, manager.createSink(exchange.instantiateSink(s0, 0).get()));
        }
    }

    /** Adds {@code tasks} sinks (task partitions 0 to tasks - 1) to {@code exchange}, and no more. */
    private static List<ExchangeSinkHandle> addSinks(Exchange exchange, int tasks) {
        List<ExchangeSinkHandle> sinks = new ArrayList<>();
        for (int t = 0; t < tasks; t++) {
            sinks.add(exchange.addSink(t));
        }
        exchange.noMoreSinks();
        return sinks;
    }

    /** Adds one page to each of {@code partitions} output partitions of {@code one}'s sink; returns them. */
    private static List<String> onePagePerPartition(OneSink one, int partitions) {
        List<String> pages = new ArrayList<>();
        for (int q = 0; q < partitions; q++) {
            one.sink().add(q, Slices.utf8Slice("output partition " + q));
            pages.add("output partition " + q);
        }
        return pages;
    }

    /**
     * Finishes attempt 0 of {@code s0}, the exchange's only sink, reports it, and returns the
     * handles of what is to be read.
     */
    private static List<ExchangeSourceHandle> finishTheOnlyAttempt(Exchange exchange, ExchangeSinkHandle s0, ExchangeSink sink)
            throws Exception {
        sink.finish().get(30, TimeUnit.SECONDS);
        exchange.sinkFinished(s0, 0);
        exchange.allRequiredSinksFinished();
        return exchange.getSourceHandles().getNextBatch().get(30, TimeUnit.SECONDS).handles();
    }

    /** The final selector of attempt 0 of an exchange's one sink. */
    private static ExchangeSourceOutputSelector attemptZero(ExchangeId id) {
        return ExchangeSourceOutputSelector.builder(Set.of(id)).include(id, 0, 0).setPartitionCount(id, 1).setFinal().build();
    }

    /**
     * A stage of 300 tasks (more than the lookups one exchange has in flight, and more than the
     * shared connection's 256 request slots): every finished attempt is looked up, in turns,
     * and read, each exactly once.
     */
    @Test
    void aStageOfManyTasksIsLookedUpInTurnsAndReadWhole() throws Exception {
        int tasks = 300;
        assertThat(tasks).isGreaterThan(4 * BinxExchange.MAX_LOOKUPS);
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = manager.createExchange(context(id), 1, false);
        List<ExchangeSinkHandle> sinks = addSinks(exchange, tasks);
        List<String> expected = new ArrayList<>();
        for (int t = 0; t < tasks; t++) {
            ExchangeSink sink = manager.createSink(exchange.instantiateSink(sinks.get(t), 0).get());
            sink.add(0, Slices.utf8Slice("task-" + t));
            expected.add("task-" + t);
            sink.finish().get(30, TimeUnit.SECONDS);
            exchange.sinkFinished(sinks.get(t), 0);
        }
        exchange.allRequiredSinksFinished();
        List<ExchangeSourceHandle> handles = exchange.getSourceHandles().getNextBatch().get(60, TimeUnit.SECONDS).handles();
        ExchangeSourceOutputSelector.Builder all = ExchangeSourceOutputSelector.builder(Set.of(id)).setPartitionCount(id, tasks);
        for (int t = 0; t < tasks; t++) {
            all.include(id, t, 0);
        }
        List<String> read = read(handles, all.setFinal().build());
        assertThat(read).containsExactlyInAnyOrderElementsOf(expected);
        exchange.close();
        awaitEmpty();
    }

    /**
     * An attempt whose output has no commit ends the engine's wait for handles at once, naming
     * it: the lookups still waiting are not started (review: each spent its own error budget
     * first, so a stage of 1000 tasks against a sidecar that is down took about an hour).
     */
    @Test
    void aChosenAttemptWithoutACommitFailsTheHandlesWithoutLookingUpTheRest() throws Exception {
        int tasks = 300;
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = manager.createExchange(context(id), 1, false);
        List<ExchangeSinkHandle> sinks = addSinks(exchange, tasks);
        // Reported finished, never written: binxd has no commit of any.
        for (int t = 0; t < tasks; t++) {
            exchange.sinkFinished(sinks.get(t), 0);
        }
        exchange.allRequiredSinksFinished();
        assertThatThrownBy(() -> exchange.getSourceHandles().getNextBatch().get(60, TimeUnit.SECONDS))
                .hasCauseInstanceOf(TrinoException.class)
                .hasMessageContaining("has no commit");
        assertThat(((BinxExchange) exchange).lookupsStarted()).isLessThanOrEqualTo(BinxExchange.MAX_LOOKUPS);
        exchange.close();
        awaitEmpty();
    }

    /**
     * A source whose buffer holds a few dozen pages reads a buffer of thousands, in order: its
     * readers stop for want of room and are resumed (on a background thread) as the engine
     * takes pages, and what it reports holding stays near its buffer size.
     */
    @Test
    void aSourceFarSmallerThanTheBufferReadsItAllInOrder() throws Exception {
        ExchangeManager small = smallSourceManager();
        try {
            OneSink one = OneSink.open(small, 1);
            ExchangeId id = one.id();
            Exchange exchange = one.exchange();
            ExchangeSinkHandle s0 = one.handle();
            ExchangeSink sink = one.sink();
            List<String> expected = new ArrayList<>();
            for (int i = 0; i < 3000; i++) {
                String page = "page-" + i + "-" + "x".repeat(i % 2000);
                sink.add(0, Slices.utf8Slice(page));
                expected.add(page);
            }
            List<ExchangeSourceHandle> handles = finishTheOnlyAttempt(exchange, s0, sink);
            ExchangeSourceOutputSelector selector = attemptZero(id);
            // 64kB of pages, one reply past it, and 4 readers x 2 replies of 16kB in flight.
            assertThat(read(small, handles, selector, 256 << 10)).containsExactlyElementsOf(expected);
            exchange.close();
            assertThat(((BinxExchangeManager) small).deleter().awaitIdle(60_000)).isTrue();
            // The manager's counters, as JMX gives them: exactly this exchange's traffic.
            long bytes = expected.stream().mapToLong(p -> Slices.utf8Slice(p).length()).sum();
            assertThat(jmx(small, "ExchangesCreated")).isEqualTo(1);
            assertThat(jmx(small, "SinksStarted")).isEqualTo(1);
            assertThat(jmx(small, "SinksCommitted")).isEqualTo(1);
            assertThat(jmx(small, "SinksFailed")).isZero();
            assertThat(jmx(small, "PagesWritten")).isEqualTo(expected.size());
            assertThat(jmx(small, "BytesWritten")).isEqualTo(bytes);
            // 1 MiB batches: a few ENQUEUEs carried the 3000 pages.
            assertThat(jmx(small, "Enqueues")).isBetween(1L, (long) expected.size() / 100);
            assertThat(jmx(small, "SourcesStarted")).isEqualTo(1);
            assertThat(jmx(small, "SourcesFailed")).isZero();
            assertThat(jmx(small, "PagesRead")).isEqualTo(expected.size());
            assertThat(jmx(small, "BytesRead")).isEqualTo(bytes);
            assertThat(jmx(small, "BuffersDeleted")).isEqualTo(1);
            assertThat(jmx(small, "TaskDeletes")).as("with one DELETE_TASK").isEqualTo(1);
            assertThat(jmx(small, "OutputsLeftToTtl")).isZero();
        } finally {
            small.shutdown();
        }
        // Two managers in one JVM (as the nodes of a test cluster) have names of their own; the
        // one shut down leaves JMX, the other stays.
        ObjectName smallName = ((BinxExchangeManager) small).stats().objectName();
        ObjectName sharedName = ((BinxExchangeManager) manager).stats().objectName();
        assertThat(smallName).isNotNull().isNotEqualTo(sharedName);
        assertThat(ManagementFactory.getPlatformMBeanServer().isRegistered(smallName))
                .as("a manager shut down leaves JMX").isFalse();
        assertThat(ManagementFactory.getPlatformMBeanServer().isRegistered(sharedName)).isTrue();
        awaitEmpty();
    }

    /**
     * Empty pages (the SPI's slices are opaque; an empty one is a page) are written and read
     * back in order, each one, among others, through a source whose buffer is small: a page
     * counts against the source's buffer with its objects, not only its bytes, so readers stop
     * for want of room on empty pages too.
     */
    @Test
    void emptyPagesAreReadBackEachOneInOrder() throws Exception {
        ExchangeManager small = smallSourceManager();
        try {
            OneSink one = OneSink.open(small, 1);
            List<String> expected = new ArrayList<>();
            for (int i = 0; i < 20_000; i++) {
                String page = i % 1000 == 0 ? "page-" + i : "";
                one.sink().add(0, Slices.utf8Slice(page));
                expected.add(page);
            }
            List<ExchangeSourceHandle> handles = finishTheOnlyAttempt(one.exchange(), one.handle(), one.sink());
            List<String> got = new ArrayList<>();
            long peak;
            try (ExchangeSource source = small.createSource()) {
                source.addSourceHandles(handles);
                source.noMoreSourceHandles();
                source.setOutputSelector(attemptZero(one.id()));
                // Unread, the pages fill the 64 kB buffer (empty ones counted 64 bytes each: the
                // code before counted none and stayed at its readers' 33 kB in flight).
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(30);
                while (source.getMemoryUsage() < 64 << 10) {
                    assertThat(System.nanoTime()).as("the source never held its buffer's worth").isLessThan(deadline);
                    Thread.sleep(10);
                }
                peak = drain(source, got);
            }
            assertThat(got).containsExactlyElementsOf(expected);
            // A reply is capped in bytes, not pages: one may bring every empty page at once, and
            // the source reports what it holds, 64 bytes a page.
            assertThat(peak).isLessThan((256 << 10) + 64L * expected.size());
            assertThat(jmx(small, "PagesRead")).isEqualTo(expected.size());
            one.exchange().close();
            assertThat(((BinxExchangeManager) small).deleter().awaitIdle(60_000)).isTrue();
        } finally {
            small.shutdown();
        }
        awaitEmpty();
    }

    /**
     * Readers a source starts while another of its readers is connecting share that one
     * connection: behind a sidecar that takes 400 ms to take a connection, a source given its
     * eight handles 40 ms apart (each starting a reader on a thread of its own) makes one
     * connection. Each reader connecting for itself, then closing all but one, made eight
     * (a socket, a thread and a HELLO each) and emptied the pool of kept connections.
     */
    @Test
    void readersThatStartTogetherShareOneConnection() throws Exception {
        OneSink one = OneSink.open(manager, 8);
        List<String> expected = onePagePerPartition(one, 8);
        List<ExchangeSourceHandle> handles = finishTheOnlyAttempt(one.exchange(), one.handle(), one.sink());
        assertThat(handles).hasSize(8);
        try (DelayingProxy proxy = new DelayingProxy(binxd.socket, 400)) {
            BinxExchangeManager slow = (BinxExchangeManager) new BinxExchangeManagerFactory().create(
                    Map.of("exchange.binx.socket", proxy.socket.toString(), "exchange.binx.source-concurrent-readers", "8"),
                    new TestExchangeManagerContext());
            try {
                // Learnt first (its own connection): what follows counts the readers' alone.
                slow.localAddressLookup().get(30, TimeUnit.SECONDS);
                int before = proxy.accepted();
                List<String> got = new ArrayList<>();
                try (ExchangeSource source = slow.createSource()) {
                    source.setOutputSelector(attemptZero(one.id()));
                    for (ExchangeSourceHandle h : handles) {
                        source.addSourceHandles(List.of(h));
                        Thread.sleep(40);
                    }
                    source.noMoreSourceHandles();
                    drain(source, got);
                }
                assertThat(got).containsExactlyInAnyOrderElementsOf(expected);
                assertThat(proxy.accepted() - before).as("connections the source's eight readers made").isEqualTo(1);
            } finally {
                slow.shutdown();
            }
        }
        one.exchange().close();
        assertThat(((BinxExchangeManager) manager).deleter().awaitIdle(60_000)).isTrue();
        awaitEmpty();
    }

    /**
     * A source reads as many buffers at once as {@code source-concurrent-readers} says, never
     * more: with eight waiting and four allowed, four read at once (review: each reader a pump
     * started was counted twice, so one pump started only two; later pumps topped them up).
     */
    @Test
    void aSourceStartsAsManyReadersAsConfigured() throws Exception {
        OneSink one = OneSink.open(manager, 8);
        List<String> expected = onePagePerPartition(one, 8);
        List<ExchangeSourceHandle> handles = finishTheOnlyAttempt(one.exchange(), one.handle(), one.sink());
        ExchangeManager four = new BinxExchangeManagerFactory().create(
                Map.of("exchange.binx.socket", binxd.socket.toString(), "exchange.binx.source-concurrent-readers", "4"),
                new TestExchangeManagerContext());
        try {
            List<String> got = new ArrayList<>();
            try (ExchangeSource source = four.createSource()) {
                source.addSourceHandles(handles);
                source.noMoreSourceHandles();
                source.setOutputSelector(attemptZero(one.id()));
                drain(source, got);
                assertThat(((BinxExchangeSource) source).mostReadersAtOnce()).isEqualTo(4);
            }
            assertThat(got).containsExactlyInAnyOrderElementsOf(expected);
        } finally {
            four.shutdown();
        }
        one.exchange().close();
        assertThat(((BinxExchangeManager) manager).deleter().awaitIdle(60_000)).isTrue();
        awaitEmpty();
    }

    /**
     * The SPI lets the engine reuse a page's memory once {@code add} returns: every page is
     * read back as it was when added, though the engine wrote the next one over the same
     * memory, a view of a far larger array (review: the sink kept the engine's slice).
     */
    @Test
    void theEngineMayReuseAPagesMemoryOnceAddReturns() throws Exception {
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = manager.createExchange(context(id), 1, true);
        ExchangeSinkHandle s0 = exchange.addSink(0);
        exchange.noMoreSinks();
        ExchangeSink sink = manager.createSink(exchange.instantiateSink(s0, 0).get());
        Slice reused = Slices.allocate(1 << 20);
        List<String> expected = new ArrayList<>();
        for (int i = 0; i < 300; i++) {
            String page = "page-" + i + "-" + "y".repeat(i % 50);
            Slice bytes = Slices.utf8Slice(page);
            reused.setBytes(0, bytes);
            sink.add(0, reused.slice(0, bytes.length()));
            expected.add(page);
            // Written over at once, as a reused buffer is.
            reused.fill((byte) '#');
        }
        // What the sink holds is the pages, not the engine's 1 MiB array.
        assertThat(sink.getMemoryUsage()).isLessThan(64 << 10);
        assertThat(read(finishTheOnlyAttempt(exchange, s0, sink), attemptZero(id))).containsExactlyElementsOf(expected);
        exchange.close();
        awaitEmpty();
    }

    /**
     * Once its finish succeeded, a sink's output is what it committed, as in Trino's filesystem
     * exchange: a page added later is ignored (counted, logged), and an abort changes nothing; the
     * attempt is read whole (review: the late page failed the writer, whose ABORT_TASK deleted
     * the committed output, and an abort after the finish did the same).
     */
    @Test
    void aCommittedOutputOutlivesALatePageAndAnAbort() throws Exception {
        OneSink one = OneSink.open(manager, 1);
        List<String> expected = List.of("first", "second", "third");
        for (String page : expected) {
            one.sink().add(0, Slices.utf8Slice(page));
        }
        long lateBefore = jmx(manager, "PagesAddedAfterFinish");
        long abortedBefore = jmx(manager, "SinksAborted");
        one.sink().finish().get(30, TimeUnit.SECONDS);
        one.sink().add(0, Slices.utf8Slice("late"));
        one.sink().add(0, Slices.utf8Slice("later"));
        // Over the page size limit, late: ignored too, not kept as the sink's failure.
        one.sink().add(0, Slices.allocate(2 << 20));
        one.sink().abort().get(30, TimeUnit.SECONDS);
        assertThat(jmx(manager, "PagesAddedAfterFinish")).isEqualTo(lateBefore + 3);
        assertThat(jmx(manager, "SinksAborted")).isEqualTo(abortedBefore);
        // An ABORT_TASK, had one gone out, travels on the writer's connection, not the reader's:
        // give it time to land before reading (the code before sent one, and lost the output).
        Thread.sleep(1000);
        assertThat(read(finishTheOnlyAttempt(one.exchange(), one.handle(), one.sink()), attemptZero(one.id())))
                .containsExactlyElementsOf(expected);
        one.exchange().close();
        awaitEmpty();
    }

    /**
     * Two attempts of one partition write at once; a third vanishes (neither finish nor
     * abort); the first finished is read, in its writer's order; nothing of the others is.
     */
    @Test
    void onlyTheSelectedAttemptIsReadInItsWritersOrder() throws Exception {
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = manager.createExchange(context(id), 2, true);
        ExchangeSinkHandle s0 = exchange.addSink(0);
        exchange.noMoreSinks();
        ExchangeSink a0 = manager.createSink(exchange.instantiateSink(s0, 0).get());
        ExchangeSink a1 = manager.createSink(exchange.instantiateSink(s0, 1).get());
        ExchangeSink vanished = manager.createSink(exchange.instantiateSink(s0, 2).get());
        for (int i = 0; i < 500; i++) {
            a0.add(i % 2, Slices.utf8Slice("a0-" + i));
            a1.add(i % 2, Slices.utf8Slice("a1-" + i));
            vanished.add(i % 2, Slices.utf8Slice("vanished-" + i));
        }
        a1.finish().get(30, TimeUnit.SECONDS);
        exchange.sinkFinished(s0, 1);
        a0.finish().get(30, TimeUnit.SECONDS);
        exchange.sinkFinished(s0, 0);
        exchange.allRequiredSinksFinished();
        List<ExchangeSourceHandle> handles = exchange.getSourceHandles().getNextBatch().get(30, TimeUnit.SECONDS).handles();
        assertThat(handles).hasSize(2);
        for (ExchangeSourceHandle h : handles) {
            // Sized by the selected attempt's commit: the bytes of "a1-<i>" of its partition.
            assertThat(h.getDataSizeInBytes()).isEqualTo(bytesOf(h.getPartitionId()));
        }
        ExchangeSourceOutputSelector selector = ExchangeSourceOutputSelector.builder(Set.of(id))
                .include(id, 0, 1).setPartitionCount(id, 1).setFinal().build();
        for (int p = 0; p < 2; p++) {
            int partition = p;
            List<String> expected = new ArrayList<>();
            for (int i = partition; i < 500; i += 2) {
                expected.add("a1-" + i);
            }
            List<ExchangeSourceHandle> mine = handles.stream().filter(h -> h.getPartitionId() == partition).toList();
            assertThat(read(mine, selector)).containsExactlyElementsOf(expected);
        }
        assertThat(a0.getMemoryUsage()).isLessThan(1024);
        exchange.close();
        // The vanished attempt's sidecar frees it by its own rules; the test frees it now.
        long abortedBefore = jmx(manager, "SinksAborted");
        vanished.abort().get(30, TimeUnit.SECONDS);
        vanished.abort().get(30, TimeUnit.SECONDS);
        assertThat(jmx(manager, "SinksAborted")).as("one sink, aborted twice").isEqualTo(abortedBefore + 1);
        awaitEmpty();
    }

    /**
     * An attempt that commits and is never reported finished (Trino fails a finished task whose
     * spooling stats are empty, and aborts a speculative attempt after its sink finished, with
     * no sinkFinished), one reported finished only after the exchange closed, and one that
     * commits only after the exchange closed and is never reported (its finish was under way
     * when the query ended), and one instantiated only after the close, committed, then
     * aborted (an abort after a commit changes nothing): closing deletes all four, not the
     * storage TTL.
     */
    @Test
    void closingDeletesCommittedAttemptsTheEngineNeverReported() throws Exception {
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = manager.createExchange(context(id), 2, true);
        ExchangeSinkHandle s0 = exchange.addSink(0);
        ExchangeSinkHandle s1 = exchange.addSink(1);
        ExchangeSinkHandle s2 = exchange.addSink(2);
        exchange.noMoreSinks();
        ExchangeSink unreported = manager.createSink(exchange.instantiateSink(s0, 0).get());
        ExchangeSink late = manager.createSink(exchange.instantiateSink(s1, 0).get());
        ExchangeSink committedAfterClose = manager.createSink(exchange.instantiateSink(s2, 0).get());
        for (int i = 0; i < 200; i++) {
            unreported.add(i % 2, Slices.utf8Slice("unreported-" + i));
            late.add(i % 2, Slices.utf8Slice("late-" + i));
            committedAfterClose.add(i % 2, Slices.utf8Slice("after-close-" + i));
        }
        unreported.finish().get(30, TimeUnit.SECONDS);
        assertThat(storedObjects()).as("the unreported attempt is committed to storage").isNotEmpty();
        exchange.close();
        // The close's lookups of the attempts it was not told of find no commit for this one
        // (its commit comes after them); the deleter looks again.
        assertThat(((BinxExchangeManager) manager).deleter().awaitIdle(30_000)).isTrue();
        committedAfterClose.finish().get(30, TimeUnit.SECONDS);
        ExchangeSink instantiatedAfterClose = manager.createSink(exchange.instantiateSink(s2, 1).get());
        instantiatedAfterClose.add(0, Slices.utf8Slice("instantiated-after-close"));
        instantiatedAfterClose.finish().get(30, TimeUnit.SECONDS);
        instantiatedAfterClose.abort().get(30, TimeUnit.SECONDS);
        // (The late one is deleted on its sinkFinished, or by the deleter's second look,
        // whichever comes first: both are the close's work.)
        late.finish().get(30, TimeUnit.SECONDS);
        exchange.sinkFinished(s1, 0);
        // Past the deleter's look 30 s after the close, in case a busy machine held the
        // commit beyond the one at 5 s.
        awaitEmpty(45);
    }

    private static long bytesOf(int partition) {
        long total = 0;
        for (int i = partition; i < 500; i += 2) {
            total += ("a1-" + i).length();
        }
        return total;
    }

    /** Exchange.close frees every attempt's memory and storage on the sidecar within seconds. */
    private void awaitEmpty() throws Exception {
        awaitEmpty(20);
    }

    private void awaitEmpty(int seconds) throws Exception {
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(seconds);
        while (true) {
            long memory = binxd.stat("memory_used");
            long tasks = binxd.stat("tasks");
            List<Path> left = storedObjects();
            if (memory == 0 && tasks == 0 && left.isEmpty()) {
                return;
            }
            if (System.nanoTime() > deadline) {
                throw new AssertionError("after close: memory_used " + memory + ", tasks " + tasks + ", objects " + left);
            }
            Thread.sleep(50);
        }
    }

    private List<Path> storedObjects() throws Exception {
        return TrinoCluster.storedFiles(binxd.dir.resolve("data").resolve("spool"));
    }

    /**
     * A sidecar whose store fails every write (its spool directory replaced by a file here, as a
     * full or lost volume fails them) fails the sink's {@code finish()} within
     * {@code exchange.binx.max-error-duration}, with the store's own error in the message the
     * query fails with; the failed attempt holds nothing after, and once the store is back a
     * retried attempt is read exactly and freed at close.
     */
    @Test
    void aStoreThatFailsFailsFinishWithItsErrorAndARetryAfterItIsBackIsExact() throws Exception {
        try (Binxd own = Binxd.start("--memory-limit", "128MiB")) {
            ExchangeManager m = new BinxExchangeManagerFactory().create(
                    Map.of("exchange.binx.socket", own.socket.toString(), "exchange.binx.max-error-duration", "3s"),
                    new TestExchangeManagerContext());
            Path spool = own.dir.resolve("data").resolve("spool");
            Path aside = own.dir.resolve("data").resolve("spool-aside");
            try {
                ExchangeId id = ExchangeId.createRandomExchangeId();
                Exchange exchange = m.createExchange(context(id), 1, false);
                ExchangeSinkHandle s0 = exchange.addSink(0);
                exchange.noMoreSinks();
                Files.createDirectories(spool);
                Files.move(spool, aside);
                Files.writeString(spool, "not a directory");
                ExchangeSink failing = m.createSink(exchange.instantiateSink(s0, 0).get());
                failing.add(0, Slices.utf8Slice("lost with its attempt"));
                long started = System.nanoTime();
                assertThatThrownBy(() -> failing.finish().get(60, TimeUnit.SECONDS))
                        .hasMessageContaining("writing its pages to storage failed")
                        .hasMessageContaining("Not a directory");
                assertThat(TimeUnit.NANOSECONDS.toSeconds(System.nanoTime() - started))
                        .as("seconds to fail, with max-error-duration 3s").isLessThan(15);
                // The failed attempt is aborted: nothing of it is held, before the store is back.
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
                while (own.stat("memory_used") != 0 || own.stat("tasks") != 0) {
                    assertThat(System.nanoTime()).as("the failed attempt freed").isLessThan(deadline);
                    Thread.sleep(50);
                }
                Files.delete(spool);
                Files.move(aside, spool);
                ExchangeSink retry = m.createSink(exchange.instantiateSink(s0, 1).get());
                retry.add(0, Slices.utf8Slice("a"));
                retry.add(0, Slices.utf8Slice("b"));
                retry.finish().get(30, TimeUnit.SECONDS);
                exchange.sinkFinished(s0, 1);
                exchange.allRequiredSinksFinished();
                List<ExchangeSourceHandle> handles = exchange.getSourceHandles().getNextBatch().get(30, TimeUnit.SECONDS).handles();
                ExchangeSourceOutputSelector attemptOne = ExchangeSourceOutputSelector.builder(Set.of(id))
                        .include(id, 0, 1).setPartitionCount(id, 1).setFinal().build();
                assertThat(read(m, handles, attemptOne, 40L << 20)).containsExactly("a", "b");
                exchange.close();
                deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
                while (own.stat("memory_used") != 0 || own.stat("tasks") != 0 || !TrinoCluster.storedFiles(spool).isEmpty()) {
                    assertThat(System.nanoTime()).as("memory, tasks and objects freed after close").isLessThan(deadline);
                    Thread.sleep(50);
                }
            } finally {
                m.shutdown();
            }
        }
    }

    /**
     * Trino reads an attempt only once its sink finished, so nothing frees an output partition's
     * pages while it writes: an attempt with more pages in one partition than the sidecar's
     * max_pages_per_buffer fails its finish at once with a message that names the limit (it
     * used to retry BUSY replies for max-error-duration, three minutes by default), and is
     * freed; an attempt within the limit is read exactly.
     */
    @Test
    void anAttemptPastTheSidecarsPageLimitFailsAtOnceSayingSo() throws Exception {
        try (Binxd own = Binxd.start("--memory-limit", "128MiB", "--max-pages-per-buffer", "32")) {
            ExchangeManager m = new BinxExchangeManagerFactory().create(
                    Map.of("exchange.binx.socket", own.socket.toString(), "exchange.binx.max-error-duration", "10m"),
                    new TestExchangeManagerContext());
            try {
                ExchangeId id = ExchangeId.createRandomExchangeId();
                Exchange exchange = m.createExchange(context(id), 2, false);
                ExchangeSinkHandle s0 = exchange.addSink(0);
                exchange.noMoreSinks();
                ExchangeSink tooMany = m.createSink(exchange.instantiateSink(s0, 0).get());
                for (int i = 0; i < 40; i++) {
                    tooMany.add(0, Slices.utf8Slice("p" + i));
                    tooMany.add(1, Slices.utf8Slice("q" + i));
                }
                assertThat(tooMany.isBlocked().isDone()).isTrue();
                assertThatThrownBy(() -> tooMany.finish().get(30, TimeUnit.SECONDS))
                        .hasMessageContaining("pages, more than the 32 its binxd holds in one buffer")
                        .hasMessageContaining("max_pages_per_buffer");
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
                while (own.stat("memory_used") != 0 || own.stat("tasks") != 0) {
                    assertThat(System.nanoTime()).as("the failed attempt freed").isLessThan(deadline);
                    Thread.sleep(50);
                }
                ExchangeSink within = m.createSink(exchange.instantiateSink(s0, 1).get());
                List<String> expected = new ArrayList<>();
                for (int i = 0; i < 32; i++) {
                    within.add(0, Slices.utf8Slice("r" + i));
                    expected.add("r" + i);
                }
                within.finish().get(30, TimeUnit.SECONDS);
                exchange.sinkFinished(s0, 1);
                exchange.allRequiredSinksFinished();
                List<ExchangeSourceHandle> handles = exchange.getSourceHandles().getNextBatch().get(30, TimeUnit.SECONDS).handles();
                ExchangeSourceOutputSelector attemptOne = ExchangeSourceOutputSelector.builder(Set.of(id))
                        .include(id, 0, 1).setPartitionCount(id, 1).setFinal().build();
                List<ExchangeSourceHandle> first = handles.stream().filter(h -> h.getPartitionId() == 0).toList();
                assertThat(read(m, first, attemptOne, 40L << 20)).containsExactlyElementsOf(expected);
                exchange.close();
            } finally {
                m.shutdown();
            }
        }
    }

    /**
     * A source whose readers start while the local sidecar cannot be reached (its container
     * restarting: no socket to connect to) asks again for max-error-duration, as every other
     * request of the plugin does, and reads everything once the sidecar is back; it used to
     * fail the task at its first try. With a budget that runs out first it fails, saying why.
     */
    @Test
    void aSourceWaitsForItsSidecarWithinItsErrorBudget() throws Exception {
        try (Binxd own = Binxd.start("--memory-limit", "128MiB")) {
            ExchangeManager writing = new BinxExchangeManagerFactory().create(
                    Map.of("exchange.binx.socket", own.socket.toString()), new TestExchangeManagerContext());
            // Readers on managers that have not asked their sidecar's address yet (other nodes').
            ExchangeManager patient = new BinxExchangeManagerFactory().create(
                    Map.of("exchange.binx.socket", own.socket.toString(), "exchange.binx.max-error-duration", "1m"),
                    new TestExchangeManagerContext());
            ExchangeManager impatient = new BinxExchangeManagerFactory().create(
                    Map.of("exchange.binx.socket", own.socket.toString(), "exchange.binx.max-error-duration", "3s"),
                    new TestExchangeManagerContext());
            Path aside = own.dir.resolve("binx.sock.aside");
            try {
                OneSink one = OneSink.open(writing, 1);
                one.sink().add(0, Slices.utf8Slice("a"));
                one.sink().add(0, Slices.utf8Slice("b"));
                List<ExchangeSourceHandle> handles = finishTheOnlyAttempt(one.exchange(), one.handle(), one.sink());

                Files.move(own.socket, aside);
                try (ExchangeSource failing = impatient.createSource()) {
                    failing.addSourceHandles(handles);
                    failing.noMoreSourceHandles();
                    // Before the selector: the lookup's budget starts at its first failure, after it.
                    long started = System.nanoTime();
                    failing.setOutputSelector(attemptZero(one.id()));
                    assertThatThrownBy(() -> drain(failing, new ArrayList<>()))
                            .hasMessageContaining("cannot reach the local binxd")
                            .hasMessageContaining("(exchange.binx.max-error-duration)")
                            .hasMessageContaining(own.socket.toString());
                    assertThat(TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - started))
                            .as("it asked again for its budget of 3 s").isGreaterThanOrEqualTo(3_000);
                }
                try (ExchangeSource waiting = patient.createSource()) {
                    waiting.addSourceHandles(handles);
                    waiting.noMoreSourceHandles();
                    waiting.setOutputSelector(attemptZero(one.id()));
                    Thread.sleep(1_000);
                    assertThat(waiting.isBlocked().isDone()).as("still waiting, not failed").isFalse();
                    Files.move(aside, own.socket);
                    List<String> out = new ArrayList<>();
                    drain(waiting, out);
                    assertThat(out).containsExactly("a", "b");
                }
                one.exchange().close();
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
                Path spool = own.dir.resolve("data").resolve("spool");
                while (own.stat("memory_used") != 0 || own.stat("tasks") != 0 || !TrinoCluster.storedFiles(spool).isEmpty()) {
                    assertThat(System.nanoTime()).as("memory, tasks and objects freed after close").isLessThan(deadline);
                    Thread.sleep(50);
                }
            } finally {
                if (Files.exists(aside)) {
                    Files.move(aside, own.socket);
                }
                writing.shutdown();
                patient.shutdown();
                impatient.shutdown();
            }
        }
    }

    @Test
    void addNeverThrowsAndAFailureFailsFinishWithItsReason() throws Exception {
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = manager.createExchange(context(id), 1, false);
        ExchangeSinkHandle s0 = exchange.addSink(0);
        long failedBefore = jmx(manager, "SinksFailed");
        long pagesBefore = jmx(manager, "PagesWritten");
        ExchangeSink sink = manager.createSink(exchange.instantiateSink(s0, 0).get());
        sink.add(7, Slices.utf8Slice("a partition it does not have"));
        sink.add(0, Slices.utf8Slice("after the failure"));
        assertThat(sink.isBlocked().isDone()).isTrue();
        assertThatThrownBy(() -> sink.finish().get(30, TimeUnit.SECONDS))
                .hasMessageContaining("buffer 7 is not one of its 1");
        // Nothing was taken; the sink counts as failed.
        assertThat(jmx(manager, "PagesWritten")).isEqualTo(pagesBefore);
        assertThat(jmx(manager, "SinksFailed")).isEqualTo(failedBefore + 1);

        ExchangeSinkHandle s1 = exchange.addSink(1);
        ExchangeSink oversized = manager.createSink(exchange.instantiateSink(s1, 0).get());
        oversized.add(0, Slices.utf8Slice("fine"));
        oversized.add(0, Slices.allocate(2 << 20));
        oversized.add(7, Slices.utf8Slice("a partition it does not have"));
        oversized.add(0, Slices.utf8Slice("after the failure"));
        assertThat(oversized.isBlocked().isDone()).isTrue();
        assertThatThrownBy(() -> oversized.finish().get(30, TimeUnit.SECONDS))
                .hasMessageContaining("exceeds exchange.binx.max-page-size");
        assertThat(jmx(manager, "PagesWritten")).isEqualTo(pagesBefore + 1);
        assertThat(jmx(manager, "SinksFailed")).isEqualTo(failedBefore + 2);
        exchange.close();
        awaitEmpty();
    }

    @Test
    void aSinkBlockedOnMemoryIsReleasedAndItsFuturesAreCancellationSafe() throws Exception {
        ExchangeManager small = new BinxExchangeManagerFactory().create(
                Map.of("exchange.binx.socket", binxd.socket.toString(), "exchange.binx.sink-buffer-size", "64kB",
                        "exchange.binx.sink-batch-size", "4kB"),
                new TestExchangeManagerContext());
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = small.createExchange(context(id), 1, false);
        ExchangeSinkHandle s0 = exchange.addSink(0);
        ExchangeSink sink = small.createSink(exchange.instantiateSink(s0, 0).get());
        int blockedSeen = 0;
        for (int i = 0; i < 400; i++) {
            CompletableFuture<Void> blocked = sink.isBlocked();
            if (!blocked.isDone()) {
                blockedSeen++;
                CompletableFuture<Void> again = sink.isBlocked();
                blocked.cancel(true);
                again.get(30, TimeUnit.SECONDS);
            }
            sink.add(0, Slices.allocate(1024));
            assertThat(sink.getMemoryUsage()).isLessThan(64 * 1024 + 8 * 1024);
        }
        sink.finish().get(30, TimeUnit.SECONDS);
        exchange.sinkFinished(s0, 0);
        exchange.allRequiredSinksFinished();
        assertThat(exchange.getSourceHandles().getNextBatch().get(30, TimeUnit.SECONDS).handles().get(0).getDataSizeInBytes())
                .isEqualTo(400 * 1024L);
        exchange.close();
        small.shutdown();
        awaitEmpty();
    }

    /**
     * Many partitions, each holding less than a batch: what the sink holds is over its limit in
     * open batches alone, and the sink must still unblock (it sends them), as a Trino task with
     * many output partitions needs.
     */
    @Test
    void aSinkOverItsLimitInOpenBatchesAloneIsReleased() throws Exception {
        ExchangeManager small = new BinxExchangeManagerFactory().create(
                Map.of("exchange.binx.socket", binxd.socket.toString(), "exchange.binx.sink-buffer-size", "64kB",
                        "exchange.binx.sink-batch-size", "1MB"),
                new TestExchangeManagerContext());
        ExchangeId id = ExchangeId.createRandomExchangeId();
        int partitions = 16;
        Exchange exchange = small.createExchange(context(id), partitions, false);
        ExchangeSinkHandle s0 = exchange.addSink(0);
        ExchangeSink sink = small.createSink(exchange.instantiateSink(s0, 0).get());
        int blockedSeen = 0;
        for (int i = 0; i < 20 * partitions; i++) {
            CompletableFuture<Void> blocked = sink.isBlocked();
            if (!blocked.isDone()) {
                blockedSeen++;
                blocked.get(30, TimeUnit.SECONDS);
            }
            sink.add(i % partitions, Slices.allocate(8 * 1024));
        }
        assertThat(blockedSeen).isGreaterThan(0);
        sink.finish().get(30, TimeUnit.SECONDS);
        exchange.sinkFinished(s0, 0);
        exchange.allRequiredSinksFinished();
        long total = 0;
        for (ExchangeSourceHandle h : exchange.getSourceHandles().getNextBatch().get(30, TimeUnit.SECONDS).handles()) {
            total += h.getDataSizeInBytes();
        }
        assertThat(total).isEqualTo(20L * partitions * 8 * 1024);
        exchange.close();
        small.shutdown();
        awaitEmpty();
    }

    /** Handles go through the engine's JSON and come back equal. */
    @Test
    @SuppressWarnings("deprecation")
    void handlesSurviveTheEnginesJson() throws Exception {
        ObjectMapper json = new ObjectMapperProvider().get();
        BinxSourceHandle handle = new BinxSourceHandle(new ExchangeId("external-exchange-3"), 4,
                List.of(new BinxSourceHandle.Entry("trino.ab12.q.e.1.0", 1, 0, "10.0.0.7:8091", 12, 3456)));
        String text = json.writeValueAsString(handle);
        assertThat(json.readValue(text, BinxSourceHandle.class)).isEqualTo(handle);
        assertThat(text).contains("\"exchangeId\":\"external-exchange-3\"");
        BinxSinkInstanceHandle sink = new BinxSinkInstanceHandle("trino.ab12.q.e.1.0", 5);
        assertThat(json.readValue(json.writeValueAsString(sink), BinxSinkInstanceHandle.class)).isEqualTo(sink);
        assertThat(handle.getDataSizeInBytes()).isEqualTo(3456);
        assertThat(handle.getRetainedSizeInBytes()).isGreaterThan(0);
        // A handle altered on its way (a negative count would turn the reader's checks off)
        // is refused, naming the entry.
        for (String field : List.of("pages", "bytes", "attemptId", "taskPartitionId")) {
            String altered = text.replaceFirst("\"" + field + "\":\\d+", "\"" + field + "\":-1");
            assertThat(altered).as(field).isNotEqualTo(text);
            assertThatThrownBy(() -> json.readValue(altered, BinxSourceHandle.class))
                    .as(field)
                    .hasStackTraceContaining("a binx source handle entry with a negative number: trino.ab12.q.e.1.0");
        }
        // An entry of no pages is never read: bytes claimed beside them would go unchecked.
        String noPages = text.replaceFirst("\"pages\":12", "\"pages\":0");
        assertThatThrownBy(() -> json.readValue(noPages, BinxSourceHandle.class))
                .hasStackTraceContaining("a binx source handle entry with bytes but no pages: trino.ab12.q.e.1.0");
        String negativePartition = text.replaceFirst("\"partitionId\":4", "\"partitionId\":-4");
        assertThatThrownBy(() -> json.readValue(negativePartition, BinxSourceHandle.class))
                .hasStackTraceContaining("a binx source handle of partition -4");
        // A partition count past what a binx task holds is refused before a sink sizes anything.
        String sinkText = json.writeValueAsString(sink);
        for (String count : List.of("0", "65537", "2147483647")) {
            String altered = sinkText.replaceFirst("\"outputPartitionCount\":5", "\"outputPartitionCount\":" + count);
            assertThat(altered).as(count).isNotEqualTo(sinkText);
            assertThatThrownBy(() -> json.readValue(altered, BinxSinkInstanceHandle.class))
                    .as(count)
                    .hasStackTraceContaining("1 to 65536 output partitions, not " + count);
        }
    }

    @Test
    void configurationErrorsNameTheProperty() {
        assertThatThrownBy(() -> BinxExchangeConfig.from(Map.of("exchange.binx.sokcet", "/x")))
                .hasMessageContaining("unknown exchange manager property exchange.binx.sokcet");
        assertThatThrownBy(() -> BinxExchangeConfig.from(Map.of("exchange.binx.spool-policy", "off")))
                .hasMessageContaining("must be \"commit\"");
        assertThatThrownBy(() -> BinxExchangeConfig.from(Map.of("exchange.binx.sink-buffer-size", "lots")))
                .hasMessageContaining("not a data size");
        assertThatThrownBy(() -> BinxExchangeConfig.from(Map.of("exchange.binx.max-error-duration", "0s")))
                .hasMessageContaining("between");
        // Readers past the source connection's request slots (64 x 3 DATA in flight of 256).
        assertThatThrownBy(() -> BinxExchangeConfig.from(Map.of("exchange.binx.source-concurrent-readers", "65")))
                .hasMessageContaining("exchange.binx.source-concurrent-readers is 65: it must be between 1 and 64");
        assertThat(BinxExchangeConfig.from(Map.of("exchange.binx.source-concurrent-readers", "64")).sourceConcurrentReaders())
                .isEqualTo(64);
        BinxExchangeConfig d = BinxExchangeConfig.defaultsOnly();
        assertThat(d.socket()).isEqualTo(Path.of("/var/run/binx/binx.sock"));
        assertThat(d.spoolPolicy()).isEqualTo("commit");
        assertThat(d.sinkBufferBytes()).isEqualTo(32L << 20);
        assertThat(d.maxErrorMillis()).isEqualTo(180_000);
    }

    @Test
    void aMissingSidecarFailsTheTaskWithTheSocketsName() throws Exception {
        ExchangeManager nowhere = new BinxExchangeManagerFactory().create(
                Map.of("exchange.binx.socket", "/nonexistent/binx.sock", "exchange.binx.max-error-duration", "2s"),
                new TestExchangeManagerContext());
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = nowhere.createExchange(context(id), 1, false);
        ExchangeSink sink = nowhere.createSink(exchange.instantiateSink(exchange.addSink(0), 0).get());
        sink.add(0, Slices.utf8Slice("x"));
        assertThatThrownBy(() -> sink.finish().get(30, TimeUnit.SECONDS))
                .hasMessageContaining("/nonexistent/binx.sock");
        nowhere.shutdown();
    }

    /**
     * Closing an exchange whose coordinator's binxd cannot be reached: the deletions that gave
     * up after max-error-duration drop what is still queued (each would wait as long, for the
     * same answer) with one warning naming the socket, instead of a warning per task after
     * twelve tasks' worth of waiting.
     */
    @Test
    void closingWithoutTheLocalSidecarGivesUpOnceForEverything() throws Exception {
        ExchangeManager nowhere = new BinxExchangeManagerFactory().create(
                Map.of("exchange.binx.socket", "/nonexistent/binx.sock", "exchange.binx.max-error-duration", "1s"),
                new TestExchangeManagerContext());
        List<LogRecord> warnings = new CopyOnWriteArrayList<>();
        Handler capture = new Handler() {
            @Override
            public void publish(LogRecord record) {
                if (record.getLevel().intValue() >= Level.WARNING.intValue()) {
                    warnings.add(record);
                }
            }

            @Override
            public void flush() {}

            @Override
            public void close() {}
        };
        Logger logger = Logger.getLogger(AttemptDeleter.class.getName());
        logger.addHandler(capture);
        try {
            ExchangeId id = ExchangeId.createRandomExchangeId();
            Exchange exchange = nowhere.createExchange(context(id), 1, false);
            int tasks = 12;
            List<ExchangeSinkHandle> sinks = new ArrayList<>();
            for (int p = 0; p < tasks; p++) {
                sinks.add(exchange.addSink(p));
            }
            exchange.noMoreSinks();
            for (ExchangeSinkHandle s : sinks) {
                exchange.sinkFinished(s, 0);
            }
            exchange.close();
            assertThat(((BinxExchangeManager) nowhere).deleter().awaitIdle(60_000)).isTrue();
            // The lookups in flight when the first gave up (4 at once) warn each; the queued
            // ones are dropped under the first warning, which says how many.
            assertThat(warnings).hasSizeLessThanOrEqualTo(4);
            assertThat(warnings.stream().map(LogRecord::getMessage).filter(m -> m.contains("cannot be reached")))
                    .anySatisfy(m -> assertThat(m).contains("/nonexistent/binx.sock").contains("and of 8 more queued task(s)"));
            // Every task's output is counted as left to the sidecars' rules, once.
            assertThat(jmx(nowhere, "OutputsLeftToTtl")).isEqualTo(tasks);
            assertThat(jmx(nowhere, "BuffersDeleted")).isZero();
        } finally {
            logger.removeHandler(capture);
            nowhere.shutdown();
        }
    }
}
