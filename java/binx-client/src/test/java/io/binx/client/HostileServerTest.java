package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
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
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.BiFunction;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;
import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.ValueSource;

/**
 * The reader against servers that lie: wrong tokens, sizes that do not add up, skipped pages,
 * spooled segments it did not ask for, {@code following_sizes} that do not hold, replies out of
 * order. It fails with a reason or reads exactly; it never hands over a wrong page.
 */
public class HostileServerTest {
    /** A buffer of 10 pages of 3 bytes: page i is {i, i, i}. */
    static final int PAGES = 10;

    static byte[] pageBytes(long i) {
        return new byte[] {(byte) i, (byte) i, (byte) i};
    }

    /** An OK reply header to {@code r}, at its token. */
    static BinReply okTo(BinRequest r) {
        BinReply h = new BinReply();
        h.requestId = r.requestId;
        h.type = r.type;
        h.status = Status.OK.number();
        h.pageToken = r.pageToken;
        return h;
    }

    /**
     * An honest reply to DATA(token, size) over the 10-page buffer: 2 pages at most, as many as
     * {@code max_size_bytes} takes, the first page whatever its size.
     */
    static Frames.Frame honest(BinRequest r) {
        return upTo(r, r.maxSizeBytes >= 6 ? 2 : 1);
    }

    /** A reply to DATA(token, size) of {@code most} pages, whatever size it asked for. */
    static Frames.Frame upTo(BinRequest r, long most) {
        BinReply h = okTo(r);
        if (r.pageToken > PAGES) {
            // A guess past the end (from a list that lied), as binxd refuses it.
            h.status = Status.BAD_REQUEST.number();
            h.pageNextToken = r.pageToken;
            h.error = "token " + r.pageToken + " is past the buffer's end";
            return new Frames.Frame(h.encode(), ByteBuffer.allocate(0));
        }
        long end = Math.min(PAGES, r.pageToken + most);
        long[] sizes = new long[(int) (end - r.pageToken)];
        ByteBuffer body = ByteBuffer.allocate(sizes.length * 3);
        for (int i = 0; i < sizes.length; i++) {
            sizes[i] = 3;
            body.put(pageBytes(r.pageToken + i));
        }
        body.flip();
        if (sizes.length > 0) {
            h.segments.add(Segment.inline(r.pageToken, sizes));
        }
        h.pageNextToken = end;
        h.bufferComplete = end == PAGES;
        if (!h.bufferComplete && r.ackToken != null) {
            h.followingSizes = new long[] {3, 3, 3, 3};
        }
        return new Frames.Frame(h.encode(), body);
    }

    /** {@link #honest}'s reply to {@code r} with its header altered by {@code lie}. */
    static Frames.Frame honestWith(BinRequest r, java.util.function.Consumer<BinReply> lie) {
        Frames.Frame f = honest(r);
        try {
            BinReply h = BinReply.decode(f.header());
            lie.accept(h);
            return new Frames.Frame(h.encode(), f.body());
        } catch (ProtocolException e) {
            throw new IllegalStateException(e);
        }
    }

    /**
     * A server on a Unix socket answering each request with {@code answer(request, count)}
     * (public: the plugin's tests use it for a sidecar that answers as no binxd would).
     */
    public static final class Server implements AutoCloseable {
        public final Path socket;
        final ServerSocketChannel channel;

        public Server(BiFunction<BinRequest, Integer, Frames.Frame> answer) throws IOException {
            this(answer, Frames.preface());
        }

        /** With {@code preface} as its preface (another version's). */
        Server(BiFunction<BinRequest, Integer, Frames.Frame> answer, byte[] preface) throws IOException {
            socket = TestSockets.create("binx-hostile", "s.sock");
            channel = TestSockets.listen(socket);
            Thread t = new Thread(() -> {
                int count = 0;
                try {
                    while (true) {
                        SocketChannel c = channel.accept();
                        ByteBuffer theirs = ByteBuffer.allocate(8);
                        Frames.readFully(c, theirs, false);
                        ByteBuffer ours = ByteBuffer.wrap(preface);
                        while (ours.hasRemaining()) {
                            c.write(ours);
                        }
                        Frames.Frame f;
                        while ((f = Frames.read(c, Frames.DEFAULT_MAX_FRAME)) != null) {
                            BinRequest r = BinRequest.decode(f.header());
                            Frames.Frame reply = answer.apply(r, count++);
                            if (reply != null) {
                                Frames.write(c, reply.header(), reply.body());
                            }
                        }
                    }
                } catch (IOException | ProtocolException e) {
                    // the test ended
                }
            });
            t.setDaemon(true);
            t.start();
        }

