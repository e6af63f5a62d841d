package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.IOException;
import java.net.StandardProtocolFamily;
import java.net.UnixDomainSocketAddress;
import java.nio.ByteBuffer;
import java.nio.channels.ServerSocketChannel;
import java.nio.channels.SocketChannel;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * A writer with more batches to send than its connection has request slots, against a binxd
 * that holds its ENQUEUE replies (short of room, it may, up to the ENQUEUE's wait): {@link
 * TaskWriter#add} never waits for a slot (the engine's threads call it, and every other add,
 * {@code whenRoom} and memory query waits on the writer meanwhile); the batches past the limit
 * wait in the writer and go, each buffer's in order, as replies come.
 */
class WriterSlotsTest {
    /** Answers HELLO, OPEN_TASK, NO_MORE_PAGES and PING at once; holds ENQUEUE replies until released. */
    static final class HoldingServer implements AutoCloseable {
        final Path socket;
        final ServerSocketChannel channel;
        final List<BinRequest> held = new ArrayList<>();
        final CountDownLatch release = new CountDownLatch(1);
        /** buffer -> the append tokens of its ENQUEUEs, in the order they came. */
        final Map<Long, List<Long>> tokens = new ConcurrentHashMap<>();
        volatile int maxHeld;

        HoldingServer() throws IOException {
            socket = Files.createTempDirectory("binx-slots").resolve("s.sock");
            channel = ServerSocketChannel.open(StandardProtocolFamily.UNIX);
            channel.bind(UnixDomainSocketAddress.of(socket));
            Thread t = new Thread(this::serve, "holding-server");
            t.setDaemon(true);
            t.start();
        }

        private void serve() {
            try {
                SocketChannel c = channel.accept();
                Frames.readFully(c, ByteBuffer.allocate(8), false);
                ByteBuffer ours = ByteBuffer.wrap(Frames.preface());
                while (ours.hasRemaining()) {
                    c.write(ours);
                }
                // Replies are written from here and from the releasing thread: one at a time.
                Object writing = new Object();
                Thread releaser = new Thread(() -> {
                    try {
                        release.await();
                        synchronized (writing) {
                            synchronized (held) {
                                for (BinRequest r : held) {
                                    Frames.Frame f = LyingWriterServerTest.frame(LyingWriterServerTest.ok(r));
                                    Frames.write(c, f.header(), f.body());
                                }
                                held.clear();
                            }
                        }
                    } catch (InterruptedException | IOException e) {
                        // the test ended
                    }
                });
                releaser.setDaemon(true);
                releaser.start();
                Frames.Frame f;
                while ((f = Frames.read(c, Frames.DEFAULT_MAX_FRAME)) != null) {
                    BinRequest r = BinRequest.decode(f.header());
                    MessageType type = MessageType.of(r.type);
                    BinReply reply = LyingWriterServerTest.ok(r);
                    if (type == MessageType.HELLO) {
                        reply.capabilities.addAll(LyingWriterServerTest.HONEST);
                    }
                    synchronized (writing) {
                        if (type == MessageType.ENQUEUE) {
                            tokens.computeIfAbsent(r.bufferId, k -> new ArrayList<>()).add(r.appendToken);
                            synchronized (held) {
                                if (release.getCount() > 0) {
                                    held.add(r);
                                    maxHeld = Math.max(maxHeld, held.size());
                                    continue;
                                }
                            }
                        }
                        Frames.Frame out = LyingWriterServerTest.frame(reply);
                        Frames.write(c, out.header(), out.body());
                    }
                }
            } catch (IOException | ProtocolException e) {
                // the test ended
            }
        }

        @Override
        public void close() throws IOException {
            release.countDown();
            channel.close();
        }
    }

    @Test
    @Timeout(60)
    void addNeverWaitsForASlotAndEveryBatchGoesInItsBuffersOrder() throws Exception {
        int buffers = 300;
        try (HoldingServer s = new HoldingServer()) {
            // One page per batch: every add sends an ENQUEUE.
            TaskWriter writer = new TaskWriter(() -> BinxConnection.unix(s.socket, BinxConnection.Options.defaults()),
                    "t.slots", buffers, "commit", new TaskWriter.Options(1 << 20, 1, 1L << 30, 1_000_000, 60_000));
            // Connected first (else the first batches wait for the connect, not for slots).
            assertTrue(writer.add(0, ByteBuffer.wrap(HostileServerTest.pageBytes(0))));
            long connected = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
            while (!s.tokens.containsKey(0L) && System.nanoTime() < connected) {
                Thread.sleep(10);
            }
            assertTrue(s.tokens.containsKey(0L), "connected");
            // Two rounds over every buffer: 600 batches, none answered. Without the limit in the
            // writer, the 256th add waits for a slot for as long as binxd holds its replies.
            CompletableFuture<Void> adds = CompletableFuture.runAsync(() -> {
                for (int round = 0; round < 2; round++) {
                    for (int b = round == 0 ? 1 : 0; b < buffers; b++) {
                        assertTrue(writer.add(b, ByteBuffer.wrap(HostileServerTest.pageBytes(round * buffers + b))));
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
            s.release.countDown();
            writer.finish().get(30, TimeUnit.SECONDS);
            // Every batch went once, each buffer's in token order.
            assertEquals(buffers, s.tokens.size());
            for (long b = 0; b < buffers; b++) {
                assertEquals(List.of(0L, 1L), s.tokens.get(b), "buffer " + b);
            }
        }
    }
}
