package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.channels.ServerSocketChannel;
import java.nio.channels.SocketChannel;
import java.nio.file.Path;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * A connection to a binxd that stops answering (stopped with SIGSTOP, or wedged) fails, after a
 * PING it does not answer either; one to a binxd that answers PINGs while it works on a long
 * request is never cut.
 */
class LivenessTest {
    private static final long LIVENESS_MILLIS = 200;

    /**
     * A server that answers PINGs at once (unless told not to) and keeps every other request,
     * unanswered, until the test answers it.
     */
    static final class QuietServer implements AutoCloseable {
        final Path socket;
        final ServerSocketChannel channel;
        final boolean answersPings;
        final List<BinRequest> received = new CopyOnWriteArrayList<>();
        /** Each request's body, by its place in {@link #received}. */
        final List<ByteBuffer> bodies = new CopyOnWriteArrayList<>();
        final CompletableFuture<SocketChannel> accepted = new CompletableFuture<>();

        QuietServer(boolean answersPings) throws IOException {
            this.answersPings = answersPings;
            socket = TestSockets.create("binx-quiet", "s.sock");
            channel = TestSockets.listen(socket);
            Thread t = new Thread(this::serve, "quiet-server");
            t.setDaemon(true);
            t.start();
        }

        private void serve() {
            try {
                SocketChannel c = channel.accept();
                ByteBuffer theirs = ByteBuffer.allocate(Frames.PREFACE_LEN);
                Frames.readFully(c, theirs, false);
                ByteBuffer ours = ByteBuffer.wrap(Frames.preface());
                while (ours.hasRemaining()) {
                    c.write(ours);
                }
                accepted.complete(c);
                Frames.Frame f;
                while ((f = Frames.read(c, Frames.DEFAULT_MAX_FRAME)) != null) {
                    BinRequest r = BinRequest.decode(f.header());
                    bodies.add(f.body());
                    received.add(r);
                    if (r.type == MessageType.PING.number() && answersPings) {
                        answer(r);
                    }
                }
            } catch (IOException | ProtocolException e) {
                // the test ended
            }
        }

        void answer(BinRequest r) throws IOException {
            BinReply h = new BinReply();
            h.requestId = r.requestId;
            h.type = r.type;
            h.status = Status.OK.number();
            // The server thread and the test both answer.
            synchronized (this) {
                Frames.write(accepted.join(), h.encode());
            }
        }

        /**
         * Answers {@code r} with an OK reply of {@code bodyBytes} bytes written a slice every
         * {@code pauseMillis}: a big reply on a slow link. A PING's answer waits behind it.
         */
        void answerSlowly(BinRequest r, int bodyBytes, int slices, long pauseMillis) throws IOException, InterruptedException {
            BinReply h = new BinReply();
            h.requestId = r.requestId;
            h.type = r.type;
            h.status = Status.OK.number();
            byte[] header = h.encode();
            ByteBuffer frame = ByteBuffer.allocate(8 + header.length + bodyBytes);
            frame.putInt(4 + header.length + bodyBytes).putInt(header.length).put(header).position(frame.capacity()).flip();
            int slice = frame.capacity() / slices + 1;
            synchronized (this) {
                SocketChannel c = accepted.join();
                while (frame.hasRemaining()) {
                    ByteBuffer part = frame.slice(frame.position(), Math.min(slice, frame.remaining()));
                    while (part.hasRemaining()) {
                        c.write(part);
                    }
                    frame.position(frame.position() + part.capacity());
                    Thread.sleep(pauseMillis);
                }
            }
        }

        long pings() {
            return received.stream().filter(r -> r.type == MessageType.PING.number()).count();
        }

        BinxConnection connect(long livenessMillis) {
            return BinxConnection.unix(socket, BinxConnection.Options.defaults().withLivenessMillis(livenessMillis));
        }

        @Override
        public void close() throws IOException {
            channel.close();
            TestSockets.remove(socket);
            if (accepted.isDone()) {
                accepted.join().close();
            }
        }
    }

    static BinRequest data() {
        BinRequest r = new BinRequest(MessageType.DATA);
        r.taskId = "t";
        r.bufferId = 0;
        r.maxSizeBytes = 1 << 20;
        return r;
    }

