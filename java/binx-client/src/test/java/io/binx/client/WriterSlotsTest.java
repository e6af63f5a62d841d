package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.channels.ServerSocketChannel;
import java.nio.channels.SocketChannel;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.Semaphore;
import java.util.concurrent.TimeoutException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.BiPredicate;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * A writer with more batches to send than its connection has request slots, against a binxd
 * that holds its ENQUEUE replies (short of room, it may, up to the ENQUEUE's wait): {@link
 * TaskWriter#add} never waits for a slot (the engine's threads call it, and every other add,
 * {@code whenRoom} and memory query waits on the writer meanwhile); the batches past the limit
 * wait in the writer and go, each buffer's in order, as replies come, also when the held
 * replies are refusals or the connection breaks while batches wait.
 */
class WriterSlotsTest {
    static final int BUFFERS = 300;

    /**
     * A binxd with numbered appends (docs/PROTOCOL.md section 9): an ENQUEUE at a buffer's next
     * token is applied when answered, another is refused with that token. On its first
     * connection it holds ENQUEUE replies until {@link #release} (then answers each, or BUSY
     * where {@code busy} says, applying nothing) or {@link #cut} (then closes it, answering
     * nothing); later connections are answered at once.
     */
    static final class Binxd implements AutoCloseable {
        final Path socket;
        final ServerSocketChannel channel;
        final CountDownLatch release = new CountDownLatch(1);
        final CountDownLatch cut = new CountDownLatch(1);
        /** Close the first connection right after the released replies. */
        volatile boolean cutAfterRelease;
        final BiPredicate<BinRequest, Integer> busy;
        final AtomicInteger connections = new AtomicInteger();
        final CountDownLatch helloAnswered = new CountDownLatch(1);
        /** buffer -> the tokens applied, in order. */
        final Map<Long, List<Long>> applied = new HashMap<>();
        volatile int maxHeld;
        /**
         * When set, ENQUEUEs are answered one a permit, in order (on every connection), instead
         * of held until {@link #release}.
         */
        final Semaphore gate;

        Binxd(BiPredicate<BinRequest, Integer> busy) throws IOException {
            this(busy, null);
        }

        Binxd(BiPredicate<BinRequest, Integer> busy, Semaphore gate) throws IOException {
            this.busy = busy;
            this.gate = gate;
            socket = TestSockets.create("binx-slots", "s.sock");
            channel = TestSockets.listen(socket);
            Thread t = new Thread(() -> {
                try {
                    while (true) {
                        SocketChannel c = channel.accept();
                        boolean first = connections.getAndIncrement() == 0;
                        Thread served = new Thread(() -> serve(c, first), "binxd-connection");
                        served.setDaemon(true);
                        served.start();
                    }
                } catch (IOException e) {
                    // the test ended
                }
            }, "binxd-accept");
            t.setDaemon(true);
            t.start();
        }

        /** Applies {@code r} if it is at its buffer's next token; the reply either way. */
        synchronized BinReply apply(BinRequest r) {
            List<Long> tokens = applied.computeIfAbsent(r.bufferId, k -> new ArrayList<>());
            long next = tokens.isEmpty() ? 0 : tokens.get(tokens.size() - 1) + 1;
            BinReply h = LyingWriterServerTest.ok(r);
            if (r.appendToken != next) {
                h.status = Status.BAD_REQUEST.number();
                h.pageNextToken = next;
                h.error = "append_token " + r.appendToken + ", buffer at " + next;
                return h;
            }
            // None: a reconnected writer's check of a buffer's end, which binxd answers OK at
            // its token and applies nothing.
            for (int i = 0; i < r.pageSizes.length; i++) {
                tokens.add(r.appendToken + i);
            }
            return h;
        }

        synchronized List<Long> appliedTo(long buffer) {
            return List.copyOf(applied.getOrDefault(buffer, List.of()));
        }

