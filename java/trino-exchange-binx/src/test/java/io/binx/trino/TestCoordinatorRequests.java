package io.binx.trino;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import io.binx.client.BinReply;
import io.binx.client.BinxConnection;
import io.binx.client.BinRequest;
import io.binx.client.Frames;
import io.binx.client.MessageType;
import io.binx.client.ProtocolException;
import io.binx.client.Status;
import io.binx.client.TestSockets;
import io.trino.plugin.exchange.filesystem.TestExchangeManagerContext;
import io.trino.spi.exchange.Exchange;
import io.trino.spi.exchange.ExchangeId;
import io.trino.spi.exchange.ExchangeSinkHandle;
import io.trino.spi.exchange.ExchangeSourceHandle;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.channels.ServerSocketChannel;
import java.nio.channels.SocketChannel;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * The coordinator's requests share one connection to its binxd, whose sender waits (holding a
 * thread) for one of its request slots. Many stages laying out their handles at once against a
 * sidecar that answers slowly must neither take every slot nor hold the plugin's threads: the
 * lookups of all exchanges wait their turn without a thread (review: five exchanges at once
 * parked the plugin's pool, and the engine's common pool, in the sender).
 */
class TestCoordinatorRequests {
    private static final int EXCHANGES = 8;
    private static final int TASKS = 64;

    /** A sidecar that answers HELLO at once and holds every COMMITTED until told to answer. */
    private static final class SlowSidecar implements AutoCloseable {
        final Path socket;
        private final ServerSocketChannel server;
        // Guarded by `this`.
        private final List<Held> held = new ArrayList<>();
        private int outstanding;
        private int peak;
        private int answered;
        private int deletes;
        /** The producer address held lookups are answered with. */
        volatile String endpoint = "10.0.0.7:8091";

        private record Held(SocketChannel channel, BinRequest request) {}

        SlowSidecar() throws IOException {
            socket = TestSockets.create("binx-slow", "binx.sock");
            server = TestSockets.listen(socket);
            Thread acceptor = new Thread(() -> {
                try {
                    while (true) {
                        SocketChannel c = server.accept();
                        Thread t = new Thread(() -> serve(c));
                        t.setDaemon(true);
                        t.start();
                    }
                } catch (IOException e) {
                    // the test ended
                }
            });
            acceptor.setDaemon(true);
            acceptor.start();
        }

        private void serve(SocketChannel c) {
            try {
                ByteBuffer theirs = ByteBuffer.allocate(Frames.PREFACE_LEN);
                while (theirs.hasRemaining()) {
                    if (c.read(theirs) < 0) {
                        return;
                    }
                }
                write(c, ByteBuffer.wrap(Frames.preface()));
                Frames.Frame f;
                while ((f = Frames.read(c, Frames.DEFAULT_MAX_FRAME)) != null) {
                    BinRequest r = BinRequest.decode(f.header());
                    if (r.type == MessageType.COMMITTED.number()) {
                        synchronized (this) {
                            held.add(new Held(c, r));
                            outstanding++;
                            peak = Math.max(peak, outstanding);
                            notifyAll();
                        }
                        continue;
                    }
                    if (r.type == MessageType.DELETE.number() || r.type == MessageType.DELETE_TASK.number()) {
                        synchronized (this) {
                            deletes++;
                        }
                    }
                    BinReply h = reply(r);
                    if (r.type == MessageType.HELLO.number()) {
                        h.capabilities.addAll(List.of("pipelined-data", "append-token", "committed", "task-delete",
                                "address=10.0.0.7:8091"));
                    }
                    send(c, h);
                }
            } catch (IOException | ProtocolException e) {
                // the test ended
            }
        }

        private static BinReply reply(BinRequest r) {
            BinReply h = new BinReply();
            h.requestId = r.requestId;
            h.type = r.type;
            h.status = Status.OK.number();
            return h;
        }

        private static void send(SocketChannel c, BinReply h) throws IOException {
            synchronized (c) {
                Frames.write(c, h.encode(), ByteBuffer.allocate(0));
            }
        }