        BinxConnection connect() {
            return BinxConnection.unix(socket, BinxConnection.Options.defaults());
        }

        @Override
        public void close() throws IOException {
            channel.close();
            TestSockets.remove(socket);
        }
    }

    static List<byte[]> pull(Server s, long end, BufferPull.Options options) throws Exception {
        List<byte[]> pages = new ArrayList<>();
        try (BinxConnection c = s.connect()) {
            BufferPull p = new BufferPull(() -> c, "t", 0, "", "", end, -1, options, () -> 1 << 20, page -> {
                byte[] b = new byte[page.remaining()];
                page.get(b);
                pages.add(b);
            });
            p.resume();
            p.done().get(30, TimeUnit.SECONDS);
        }
        return pages;
    }

    static void assertExact(List<byte[]> pages) {
        assertEquals(PAGES, pages.size());
        for (int i = 0; i < PAGES; i++) {
            assertEquals(ByteBuffer.wrap(pageBytes(i)), ByteBuffer.wrap(pages.get(i)), "page " + i);
        }
    }

    static String failure(BiFunction<BinRequest, Integer, Frames.Frame> answer) throws Exception {
        try (Server s = new Server(answer)) {
            var e = assertThrows(ExecutionException.class, () -> pull(s, PAGES, BufferPull.Options.defaults()));
            return e.getCause().getMessage();
        }
    }

    /**
     * A server that accepts and never sends its preface (a wedged or stopped binxd): the
     * connection fails at its deadline, saying so, instead of holding the caller for good.
     */
    @Test
    @Timeout(30)
    void aServerThatNeverSpeaksFailsTheConnectAtItsDeadline() throws Exception {
        Path dir = Files.createTempDirectory("binx-silent");
        Path socket = dir.resolve("silent.sock");
        try (ServerSocketChannel server = ServerSocketChannel.open(StandardProtocolFamily.UNIX)) {
            server.bind(UnixDomainSocketAddress.of(socket));
            List<SocketChannel> accepted = new ArrayList<>();
            Thread acceptor = new Thread(() -> {
                try {
                    while (true) {
                        accepted.add(server.accept());
                    }
                } catch (IOException closed) {
                    // the test is over
                }
            });
            acceptor.setDaemon(true);
            acceptor.start();
            BinxConnectionException e = assertThrows(BinxConnectionException.class, () -> BinxConnection.unix(socket,
                    BinxConnection.Options.defaults().withConnectTimeoutMillis(300)));
            assertTrue(e.getMessage().contains("no preface from it in 300 ms"), e.getMessage());
        } finally {
            Files.deleteIfExists(socket);
            Files.deleteIfExists(dir);
        }
    }