        private void serve(SocketChannel c, boolean holding) {
            List<BinRequest> held = new ArrayList<>();
            Object writing = new Object();
            try {
                Frames.readFully(c, ByteBuffer.allocate(8), false);
                ByteBuffer ours = ByteBuffer.wrap(Frames.preface());
                while (ours.hasRemaining()) {
                    c.write(ours);
                }
                BlockingQueue<BinRequest> gated = new LinkedBlockingQueue<>();
                if (gate != null) {
                    Thread answering = new Thread(() -> {
                        try {
                            while (true) {
                                gate.acquire();
                                BinRequest r = gated.take();
                                synchronized (writing) {
                                    write(c, apply(r));
                                }
                            }
                        } catch (InterruptedException | IOException e) {
                            // the test ended
                        }
                    }, "binxd-gate");
                    answering.setDaemon(true);
                    answering.start();
                } else if (holding) {
                    Thread ender = new Thread(() -> {
                        try {
                            while (!release.await(10, TimeUnit.MILLISECONDS)) {
                                if (cut.getCount() == 0) {
                                    c.close();
                                    return;
                                }
                            }
                            synchronized (writing) {
                                int n = 0;
                                for (BinRequest r : held) {
                                    BinReply h = busy.test(r, n++) ? busy(r) : apply(r);
                                    write(c, h);
                                }
                                held.clear();
                                if (cutAfterRelease) {
                                    c.close();
                                }
                            }
                        } catch (InterruptedException | IOException e) {
                            // the test ended
                        }
                    });
                    ender.setDaemon(true);
                    ender.start();
                }
                Frames.Frame f;
                while ((f = Frames.read(c, Frames.DEFAULT_MAX_FRAME)) != null) {
                    BinRequest r = BinRequest.decode(f.header());
                    MessageType type = MessageType.of(r.type);
                    synchronized (writing) {
                        if (type == MessageType.ENQUEUE) {
                            if (gate != null) {
                                gated.add(r);
                                continue;
                            }
                            if (holding && release.getCount() > 0) {
                                held.add(r);
                                maxHeld = Math.max(maxHeld, held.size());
                                continue;
                            }
                            write(c, apply(r));
                            continue;
                        }
                        BinReply h = LyingWriterServerTest.ok(r);
                        if (type == MessageType.HELLO) {
                            h.capabilities.addAll(LyingWriterServerTest.HONEST);
                        }
                        write(c, h);
                        if (type == MessageType.HELLO) {
                            helloAnswered.countDown();
                        }
                    }
                }
            } catch (IOException | ProtocolException e) {
                // cut, or the test ended
            }
        }

        static BinReply busy(BinRequest r) {
            BinReply h = LyingWriterServerTest.ok(r);
            h.status = Status.BUSY.number();
            h.error = "no room";
            return h;
        }

        static void write(SocketChannel c, BinReply h) throws IOException {
            Frames.Frame f = LyingWriterServerTest.frame(h);
            Frames.write(c, f.header(), f.body());
        }

        @Override
        public void close() throws IOException {
            release.countDown();
            channel.close();
            TestSockets.remove(socket);
        }
    }

    /**
     * Writes two one-page batches to each of {@link #BUFFERS} buffers (600 ENQUEUEs) while
     * binxd holds every reply, checking no add waits and that ENQUEUEs in flight stop below
     * the connection's limit; returns the writer.
     */
    static TaskWriter writeWhileHeld(Binxd s) throws Exception {
        TaskWriter writer = new TaskWriter(() -> BinxConnection.unix(s.socket, BinxConnection.Options.defaults()),
                "t.slots", BUFFERS, "commit", new TaskWriter.Options(1 << 20, 1, 1L << 30, 1_000_000, 60_000));
        // Connected first (else the first batches wait for the connect, not for slots, and
        // their buffers resync): the writer connects when made; it takes the HELLO's reply
        // within moments.
        assertTrue(s.helloAnswered.await(10, TimeUnit.SECONDS));
        Thread.sleep(300);
        assertTrue(writer.add(0, ByteBuffer.wrap(HostileServerTest.pageBytes(0))));
        long connected = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
        while (s.maxHeld == 0 && System.nanoTime() < connected) {
            Thread.sleep(10);
        }
        assertEquals(1, s.maxHeld, "connected");
        // Without the limit in the writer, the 256th add waits for a slot for as long as
        // binxd holds its replies.
        CompletableFuture<Void> adds = CompletableFuture.runAsync(() -> {
            for (int round = 0; round < 2; round++) {
                for (int b = round == 0 ? 1 : 0; b < BUFFERS; b++) {
                    assertTrue(writer.add(b, ByteBuffer.wrap(HostileServerTest.pageBytes(round * BUFFERS + b))));
                }
            }
        });
        adds.get(30, TimeUnit.SECONDS);
        int limit = BinxConnection.Options.defaults().maxOutstanding();
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
        while (s.maxHeld < limit - 16 && System.nanoTime() < deadline) {
            Thread.sleep(10);
        }
        assertEquals(limit - 16, s.maxHeld, "ENQUEUEs in flight stop below the connection's limit");
        return writer;
    }

