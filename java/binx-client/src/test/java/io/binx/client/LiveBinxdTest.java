package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Random;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestInstance;

/** The client against a real binxd (started here, on its own socket and ports). */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
class LiveBinxdTest {
    private Binxd binxd;

    @BeforeAll
    void start() throws Exception {
        binxd = Binxd.start("--memory-limit", "64MiB");
    }

    @AfterAll
    void stop() throws Exception {
        binxd.close();
    }

    static ByteBuffer page(String task, int buffer, int i, int size) {
        byte[] b = new byte[size];
        byte[] name = (task + "/" + buffer + "/" + i + "/").getBytes(StandardCharsets.UTF_8);
        for (int k = 0; k < size; k++) {
            b[k] = k < name.length ? name[k] : (byte) (i * 31 + k);
        }
        return ByteBuffer.wrap(b);
    }

    /**
     * Adds pages 0 to {@code pages - 1} (100 bytes each, {@link #page}) to {@code buffer}, and
     * waits until binxd confirmed everything the writer holds.
     */
    static void addConfirmed(TaskWriter writer, String task, int buffer, int pages) throws InterruptedException {
        for (int i = 0; i < pages; i++) {
            writer.add(buffer, page(task, buffer, i, 100));
        }
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
        while (writer.bufferedBytes() > 0) {
            assertTrue(System.nanoTime() < deadline, "binxd confirms the pages of buffer " + buffer + " of " + task);
            Thread.sleep(10);
        }
    }

    /** Reads a whole buffer, checking it against its commit. */
    static List<ByteBuffer> readAll(BinxConnection c, String task, long buffer, String remote, long end, long bytes)
            throws Exception {
        List<ByteBuffer> pages = new ArrayList<>();
        BufferPull pull = new BufferPull(() -> c, task, buffer, remote, remote, end, bytes, BufferPull.Options.defaults(),
                () -> Long.MAX_VALUE, p -> {
                    ByteBuffer copy = ByteBuffer.allocate(p.remaining());
                    copy.put(p.duplicate()).flip();
                    pages.add(copy);
                });
        pull.resume();
        pull.done().get(60, TimeUnit.SECONDS);
        return pages;
    }

    @Test
    void helloNamesWhatTheServerOffers() {
        try (BinxConnection c = binxd.connect()) {
            assertEquals(2, c.serverMinor());
            List<String> caps = c.capabilities(5_000);
            assertTrue(caps.contains("append-token"), caps.toString());
            assertTrue(caps.contains("pipelined-data"), caps.toString());
            assertTrue(caps.contains("committed"), caps.toString());
            assertTrue(caps.contains("address=" + binxd.tcp), caps + " vs " + binxd.tcp);
        }
    }

    /**
     * Four threads write a buffer each, concurrently, through one writer with small batches
     * (many ENQUEUEs in flight); the commit names every page and byte, and every buffer reads
     * back exactly, in order, twice (nothing is acknowledged).
     */
    @Test
    void pagesWrittenConcurrentlyReadBackExactlyAndTheCommitNamesThem() throws Exception {
        String task = "java.live.concurrent";
        int buffers = 4;
        int perBuffer = 300;
        TaskWriter.Options small = new TaskWriter.Options(8 * 1024, 16, 1 << 20, 1_000_000, 60_000);
        TaskWriter writer = new TaskWriter(binxd::connect, task, buffers, "commit", small);
        long[] bytes = new long[buffers];
        List<Thread> threads = new ArrayList<>();
        for (int b = 0; b < buffers; b++) {
            int buffer = b;
            Thread t = new Thread(() -> {
                Random random = new Random(buffer);
                for (int i = 0; i < perBuffer; i++) {
                    ByteBuffer p = page(task, buffer, i, random.nextInt(3000));
                    bytes[buffer] += p.remaining();
                    writer.whenRoom().join();
                    writer.add(buffer, p);
                }
            });
            threads.add(t);
            t.start();
        }
        for (Thread t : threads) {
            t.join();
        }
        writer.finish().get(60, TimeUnit.SECONDS);
        assertNull(writer.failure());
        try (BinxConnection c = binxd.connect()) {
            Tasks.CommittedTask commit = Tasks.committed(c, task).get(10, TimeUnit.SECONDS);
            assertEquals(binxd.tcp, commit.endpoint());
            assertEquals(buffers, commit.bufferCount());
            for (int b = 0; b < buffers; b++) {
                assertEquals(perBuffer, commit.endTokens()[b]);
                assertEquals(bytes[b], commit.bytes()[b]);
                for (int round = 0; round < 2; round++) {
                    List<ByteBuffer> read = readAll(c, task, b, "", commit.endTokens()[b], commit.bytes()[b]);
                    Random random = new Random(b);
                    assertEquals(perBuffer, read.size());
                    for (int i = 0; i < perBuffer; i++) {
                        assertEquals(page(task, b, i, random.nextInt(3000)), read.get(i), "buffer " + b + " page " + i);
                    }
                }
            }
            // Read through the sidecar's own forwarding too (remote = itself).
            List<ByteBuffer> viaTcp = readAll(c, task, 2, binxd.tcp, commit.endTokens()[2], commit.bytes()[2]);
            assertEquals(perBuffer, viaTcp.size());
            // A reader that expects another end fails, never returns a short buffer.
            var e = assertThrows(ExecutionException.class,
                    () -> readAll(c, task, 1, "", commit.endTokens()[1] + 1, -1));
            assertTrue(e.getCause().getMessage().contains("read would be short"), e.getCause().getMessage());
            assertNull(Tasks.committed(c, "java.live.never").get(10, TimeUnit.SECONDS));
            for (int b = 0; b < buffers; b++) {
                Tasks.delete(c, task, b, "").get(10, TimeUnit.SECONDS);
            }
        }
    }

