package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.util.List;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import org.junit.jupiter.api.Test;

/**
 * A task writer whose engine adds nothing for a long time (a task waiting on its input). binxd
 * closes a connection that sends nothing for {@code idle_timeout}, drops a task no connection of
 * its producer holds after {@code abandon_after}, and forgets the drop as long after: OPEN_TASK
 * on the writer's next connection then opens the task anew, empty, and a task-wide NO_MORE_PAGES
 * would commit it without the pages binxd had confirmed (a wrong query answer). Here binxd's
 * clocks are seconds instead of minutes.
 */
class QuietWriterTest {
    private static final String[] QUICK_CLOCKS = {"--memory-limit", "64MiB", "--max-wait", "1s", "--idle-timeout", "3s",
        "--abandon-after", "1s"};
    /** Past idle_timeout, abandon_after and the drop's memory together, with a margin. */
    private static final long QUIET_MILLIS = 8_000;

    /** The writer holds its connection open while its task is: the task is never dropped. */
    @Test
    void aWriterQuietForLongerThanBinxdsClocksCommitsEveryPage() throws Exception {
        // idle_timeout 5 s: the keep-alive PING after 2 s of quiet has 3 s to get there on a busy
        // machine; 8 s of quiet still outlasts it and abandon_after together.
        try (Binxd binxd = Binxd.start("--memory-limit", "64MiB", "--max-wait", "1s", "--idle-timeout", "5s",
                "--abandon-after", "1s")) {
            String task = "java.quiet.held";
            // Liveness 500 ms: a held connection sends a PING after 2 s of quiet (within binxd's 5 s
            // idle_timeout), and its answer may take 500 ms on a busy machine.
            TaskWriter writer = new TaskWriter(() -> BinxConnection.unix(binxd.socket,
                    BinxConnection.Options.defaults().withLivenessMillis(500)), task, 2, "commit", options());
            LiveBinxdTest.addConfirmed(writer, task, 0, 32);
            Thread.sleep(QUIET_MILLIS);
            writer.finish().get(30, TimeUnit.SECONDS);
            try (BinxConnection c = binxd.connect()) {
                Tasks.CommittedTask commit = Tasks.committed(c, task).get(10, TimeUnit.SECONDS);
                assertEquals(32, commit.endTokens()[0]);
                assertEquals(0, commit.endTokens()[1]);
                List<ByteBuffer> pages = LiveBinxdTest.readAll(c, task, 0, "", 32, commit.bytes()[0]);
                assertEquals(32, pages.size());
                for (int i = 0; i < 32; i++) {
                    assertEquals(LiveBinxdTest.page(task, 0, i, 100), pages.get(i), "page " + i);
                }
                for (int b = 0; b < 2; b++) {
                    Tasks.delete(c, task, b, "").get(10, TimeUnit.SECONDS);
                }
            }
            assertEquals(0, binxd.stat("abandoned_buffers"), binxd.stats());
        }
    }

    /**
     * The writer's connection is cut after binxd confirmed every page, and nothing more comes
     * until the finish: binxd dropped the task and forgot it meanwhile. The finish fails, naming
     * the buffer that lost its pages, and nothing is committed.
     */
    @Test
    void aWriterWhoseTaskWasDroppedAndForgottenFailsItsFinish() throws Exception {
        quietAfterACut(1);
    }

    /** The same with the pages in every buffer but one, and the cut buffer the last. */
    @Test
    void aWriterWhoseTaskWasDroppedAndForgottenFailsItsFinishWhateverBufferLostPages() throws Exception {
        quietAfterACut(3);
    }

    private static void quietAfterACut(int buffersWritten) throws Exception {
        try (Binxd binxd = Binxd.start(QUICK_CLOCKS)) {
            String task = "java.quiet.cut." + buffersWritten;
            AtomicReference<BinxConnection> current = new AtomicReference<>();
            TaskWriter writer = cuttable(binxd, task, 4, current);
            for (int b = 0; b < buffersWritten; b++) {
                LiveBinxdTest.addConfirmed(writer, task, b, 8 * (b + 1));
            }
            current.get().close();
            Thread.sleep(QUIET_MILLIS);
            var failed = assertThrows(ExecutionException.class, () -> writer.finish().get(30, TimeUnit.SECONDS));
            String why = failed.getCause().getMessage();
            assertTrue(why.contains(task) && why.contains("continues at token 0") && why.contains("pages are lost"), why);
            try (BinxConnection c = binxd.connect()) {
                assertNull(Tasks.committed(c, task).get(10, TimeUnit.SECONDS), "nothing of the attempt is committed");
            }
        }
    }

    /**
     * The writer's connection is cut and its finish comes at once, on a new connection, while
     * binxd still holds the task: each written buffer's check passes (an ENQUEUE of no page
     * adds nothing), and the commit holds every page exactly once.
     */
    @Test
    void aWriterThatReconnectedCommitsEveryPageExactlyOnce() throws Exception {
        // Its task must outlive the cut: abandon_after 10 s, not 1 (a reconnect slower than
        // 1 s on a busy machine would find it dropped).
        try (Binxd binxd = Binxd.start("--memory-limit", "64MiB", "--max-wait", "1s", "--idle-timeout", "3s",
                "--abandon-after", "10s")) {
            String task = "java.quiet.reconnected";
            AtomicReference<BinxConnection> current = new AtomicReference<>();
            TaskWriter writer = cuttable(binxd, task, 3, current);
            LiveBinxdTest.addConfirmed(writer, task, 0, 16);
            LiveBinxdTest.addConfirmed(writer, task, 2, 8);
            current.get().close();
            writer.finish().get(30, TimeUnit.SECONDS);
            try (BinxConnection c = binxd.connect()) {
                Tasks.CommittedTask commit = Tasks.committed(c, task).get(10, TimeUnit.SECONDS);
                long[] ends = {16, 0, 8};
                for (int b = 0; b < 3; b++) {
                    assertEquals(ends[b], commit.endTokens()[b], "buffer " + b);
                    if (ends[b] == 0) {
                        continue;
                    }
                    List<ByteBuffer> pages = LiveBinxdTest.readAll(c, task, b, "", ends[b], commit.bytes()[b]);
                    for (int i = 0; i < ends[b]; i++) {
                        assertEquals(LiveBinxdTest.page(task, b, i, 100), pages.get(i), "buffer " + b + " page " + i);
                    }
                }
                for (int b = 0; b < 3; b++) {
                    Tasks.delete(c, task, b, "").get(10, TimeUnit.SECONDS);
                }
            }
        }
    }

    /** A writer whose latest connection is in {@code current}, for the test to cut. */
    private static TaskWriter cuttable(Binxd binxd, String task, int buffers, AtomicReference<BinxConnection> current) {
        return new TaskWriter(() -> {
            BinxConnection c = binxd.connect();
            current.set(c);
            return c;
        }, task, buffers, "commit", options());
    }

    /** Batches of 8 pages: a multiple of 8 pages leaves none waiting in an open batch. */
    private static TaskWriter.Options options() {
        return new TaskWriter.Options(1 << 20, 8, 1 << 20, 1_000_000, 60_000);
    }
}