    /**
     * A server that answers every connection's HELLO and then closes it: the writer counts
     * each such connection as a failed connect, waits its backoff between them, and fails
     * its finish once its error budget is spent, instead of connecting again without end.
     */
    @Test
    @Timeout(60)
    void aServerThatDropsEveryConnectionAfterHelloFailsTheWriterWithinItsBudget() throws Exception {
        Path socket = TestSockets.create("binx-dropping", "s.sock");
        java.util.concurrent.atomic.AtomicInteger accepted = new java.util.concurrent.atomic.AtomicInteger();
        try (ServerSocketChannel server = ServerSocketChannel.open(StandardProtocolFamily.UNIX)) {
            server.bind(UnixDomainSocketAddress.of(socket));
            Thread t = new Thread(() -> {
                try {
                    while (true) {
                        try (SocketChannel c = server.accept()) {
                            accepted.incrementAndGet();
                            Frames.readFully(c, ByteBuffer.allocate(Frames.PREFACE_LEN), false);
                            ByteBuffer ours = ByteBuffer.wrap(Frames.preface());
                            while (ours.hasRemaining()) {
                                c.write(ours);
                            }
                            Frames.Frame f = Frames.read(c, Frames.DEFAULT_MAX_FRAME);
                            if (f == null) {
                                continue;
                            }
                            BinRequest hello = BinRequest.decode(f.header());
                            BinReply h = new BinReply();
                            h.requestId = hello.requestId;
                            h.type = hello.type;
                            h.status = Status.OK.number();
                            h.capabilities.add("append-token");
                            h.capabilities.add("instance=00000000000000aa");
                            Frames.write(c, h.encode());
                        } catch (IOException | ProtocolException e) {
                            if (!server.isOpen()) {
                                return;
                            }
                            // that connection is over; take the next
                        }
                    }
                } catch (RuntimeException e) {
                    // the test ended
                }
            });
            t.setDaemon(true);
            t.start();
            TaskWriter writer = new TaskWriter(() -> BinxConnection.unix(socket, BinxConnection.Options.defaults()),
                    "t.dropped", 1, "commit", new TaskWriter.Options(1 << 20, 8, 1 << 20, 1_000_000, 1_000));
            writer.add(0, ByteBuffer.wrap(pageBytes(0)));
            var e = assertThrows(ExecutionException.class, () -> writer.finish().get(30, TimeUnit.SECONDS));
            assertTrue(e.getCause().getMessage().contains("t.dropped"), e.getCause().getMessage());
            int connects = accepted.get();
            // Backoff from 10 ms, doubling, over a second: a handful of connects, not thousands.
            assertTrue(connects >= 2 && connects < 100, connects + " connections");
        } finally {
            TestSockets.remove(socket);
        }
    }

    @Test
    void anHonestServerIsReadExactlyWithTwoRequestsInFlight() throws Exception {
        try (Server s = new Server((r, n) -> honest(r))) {
            assertExact(pull(s, PAGES, BufferPull.Options.defaults()));
        }
    }

    @Test
    void lyingRepliesFailWithAReasonAndNeverHandOverAWrongPage() throws Exception {
        String sizes = failure((r, n) -> honestWith(r, h -> h.segments.get(0).pageSizes[0] = 4));
        assertTrue(sizes.contains("exceed the reply") || sizes.contains("add up to"), sizes);
        String skipped = failure((r, n) -> honestWith(r, h -> h.pageNextToken += 1));
        assertTrue(skipped.contains("says the next is"), skipped);
        String spooled = failure((r, n) -> {
            Frames.Frame f = honestWith(r, h -> {
                h.segments.get(0).inline = false;
                h.segments.get(0).spooled = new Segment.Spooled();
            });
            // A spooled segment's pages are not in the body.
            return new Frames.Frame(f.header(), ByteBuffer.allocate(0));
        });
        assertTrue(spooled.contains("spooled segment"), spooled);
        String early = failure((r, n) -> honestWith(r, h -> h.bufferComplete = r.pageToken >= 4));
        assertTrue(early.contains("read would be short"), early);
    }

    /**
     * {@code following_sizes} that lie (each page said to be 1 byte: guesses land in the
     * middle of replies), and replies dropped now and then: the reader drops what does not
     * line up, asks again, and reads exactly.
     */
    @Test
    void guessesThatDoNotLineUpAreDroppedAndAskedAgain() throws Exception {
        try (Server s = new Server((r, n) -> {
            if (n % 7 == 3) {
                BinReply busy = new BinReply();
                busy.requestId = r.requestId;
                busy.type = r.type;
                busy.status = Status.BUSY.number();
                busy.pageToken = r.pageToken;
                busy.pageNextToken = r.pageToken;
                busy.error = "try later";
                return new Frames.Frame(busy.encode(), ByteBuffer.allocate(0));
            }
            return honestWith(r, h -> {
                if (h.followingSizes.length > 0) {
                    h.followingSizes = new long[] {1, 1, 1, 1, 1, 1};
                }
            });
        })) {
            BufferPull.Options opts = new BufferPull.Options(2, 3, false, 1_000_000, 30_000);
            assertExact(pull(s, PAGES, opts));
        }
    }