    /**
     * DELETE_TASK frees a committed task's buffers with one request, through the sidecar's own
     * forwarding too; what it may not name is refused, naming the task, and deletes nothing.
     */
    @Test
    void aTaskDeleteFreesEveryBufferInOneRequest() throws Exception {
        TaskWriter.Options small = new TaskWriter.Options(8 * 1024, 16, 1 << 20, 1_000_000, 60_000);
        try (BinxConnection c = binxd.connect()) {
            assertTrue(c.capabilities(5_000).contains("task-delete"));
            for (String remote : List.of("", binxd.tcp)) {
                String task = "java.live.whole" + (remote.isEmpty() ? "" : ".forwarded");
                TaskWriter writer = new TaskWriter(binxd::connect, task, 3, "commit", small);
                for (int b = 0; b < 3; b++) {
                    for (int i = 0; i < 5; i++) {
                        writer.add(b, page(task, b, i, 100));
                    }
                }
                writer.finish().get(60, TimeUnit.SECONDS);
                assertEquals(3, Tasks.committed(c, task).get(10, TimeUnit.SECONDS).bufferCount());
                for (long wrong : new long[] {0, 4}) {
                    var e = assertThrows(ExecutionException.class,
                            () -> Tasks.deleteTask(c, task, wrong, remote).get(10, TimeUnit.SECONDS));
                    assertTrue(e.getCause() instanceof BinxRefusedException r && r.status() == Status.BAD_REQUEST
                            && r.getMessage().contains(task), e.getCause().getMessage());
                }
                assertEquals(5, readAll(c, task, 2, "", 5, 500).size(), "nothing was deleted");
                Tasks.deleteTask(() -> c, task, 3, remote).get(10, TimeUnit.SECONDS);
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
                while (Tasks.committed(c, task).get(10, TimeUnit.SECONDS) != null) {
                    assertTrue(System.nanoTime() < deadline, "the manifest of " + task + " is deleted");
                    Thread.sleep(20);
                }
            }
        }
    }

    /**
     * The writer's connections break again and again mid-frame (a proxy that cuts each one
     * after a few KiB): every ENQUEUE without a reply is sent again with its numbers, and the
     * buffer holds every page once, in order.
     */
    @Test
    void brokenConnectionsLoseAndRepeatNothing() throws Exception {
        try (CuttingProxy proxy = new CuttingProxy(binxd.socket, 20_000)) {
            writeThroughCuts("java.live.cut", proxy, proxy::connect);
        }
    }

    /**
     * The same, with every connect taking 150 ms: requests that find no connection wait for
     * it parked (the engine's threads are not held), and go out once it is made.
     */
    @Test
    void slowConnectsParkRequestsAndLoseNothing() throws Exception {
        try (CuttingProxy proxy = new CuttingProxy(binxd.socket, 20_000)) {
            writeThroughCuts("java.live.slow-connects", proxy, () -> {
                try {
                    Thread.sleep(150);
                } catch (InterruptedException e) {
                    Thread.currentThread().interrupt();
                }
                return proxy.connect();
            });
        }
    }