    @Test
    @Timeout(30)
    void aServerThatAnswersNothingFailsTheConnectionAfterAnUnansweredPing() throws Exception {
        try (QuietServer server = new QuietServer(false); BinxConnection c = server.connect(LIVENESS_MILLIS)) {
            long start = System.nanoTime();
            CompletableFuture<Response> reply = c.send(data());
            ExecutionException e = assertThrows(ExecutionException.class, () -> reply.get(20, TimeUnit.SECONDS));
            long tookMillis = TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - start);
            assertInstanceOf(BinxConnectionException.class, e.getCause());
            assertTrue(e.getCause().getMessage().contains("not even the answer to a PING"), e.getCause().getMessage());
            assertTrue(e.getCause().getMessage().contains(server.socket.toString()), e.getCause().getMessage());
            // Silence for one period after the request went out, then the PING's for another.
            assertTrue(tookMillis >= 2 * LIVENESS_MILLIS, "failed after " + tookMillis + " ms");
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
            while (server.pings() == 0 && System.nanoTime() < deadline) {
                Thread.sleep(10);
            }
            // One PING at most; none when the machine was too slow to write it within the period
            // (it is written on the client's pools), which fails the connection the same way.
            assertTrue(server.pings() <= 1, "at most one PING went out before the connection failed: " + server.pings());
            assertFalse(c.isOpen());
            // What is sent after fails at once, naming why.
            ExecutionException next = assertThrows(ExecutionException.class, () -> c.send(data()).get(5, TimeUnit.SECONDS));
            assertTrue(next.getCause().getMessage().contains("not even the answer to a PING"), next.getCause().getMessage());
        }
    }

    @Test
    @Timeout(30)
    void aLongRequestOnAServerThatAnswersPingsIsNeverCut() throws Exception {
        // A longer period here: the server thread must answer each PING within it, on a busy machine.
        long liveness = 1_000;
        try (QuietServer server = new QuietServer(true); BinxConnection c = server.connect(liveness)) {
            CompletableFuture<Response> reply = c.send(data());
            // Four liveness periods without its reply (two PINGs at least).
            Thread.sleep(4 * liveness + liveness / 2);
            assertFalse(reply.isDone(), "the request is still waiting for its reply");
            assertTrue(c.isOpen());
            assertTrue(server.pings() >= 2, "PINGs kept it alive: " + server.pings());
            BinRequest asked = server.received.stream().filter(r -> r.type == MessageType.DATA.number()).findFirst()
                    .orElseThrow();
            server.answer(asked);
            assertEquals(Status.OK, reply.get(10, TimeUnit.SECONDS).header().status());
        }
    }

    /**
     * A reply that takes eight liveness periods to arrive, bytes moving all along, with the
     * PING's answer queued behind it: not silence, so the connection lives and the reply is whole.
     */
    @Test
    @Timeout(30)
    void aReplyThatArrivesSlowlyIsNotSilence() throws Exception {
        // A longer period than the others': a stall of two periods on a busy machine (the
        // server's thread, the client's reader) would be silence, and fail the test.
        long liveness = 500;
        try (QuietServer server = new QuietServer(true); BinxConnection c = server.connect(liveness)) {
            CompletableFuture<Response> reply = c.send(data());
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
            while (server.received.isEmpty()) {
                assertTrue(System.nanoTime() < deadline, "the request reaches the server");
                Thread.sleep(5);
            }
            server.answerSlowly(server.received.get(0), 1 << 20, 32, liveness / 4);
            Response r = reply.get(10, TimeUnit.SECONDS);
            assertEquals(Status.OK, r.header().status());
            assertEquals(1 << 20, r.body().remaining());
            assertTrue(c.isOpen());
        }
    }

    @Test
    @Timeout(30)
    void anIdleConnectionSendsNoPing() throws Exception {
        try (QuietServer server = new QuietServer(false); BinxConnection c = server.connect(LIVENESS_MILLIS)) {
            Thread.sleep(5 * LIVENESS_MILLIS);
            assertTrue(c.isOpen(), "nothing was outstanding, so silence is fine");
            assertEquals(0, server.pings());
        }
    }

    /**
     * A binxd that stopped reading (SIGSTOP, or wedged) while 64 MiB of pages are sent to it:
     * every send returns while the connection is still open (before, the caller's thread waited
     * in the socket's write, with the writer's lock held, until the liveness check failed the
     * connection), and then every request fails, naming the unanswered PING.
     */
    @Test
    @Timeout(60)
    void sendingNeverWaitsOnAServerThatStoppedReading() throws Exception {
        // Long enough that 64 sends, which copy nothing, are done well before it fails.
        long liveness = 2_000;
        Path socket = TestSockets.create("binx-unread", "s.sock");
        try (ServerSocketChannel server = TestSockets.listen(socket)) {
            CompletableFuture<SocketChannel> accepted = new CompletableFuture<>();
            Thread t = new Thread(() -> {
                try {
                    SocketChannel ch = server.accept();
                    Frames.readFully(ch, ByteBuffer.allocate(Frames.PREFACE_LEN), false);
                    ByteBuffer ours = ByteBuffer.wrap(Frames.preface());
                    while (ours.hasRemaining()) {
                        ch.write(ours);
                    }
                    // and never reads again
                    accepted.complete(ch);
                } catch (IOException e) {
                    accepted.completeExceptionally(e);
                }
            }, "unread-server");
            t.setDaemon(true);
            t.start();
            try (BinxConnection c = BinxConnection.unix(socket, BinxConnection.Options.defaults().withLivenessMillis(liveness))) {
                ByteBuffer page = ByteBuffer.allocate(1 << 20);
                List<CompletableFuture<Response>> replies = new java.util.ArrayList<>();
                for (int i = 0; i < 64; i++) {
                    BinRequest r = new BinRequest(MessageType.ENQUEUE);
                    r.taskId = "t";
                    r.bufferId = i;
                    r.pageSizes = new long[] {page.remaining()};
                    replies.add(c.send(r, page));
                }
                assertTrue(c.isOpen(), "every send returned while the connection was still open");
                assertEquals(1 << 20, page.remaining(), "the caller's buffer is not consumed");
                for (CompletableFuture<Response> reply : replies) {
                    ExecutionException e = assertThrows(ExecutionException.class, () -> reply.get(30, TimeUnit.SECONDS));
                    assertInstanceOf(BinxConnectionException.class, e.getCause());
                    assertTrue(e.getCause().getMessage().contains("not even the answer to a PING"), e.getCause().getMessage());
                }
                assertFalse(c.isOpen());
            } finally {
                TestSockets.remove(socket);
                if (accepted.isDone() && !accepted.isCompletedExceptionally()) {
                    accepted.join().close();
                }
            }
        }
    }

    /**
     * Many requests sent at once reach a live server whole and in order, each with its own
     * reply: small ones that share a write, and every tenth with a body of 300 KiB to 1 MiB,
     * more than the writer's staging buffer, so written in parts, which nothing may come between.
     */
    @Test
    @Timeout(30)
    void manyRequestsSentAtOnceArriveInOrderAndEachIsAnswered() throws Exception {
        try (QuietServer server = new QuietServer(true); BinxConnection c = server.connect(10_000)) {
            List<CompletableFuture<Response>> replies = new java.util.ArrayList<>();
            java.util.Random random = new java.util.Random(7);
            List<ByteBuffer> sent = new java.util.ArrayList<>();
            for (int i = 0; i < 200; i++) {
                BinRequest r = data();
                r.bufferId = i;
                byte[] body = new byte[i % 10 == 0 ? BinxConnection.STAGING_BYTES + 44_000 + random.nextInt(700_000) : i];
                random.nextBytes(body);
                sent.add(ByteBuffer.wrap(body));
                replies.add(c.send(r, ByteBuffer.wrap(body)));
            }
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
            while (server.received.size() < 200) {
                assertTrue(System.nanoTime() < deadline, "all 200 arrive: " + server.received.size());
                Thread.sleep(5);
            }
            for (int i = 0; i < 200; i++) {
                assertEquals(i, server.received.get(i).bufferId, "request " + i + " in send order");
                assertEquals(sent.get(i), server.bodies.get(i), "request " + i + "'s body, whole");
                server.answer(server.received.get(i));
            }
            for (CompletableFuture<Response> reply : replies) {
                assertEquals(Status.OK, reply.get(10, TimeUnit.SECONDS).header().status());
            }
        }
    }
}