    /**
     * {@code following_sizes} that understate every page (100-byte pages listed as 1 byte) while
     * each reply still ends where the list says: eight DATA go out on one list, each counting 1
     * byte against a credit of 100. The first reply shows the list wrong; the reader takes it and
     * drops the replies to the DATA sent behind it, so it never holds more than its credit plus
     * one reply, and it reads every page exactly.
     */
    @Test
    void aListThatUnderstatesSizesCostsAtMostOneReplyBeyondTheCredit() throws Exception {
        int pages = 40;
        int size = 100;
        long budget = 100;
        try (Server s = new Server((r, n) -> {
            // Page t is `size` bytes of (byte) t; a DATA gets one page (it asks for 1 byte).
            BinReply h = okTo(r);
            ByteBuffer body = ByteBuffer.allocate(0);
            if (r.pageToken < pages) {
                body = ByteBuffer.allocate(size);
                java.util.Arrays.fill(body.array(), (byte) r.pageToken);
                h.segments.add(Segment.inline(r.pageToken, new long[] {size}));
            }
            h.pageNextToken = Math.min(pages, r.pageToken + 1);
            h.bufferComplete = h.pageNextToken == pages;
            if (!h.bufferComplete) {
                h.followingSizes = new long[16];
                java.util.Arrays.fill(h.followingSizes, 1);
            }
            return new Frames.Frame(h.encode(), body);
        }); BinxConnection c = s.connect()) {
            java.util.concurrent.atomic.AtomicLong held = new java.util.concurrent.atomic.AtomicLong();
            java.util.concurrent.atomic.AtomicLong mostHeld = new java.util.concurrent.atomic.AtomicLong();
            List<byte[]> got = java.util.Collections.synchronizedList(new ArrayList<>());
            BufferPull[] pull = new BufferPull[1];
            pull[0] = new BufferPull(() -> c, "t", 0, "", "", pages, (long) pages * size,
                    new BufferPull.Options(1, 8, false, 1_000_000, 30_000),
                    () -> Math.max(0, budget - held.get()), page -> {
                        byte[] b = new byte[page.remaining()];
                        page.get(b);
                        got.add(b);
                        mostHeld.accumulateAndGet(held.addAndGet(b.length), Math::max);
                    });
            // The engine takes what was handed over every few milliseconds, and the pull goes on.
            var engine = java.util.concurrent.Executors.newSingleThreadScheduledExecutor();
            try {
                engine.scheduleWithFixedDelay(() -> {
                    held.set(0);
                    pull[0].resume();
                }, 0, 5, TimeUnit.MILLISECONDS);
                pull[0].done().get(30, TimeUnit.SECONDS);
            } finally {
                engine.shutdownNow();
            }
            assertEquals(pages, got.size());
            for (int i = 0; i < pages; i++) {
                byte[] want = new byte[size];
                java.util.Arrays.fill(want, (byte) i);
                assertEquals(ByteBuffer.wrap(want), ByteBuffer.wrap(got.get(i)), "page " + i);
            }
            assertTrue(mostHeld.get() <= budget + size, "held " + mostHeld.get() + " bytes on a credit of " + budget);
            assertTrue(pull[0].repliesPastListed() > 0, "the list was found wrong");
        }
    }