        private static void write(SocketChannel c, ByteBuffer b) throws IOException {
            synchronized (c) {
                while (b.hasRemaining()) {
                    c.write(b);
                }
            }
        }

        /** Waits until {@code count} lookups are held, then 500 ms more for any past them. */
        synchronized int awaitHeld(int count) throws InterruptedException {
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(30);
            while (held.size() < count && System.nanoTime() < deadline) {
                wait(100);
            }
            wait(500);
            return held.size();
        }

        /** Answers every held lookup: one buffer of one page, 10 bytes, at this sidecar. */
        int answerHeld() throws IOException {
            List<Held> now;
            synchronized (this) {
                now = new ArrayList<>(held);
                held.clear();
                outstanding -= now.size();
                answered += now.size();
            }
            for (Held x : now) {
                BinReply h = reply(x.request());
                h.committed = new BinReply.Committed();
                h.committed.node = "slow";
                h.committed.endpoint = endpoint;
                h.committed.bufferCount = 1;
                h.committed.endTokens = new long[] {1};
                h.committed.bytes = new long[] {10};
                h.pageToken = 0;
                h.pageNextToken = 1;
                h.bufferComplete = true;
                send(x.channel(), h);
            }
            return now.size();
        }

        synchronized int deletes() {
            return deletes;
        }

        synchronized int peak() {
            return peak;
        }

        synchronized int answered() {
            return answered;
        }

        @Override
        public void close() throws IOException {
            server.close();
            TestSockets.remove(socket);
        }
    }

    private static BinxExchangeManager manager(SlowSidecar sidecar, String maxErrorDuration) {
        return (BinxExchangeManager) new BinxExchangeManagerFactory().create(
                Map.of("exchange.binx.socket", sidecar.socket.toString(), "exchange.binx.max-error-duration", maxErrorDuration),
                new TestExchangeManagerContext());
    }

    /** An exchange of one output partition whose {@code tasks} tasks finished (attempt 0): its handles, being laid out. */
    private static CompletableFuture<List<ExchangeSourceHandle>> handlesOf(BinxExchangeManager manager, String query, int tasks)
            throws Exception {
        Exchange exchange = manager.createExchange(new TestingExchangeContext(query, ExchangeId.createRandomExchangeId()), 1, false);
        for (int p = 0; p < tasks; p++) {
            ExchangeSinkHandle sink = exchange.addSink(p);
            exchange.instantiateSink(sink, 0).get(5, TimeUnit.SECONDS);
            exchange.sinkFinished(sink, 0);
        }
        exchange.noMoreSinks();
        exchange.allRequiredSinksFinished();
        return exchange.getSourceHandles().getNextBatch().thenApply(b -> b.handles());
    }

    /**
     * A sidecar that never answers a lookup: the engine's wait for handles ends (the lookup's
     * time is its error budget and a margin), and the lookup's turn, held while its request
     * was unanswered, comes back once the shared connection is dropped a margin later.
     */
    @Test
    @Timeout(60)
    void aLookupNeverAnsweredEndsAndGivesItsTurnBack() throws Exception {
        try (SlowSidecar sidecar = new SlowSidecar()) {
            BinxExchangeManager manager = manager(sidecar, "1s");
            try {
                CompletableFuture<?> handles = handlesOf(manager, "q_unanswered", 1);
                assertThat(sidecar.awaitHeld(1)).isEqualTo(1);
                assertThatThrownBy(() -> handles.get(20, TimeUnit.SECONDS))
                        .hasMessageContaining("cannot learn where the output of task partition 0 attempt 0 is");
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
                while (manager.lookups().inFlight() > 0 && System.nanoTime() < deadline) {
                    Thread.sleep(50);
                }
                assertThat(manager.lookups().inFlight()).as("the unanswered lookup's turn").isZero();
            } finally {
                manager.shutdown();
            }
        }
    }

