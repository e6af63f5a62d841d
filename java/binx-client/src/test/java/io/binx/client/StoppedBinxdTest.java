package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTimeoutPreemptively;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.function.Supplier;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * The local binxd stops answering (SIGSTOP: alive, its sockets open, silent; a wedged process or
 * a paused container) under a writer and under a reader. Each fails within its error budget,
 * saying why, instead of waiting for good: an engine task that waits for good holds its query
 * for good, while a failed one is retried elsewhere.
 */
class StoppedBinxdTest {
    /** Liveness and connect deadlines short enough for a test; the budget of errors too. */
    private static Supplier<BinxConnection> impatient(Binxd binxd) {
        return () -> BinxConnection.unix(binxd.socket, BinxConnection.Options.defaults()
                .withLivenessMillis(200).withConnectTimeoutMillis(300));
    }

    /** The same liveness deadline, and a connect that waits out a stopped binxd's preface (20 s). */
    private static Supplier<BinxConnection> patient(Binxd binxd) {
        return () -> BinxConnection.unix(binxd.socket, BinxConnection.Options.defaults()
                .withLivenessMillis(200).withConnectTimeoutMillis(20_000));
    }

    private static final long MAX_ERROR_MILLIS = 2_000;

    @Test
    @Timeout(60)
    void aWriterWhoseBinxdStopsAnsweringFailsItsFinishAndAbortsOnceItAnswersAgain() throws Exception {
        try (Binxd binxd = Binxd.start("--memory-limit", "64MiB")) {
            String task = "java.live.stopped-writer";
            TaskWriter.Options options = new TaskWriter.Options(1 << 20, 8, 1 << 20, 1_000_000, MAX_ERROR_MILLIS);
            TaskWriter writer = new TaskWriter(impatient(binxd), task, 2, "commit", options);
            LiveBinxdTest.addConfirmed(writer, task, 0, 16);

            binxd.suspend();
            long stoppedAt = System.nanoTime();
            for (int i = 0; i < 8; i++) {
                writer.add(1, LiveBinxdTest.page(task, 1, i, 100));
            }
            var failed = assertThrows(ExecutionException.class, () -> writer.finish().get(30, TimeUnit.SECONDS));
            long tookMillis = TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - stoppedAt);
            String why = failed.getCause().getMessage();
            assertTrue(why.contains(task) && why.contains("gave up"), why);
            assertTrue(tookMillis >= MAX_ERROR_MILLIS, "it kept trying for its budget: " + tookMillis + " ms");

            // Once it answers again, the writer's abort frees the task: nothing of it stays.
            binxd.resume();
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
            while (binxd.stat("tasks") != 0) {
                assertTrue(System.nanoTime() < deadline, "the abort reaches binxd: " + binxd.stats());
                Thread.sleep(20);
            }
            assertTrue(binxd.stats().contains("\"ABORT_TASK OK\""), binxd.stats());
            try (BinxConnection c = binxd.connect()) {
                assertEquals(null, Tasks.committed(c, task).get(10, TimeUnit.SECONDS));
            }
        }
    }

    /**
     * While the writer's binxd is stopped, its reconnects wait for the preface (20 s here) on a
     * thread of their own: the engine's threads that add pages and ask what the writer holds
     * are never held by them. Once binxd answers again, the writer goes on where it was and
     * the task is committed whole.
     */
    @Test
    @Timeout(120)
    void aStoppedBinxdNeverHoldsTheWritersCallersAndLosesNothingWhenItResumes() throws Exception {
        try (Binxd binxd = Binxd.start("--memory-limit", "64MiB")) {
            String task = "java.live.stopped-resumed";
            TaskWriter writer = new TaskWriter(patient(binxd), task, 2, "commit",
                    new TaskWriter.Options(1 << 20, 8, 1 << 20, 1_000_000, 60_000));
            LiveBinxdTest.addConfirmed(writer, task, 0, 16);

            binxd.suspend();
            for (int i = 0; i < 8; i++) {
                writer.add(1, LiveBinxdTest.page(task, 1, i, 100));
            }
            // The connection fails at its liveness deadline; a reconnect then waits on the
            // stopped binxd's preface.
            Thread.sleep(2_000);
            assertTimeoutPreemptively(Duration.ofSeconds(2), () -> {
                for (int i = 16; i < 24; i++) {
                    writer.add(0, LiveBinxdTest.page(task, 0, i, 100));
                }
                assertEquals(16 * (100 + TaskWriter.PAGE_OVERHEAD), writer.bufferedBytes());
            }, "adding pages and asking what the writer holds wait for no connect");

            binxd.resume();
            writer.finish().get(60, TimeUnit.SECONDS);
            try (BinxConnection c = binxd.connect()) {
                Tasks.CommittedTask committed = Tasks.committed(c, task).get(10, TimeUnit.SECONDS);
                assertEquals(24, committed.endTokens()[0]);
                assertEquals(8, committed.endTokens()[1]);
                assertEquals(2_400, committed.bytes()[0]);
                assertEquals(800, committed.bytes()[1]);
            }
        }
    }

    /**
     * Empty pages cost the writer memory too (an object and a slot each, {@link
     * TaskWriter#PAGE_OVERHEAD}): while binxd is stopped, a caller adding nothing but empty
     * pages is told to wait once they fill the writer's limit, as with any pages, instead of
     * piling them up for good. Once binxd answers, room comes back and every one is committed.
     */
    @Test
    @Timeout(60)
    void emptyPagesFillTheWriterWhileItsBinxdIsStopped() throws Exception {
        try (Binxd binxd = Binxd.start("--memory-limit", "64MiB")) {
            String task = "java.live.stopped-empty";
            long limit = 64 << 10;
            TaskWriter writer = new TaskWriter(patient(binxd), task, 1, "commit",
                    new TaskWriter.Options(1 << 20, 8, limit, 1_000_000, 60_000));
            LiveBinxdTest.addConfirmed(writer, task, 0, 8);
            binxd.suspend();
            int added = 0;
            while (writer.whenRoom().isDone()) {
                assertTrue(added < 2 * limit / TaskWriter.PAGE_OVERHEAD, "empty pages fill the writer: " + added + " added");
                assertTrue(writer.add(0, java.nio.ByteBuffer.allocate(0)));
                added++;
            }
            assertEquals(limit / TaskWriter.PAGE_OVERHEAD + 1, added, "the page past the limit is the one told to wait");
            assertEquals(added * TaskWriter.PAGE_OVERHEAD, writer.bufferedBytes());

            binxd.resume();
            writer.whenRoom().get(30, TimeUnit.SECONDS);
            writer.finish().get(30, TimeUnit.SECONDS);
            assertEquals(0, writer.bufferedBytes());
            try (BinxConnection c = binxd.connect()) {
                Tasks.CommittedTask committed = Tasks.committed(c, task).get(10, TimeUnit.SECONDS);
                assertEquals(8 + added, committed.endTokens()[0]);
                assertEquals(800, committed.bytes()[0]);
            }
        }
    }

    @Test
    @Timeout(60)
    void aReaderWhoseBinxdStopsAnsweringFailsWithinItsBudget() throws Exception {
        try (Binxd binxd = Binxd.start("--memory-limit", "64MiB")) {
            String task = "java.live.stopped-reader";
            // One page in, the buffer left open: the reader waits on DATA's long poll for more.
            TaskWriter writer = new TaskWriter(binxd::connect, task, 1, "",
                    new TaskWriter.Options(1 << 20, 1, 1 << 20, 1_000_000, 60_000));
            writer.add(0, LiveBinxdTest.page(task, 0, 0, 100));
            java.util.concurrent.atomic.AtomicLong pages = new java.util.concurrent.atomic.AtomicLong();
            BufferPull pull = new BufferPull(impatient(binxd), task, 0, "", "", -1, -1,
                    new BufferPull.Options(2 << 20, 2, false, 1_000_000, MAX_ERROR_MILLIS), () -> Long.MAX_VALUE,
                    p -> pages.incrementAndGet());
            // Connected, the page read, a DATA waiting for more: then binxd stops.
            pull.resume();
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
            while (pages.get() == 0) {
                assertTrue(System.nanoTime() < deadline, "the first page is read");
                Thread.sleep(10);
            }
            binxd.suspend();
            var failed = assertThrows(ExecutionException.class, () -> pull.done().get(30, TimeUnit.SECONDS));
            String why = failed.getCause().getMessage();
            assertTrue(why.contains(task), why);
            assertEquals(1, pages.get(), "the one page written, once");
            binxd.resume();
            writer.abort("test over");
        }
    }
}