    /** The writer finishes, and every buffer holds its two pages once, in order. */
    static void finishesWithEveryPageOnce(TaskWriter writer, Binxd s) throws Exception {
        writer.finish().get(30, TimeUnit.SECONDS);
        for (long b = 0; b < BUFFERS; b++) {
            assertEquals(List.of(0L, 1L), s.appliedTo(b), "buffer " + b);
        }
    }

    @Test
    @Timeout(60)
    void addNeverWaitsForASlotAndEveryBatchGoesInItsBuffersOrder() throws Exception {
        try (Binxd s = new Binxd((r, n) -> false)) {
            TaskWriter writer = writeWhileHeld(s);
            s.release.countDown();
            finishesWithEveryPageOnce(writer, s);
            assertEquals(1, s.connections.get());
        }
    }

    /** Held replies that come back BUSY (every third): those buffers resync, the rest go on. */
    @Test
    @Timeout(60)
    void batchesWaitingBehindARefusalGoAfterItsResync() throws Exception {
        try (Binxd s = new Binxd((r, n) -> n % 3 == 0)) {
            TaskWriter writer = writeWhileHeld(s);
            s.release.countDown();
            finishesWithEveryPageOnce(writer, s);
        }
    }

    /**
     * binxd answers all 240 ENQUEUEs in flight, OK, and closes the connection (review: with
     * nothing refused or failed, nothing reconnected, and 360 batches waited for ever): the
     * waiting ones go on a new connection.
     */
    @Test
    @Timeout(60)
    void batchesWaitingWhenTheConnectionClosesAfterItsRepliesGoOnTheNextOne() throws Exception {
        try (Binxd s = new Binxd((r, n) -> false)) {
            TaskWriter writer = writeWhileHeld(s);
            s.cutAfterRelease = true;
            s.release.countDown();
            finishesWithEveryPageOnce(writer, s);
            assertTrue(s.connections.get() >= 2, "reconnected");
        }
    }

    /**
     * The connection breaks with 240 ENQUEUEs in flight and 360 batches waiting (review: the
     * waiting ones stayed queued for ever with nothing in flight to drain them, and finish
     * never came): every batch goes on the next connection, once. The break is one failure
     * to the writer's backoff (and the reconnect one more), not one per buffer it cut.
     */
    @Test
    @Timeout(60)
    void batchesWaitingWhenTheConnectionBreaksGoOnTheNextOne() throws Exception {
        try (Binxd s = new Binxd((r, n) -> false)) {
            TaskWriter writer = writeWhileHeld(s);
            s.cut.countDown();
            finishesWithEveryPageOnce(writer, s);
            assertTrue(s.connections.get() >= 2, "reconnected");
            assertTrue(writer.failuresCounted() <= 2 * (s.connections.get() - 1),
                    "failures counted: " + writer.failuresCounted() + " for " + (s.connections.get() - 1) + " break(s)");
        }
    }