    /**
     * A lookup that waited for its turn longer than its own time is cancelled by the engine's
     * deadline (counted from before the wait), not timed out, while its request may be
     * unanswered: it gives its turn back by a reconnect all the same (review: only a timeout
     * started the reconnect, and such lookups held their turns for good, so each later query's
     * handles waited out their deadline). A request ended that way whose answer then comes
     * costs no reconnect.
     */
    @Test
    @Timeout(60)
    void aRequestCancelledUnansweredClosesTheSharedConnectionAndAnAnsweredOneDoesNot() throws Exception {
        try (SlowSidecar sidecar = new SlowSidecar()) {
            BinxExchangeManager manager = manager(sidecar, "1s");
            try {
                BinxConnection first = manager.shared();
                CompletableFuture<Object> answered = new CompletableFuture<>();
                CompletableFuture<Void> answeredSettled = new CompletableFuture<>();
                manager.unstick(answered, answeredSettled).cancel(false);
                answeredSettled.complete(null);
                Thread.sleep(2_000);
                assertThat(first.isOpen()).as("a cancelled request whose answer came").isTrue();

                CompletableFuture<Object> unanswered = new CompletableFuture<>();
                manager.unstick(unanswered, new CompletableFuture<>()).cancel(false);
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
                while (first.isOpen() && System.nanoTime() < deadline) {
                    Thread.sleep(50);
                }
                assertThat(first.isOpen()).as("the connection holding an unanswered, cancelled request").isFalse();
                assertThat(manager.shared()).isNotSameAs(first);
            } finally {
                manager.shutdown();
            }
        }
    }

    /**
     * The deleter's requests are bounded like the exchange's lookups: a closed exchange's
     * attempts looked up on a sidecar that never answers are given up (their output left to the
     * sidecars' TTL, counted) once the error budget and a margin passed, and the deleter is idle
     * again (review: an unanswered lookup held its slot for good, and four stopped every deletion).
     */
    @Test
    @Timeout(60)
    void theDeletersLookupsNeverAnsweredEndAndLeaveTheOutputToTheTtl() throws Exception {
        try (SlowSidecar sidecar = new SlowSidecar()) {
            BinxExchangeManager manager = manager(sidecar, "1s");
            try {
                Exchange exchange = manager.createExchange(
                        new TestingExchangeContext("q_deleter", ExchangeId.createRandomExchangeId()), 1, false);
                for (int p = 0; p < 6; p++) {
                    ExchangeSinkHandle sink = exchange.addSink(p);
                    exchange.instantiateSink(sink, 0).get(5, TimeUnit.SECONDS);
                }
                long before = manager.stats().getOutputsLeftToTtl();
                exchange.close();
                assertThat(sidecar.awaitHeld(4)).as("the deleter's lookups reached the sidecar").isGreaterThanOrEqualTo(4);
                assertThat(manager.deleter().awaitIdle(30_000)).as("the deleter ended every request").isTrue();
                assertThat(manager.stats().getOutputsLeftToTtl() - before).as("attempts left to the TTL").isEqualTo(6);
            } finally {
                manager.shutdown();
            }
        }
    }

    /**
     * An attempt whose producer's sidecar names no address, on another node than the
     * coordinator's (whose sidecar names one): no DELETE can reach it, and the coordinator's
     * binxd never deletes another node's output, so none is sent and it is counted as left to
     * the TTL (it was sent to the local binxd, and counted deleted).
     */
    @Test
    @Timeout(60)
    void outputOnASidecarWithoutAnAddressIsLeftToTheTtlNotDeletedHere() throws Exception {
        try (SlowSidecar sidecar = new SlowSidecar()) {
            sidecar.endpoint = "";
            BinxExchangeManager manager = manager(sidecar, "5s");
            try {
                Exchange exchange = manager.createExchange(
                        new TestingExchangeContext("q_no_address", ExchangeId.createRandomExchangeId()), 1, false);
                ExchangeSinkHandle sink = exchange.addSink(0);
                exchange.instantiateSink(sink, 0).get(5, TimeUnit.SECONDS);
                long before = manager.stats().getOutputsLeftToTtl();
                exchange.close();
                assertThat(sidecar.awaitHeld(1)).isEqualTo(1);
                sidecar.answerHeld();
                assertThat(manager.deleter().awaitIdle(20_000)).isTrue();
                assertThat(manager.stats().getOutputsLeftToTtl() - before).isEqualTo(1);
                assertThat(sidecar.deletes()).as("DELETEs sent to the coordinator's binxd").isZero();
            } finally {
                manager.shutdown();
            }
        }
    }

