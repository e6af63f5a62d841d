package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.util.List;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * The writer against servers that do not keep the numbered-append contract (docs/PROTOCOL.md
 * section 9): one that does not advertise it, one that holds pages the writer never sent, one
 * that lost pages it had confirmed, one that answers at other tokens. The writer fails its
 * finish at once with a reason; it never finishes a task whose buffers are not its own pages.
 */
class LyingWriterServerTest {
    /** An OK reply to {@code r} carrying its token, as binxd's every reply to a numbered request does. */
    static BinReply ok(BinRequest r) {
        BinReply h = new BinReply();
        h.requestId = r.requestId;
        h.type = r.type;
        h.status = Status.OK.number();
        if (r.appendToken != null) {
            h.pageToken = r.appendToken;
            h.pageNextToken = r.appendToken + r.pageSizes.length;
        }
        return h;
    }

    static Frames.Frame frame(BinReply h) {
        return new Frames.Frame(h.encode(), ByteBuffer.allocate(0));
    }

    /**
     * A server that says HELLO with {@code capabilities}, takes OPEN_TASK, NO_MORE_PAGES and
     * ABORT_TASK, and answers the n-th ENQUEUE (from 0) with {@code enqueue}.
     */
    static HostileServerTest.Server server(List<String> capabilities, AtomicInteger enqueues, AtomicInteger aborts,
            java.util.function.BiFunction<BinRequest, Integer, BinReply> enqueue) throws Exception {
        return new HostileServerTest.Server((r, n) -> {
            MessageType type = MessageType.of(r.type);
            if (type == MessageType.HELLO) {
                BinReply h = ok(r);
                h.capabilities.addAll(capabilities);
                return frame(h);
            }
            if (type == MessageType.ENQUEUE) {
                return frame(enqueue.apply(r, enqueues.getAndIncrement()));
            }
            if (type == MessageType.ABORT_TASK) {
                aborts.incrementAndGet();
            }
            return frame(ok(r));
        });
    }

    /** Writes 4 pages to buffer 0 in batches of 2, and returns why finish failed. */
    static String finishFailure(HostileServerTest.Server s) {
        TaskWriter writer = new TaskWriter(s::connect, "t.lying", 1, "commit",
                new TaskWriter.Options(1 << 20, 2, 1 << 20, 1_000_000, 60_000));
        for (int i = 0; i < 4; i++) {
            // Not asserted taken: the writer connects in the background, and a failure it learns
            // first (a HELLO without a capability it needs, a lying OK) makes it ignore later adds.
            writer.add(0, ByteBuffer.wrap(HostileServerTest.pageBytes(i)));
        }
        // Well inside the 60 s error budget: these fail at once, never by retrying until it is spent.
        var e = assertThrows(ExecutionException.class, () -> writer.finish().get(30, TimeUnit.SECONDS));
        return e.getCause().getMessage();
    }

    static final List<String> HONEST = List.of("append-token", "instance=00000000000000bb");

    @Test
    @Timeout(60)
    void aServerThatDoesNotNumberAppendsGetsNoPage() throws Exception {
        for (List<String> caps : List.of(List.of("instance=00000000000000bb"), List.of("append-token"))) {
            AtomicInteger enqueues = new AtomicInteger();
            AtomicInteger aborts = new AtomicInteger();
            try (var s = server(caps, enqueues, aborts, (r, n) -> ok(r))) {
                String why = finishFailure(s);
                String missing = caps.contains("append-token") ? "instance=" : "append-token";
                assertTrue(why.contains("t.lying") && why.contains("`" + missing + "`"), why);
                assertEquals(0, enqueues.get(), "no ENQUEUE went to it");
            }
        }
    }

    /**
     * Why finish failed against a server that refuses the ENQUEUEs {@code refused} picks (the
     * n-th, from 0) for the token, saying the buffer continues at {@code next}.
     */
    static String refusedAt(long next, java.util.function.BiPredicate<BinRequest, Integer> refused) throws Exception {
        try (var s = server(HONEST, new AtomicInteger(), new AtomicInteger(), (r, n) -> {
            BinReply h = ok(r);
            if (refused.test(r, n)) {
                h.status = Status.BAD_REQUEST.number();
                h.pageNextToken = next;
                h.error = "append_token " + r.appendToken + ", buffer at " + next;
            }
            return h;
        })) {
            return finishFailure(s);
        }
    }

    @Test
    @Timeout(60)
    void pagesTheWriterNeverSentFailItsFinish() throws Exception {
        // The first ENQUEUE (tokens 0..2) is refused as if tokens 0..5 were there already.
        String why = refusedAt(5, (r, n) -> n == 0);
        assertTrue(why.contains("continues at token 5") && why.contains("another writer"), why);
    }

    @Test
    @Timeout(60)
    void aServerThatLostConfirmedPagesFailsTheFinishAtOnce() throws Exception {
        // Pages 0..2 are confirmed; then the server says the buffer is back at 0.
        String why = refusedAt(0, (r, n) -> r.appendToken != null && r.appendToken > 0);
        assertTrue(why.contains("continues at token 0") && why.contains("lost some"), why);
    }

    @Test
    @Timeout(60)
    void anOkAtAnotherTokenFailsTheFinish() throws Exception {
        String why = finishFailureWhenOkSays(h -> h.pageToken = 7);
        assertTrue(why.contains("OK for tokens 7.."), why);
    }

    /**
     * An OK at the batch's token that says more (or fewer) pages were applied than it carried.
     * Either batch's lie may be the one named: replies are handled on the client's callback
     * pool, so the second batch's may be handled first (CI saw "2..5, not 2..4").
     */
    @Test
    @Timeout(60)
    void anOkForAnotherNumberOfPagesFailsTheFinish() throws Exception {
        String why = finishFailureWhenOkSays(h -> h.pageNextToken += 1);
        assertTrue(why.contains("OK for tokens 0..3, not 0..2") || why.contains("OK for tokens 2..5, not 2..4"), why);
    }

    /** Why the finish fails when every ENQUEUE's OK is altered by {@code lie}. */
    private static String finishFailureWhenOkSays(java.util.function.Consumer<BinReply> lie) throws Exception {
        try (var s = server(HONEST, new AtomicInteger(), new AtomicInteger(), (r, n) -> {
            BinReply h = ok(r);
            lie.accept(h);
            return h;
        })) {
            return finishFailure(s);
        }
    }

    /** The same writer against an honest server of the same shape finishes: the checks above are not what fails. */
    @Test
    @Timeout(60)
    void anHonestServerTakesEveryPage() throws Exception {
        AtomicInteger enqueues = new AtomicInteger();
        AtomicInteger aborts = new AtomicInteger();
        try (var s = server(HONEST, enqueues, aborts, (r, n) -> ok(r))) {
            TaskWriter writer = new TaskWriter(s::connect, "t.honest", 1, "commit",
                    new TaskWriter.Options(1 << 20, 2, 1 << 20, 1_000_000, 60_000));
            for (int i = 0; i < 4; i++) {
                assertTrue(writer.add(0, ByteBuffer.wrap(HostileServerTest.pageBytes(i))));
            }
            writer.finish().get(30, TimeUnit.SECONDS);
            assertEquals(2, enqueues.get());
            assertEquals(0, aborts.get());
        }
    }

}