    /**
     * A writer at its limit over many buffers whose consumers read once it finished (as Trino's
     * do), against a binxd that answers one ENQUEUE at a time and only while the writer waits
     * for room: each reply frees a little room, and the
     * engine adds a few pages into it. Sealing every open batch whenever the writer went over
     * its limit sent about one page an ENQUEUE (each page added over the limit was sealed
     * alone); sealing the fullest batches down to a quarter of the limit sends many. Every
     * page is applied once, in order.
     */
    @Test
    @Timeout(60)
    void aWriterAtItsLimitSendsFullBatchesNotOnePageAnEnqueue() throws Exception {
        Semaphore gate = new Semaphore(0);
        int buffers = 16;
        int perBuffer = 200;
        int size = 1000;
        long limit = 1024 * (size + TaskWriter.PAGE_OVERHEAD);
        try (Binxd s = new Binxd((r, n) -> false, gate)) {
            TaskWriter writer = new TaskWriter(() -> BinxConnection.unix(s.socket, BinxConnection.Options.defaults()),
                    "t.batching", buffers, "commit",
                    new TaskWriter.Options(1 << 20, 4096, limit, 1_000_000, 60_000).withReadAfterFinish());
            int waits = 0;
            for (int i = 0; i < perBuffer; i++) {
                for (int b = 0; b < buffers; b++) {
                    CompletableFuture<Void> room = writer.whenRoom();
                    while (!room.isDone()) {
                        // One reply; another only if it did not free room.
                        gate.release();
                        waits++;
                        try {
                            room.get(200, TimeUnit.MILLISECONDS);
                        } catch (TimeoutException e) {
                            // not yet
                        }
                    }
                    assertTrue(writer.add(b, ByteBuffer.wrap(new byte[size])));
                }
            }
            assertTrue(waits > 10, "the writer was at its limit: " + waits + " waits");
            gate.release(1_000_000);
            writer.finish().get(30, TimeUnit.SECONDS);
            long pages = (long) buffers * perBuffer;
            // At least a quarter of the limit (256 pages) in at most 16 batches each time it
            // seals at its limit, and at most one a buffer at the finish.
            assertTrue(writer.batchesSealed() <= pages / 16 + buffers,
                    writer.batchesSealed() + " ENQUEUEs for " + pages + " pages");
            for (long b = 0; b < buffers; b++) {
                List<Long> applied = s.appliedTo(b);
                assertEquals(perBuffer, applied.size(), "buffer " + b);
                for (int i = 0; i < perBuffer; i++) {
                    assertEquals(i, applied.get(i).longValue(), "buffer " + b);
                }
            }
        }
    }

    /**
     * The writer completes its futures while it holds its lock; what a caller attaches to them
     * runs outside it, so a callback may wait for a thread that needs the writer (an engine
     * whose callback takes a lock another of its threads holds while it adds a page). Run
     * under the lock, each callback below waits for {@code bufferedBytes} on another thread
     * until it gives up.
     */
    @Test
    @Timeout(60)
    void callbacksOnTheWritersFuturesRunOutsideItsLock() throws Exception {
        Semaphore gate = new Semaphore(0);
        int size = 1000;
        try (Binxd s = new Binxd((r, n) -> false, gate)) {
            TaskWriter writer = new TaskWriter(() -> BinxConnection.unix(s.socket, BinxConnection.Options.defaults()),
                    "t.callbacks", 1, "commit",
                    new TaskWriter.Options(size, 1, 4 * (size + TaskWriter.PAGE_OVERHEAD), 1_000_000, 60_000));
            int added = 0;
            while (writer.whenRoom().isDone()) {
                assertTrue(writer.add(0, ByteBuffer.wrap(new byte[size])));
                added++;
            }
            CompletableFuture<Long> inRoomCallback = writer.whenRoom().thenApply(ok -> onAnotherThread(writer::bufferedBytes));
            CompletableFuture<Long> inFinishCallback = writer.finish().thenApply(ok -> onAnotherThread(writer::bufferedBytes));
            assertTrue(!inRoomCallback.isDone() && !inFinishCallback.isDone(), "binxd holds every reply");
            gate.release(added);
            assertTrue(inRoomCallback.get(30, TimeUnit.SECONDS) <= 4 * (size + TaskWriter.PAGE_OVERHEAD));
            assertEquals(0L, inFinishCallback.get(30, TimeUnit.SECONDS));
            assertEquals(added, s.appliedTo(0).size());
        }
    }

    /** {@code call}'s result from a thread of its own, waiting at most 5 s for it. */
    static <T> T onAnotherThread(java.util.concurrent.Callable<T> call) {
        java.util.concurrent.FutureTask<T> task = new java.util.concurrent.FutureTask<>(call);
        Thread t = new Thread(task, "another-thread");
        t.setDaemon(true);
        t.start();
        try {
            return task.get(5, TimeUnit.SECONDS);
        } catch (Exception e) {
            throw new java.util.concurrent.CompletionException("the other thread did not get it within 5 s", e);
        }
    }
}
