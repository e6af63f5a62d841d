package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotSame;
import static org.junit.jupiter.api.Assertions.assertSame;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * Connections kept for their next user, against a real binxd: a writer's connection serves
 * the next writer and a reader, each page exact; one with a request
 * in flight, one that broke, one past the bounds or given back to a closed pool is closed,
 * never handed out; a binxd restarted behind kept connections gets new ones.
 */
class BinxConnectionPoolTest {

    private static BinxConnectionPool pool(Binxd binxd, int maxIdle, long maxIdleMillis) {
        return new BinxConnectionPool(binxd::connect, maxIdle, maxIdleMillis);
    }

    @Test
    @Timeout(60)
    void aCommittedWritersConnectionServesTheNextWriterAndAReader() throws Exception {
        try (Binxd binxd = Binxd.start("--memory-limit", "64MiB"); BinxConnectionPool pool = pool(binxd, 8, 30_000)) {
            for (String task : List.of("pool.a", "pool.b", "pool.c")) {
                TaskWriter writer = new TaskWriter(pool, task, 2, "", TaskWriter.Options.defaults());
                for (int i = 0; i < 20; i++) {
                    writer.add(i % 2, LiveBinxdTest.page(task, i % 2, i / 2, 300));
                }
                writer.finish().get(20, TimeUnit.SECONDS);
                assertEquals(1, pool.idle(), "the committed writer's connection is kept for " + task);
            }
            assertEquals(1, pool.opened(), "one connection for three writers");
            assertEquals(2, pool.reused());
            for (String task : List.of("pool.a", "pool.b", "pool.c")) {
                for (int buffer = 0; buffer < 2; buffer++) {
                    BinxConnection c = pool.get();
                    List<ByteBuffer> pages = LiveBinxdTest.readAll(c, task, buffer, "", 10, 3_000);
                    // Read: the buffer goes (so the task ends, and binxd stops at once).
                    BinRequest delete = new BinRequest(MessageType.DELETE);
                    delete.taskId = task;
                    delete.bufferId = buffer;
                    assertEquals(Status.OK, c.call(delete, 10_000).header().status());
                    pool.giveBack(c);
                    assertEquals(10, pages.size(), task + "/" + buffer);
                    for (int i = 0; i < 10; i++) {
                        assertEquals(LiveBinxdTest.page(task, buffer, i, 300), pages.get(i), task + "/" + buffer + " page " + i);
                    }
                }
            }
            assertEquals(1, pool.opened(), "the readers took the writers' connection");
        }
    }

    @Test
    @Timeout(60)
    void onlyAnOpenIdleConnectionIsKeptAndOnlyWithinItsBounds() throws Exception {
        try (Binxd binxd = Binxd.start("--memory-limit", "64MiB")) {
            BinxConnectionPool pool = pool(binxd, 2, 30_000);
            try {
                // A long poll in flight: its late reply would reach the next user.
                // Each page sent at once.
                TaskWriter open = new TaskWriter(pool, "pool.poll", 1, "", new TaskWriter.Options(1, 1, 1 << 20, 1_000, 180_000));
                open.add(0, LiveBinxdTest.page("pool.poll", 0, 0, 10));
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
                while (open.bufferedBytes() > 0) {
                    assertTrue(System.nanoTime() < deadline, "binxd confirms the page");
                    Thread.sleep(5);
                }
                BinxConnection polling = pool.get();
                BinRequest data = new BinRequest(MessageType.DATA);
                data.taskId = "pool.poll";
                data.bufferId = 0;
                data.pageToken = 1;
                data.maxSizeBytes = 1 << 20;
                data.maxWaitMicros = 5_000_000;
                CompletableFuture<Response> waiting = polling.send(data);
                assertEquals(1, polling.outstanding());
                pool.giveBack(polling);
                assertFalse(polling.isOpen(), "a connection with a request in flight is closed");
                assertThrows(java.util.concurrent.ExecutionException.class, () -> waiting.get(10, TimeUnit.SECONDS),
                        "its request failed with it");
                assertEquals(0, pool.idle());
                open.abort("done").get(10, TimeUnit.SECONDS);

                // Closed by its user: not kept.
                BinxConnection closed = pool.get();
                closed.close();
                pool.giveBack(closed);
                assertEquals(0, pool.idle());

                // Three given back, two kept: the one given back first is closed.
                BinxConnection a = pool.get();
                BinxConnection b = pool.get();
                BinxConnection c = pool.get();
                pool.giveBack(a);
                pool.giveBack(b);
                pool.giveBack(c);
                assertEquals(2, pool.idle());
                assertFalse(a.isOpen(), "the oldest kept is closed past the bound");
                assertSame(c, pool.get(), "the most recently given back first");
                pool.giveBack(c);
                pool.close();
                assertFalse(b.isOpen(), "closing the pool closes what it keeps");
                assertFalse(c.isOpen());
                BinxConnection late = binxd.connect();
                pool.giveBack(late);
                assertFalse(late.isOpen(), "given back to a closed pool: closed");
                assertThrows(BinxConnectionException.class, pool::get, "a closed pool opens nothing");
            } finally {
                pool.close();
            }
            // Kept past its time: the sweep closes it, and a get opens another.
            try (BinxConnectionPool sweeping = pool(binxd, 4, 200)) {
                BinxConnection kept = sweeping.get();
                sweeping.giveBack(kept);
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
                while (kept.isOpen()) {
                    assertTrue(System.nanoTime() < deadline, "the sweep closes a connection kept past its time");
                    Thread.sleep(20);
                }
                assertEquals(0, sweeping.idle());
                BinxConnection next = sweeping.get();
                assertNotSame(kept, next);
                assertTrue(next.isOpen());
                next.close();
            }
        }
    }

    @Test
    @Timeout(90)
    void aRestartedBinxdIsReachedOnANewConnection() throws Exception {
        Binxd binxd = Binxd.start("--memory-limit", "64MiB");
        try (BinxConnectionPool pool = pool(binxd, 4, 30_000)) {
            BinxConnection kept = pool.get();
            String before = BinxConnection.capability(kept.capabilities(5_000), "instance");
            pool.giveBack(kept);
            binxd = binxd.restart();
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
            while (kept.isOpen()) {
                assertTrue(System.nanoTime() < deadline, "the kept connection sees binxd go");
                Thread.sleep(10);
            }
            BinxConnection next = pool.get();
            assertNotSame(kept, next);
            String after = BinxConnection.capability(next.capabilities(5_000), "instance");
            assertFalse(after.isEmpty());
            assertTrue(!after.equals(before), "the new connection reaches the new instance");
            pool.giveBack(next);
        } finally {
            binxd.close();
        }
    }
}