    /** 400 pages over 2 buffers through connections {@code proxy} cuts; every page once, in order. */
    private void writeThroughCuts(String task, CuttingProxy proxy, java.util.function.Supplier<BinxConnection> connector)
            throws Exception {
        TaskWriter.Options small = new TaskWriter.Options(4 * 1024, 8, 256 * 1024, 1_000_000, 60_000);
        TaskWriter writer = new TaskWriter(connector, task, 2, "always", small);
        Random random = new Random(7);
        long[] bytes = new long[2];
        for (int i = 0; i < 400; i++) {
            int b = i % 2;
            ByteBuffer p = page(task, b, i / 2, random.nextInt(1500));
            bytes[b] += p.remaining();
            writer.whenRoom().get(60, TimeUnit.SECONDS);
            writer.add(b, p);
        }
        writer.finish().get(120, TimeUnit.SECONDS);
        assertTrue(proxy.cuts() > 5, "the proxy cut " + proxy.cuts() + " connections");
        try (BinxConnection c = binxd.connect()) {
            Tasks.CommittedTask commit = Tasks.committed(c, task).get(10, TimeUnit.SECONDS);
            Random again = new Random(7);
            List<List<ByteBuffer>> expected = List.of(new ArrayList<>(), new ArrayList<>());
            for (int i = 0; i < 400; i++) {
                expected.get(i % 2).add(page(task, i % 2, i / 2, again.nextInt(1500)));
            }
            for (int b = 0; b < 2; b++) {
                assertEquals(200, commit.endTokens()[b]);
                assertEquals(bytes[b], commit.bytes()[b]);
                assertEquals(expected.get(b), readAll(c, task, b, "", 200, bytes[b]));
            }
        }
    }

    /**
     * A reader hands pages over holding its own lock, and the engine's source takes its lock to
     * take them; the source, holding that lock, may ask the reader what it reads (for a
     * message). {@link BufferPull#describe} must not wait for the reader's lock: two threads
     * taking the two locks in opposite orders would hang the engine's reads for good.
     */
    @Test
    void aReaderCanBeDescribedWhileItHandsOverAPage() throws Exception {
        String task = "java.live.describe";
        TaskWriter writer = new TaskWriter(binxd::connect, task, 1, "commit", TaskWriter.Options.defaults());
        writer.add(0, page(task, 0, 0, 100));
        writer.finish().get(30, TimeUnit.SECONDS);
        Object sourceLock = new Object();
        java.util.concurrent.CountDownLatch inHandOver = new java.util.concurrent.CountDownLatch(1);
        try (BinxConnection c = binxd.connect()) {
            Tasks.CommittedTask commit = Tasks.committed(c, task).get(10, TimeUnit.SECONDS);
            BufferPull pull = new BufferPull(() -> c, task, 0, "", "", commit.endTokens()[0], commit.bytes()[0],
                    BufferPull.Options.defaults(), () -> Long.MAX_VALUE, p -> {
                        inHandOver.countDown();
                        synchronized (sourceLock) {
                            // The source takes the page.
                        }
                    });
            String described;
            synchronized (sourceLock) {
                pull.resume();
                assertTrue(inHandOver.await(30, TimeUnit.SECONDS), "the reader hands a page over");
                // The source's lock is held here, and the reader waits for it holding its own.
                // Asked from another thread so that a describe() that waits fails the test (a
                // timeout) instead of hanging it; the lock goes after that either way.
                described = CompletableFuture.supplyAsync(pull::describe).get(10, TimeUnit.SECONDS);
            }
            assertTrue(described.contains(task), described);
            pull.done().get(30, TimeUnit.SECONDS);
            Tasks.delete(c, task, 0, "").get(10, TimeUnit.SECONDS);
        }
    }

