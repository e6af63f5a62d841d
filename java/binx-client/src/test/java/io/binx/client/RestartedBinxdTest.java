package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
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
    @Test
    void aWriterWhoseBinxdRestartedAfterConfirmingPagesFailsItsFinish() throws Exception {
        Binxd first = Binxd.start("--memory-limit", "64MiB");
        Binxd second = null;
        try {
            String task = "java.live.restarted";
            // Batches of 8 pages: 40 pages of buffer 0 go out as 5 batches, none left open.
            TaskWriter.Options options = new TaskWriter.Options(1 << 20, 8, 1 << 20, 1_000_000, 60_000);
            Binxd daemon = first;
            TaskWriter writer = new TaskWriter(daemon::connect, task, 2, "commit", options);
            for (int i = 0; i < 40; i++) {
                writer.add(0, LiveBinxdTest.page(task, 0, i, 100));
            }
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
            while (writer.bufferedBytes() > 0) {
                assertTrue(System.nanoTime() < deadline, "binxd confirms buffer 0's pages");
                Thread.sleep(10);
            }
            assertEquals(40, first.stat("pages_enqueued"));
            String before = instance(first);

            second = first.restart();
            assertNotEquals(before, instance(second), "a new process is a new instance");
            // Buffer 1's first page: token 0, which the new binxd would take.
            writer.add(1, LiveBinxdTest.page(task, 1, 0, 100));
            var failed = assertThrows(ExecutionException.class, () -> writer.finish().get(30, TimeUnit.SECONDS));
            String why = failed.getCause().getMessage();
            assertTrue(why.contains("binxd restarted") && why.contains(task), why);
            // Nothing of the attempt is committed on the new binxd, and its abort freed what it took.
            try (BinxConnection c = second.connect()) {
                assertEquals(null, Tasks.committed(c, task).get(10, TimeUnit.SECONDS));
            }
            Binxd now = second;
            deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
            while (now.stat("tasks") != 0 || now.stat("memory_used") != 0) {
                assertTrue(System.nanoTime() < deadline, "the abort reaches the new binxd");
                Thread.sleep(20);
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
            return caps.stream().filter(s -> s.startsWith("instance=")).findFirst()
                    .orElseThrow(() -> new AssertionError("HELLO names no instance: " + caps));
        }
    }
}