    /**
     * A reply that ends earlier than asked (a server's reply limit, here at token 10 only) while a
     * guess is in flight: the DATA asked next at the next page expected counts the guess's bytes
     * against the credit, so the server never sends more than the credit (plus one page) before
     * the engine takes anything. (Replies on loopback often complete their DATA inside the call
     * that sent it; the credit must be read again after each.)
     */
    @Test
    void theNextDataCountsTheGuessesInFlightAgainstTheCredit() throws Exception {
        int pages = 40;
        int size = 10;
        long credit = 300;
        java.util.concurrent.atomic.AtomicLong sent = new java.util.concurrent.atomic.AtomicLong();
        try (Server s = new Server((r, n) -> {
            BinReply h = okTo(r);
            long limit = r.pageToken == 10 ? 5 * size : r.maxSizeBytes;
            long end = r.pageToken;
            while (end < pages && (end == r.pageToken || (end - r.pageToken + 1) * size <= limit)) {
                end++;
            }
            ByteBuffer body = ByteBuffer.allocate((int) (end - r.pageToken) * size);
            long[] sizes = new long[(int) (end - r.pageToken)];
            for (int i = 0; i < sizes.length; i++) {
                sizes[i] = size;
                java.util.Arrays.fill(body.array(), i * size, (i + 1) * size, (byte) (r.pageToken + i));
            }
            if (sizes.length > 0) {
                h.segments.add(Segment.inline(r.pageToken, sizes));
            }
            h.pageNextToken = end;
            h.bufferComplete = end == pages;
            if (!h.bufferComplete) {
                h.followingSizes = new long[(int) Math.min(16, pages - end)];
                java.util.Arrays.fill(h.followingSizes, size);
            }
            sent.addAndGet(body.capacity());
            return new Frames.Frame(h.encode(), body);
        }); BinxConnection c = s.connect()) {
            java.util.concurrent.atomic.AtomicLong held = new java.util.concurrent.atomic.AtomicLong();
            java.util.concurrent.CountDownLatch full = new java.util.concurrent.CountDownLatch(1);
            List<byte[]> got = java.util.Collections.synchronizedList(new ArrayList<>());
            BufferPull pull = new BufferPull(() -> c, "t", 0, "", "", pages, (long) pages * size,
                    new BufferPull.Options(100, 2, false, 1_000_000, 30_000),
                    () -> Math.max(0, credit - held.get()), page -> {
                        byte[] b = new byte[page.remaining()];
                        page.get(b);
                        got.add(b);
                        if (held.addAndGet(b.length) >= credit) {
                            full.countDown();
                        }
                    });
            pull.resume();
            assertTrue(full.await(30, TimeUnit.SECONDS), "the credit was filled");
            assertTrue(sent.get() <= credit + size, "sent " + sent.get() + " bytes on a credit of " + credit);
            for (int i = 0; i < got.size(); i++) {
                byte[] want = new byte[size];
                java.util.Arrays.fill(want, (byte) i);
                assertEquals(ByteBuffer.wrap(want), ByteBuffer.wrap(got.get(i)), "page " + i);
            }
            pull.stop();
        }
    }

    /**
     * What the caller hands the pull may throw: a connection supplier that breaks its contract
     * (a RuntimeException, not a BinxException) is retried within the error budget and then
     * named; a page sink that throws fails the pull at once. Neither leaves it waiting for ever
     * on a DATA it thinks is in flight.
     */
    @Test
    @Timeout(60)
    void whatTheCallerThrowsFailsThePullInsteadOfFreezingIt() throws Exception {
        BufferPull broken = new BufferPull(() -> {
            throw new IllegalStateException("no connection for you");
        }, "t", 0, "", "", PAGES, -1, new BufferPull.Options(1 << 20, 2, false, 1_000_000, 300), () -> 1 << 20, page -> {});
        broken.resume();
        var e = assertThrows(ExecutionException.class, () -> broken.done().get(30, TimeUnit.SECONDS));
        assertTrue(e.getCause().getMessage().contains("no connection for you"), e.getCause().getMessage());

        try (Server s = new Server((r, n) -> honest(r)); BinxConnection c = s.connect()) {
            List<byte[]> got = new ArrayList<>();
            BufferPull p = new BufferPull(() -> c, "t", 0, "", "", PAGES, -1, BufferPull.Options.defaults(), () -> 1 << 20,
                    page -> {
                        if (got.size() == 3) {
                            throw new IllegalStateException("the engine's sink is full");
                        }
                        got.add(new byte[page.remaining()]);
                    });
            p.resume();
            var f = assertThrows(ExecutionException.class, () -> p.done().get(30, TimeUnit.SECONDS));
            assertTrue(f.getCause().getMessage().contains("the engine's sink is full"), f.getCause().getMessage());
            assertEquals(3, got.size());
        }
    }

    /** A read that must not acknowledge needs ack_token (1.2): a 1.1 server would free what it skips. */
    @Test
    @Timeout(60)
    void aReadThatMustNotAcknowledgeRefusesAnOlderServer() throws Exception {
        byte[] older = Frames.preface();
        older[5] = 1;
        AtomicInteger asked = new AtomicInteger();
        try (Server s = new Server((r, n) -> {
            asked.incrementAndGet();
            return honest(r);
        }, older)) {
            var e = assertThrows(ExecutionException.class, () -> pull(s, PAGES, BufferPull.Options.defaults()));
            assertTrue(e.getCause().getMessage().contains("needs 1.2"), e.getCause().getMessage());
            assertEquals(0, asked.get(), "no DATA went to it");
        }
    }

