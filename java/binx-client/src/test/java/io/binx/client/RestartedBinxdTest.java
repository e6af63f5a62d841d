package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.List;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;

/**
 * The local binxd restarts under a writer (its container restarted in the pod): the new one
 * knows nothing of the pages the old one confirmed. A writer that went on would resend only
 * what was unconfirmed, the new binxd would take it (a buffer's first batch is token 0 there
 * too), and NO_MORE_PAGES would commit the task with a buffer short: a wrong query answer.
 */
class RestartedBinxdTest {
    /** More pages come after the restart: buffer 1's first batch (token 0) would be taken. */
    @Test
    void aWriterWhoseBinxdRestartedBeforeItsLastPagesFailsItsFinish() throws Exception {
        restartThenFinish(true);
    }

    /** Every page was confirmed before the restart: only NO_MORE_PAGES would reach the new binxd. */
    @Test
    void aWriterWhoseBinxdRestartedAfterEveryPageFailsItsFinish() throws Exception {
        restartThenFinish(false);
    }

    private static void restartThenFinish(boolean morePages) throws Exception {
        Binxd first = Binxd.start("--memory-limit", "64MiB");
        Binxd second = null;
        try {
            String task = "java.live.restarted";
            // Batches of 8 pages: 40 pages of buffer 0 go out as 5 batches, none left open.
            TaskWriter.Options options = new TaskWriter.Options(1 << 20, 8, 1 << 20, 1_000_000, 60_000);
            Binxd daemon = first;
            TaskWriter writer = new TaskWriter(daemon::connect, task, 2, "commit", options);
            LiveBinxdTest.addConfirmed(writer, task, 0, 40);
            assertEquals(40, first.stat("pages_enqueued"));
            String before = instance(first);

            second = first.restart();
            assertNotEquals(before, instance(second), "a new process is a new instance");
            if (morePages) {
                // Into both buffers: buffer 1's first batch, and buffer 0 past what was confirmed.
                writer.add(1, LiveBinxdTest.page(task, 1, 0, 100));
                writer.add(0, LiveBinxdTest.page(task, 0, 40, 100));
            }
            var failed = assertThrows(ExecutionException.class, () -> writer.finish().get(30, TimeUnit.SECONDS));
            String why = failed.getCause().getMessage();
            assertTrue(why.contains("binxd restarted") && why.contains(task), why);
            // The new binxd got nothing of the attempt: no OPEN_TASK, ENQUEUE or NO_MORE_PAGES
            // (which would have committed it, short), so nothing is in storage; nor an
            // ABORT_TASK, whose tombstone would keep it from releasing what the earlier
            // instance committed when the attempt's output is deleted.
            Binxd now = second;
            writer.abort("the engine aborts the failed attempt too");
            String stats = now.stats();
            for (String request : List.of("OPEN_TASK", "ENQUEUE", "NO_MORE_PAGES", "ABORT_TASK")) {
                assertFalse(stats.contains("\"" + request + " "), request + " reached the new binxd: " + stats);
            }
            assertEquals(0, now.stat("pages_enqueued"));
            assertEquals(0, now.stat("tasks"));
            try (BinxConnection c = now.connect()) {
                assertEquals(null, Tasks.committed(c, task).get(10, TimeUnit.SECONDS));
            }
        } finally {
            first.close();
            if (second != null) {
                second.close();
            }
        }
    }

    private static String instance(Binxd b) {
        try (BinxConnection c = b.connect()) {
            List<String> caps = c.capabilities(5_000);
            String instance = BinxConnection.capability(caps, "instance");
            assertFalse(instance.isEmpty(), "HELLO names no instance: " + caps);
            return instance;
        }
    }
}