    /**
     * Attempts waiting for their first lookup are bounded: past the bound (100,000; 3 here)
     * a closed exchange's attempts are left to the sidecars' TTL at once, counted, rather than
     * queued without end while the local binxd answers too slowly.
     */
    @Test
    @Timeout(60)
    void attemptsPastTheDeletersQueueAreLeftToTheTtl() throws Exception {
        try (SlowSidecar sidecar = new SlowSidecar()) {
            BinxExchangeManager manager = manager(sidecar, "1s");
            try {
                AttemptDeleter deleter = new AttemptDeleter(manager, 3);
                long before = manager.stats().getOutputsLeftToTtl();
                List<String> attempts = new ArrayList<>();
                for (int i = 0; i < 10; i++) {
                    attempts.add("q_queue.0." + i + ".0");
                }
                deleter.delete("e1", attempts, Map.of());
                assertThat(manager.stats().getOutputsLeftToTtl() - before).as("dropped at once").isEqualTo(7);
                // The three queued ones are looked up (never answered here) and given up in time.
                assertThat(deleter.awaitIdle(30_000)).isTrue();
                assertThat(manager.stats().getOutputsLeftToTtl() - before).isEqualTo(10);
            } finally {
                manager.shutdown();
            }
        }
    }

    @Test
    @Timeout(120)
    void manyExchangesLayingOutHandlesAtOnceWaitTheirTurnWithoutAThread() throws Exception {
        try (SlowSidecar sidecar = new SlowSidecar()) {
            BinxExchangeManager manager = manager(sidecar, "60s");
            try {
                List<CompletableFuture<List<ExchangeSourceHandle>>> handles = new ArrayList<>();
                for (int e = 0; e < EXCHANGES; e++) {
                    handles.add(handlesOf(manager, "q_gate", TASKS));
                }
                // 512 lookups are wanted; the sidecar holds them. Only the manager's bound is
                // asked at once (the connection's 256 slots were all taken before), ...
                assertThat(sidecar.awaitHeld(BinxExchangeManager.MAX_LOOKUPS))
                        .as("lookups in flight while the sidecar answers none")
                        .isEqualTo(BinxExchangeManager.MAX_LOOKUPS);
                // ... and the plugin's threads are free meanwhile: the rest wait without one
                // (the pool's four threads were parked in the sender before).
                assertThat(manager.background().submit(() -> 7).get(5, TimeUnit.SECONDS)).isEqualTo(7);
                assertThat(CompletableFuture.supplyAsync(() -> 8).get(5, TimeUnit.SECONDS)).isEqualTo(8);

                // Answered as they come, every lookup is made, within the bound throughout.
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(60);
                while (sidecar.answered() < EXCHANGES * TASKS && System.nanoTime() < deadline) {
                    if (sidecar.answerHeld() == 0) {
                        Thread.sleep(10);
                    }
                }
                for (CompletableFuture<List<ExchangeSourceHandle>> h : handles) {
                    List<ExchangeSourceHandle> got = h.get(30, TimeUnit.SECONDS);
                    int entries = 0;
                    long bytes = 0;
                    for (ExchangeSourceHandle x : got) {
                        entries += ((BinxSourceHandle) x).entries().size();
                        bytes += x.getDataSizeInBytes();
                    }
                    assertThat(entries).as("one entry per task partition").isEqualTo(TASKS);
                    assertThat(bytes).isEqualTo(10L * TASKS);
                }
                assertThat(sidecar.answered()).isEqualTo(EXCHANGES * TASKS);
                assertThat(sidecar.peak()).as("lookups in flight at most").isEqualTo(BinxExchangeManager.MAX_LOOKUPS);
                assertThat(manager.lookups().peak()).isEqualTo(BinxExchangeManager.MAX_LOOKUPS);
                assertThat(manager.lookups().waiting()).isZero();
            } finally {
                manager.shutdown();
            }
        }
    }
}
