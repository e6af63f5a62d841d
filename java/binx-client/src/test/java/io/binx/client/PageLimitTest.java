package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.List;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.function.Supplier;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * A buffer holds at most binxd's {@code max_pages_per_buffer} pages until a consumer
 * acknowledges some. A writer whose consumers read only once it finished (Trino's) can never
 * get room past it: it fails at once, naming the limit, where it used to retry BUSY replies
 * for its whole error budget (three minutes by default) and then fail with binxd's last BUSY.
 */
class PageLimitTest {
    private static final int LIMIT = 16;
    /** An error budget far above the test's timeouts: a failure within them did not wait it out. */
    private static final TaskWriter.Options READ_AFTER_FINISH =
            new TaskWriter.Options(1 << 20, 4, 1 << 20, 1_000_000, 600_000).withReadAfterFinish();

    private static Binxd limited() throws Exception {
        return Binxd.start("--memory-limit", "64MiB", "--max-pages-per-buffer", Integer.toString(LIMIT));
    }

    /**
     * The writer's finish fails (well within its 10-minute error budget) saying buffer 0 would
     * hold one page past the limit, and nothing of the task stays in binxd.
     */
    private static void assertFailedAtTheLimit(Binxd binxd, String task, TaskWriter writer) throws Exception {
        var failed = assertThrows(ExecutionException.class, () -> writer.finish().get(30, TimeUnit.SECONDS));
        String why = failed.getCause().getMessage();
        assertTrue(why.contains("task " + task) && why.contains("buffer 0 would hold " + (LIMIT + 1) + " pages")
                && why.contains("the " + LIMIT + " its binxd holds") && why.contains("max_pages_per_buffer"), why);
        assertFreed(binxd, task);
    }

    /** The writer's abort frees the task: nothing of it stays in binxd. */
    private static void assertFreed(Binxd binxd, String task) throws Exception {
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
        while (binxd.stat("tasks") != 0) {
            assertTrue(System.nanoTime() < deadline, "the abort reaches binxd: " + binxd.stats());
            Thread.sleep(20);
        }
        try (BinxConnection c = binxd.connect()) {
            assertEquals(null, Tasks.committed(c, task).get(10, TimeUnit.SECONDS));
        }
    }

    /**
     * A writer of a one-buffer task whose binxd is stopped: its connect waits for the preface
     * (up to 20 s), so no limit is known while pages are added, until the test resumes binxd.
     */
    private static TaskWriter writerBeforeHello(Binxd binxd, String task) throws Exception {
        binxd.suspend();
        Supplier<BinxConnection> patient = () -> BinxConnection.unix(binxd.socket,
                BinxConnection.Options.defaults().withConnectTimeoutMillis(20_000));
        return new TaskWriter(patient, task, 1, "commit", READ_AFTER_FINISH);
    }

    /**
     * {@link #writerBeforeHello}, which takes {@code pages} pages of 100 bytes into buffer 0 (no
     * limit known yet), then lets binxd answer.
     */
    private static TaskWriter pagesBeforeHello(Binxd binxd, String task, int pages) throws Exception {
        TaskWriter writer = writerBeforeHello(binxd, task);
        for (int i = 0; i < pages; i++) {
            assertTrue(writer.add(0, LiveBinxdTest.page(task, 0, i, 100)), "page " + i + " taken, no limit known");
        }
        binxd.resume();
        return writer;
    }

    @Test
    @Timeout(60)
    void theFirstPagePastTheLimitFailsTheWriterAtOnce() throws Exception {
        try (Binxd binxd = limited()) {
            String task = "java.limit.past";
            TaskWriter writer = new TaskWriter(binxd::connect, task, 2, "commit", READ_AFTER_FINISH);
            // Confirmed: binxd's HELLO came, and with it the limit.
            LiveBinxdTest.addConfirmed(writer, task, 0, LIMIT);
            LiveBinxdTest.addConfirmed(writer, task, 1, 4);

            assertFalse(writer.add(0, LiveBinxdTest.page(task, 0, LIMIT, 100)), "the page past the limit is not taken");
            assertFailedAtTheLimit(binxd, task, writer);
            assertFalse(writer.add(1, LiveBinxdTest.page(task, 1, 4, 100)), "nothing is taken after the failure");
        }
    }

    /** Pages added before binxd's HELLO said its limit are checked once it does. */
    @Test
    @Timeout(60)
    void pagesAddedBeforeTheHelloAreCheckedWhenItComes() throws Exception {
        try (Binxd binxd = limited()) {
            String task = "java.limit.before-hello";
            TaskWriter writer = pagesBeforeHello(binxd, task, LIMIT + 1);
            assertFailedAtTheLimit(binxd, task, writer);
        }
    }

    /** The limit itself fits: a buffer of exactly that many pages is committed whole. */
    @Test
    @Timeout(60)
    void aBufferOfExactlyTheLimitIsCommitted() throws Exception {
        try (Binxd binxd = limited()) {
            String task = "java.limit.at";
            TaskWriter writer = new TaskWriter(binxd::connect, task, 1, "commit", READ_AFTER_FINISH);
            for (int i = 0; i < LIMIT; i++) {
                assertTrue(writer.add(0, LiveBinxdTest.page(task, 0, i, 100)));
            }
            writer.finish().get(30, TimeUnit.SECONDS);
            try (BinxConnection c = binxd.connect()) {
                Tasks.CommittedTask committed = Tasks.committed(c, task).get(10, TimeUnit.SECONDS);
                assertEquals(LIMIT, committed.endTokens()[0]);
                assertEquals(LIMIT * 100, committed.bytes()[0]);
                // Nothing left to serve: binxd stops at once.
                Tasks.deleteTask(c, task, 1, "").get(10, TimeUnit.SECONDS);
            }
        }
    }

    /** The same at the check a HELLO makes of pages added before it: the limit itself fits. */
    @Test
    @Timeout(60)
    void aBufferOfExactlyTheLimitAddedBeforeTheHelloIsCommitted() throws Exception {
        try (Binxd binxd = limited()) {
            String task = "java.limit.at-before-hello";
            TaskWriter writer = pagesBeforeHello(binxd, task, LIMIT);
            writer.finish().get(30, TimeUnit.SECONDS);
            try (BinxConnection c = binxd.connect()) {
                assertEquals(LIMIT, Tasks.committed(c, task).get(10, TimeUnit.SECONDS).endTokens()[0]);
                Tasks.deleteTask(c, task, 1, "").get(10, TimeUnit.SECONDS);
            }
        }
    }

    /** What a HELLO says is checked: only a positive number is a limit; anything else is none. */
    @Test
    void onlyAPositiveNumberIsALimit() {
        assertEquals(16, TaskWriter.pageLimit("16"));
        assertEquals(1L << 20, TaskWriter.pageLimit("1048576"));
        for (String said : new String[] {"", "0", "-3", "abc", "16x", " 16", "99999999999999999999"}) {
            assertEquals(Long.MAX_VALUE, TaskWriter.pageLimit(said), "'" + said + "'");
        }
    }

    /**
     * A binxd with a 1 MiB memory limit (the least it takes; pages spilled to storage) says
     * {@code max-enqueue-bytes=1048192} in its HELLO, and a writer made with 4 MiB batches sends
     * none larger (five 200 KB pages a batch, with 128 bytes a page for binxd's index): with 4
     * MiB batches binxd refused the first as one that can never fit its limit, though every
     * page fit, and the writer failed. Every page reads back exactly. The writer is connected
     * before the first page (batches made before, see the next test).
     */
    @Test
    @Timeout(120)
    void batchesStayWithinWhatASmallBinxdTakes() throws Exception {
        try (Binxd small = Binxd.start("--memory-limit", "1MiB", "--default-spool-policy", "overflow")) {
            String task = "java.small.batches";
            int pages = 20;
            int size = 200_000;
            TaskWriter writer = new TaskWriter(small::connect, task, 1, "overflow",
                    new TaskWriter.Options(4 << 20, 4096, 32 << 20, 1_000_000, 60_000));
            assertHelloSays(small, "max-enqueue-bytes=1048192");
            awaitConnected(writer);
            for (int i = 0; i < pages; i++) {
                writer.whenRoom().get(30, TimeUnit.SECONDS);
                assertTrue(writer.add(0, LiveBinxdTest.page(task, 0, i, size)));
            }
            writer.finish().get(60, TimeUnit.SECONDS);
            assertEquals(pages / 5, writer.batchesSealed());
            assertReadsBackAndDelete(small, task, pages, size);
        }
    }

    /**
     * Buffer 0 of {@code task} reads back as {@link LiveBinxdTest#page} made its {@code pages}
     * pages of {@code size} bytes, byte for byte; then the task is deleted (nothing left to
     * serve: binxd stops at once).
     */
    private static void assertReadsBackAndDelete(Binxd binxd, String task, int pages, int size) throws Exception {
        try (BinxConnection c = binxd.connect()) {
            var read = LiveBinxdTest.readAll(c, task, 0, "", pages, (long) pages * size);
            assertEquals(pages, read.size());
            for (int i = 0; i < pages; i++) {
                assertEquals(LiveBinxdTest.page(task, 0, i, size), read.get(i), "page " + i);
            }
            Tasks.deleteTask(c, task, 1, "").get(10, TimeUnit.SECONDS);
        }
    }

    /** {@code binxd}'s HELLO reply lists {@code capability}. */
    private static void assertHelloSays(Binxd binxd, String capability) throws Exception {
        try (BinxConnection c = binxd.connect()) {
            List<String> said = c.capabilities(5_000);
            assertTrue(said.contains(capability), said.toString());
        }
    }

    /** A connector that connects to {@code binxd} once {@code gate} opens: what is added before waits unsent. */
    private static Supplier<BinxConnection> gated(Binxd binxd, CountDownLatch gate) {
        return () -> {
            try {
                assertTrue(gate.await(60, TimeUnit.SECONDS), "the gate opens");
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                throw new IllegalStateException(e);
            }
            return binxd.connect();
        };
    }

    private static void awaitConnected(TaskWriter writer) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
        while (!writer.connected()) {
            assertTrue(System.nanoTime() < deadline, "the writer connects");
            Thread.sleep(5);
        }
    }

    /**
     * Pages added while the writer connects are batched under its own limits (4 MiB) alone:
     * binxd has not said its own yet. At the HELLO of a 1 MiB binxd, the 4 MB batch sealed
     * meanwhile is cut in 5-page batches before it goes, and the open batch sealed in them too:
     * sent as they were made, binxd refused the 4 MB ENQUEUE as one that can never fit, and the
     * writer failed (review of the capability's first version).
     */
    @Test
    @Timeout(120)
    void batchesMadeWhileConnectingAreCutToWhatBinxdTakes() throws Exception {
        try (Binxd small = Binxd.start("--memory-limit", "1MiB", "--default-spool-policy", "overflow")) {
            String task = "java.small.early";
            int pages = 25;
            int size = 200_000;
            CountDownLatch gate = new CountDownLatch(1);
            TaskWriter writer = new TaskWriter(gated(small, gate), task, 1, "overflow",
                    new TaskWriter.Options(4 << 20, 4096, 32 << 20, 1_000_000, 60_000));
            for (int i = 0; i < pages; i++) {
                assertTrue(writer.add(0, LiveBinxdTest.page(task, 0, i, size)));
            }
            // 20 pages (4,000,000 bytes) sealed at the writer's 4 MiB, 5 open.
            assertEquals(1, writer.batchesSealed());
            assertFalse(writer.connected());
            gate.countDown();
            writer.finish().get(60, TimeUnit.SECONDS);
            // The 20 in 4 batches of 5 (1,000,640 with 128 a page, within 1,048,192), the 5 in one.
            assertEquals(5, writer.batchesSealed());
            assertReadsBackAndDelete(small, task, pages, size);
        }
    }

    /**
     * A binxd that takes 16 pages an ENQUEUE ({@code --max-pages-per-enqueue 16}) says so in
     * its HELLO, and the writer (4,096 pages a batch of its own) keeps every batch within it:
     * the 40 pages added while it connected are cut at the HELLO, the 60 added after it go 16 a
     * batch. The old writer sent all 100 in one ENQUEUE, and binxd refused it ("carries 100
     * pages; the limit is 16").
     */
    @Test
    @Timeout(120)
    void batchesStayWithinThePagesBinxdTakesInOneEnqueue() throws Exception {
        try (Binxd few = Binxd.start("--max-pages-per-enqueue", "16")) {
            assertHelloSays(few, "max-pages-per-enqueue=16");
            String task = "java.few.pages";
            int size = 100;
            CountDownLatch gate = new CountDownLatch(1);
            TaskWriter writer = new TaskWriter(gated(few, gate), task, 1, "",
                    new TaskWriter.Options(1 << 20, 4096, 32 << 20, 1_000_000, 60_000));
            for (int i = 0; i < 40; i++) {
                assertTrue(writer.add(0, LiveBinxdTest.page(task, 0, i, size)));
            }
            gate.countDown();
            awaitConnected(writer);
            for (int i = 40; i < 100; i++) {
                writer.whenRoom().get(30, TimeUnit.SECONDS);
                assertTrue(writer.add(0, LiveBinxdTest.page(task, 0, i, size)));
            }
            writer.finish().get(60, TimeUnit.SECONDS);
            // 40 as 16 + 16 + 8 at the first add after the HELLO; 60 as 16 + 16 + 16 + 12.
            assertEquals(7, writer.batchesSealed());
            assertReadsBackAndDelete(few, task, 100, size);
        }
    }

    /**
     * A binxd that reads frames of at most 64 KiB ({@code --max-frame-size 64KiB}) says {@code
     * max-frame-bytes=65536} in its HELLO: the writer (1 MiB batches of its own) sends three
     * 30,000-byte pages in two frames (two pages, then one), and they read back exactly (the
     * old writer sent them in one 90 KB frame, binxd closed the connection, and the writer
     * tried again until its error budget was spent). A 100,000-byte page, which no frame carries, fails the writer at once,
     * naming the setting: added after the HELLO (the add is refused) or before it (the HELLO
     * fails it).
     */
    @Test
    @Timeout(120)
    void pagesGoInFramesBinxdReads() throws Exception {
        try (Binxd small = Binxd.start("--max-frame-size", "64KiB")) {
            assertHelloSays(small, "max-frame-bytes=65536");
            String task = "java.small.frames";
            TaskWriter.Options options = new TaskWriter.Options(1 << 20, 4096, 32 << 20, 1_000_000, 60_000);
            TaskWriter writer = new TaskWriter(small::connect, task, 1, "", options);
            awaitConnected(writer);
            for (int i = 0; i < 3; i++) {
                assertTrue(writer.add(0, LiveBinxdTest.page(task, 0, i, 30_000)));
            }
            writer.finish().get(60, TimeUnit.SECONDS);
            assertEquals(2, writer.batchesSealed());
            assertReadsBackAndDelete(small, task, 3, 30_000);

            TaskWriter after = new TaskWriter(small::connect, "java.small.frames.after", 1, "", options);
            awaitConnected(after);
            assertFalse(after.add(0, LiveBinxdTest.page("java.small.frames.after", 0, 0, 100_000)));
            assertPagePastFrame(after, "java.small.frames.after");

            CountDownLatch gate = new CountDownLatch(1);
            TaskWriter before = new TaskWriter(gated(small, gate), "java.small.frames.before", 1, "", options);
            assertTrue(before.add(0, LiveBinxdTest.page("java.small.frames.before", 0, 0, 100_000)));
            gate.countDown();
            assertPagePastFrame(before, "java.small.frames.before");
        }
    }

    /** {@code writer}'s finish fails at once (well within its minute of error budget), naming the page and the setting. */
    private static void assertPagePastFrame(TaskWriter writer, String task) {
        long start = System.nanoTime();
        var failed = assertThrows(ExecutionException.class, () -> writer.finish().get(30, TimeUnit.SECONDS));
        String why = failed.getCause().getMessage();
        assertTrue(why.contains("task " + task) && why.contains("a page of 100000 bytes for buffer 0")
                && why.contains("max-frame-bytes=65536") && why.contains("max_frame_size"), why);
        // Not by retrying a connection binxd closes at every try (the writer's budget is a minute).
        assertTrue(System.nanoTime() - start < TimeUnit.SECONDS.toNanos(10), "failed at once");
    }
}