    /**
     * A committed buffer the local binxd does not have, whose producer's binxd named no address
     * to reach it at: no sidecar could serve it, so the read fails at once saying so, instead of
     * waiting out its error budget.
     */
    @Test
    void aCommittedBufferNoSidecarCanReachFailsAtOnceSayingWhy() throws Exception {
        AtomicInteger asked = new AtomicInteger();
        try (Server s = new Server((r, n) -> {
            asked.incrementAndGet();
            BinReply h = okTo(r);
            h.status = Status.NO_DATA.number();
            h.pageNextToken = r.pageToken;
            return new Frames.Frame(h.encode(), ByteBuffer.allocate(0));
        })) {
            var e = assertThrows(ExecutionException.class,
                    () -> pull(s, PAGES, new BufferPull.Options(2 << 20, 2, false, 1_000_000, 20_000)));
            String why = e.getCause().getMessage();
            assertTrue(why.contains("named no address to reach it at"), why);
            assertTrue(asked.get() <= 2, "asked " + asked.get() + " times");
        }
    }

    /**
     * Commits that no binxd would answer are refused with what is wrong, never taken as output
     * to read: here a buffer of no pages that claims bytes (a reader never reads it, so the bytes
     * would be lost unseen) and one whose byte count is past 2^63.
     */
    @ParameterizedTest
    @ValueSource(strings = {"no pages but 100 bytes", "past 2^63"})
    void commitsNoBinxdWouldAnswerAreRefusedWithWhatIsWrong(String lie) throws Exception {
        try (Server s = new Server((r, n) -> {
            BinReply h = okTo(r);
            h.committed = new BinReply.Committed();
            h.committed.node = "n1";
            h.committed.endpoint = "10.0.0.1:8091";
            h.committed.bufferCount = 2;
            h.committed.endTokens = lie.startsWith("no pages") ? new long[] {5, 0} : new long[] {5, 1};
            h.committed.bytes = lie.startsWith("no pages") ? new long[] {50, 100} : new long[] {50, -1};
            h.pageToken = 0;
            h.pageNextToken = 2;
            h.bufferComplete = true;
            return new Frames.Frame(h.encode(), ByteBuffer.allocate(0));
        })) {
            try (BinxConnection c = s.connect()) {
                var e = assertThrows(ExecutionException.class, () -> Tasks.committed(c, "t").get(30, TimeUnit.SECONDS));
                String why = e.getCause().getMessage();
                assertTrue(why.contains("binxd answered buffer 1") && why.contains(lie), why);
            }
        }
    }

    /**
     * Replies of another type than their request's (an honest DATA reply labelled ENQUEUE): the
     * connection fails as broken, so no page of them is handed over, and the read gives up
     * within its error budget, saying why.
     */
    @Test
    void aReplyOfAnotherTypeThanItsRequestIsNotBelieved() throws Exception {
        try (Server s = new Server((r, n) -> honestWith(r, h -> h.type = MessageType.ENQUEUE.number()))) {
            List<byte[]> handed = new ArrayList<>();
            var e = assertThrows(ExecutionException.class, () -> {
                try (BinxConnection c = s.connect()) {
                    BufferPull p = new BufferPull(() -> c, "t", 0, "", "", PAGES, -1,
                            new BufferPull.Options(2 << 20, 2, false, 1_000_000, 1_000), () -> 1 << 20,
                            page -> handed.add(new byte[page.remaining()]));
                    p.resume();
                    p.done().get(30, TimeUnit.SECONDS);
                }
            });
            String why = e.getCause().getMessage();
            assertTrue(why.contains("a reply of type 17") && why.contains("which is of type"), why);
            assertEquals(0, handed.size(), "no page of a mislabelled reply is handed over");
        }
    }

    /**
     * OKs with no page that do not end the buffer (binxd sends NO_DATA instead): each is a
     * failure that waits the backoff, so the read gives up within its error budget after a few
     * DATA, never asking again in a tight loop.
     */
    @ParameterizedTest
    @ValueSource(booleans = {false, true})
    void emptyRepliesThatDoNotEndTheBufferAreNotAskedAgainAtOnce(boolean emptySegment) throws Exception {
        AtomicInteger asked = new AtomicInteger();
        try (Server s = new Server((r, n) -> {
            if (r.type == MessageType.DATA.number()) {
                asked.incrementAndGet();
            }
            BinReply h = okTo(r);
            h.pageNextToken = r.pageToken;
            if (emptySegment) {
                // A segment that lists no page (a review found this form asked again at once,
                // without end, its error budget reset by every reply).
                h.segments.add(Segment.inline(r.pageToken));
            }
            return new Frames.Frame(h.encode(), ByteBuffer.allocate(0));
        })) {
            var e = assertThrows(ExecutionException.class, () -> pull(s, PAGES, new BufferPull.Options(2 << 20, 2, false, 1_000_000, 1_000)));
            assertTrue(e.getCause().getMessage().contains("an OK with no page"), e.getCause().getMessage());
            assertTrue(asked.get() < 100, asked.get() + " DATA in the 1 s budget");
        }
    }