    @Test
    void anAbortedTaskFailsItsReadersWithTheReason() throws Exception {
        String task = "java.live.aborted";
        TaskWriter writer = new TaskWriter(binxd::connect, task, 1, "", TaskWriter.Options.defaults());
        writer.add(0, page(task, 0, 0, 10));
        writer.abort("the query was cancelled").get(10, TimeUnit.SECONDS);
        writer.add(0, page(task, 0, 1, 10));
        var failed = assertThrows(ExecutionException.class, () -> writer.finish().get(10, TimeUnit.SECONDS));
        assertTrue(failed.getCause().getMessage().contains("aborted"), failed.getCause().getMessage());
        try (BinxConnection c = binxd.connect()) {
            var e = assertThrows(ExecutionException.class, () -> readAll(c, task, 0, "", -1, -1));
            assertTrue(e.getCause().getMessage().contains("the query was cancelled"), e.getCause().getMessage());
        }
    }

    /**
     * An engine passes a stack trace as the reason: the abort is still sent (the reason cut to
     * what binxd keeps, at a character's end), and the readers see it. The whole reason made the
     * header pass its limit, and the abort was retried until its error budget ran out.
     */
    @Test
    void anAbortWithAStackTraceForAReasonStillAborts() throws Exception {
        String task = "java.live.traced";
        TaskWriter writer = new TaskWriter(binxd::connect, task, 1, "", TaskWriter.Options.defaults());
        writer.add(0, page(task, 0, 0, 10));
        String trace = "worker lost: " + "at Frame.\u00e9(Frame.java:1) \ud83d\ude00\n".repeat(3000);
        assertTrue(trace.getBytes(StandardCharsets.UTF_8).length > 70_000);
        writer.abort(trace).get(10, TimeUnit.SECONDS);
        try (BinxConnection c = binxd.connect()) {
            var e = assertThrows(ExecutionException.class, () -> readAll(c, task, 0, "", -1, -1));
            assertTrue(e.getCause().getMessage().contains("worker lost: at Frame.\u00e9(Frame.java:1) \ud83d\ude00"),
                    e.getCause().getMessage());
        }
    }

    /** A reason is cut to 4096 bytes of UTF-8 at a character's end, never inside one. */
    @Test
    void aReasonIsCutAtACharactersEnd() {
        assertEquals("", BinRequest.reasonWithin(null));
        assertEquals("short", BinRequest.reasonWithin("short"));
        for (String unit : new String[] {"a", "\u00e9", "\u20ac", "\ud83d\ude00"}) {
            for (int pad = 0; pad < 4; pad++) {
                String whole = "x".repeat(pad) + unit.repeat(5000);
                String cut = BinRequest.reasonWithin(whole);
                int bytes = cut.getBytes(StandardCharsets.UTF_8).length;
                int unitBytes = unit.getBytes(StandardCharsets.UTF_8).length;
                assertTrue(whole.startsWith(cut));
                assertTrue(bytes <= BinRequest.MAX_REASON_BYTES, bytes + " bytes");
                assertTrue(bytes + unitBytes > BinRequest.MAX_REASON_BYTES, "as much as fits: " + bytes);
                assertTrue(cut.isEmpty() || !Character.isHighSurrogate(cut.charAt(cut.length() - 1)), "a pair is never split");
            }
        }
    }

    @Test
    void refusalsNameTheRequestAndNumbersGuardAppends() throws Exception {
        try (BinxConnection c = binxd.connect()) {
            BinRequest open = new BinRequest(MessageType.OPEN_TASK);
            open.taskId = "java.live.numbers";
            open.bufferCount = 1;
            assertEquals(Status.OK, c.call(open, 5_000).header().status());
            BinRequest enqueue = new BinRequest(MessageType.ENQUEUE);
            enqueue.taskId = "java.live.numbers";
            enqueue.pageSizes = new long[] {3};
            enqueue.appendToken = 5L;
            Response r = c.call(enqueue, 5_000, ByteBuffer.wrap("abc".getBytes(StandardCharsets.US_ASCII)));
            assertEquals(Status.BAD_REQUEST, r.header().status());
            assertEquals(5, r.header().pageToken);
            assertEquals(0, r.header().pageNextToken);
            var refused = new BinxRefusedException(enqueue, r.header());
            assertTrue(refused.getMessage().startsWith("ENQUEUE for buffer 0 of task java.live.numbers at token 5: BAD_REQUEST"),
                    refused.getMessage());
            BinRequest bad = new BinRequest(MessageType.OPEN_TASK);
            bad.taskId = "../escape";
            assertEquals(Status.BAD_REQUEST, c.call(bad, 5_000).header().status());
            Tasks.abort(c, "java.live.numbers", "done").get(5, TimeUnit.SECONDS);
        }
    }

    /**
     * A writer far smaller than what is written over many buffers, whose consumers read once it
     * finished, is at its limit nearly all the time: each time it seals at its limit it seals
     * the fullest batches until a quarter of the limit (61 of these pages) is left open, from
     * at least half (124), at most one a buffer, and every page reads back exactly ({@code
     * WriterSlotsTest} shows the batching where binxd's replies come one at a time).
     */
    @Test
    void aWriterAtItsLimitStillSendsSeveralPagesAnEnqueue() throws Exception {
        String task = "java.live.backpressure";
        int buffers = 16;
        int perBuffer = 400;
        int size = 1000;
        long limit = 256 * 1024;
        TaskWriter writer = new TaskWriter(binxd::connect, task, buffers, "commit",
                new TaskWriter.Options(1 << 20, 4096, limit, 1_000_000, 60_000).withReadAfterFinish());
        for (int i = 0; i < perBuffer; i++) {
            for (int b = 0; b < buffers; b++) {
                writer.whenRoom().get(30, TimeUnit.SECONDS);
                assertTrue(writer.add(b, page(task, b, i, size)));
            }
        }
        writer.finish().get(60, TimeUnit.SECONDS);
        assertNull(writer.failure());
        long pages = (long) buffers * perBuffer;
        // At least 63 pages (from 124 open to 61) in at most 16 batches each time, the fullest
        // first; the finish seals what is left, at most one a buffer.
        assertTrue(writer.batchesSealed() <= (pages / 63 + 1) * buffers + buffers,
                writer.batchesSealed() + " ENQUEUEs for " + pages + " pages");
        try (BinxConnection c = binxd.connect()) {
            Tasks.CommittedTask commit = Tasks.committed(c, task).get(10, TimeUnit.SECONDS);
            for (int b = 0; b < buffers; b++) {
                assertEquals(perBuffer, commit.endTokens()[b]);
                List<ByteBuffer> read = readAll(c, task, b, "", commit.endTokens()[b], commit.bytes()[b]);
                for (int i = 0; i < perBuffer; i++) {
                    assertEquals(page(task, b, i, size), read.get(i), "buffer " + b + " page " + i);
                }
            }
            Tasks.deleteTask(c, task, buffers, "").get(10, TimeUnit.SECONDS);
        }
    }

    /** Many requests in flight on one connection, answered out of order, each to its own caller. */
    @Test
    void oneConnectionCarriesManyRequestsAtOnce() throws Exception {
        try (BinxConnection c = binxd.connect()) {
            List<CompletableFuture<Response>> pings = new ArrayList<>();
            for (int i = 0; i < 2000; i++) {
                pings.add(c.send(new BinRequest(MessageType.PING)));
            }
            AtomicLong ok = new AtomicLong();
            for (CompletableFuture<Response> f : pings) {
                if (f.get(30, TimeUnit.SECONDS).header().status() == Status.OK) {
                    ok.incrementAndGet();
                }
            }
            assertEquals(2000, ok.get());
            byte[] big = new byte[1 << 20];
            new Random(1).nextBytes(big);
            BinRequest open = new BinRequest(MessageType.OPEN_TASK);
            open.taskId = "java.live.big";
            open.bufferCount = 1;
            c.call(open, 5_000);
            BinRequest enqueue = new BinRequest(MessageType.ENQUEUE);
            enqueue.taskId = "java.live.big";
            enqueue.pageSizes = new long[] {big.length};
            enqueue.appendToken = 0L;
            assertEquals(Status.OK, c.call(enqueue, 10_000, ByteBuffer.wrap(big)).header().status());
            BinRequest finish = new BinRequest(MessageType.NO_MORE_PAGES);
            finish.taskId = "java.live.big";
            finish.bufferId = -1L;
            assertEquals(Status.OK, c.call(finish, 5_000).header().status());
            List<ByteBuffer> read = readAll(c, "java.live.big", 0, "", 1, 1 << 20);
            assertEquals(1, read.size());
            byte[] got = new byte[read.get(0).remaining()];
            read.get(0).get(got);
            assertArrayEquals(big, got);
        }
    }
}