    /**
     * Replies larger than their DATA asked for (two 3-byte pages to a DATA of at most 3 bytes),
     * or listing more than 8192 pages, are not held: the caller's credit counted what was asked.
     * One in three such costs requests, never a page; a server that always does it fails the
     * read within its error budget, saying why.
     */
    @Test
    void repliesLargerThanAskedAreDroppedAndAskedAgain() throws Exception {
        BufferPull.Options small = new BufferPull.Options(3, 2, false, 1_000_000, 1_000);
        AtomicInteger calls = new AtomicInteger();
        try (Server s = new Server((r, n) -> r.type == MessageType.DATA.number() && calls.incrementAndGet() % 3 == 1 ? upTo(r, 2) : honest(r))) {
            assertExact(pull(s, PAGES, small));
        }
        try (Server s = new Server((r, n) -> upTo(r, 2))) {
            var e = assertThrows(ExecutionException.class, () -> pull(s, PAGES, small));
            assertTrue(e.getCause().getMessage().contains("a reply of 6 bytes in 2 pages to a DATA that asked for at most 3"),
                    e.getCause().getMessage());
        }
        try (Server s = new Server((r, n) -> {
            BinReply h = okTo(r);
            h.segments.add(Segment.inline(r.pageToken, new long[8193]));
            h.pageNextToken = r.pageToken + 8193;
            return new Frames.Frame(h.encode(), ByteBuffer.allocate(0));
        })) {
            var e = assertThrows(ExecutionException.class, () -> pull(s, PAGES, small));
            assertTrue(e.getCause().getMessage().contains("lists 8193 pages, more than the 8192"), e.getCause().getMessage());
        }
    }

    /**
     * A HELLO the server never answers: the call fails at its deadline and the connection with
     * it, so the request holds no slot for good and a late reply reaches nobody.
     */
    @Test
    void aCallPastItsDeadlineFailsTheConnection() throws Exception {
        try (Server s = new Server((r, n) -> null); BinxConnection c = s.connect()) {
            var e = assertThrows(BinxConnectionException.class, () -> c.capabilities(300));
            assertTrue(e.getMessage().contains("no reply from binxd") && e.getMessage().contains("300 ms"), e.getMessage());
            assertTrue(!c.isOpen(), "the connection failed with its call");
            assertEquals(0, c.outstanding(), "no request is left outstanding");
        }
    }

    /**
     * Replies that start elsewhere than their DATA asked are dropped and asked again (contract
     * section 10): one such reply in three costs requests, never a page; a server that always
     * does it fails the read within its error budget, saying so.
     */
    @Test
    void repliesThatStartElsewhereAreDroppedAndAskedAgain() throws Exception {
        BiFunction<BinRequest, Integer, Frames.Frame> shifted = (r, n) -> honestWith(r, h -> h.pageToken += 1);
        try (Server s = new Server((r, n) -> n % 3 == 1 && r.type == MessageType.DATA.number() ? shifted.apply(r, n) : honest(r))) {
            assertExact(pull(s, PAGES, BufferPull.Options.defaults()));
        }
        try (Server s = new Server(shifted)) {
            var e = assertThrows(ExecutionException.class, () -> pull(s, PAGES, new BufferPull.Options(2 << 20, 2, false, 1_000_000, 1_000)));
            assertTrue(e.getCause().getMessage().contains("starts at token"), e.getCause().getMessage());
        }
    }

    @Test
    void longPollsShorterThanTenMillisecondsAreRefused() {
        var e = assertThrows(IllegalArgumentException.class, () -> new BufferPull.Options(1 << 20, 2, false, 0, 1_000));
        assertTrue(e.getMessage().contains("maxWaitMicros"), e.getMessage());
    }
}
