package io.binx.client;

import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.function.LongSupplier;
import java.util.function.Supplier;

/**
 * Reads one buffer from token 0 to its end with DATA requests, one or two in flight (pipelined
 * DATA, docs/PROTOCOL.md section 8), and hands each page, in token order, to a {@link PageSink}.
 *
 * <p>What it checks, so that no reply can skip, repeat or shorten a page: a reply is used only
 * when it starts at the next page expected; its segments must be inline, contiguous from that
 * token, and their sizes must add up to the body; its next token must follow its last page. A
 * reply to a DATA sent past the next page (a guess from {@code following_sizes}) that does not
 * line up is dropped and asked again; a refusal of one is dropped too. BUSY, TIMEOUT, NO_DATA
 * and broken connections are retried at the same token, which is exact. When the caller knows
 * where the buffer ends (from its commit), a buffer that completes anywhere else fails.
 *
 * <p>A committed buffer is never answered NO_DATA by a sidecar that has it: such a reply means
 * the sidecar lost the task (it restarted). Read locally, the pull then asks through the local
 * sidecar's forwarder at the producer's address, which fails over to the commit in storage
 * (PROTOCOL.md, "Failover"); forwarded already, NO_DATA counts against the error budget, so a
 * buffer nobody can serve fails the read instead of waiting forever.
 *
 * <p>With {@link Options#acknowledge} off, every DATA carries {@code ack_token} 0: nothing is
 * freed, so another reader (a retried task) can read the same pages again.
 */
public final class BufferPull {
    private static final ScheduledExecutorService RETRIES = DaemonThreads.scheduler("binx-pull-retries");
    /**
     * Where a retry runs once due: asking again may connect, which can wait for its deadline on
     * a stuck binxd, and must not hold up every other pull's retries on the timer's one thread.
     * A failure found before a request was sent is handled here too, never on the engine's
     * common pool.
     */
    private static final java.util.concurrent.ExecutorService RETRY_WORKERS = DaemonThreads.cached("binx-pull-retry");
    /** The most pages one reply may carry (docs/PROTOCOL.md section 8). */
    private static final int MAX_REPLY_PAGES = 8192;

    /** Receives the pages of a buffer, in order. Called under the pull's lock: must not block. */
    public interface PageSink {
        void page(ByteBuffer page);
    }

    /** How a pull asks. */
    public record Options(long maxReplyBytes, int depth, boolean acknowledge, long maxWaitMicros, long maxErrorMillis) {
        public Options {
            if (maxReplyBytes < 1 || depth < 1) {
                throw new IllegalArgumentException("maxReplyBytes and depth must be positive");
            }
            if (maxWaitMicros < MIN_WAIT_MICROS) {
                // An empty reply is asked again at once: a shorter long poll spins on a producer
                // with nothing new.
                throw new IllegalArgumentException("maxWaitMicros must be at least " + MIN_WAIT_MICROS + " (10 ms), not "
                        + maxWaitMicros);
            }
        }

        /** 2 MiB replies, two in flight, nothing acknowledged, 1 s long polls, 3 minutes of errors. */
        public static Options defaults() {
            return new Options(2 << 20, 2, false, 1_000_000, 180_000);
        }
    }

    /** Shortest long poll: see {@link Options}. */
    public static final long MIN_WAIT_MICROS = 10_000;

    private final Supplier<BinxConnection> connection;
    private final String taskId;
    private final long bufferId;
    private final String endpoint;
    private final long expectedEnd;
    private final long expectedBytes;
    private final Options options;
    private final PageSink sink;
    private final LongSupplier credit;
    private final CompletableFuture<Void> done = new CompletableFuture<>();
    private final Backoff backoff;

    /**
     * A DATA in flight: the reply size it asked for, and the bytes its reply holds by the
     * following_sizes it was sent on (-1 when they did not say where it ends).
     */
    private record Sent(long maxSize, long predicted) {}

    /** A good reply that came before the one ahead of it, and what its DATA was sent on. */
    private record Early(Response response, long predicted) {}

    // Guarded by `this`.
    private long expected;
    private long bytesRead;
    /** DATA in flight, by the token each asked for. */
    private final Map<Long, Sent> inFlight = new HashMap<>();
    /**
     * DATA in flight sent on a list a reply proved wrong: their replies are dropped. They stay in
     * {@link #inFlight} (so a token is never asked twice at once) until their replies come.
     */
    private final java.util.Set<Long> forgotten = new java.util.HashSet<>();
    /** Good replies that came before the one ahead of them, by their token. */
    private final Map<Long, Early> early = new HashMap<>();
    /** Sizes of the pages from {@code knownFrom} on, from the last reply's following_sizes. */
    private long knownFrom;
    private long[] known = new long[0];
    private boolean retryScheduled;
    private long repliesPastListed;
    /** Written without the lock by {@link #stop}. */
    private volatile boolean stopped;
    /**
     * "" (the local sidecar) or the producer's sidecar, through the local one's forwarder.
     * Written under the pull's lock; volatile so that {@link #describe} takes no lock.
     */
    private volatile String remote;
    /** DATA in flight that were sent past the next page (guesses). */
    private final java.util.Set<Long> guesses = new java.util.HashSet<>();

    /**
     * A pull of buffer {@code bufferId} of {@code taskId}, through {@code connection}; {@code
     * remote} names the sidecar that holds it ("" when it is the local one), and {@code endpoint}
     * that sidecar's address in any case ("" when unknown), asked through the local sidecar's
     * forwarder when a committed buffer read locally is lost. {@code expectedEnd}
     * and {@code expectedBytes} are where the buffer ends and its bytes when known, else -1.
     * {@code credit} says how many more bytes the caller can hold now; the pull sends nothing
     * while it is 0 and {@link #resume} is called when it grows.
     */
    public BufferPull(Supplier<BinxConnection> connection, String taskId, long bufferId, String remote, String endpoint,
            long expectedEnd, long expectedBytes, Options options, LongSupplier credit, PageSink sink) {
        this.connection = connection;
        this.taskId = taskId;
        this.bufferId = bufferId;
        this.remote = remote == null ? "" : remote;
        this.endpoint = endpoint == null ? "" : endpoint;
        this.expectedEnd = expectedEnd;
        this.expectedBytes = expectedBytes;
        this.options = options;
        this.credit = credit;
        this.sink = sink;
        this.backoff = new Backoff(10, 2_000, options.maxErrorMillis());
    }

    /** Completes when the buffer was read to its end; fails with what stopped it. */
    public CompletableFuture<Void> done() {
        return done;
    }

    public synchronized long pagesRead() {
        return expected;
    }

    /**
     * Replies that held more bytes than the following_sizes they were sent on said: a server
     * whose list was wrong (binxd's never is). Each cost budget, never a page.
     */
    public synchronized long repliesPastListed() {
        return repliesPastListed;
    }

    /**
     * What this pull reads, for messages. Takes no lock: a caller holding its own lock (a
     * source's) may ask while this pull, holding its lock, calls into that caller.
     */
    public String describe() {
        return "buffer " + Long.toUnsignedString(bufferId) + " of task " + taskId + (remote.isEmpty() ? "" : " at " + remote);
    }

    /** Starts, or goes on after the caller's credit grew. */
    public synchronized void resume() {
        safePump();
    }

    /** {@link #pump} from outside a reply: what throws fails the pull, as in {@link #onReply}. */
    private void safePump() {
        try {
            pump();
        } catch (RuntimeException e) {
            fail(new BinxException(describe() + ": asking for pages failed: " + e, e));
        }
    }

    /**
     * Stops asking; replies still in flight are dropped. Takes no lock, so a caller may hold its
     * own (or another pull's); {@link #done} fails on another thread.
     */
    public void stop() {
        stopped = true;
        if (!done.isDone()) {
            BinxException why = new BinxException("buffer " + Long.toUnsignedString(bufferId) + " of task " + taskId
                    + ": the read was stopped");
            RETRIES.execute(() -> done.completeExceptionally(why));
        }
    }

    private void pump() {
        if (stopped || done.isDone() || retryScheduled) {
            return;
        }
        long room = credit.getAsLong();
        if (!inFlight.containsKey(expected) && !early.containsKey(expected)) {
            if (room <= 0 && !inFlight.isEmpty()) {
                return;
            }
            if (room <= 0) {
                // Nothing in flight and no room: wait for resume().
                return;
            }
            // The room left once what is on its way is counted: DATA in flight (by the sizes
            // listed, else the size each asked for) and replies held until the ones ahead of them
            // come. With DATA in flight and no room left, their replies make it or free it.
            long left = room - committedBytes();
            if (left <= 0 && inFlight.size() > forgotten.size()) {
                return;
            }
            ask(expected, Math.min(options.maxReplyBytes(), Math.max(1, left)), false);
        }
        // Past the next page only on the word of following_sizes: a DATA whose end is known.
        while (inFlight.size() < options.depth()) {
            // Read again each time: a reply that came already completes its DATA inside ask(),
            // on this thread, and hands pages over, so the credit read above may be spent.
            room = credit.getAsLong();
            long furthest = -1;
            long furthestSize = 0;
            for (Map.Entry<Long, Sent> e : inFlight.entrySet()) {
                if (e.getKey() > furthest) {
                    furthest = e.getKey();
                    furthestSize = e.getValue().maxSize();
                }
            }
            if (furthest < 0) {
                return;
            }
            long end = endOf(furthest, furthestSize);
            if (end < 0 || inFlight.containsKey(end) || early.containsKey(end)) {
                return;
            }
            long bytesAhead = bytesBetween(expected, end);
            // A reply holds at least its first page, whatever size it asks: that page must fit
            // too (its size is known but where a reply ends at MAX_REPLY_PAGES).
            long firstPage = Math.max(1, bytesBetween(end, end + 1));
            if (bytesAhead < 0 || bytesAhead + firstPage > room) {
                return;
            }
            ask(end, Math.min(options.maxReplyBytes(), room - bytesAhead), true);
        }
    }

    /** Bytes the pull will hold beyond what the caller's credit counts: see {@link #pump}. */
    private long committedBytes() {
        long bytes = 0;
        for (Map.Entry<Long, Sent> e : inFlight.entrySet()) {
            if (!forgotten.contains(e.getKey())) {
                Sent sent = e.getValue();
                bytes += sent.predicted() >= 0 ? sent.predicted() : sent.maxSize();
            }
        }
        for (Early e : early.values()) {
            bytes += e.response().body().remaining();
        }
        return bytes;
    }

    /** Where a reply to DATA(token, size) ends, by the known sizes; -1 when they do not say. */
    private long endOf(long token, long size) {
        if (token < knownFrom) {
            return -1;
        }
        long i = token - knownFrom;
        long total = 0;
        long pages = 0;
        while (i < known.length && pages < MAX_REPLY_PAGES) {
            long s = known[(int) i];
            if (pages > 0 && total + s > size) {
                return token + pages;
            }
            total += s;
            pages++;
            i++;
        }
        // A reply carries at most MAX_REPLY_PAGES pages: one that reaches it ends there.
        return pages == MAX_REPLY_PAGES ? token + pages : -1;
    }

    private long bytesBetween(long from, long to) {
        long total = 0;
        for (long t = Math.max(from, knownFrom); t < to; t++) {
            long i = t - knownFrom;
            if (i >= known.length) {
                return -1;
            }
            total += known[(int) i];
        }
        return total;
    }

    private void ask(long token, long maxSize, boolean guess) {
        BinRequest r = new BinRequest(MessageType.DATA);
        r.taskId = taskId;
        r.bufferId = bufferId;
        r.pageToken = token;
        r.maxSizeBytes = maxSize;
        r.maxWaitMicros = options.maxWaitMicros();
        r.ackToken = options.acknowledge() ? expected : 0L;
        r.remote = remote;
        long end = endOf(token, maxSize);
        inFlight.put(token, new Sent(maxSize, end < 0 ? -1 : bytesBetween(token, end)));
        if (guess) {
            guesses.add(token);
        } else {
            guesses.remove(token);
        }
        BinxConnection c;
        try {
            c = connection.get();
        } catch (BinxException e) {
            CompletableFuture.runAsync(() -> onReply(token, r, null, e), RETRY_WORKERS);
            return;
        } catch (RuntimeException e) {
            // The supplier broke its contract (it should wrap what fails in a BinxException):
            // tried again like a failed connection, within the error budget, and named.
            BinxConnectionException why = new BinxConnectionException(describe() + ": getting a connection to binxd failed: " + e, e);
            CompletableFuture.runAsync(() -> onReply(token, r, null, why), RETRY_WORKERS);
            return;
        }
        if (!options.acknowledge() && c.serverMinor() < 2) {
            // Before 1.2 a DATA at T acknowledges every page below T: a read that must leave the
            // pages for a retried reader needs ack_token (docs/PROTOCOL.md section 10).
            BinxException why = new BinxException(describe() + ": binxd speaks BinX 1." + c.serverMinor()
                    + ", which acknowledges what a DATA skips; this read must not acknowledge and needs 1.2");
            CompletableFuture.runAsync(() -> {
                synchronized (this) {
                    inFlight.remove(token);
                    fail(why);
                }
            }, RETRY_WORKERS);
            return;
        }
        c.send(r).whenComplete((resp, err) -> onReply(token, r, resp, err));
    }

    private synchronized void onReply(long token, BinRequest r, Response resp, Throwable err) {
        try {
            handleReply(token, r, resp, err);
        } catch (RuntimeException e) {
            // Thrown by the caller's sink or credit, or a bug: the pull fails, never freezes with
            // a DATA it thinks is in flight.
            fail(new BinxException(describe() + ": handling the reply at token " + token + " failed: " + e, e));
        }
    }

    private void handleReply(long token, BinRequest r, Response resp, Throwable err) {
        Sent sent = inFlight.remove(token);
        boolean guess = guesses.remove(token);
        if (stopped || done.isDone()) {
            return;
        }
        if (forgotten.remove(token)) {
            // Sent on a list a larger reply proved wrong: its room was counted on that list.
            pump();
            return;
        }
        long predicted = sent == null ? -1 : sent.predicted();
        boolean ahead = token != expected;
        if (err == null && resp.header().status() == Status.OK && resp.header().pageToken != token) {
            // A reply that starts elsewhere than its DATA asked is dropped, and that token asked
            // again when it is next (docs/PROTOCOL.md section 10): at the next page, after the
            // backoff, so a server that keeps doing so is asked at its pace and the read gives up
            // within its error budget.
            if (guess) {
                known = new long[0];
            }
            if (ahead) {
                pump();
            } else {
                retry(r, "a reply to DATA at token " + token + " starts at token " + resp.header().pageToken);
            }
            return;
        }
        boolean failed = err != null || resp.header().status() != Status.OK;
        if (failed && guess) {
            // A guess that went wrong (docs/PROTOCOL.md section 8) is dropped and asked again only
            // when it is the next page; no more guesses until a good reply lists sizes again.
            known = new long[0];
            pump();
            return;
        }
        if (err != null || resp.header().status() == Status.BUSY || resp.header().status() == Status.TIMEOUT
                || resp.header().status() == Status.NO_DATA) {
            if (!ahead) {
                if (resp != null && resp.header().status() == Status.NO_DATA) {
                    noData(r);
                } else {
                    retry(r, err != null ? err.getMessage() : resp.header().status().name() + ": " + resp.header().error);
                }
            } else {
                pump();
            }
            return;
        }
        BinReply h = resp.header();
        if (h.status() != Status.OK) {
            if (ahead) {
                // A guess refused (docs/PROTOCOL.md section 8): dropped, asked again when next.
                pump();
            } else {
                fail(new BinxRefusedException(r, h));
            }
            return;
        }
        String oversized = sent == null ? null : oversized(h, sent.maxSize());
        if (oversized != null) {
            // More than the DATA asked for (docs/PROTOCOL.md section 4: pages while the total stays
            // within max_size_bytes, the first page alone if larger, at most 8192): not held, since
            // the caller's credit counted what was asked; asked again when next, so a server that
            // keeps doing so fails the read within its error budget.
            if (guess) {
                known = new long[0];
            }
            if (ahead) {
                pump();
            } else {
                retry(r, oversized);
            }
            return;
        }
        if (ahead) {
            if (token > expected) {
                early.put(token, new Early(resp, predicted));
            }
            pump();
            return;
        }
        if (pageCount(h) == 0 && !h.bufferComplete) {
            // binxd answers a DATA it has no page for with NO_DATA, or ends the buffer; an
            // OK without a page that does neither (no segment, or segments listing no page)
            // would be asked again at once, without end.
            retry(r, "an OK with no page that does not end the buffer");
            return;
        }
        backoff.success();
        if (!accept(r, resp, predicted)) {
            return;
        }
        Early next;
        while (!done.isDone() && (next = early.remove(expected)) != null) {
            if (!accept(r, next.response(), next.predicted())) {
                return;
            }
        }
        early.keySet().removeIf(t -> t < expected);
        pump();
    }

    /** Pages a reply lists, in every segment. */
    private static long pageCount(BinReply h) {
        long pages = 0;
        for (Segment s : h.segments) {
            pages += s.pageSizes.length;
        }
        return pages;
    }

    /**
     * Why a reply holds more than a DATA that asked for {@code maxSize} bytes may get: more than
     * 8192 pages, or more bytes than {@code maxSize} where no single page is that large (binxd
     * takes pages while the total stays within it, and the first page alone if it is larger);
     * null if it does not. Sizes that do not fit a long are left to {@link #accept}, which fails
     * them.
     */
    private static String oversized(BinReply h, long maxSize) {
        long pages = pageCount(h);
        if (pages > MAX_REPLY_PAGES) {
            return "a reply lists " + pages + " pages, more than the " + MAX_REPLY_PAGES + " a reply may hold";
        }
        long total = 0;
        long largest = 0;
        for (Segment s : h.segments) {
            for (long size : s.pageSizes) {
                if (size < 0) {
                    return null;
                }
                total = total + size < 0 ? Long.MAX_VALUE : total + size;
                largest = Math.max(largest, size);
            }
        }
        if (total > Math.max(maxSize, largest)) {
            return "a reply of " + total + " bytes in " + pages + " pages to a DATA that asked for at most " + maxSize;
        }
        return null;
    }

    /**
     * Checks a reply at the next page expected and hands over its pages; false if it failed.
     * {@code predicted} is what the list its DATA was sent on said the reply holds (-1: unknown).
     */
    private boolean accept(BinRequest r, Response resp, long predicted) {
        BinReply h = resp.header();
        ByteBuffer body = resp.body();
        if (h.pageToken != expected) {
            fail(new BinxException(describe() + ": a reply to DATA at token " + expected + " starts at token " + h.pageToken));
            return false;
        }
        long token = expected;
        long bodyLen = body.remaining();
        long total = 0;
        List<long[]> runs = new ArrayList<>();
        for (Segment s : h.segments) {
            if (!s.inline) {
                fail(new BinxException(describe() + ": a reply carries a spooled segment, which this client did not accept"));
                return false;
            }
            if (s.firstToken != token) {
                fail(new BinxException(describe() + ": a segment starts at token " + s.firstToken + " where token " + token + " was next"));
                return false;
            }
            long bytes = s.totalBytes();
            if (bytes < 0 || total + bytes > bodyLen) {
                fail(new BinxException(describe() + ": segment sizes exceed the reply's body of " + bodyLen + " bytes"));
                return false;
            }
            runs.add(s.pageSizes);
            token += s.pageSizes.length;
            total += bytes;
        }
        if (total != bodyLen) {
            fail(new BinxException(describe() + ": the pages' sizes add up to " + total + " bytes, the body has " + bodyLen));
            return false;
        }
        if (h.pageNextToken != token) {
            fail(new BinxException(describe() + ": a reply with pages up to token " + token + " says the next is " + h.pageNextToken));
            return false;
        }
        if (expectedEnd >= 0 && Long.compareUnsigned(token, expectedEnd) > 0) {
            fail(new BinxException(describe() + ": pages past token " + expectedEnd + ", where its commit says it ends"));
            return false;
        }
        if (predicted >= 0 && total > predicted) {
            // More than the listed sizes said (a wrong list, docs/PROTOCOL.md section 8): taken,
            // since its pages are right, but every DATA sent after it counted its room on the
            // same list, so their replies are dropped and those pages asked again within the room
            // left. Taking them too could hold several times the caller's credit.
            forgotten.addAll(inFlight.keySet());
            early.clear();
            repliesPastListed++;
        }
        int at = body.position();
        for (long[] sizes : runs) {
            for (long size : sizes) {
                ByteBuffer page = body.duplicate();
                page.position(at).limit(at + (int) size);
                sink.page(page.slice());
                at += (int) size;
            }
        }
        bytesRead += total;
        expected = token;
        knownFrom = token;
        known = h.followingSizes;
        if (h.bufferComplete) {
            if (expectedEnd >= 0 && expected != expectedEnd) {
                fail(new BinxException(describe() + ": it ended at token " + expected + ", but its commit says " + expectedEnd
                        + " pages: the read would be short"));
                return false;
            }
            if (expectedBytes >= 0 && bytesRead != expectedBytes) {
                fail(new BinxException(describe() + ": its " + expected + " pages hold " + bytesRead + " bytes, its commit says " + expectedBytes));
                return false;
            }
            done.complete(null);
        }
        return true;
    }

    /** NO_DATA at the next page. */
    private void noData(BinRequest r) {
        if (expectedEnd < 0) {
            // A long poll that ended empty: ask again at once.
            pump();
            return;
        }
        // A committed buffer: whoever answered does not have the task.
        if (remote.isEmpty() && !endpoint.isEmpty()) {
            remote = endpoint;
            pump();
            return;
        }
        if (remote.isEmpty()) {
            // Its producer's binxd named no address other sidecars reach it at: no sidecar but
            // that one can serve it, and the one asked does not have it. Waiting would not help.
            fail(new BinxException(BinxException.describe(r) + ": the local binxd does not have this committed buffer, and its"
                    + " producer's binxd named no address to reach it at (no TCP listener or advertise_address): it can be read"
                    + " only on the producer's own node"));
            return;
        }
        retry(r, "NO_DATA for a committed buffer (the sidecar that holds it lost it; waiting for failover to storage)");
    }

    private void retry(BinRequest r, String why) {
        long delay = backoff.failure();
        if (delay < 0) {
            fail(new BinxException(BinxException.describe(r) + ": gave up after " + backoff.failingForMillis() + " ms: " + why));
            return;
        }
        retryScheduled = true;
        Runnable again = () -> {
            synchronized (this) {
                retryScheduled = false;
                safePump();
            }
        };
        RETRIES.schedule(() -> {
            try {
                RETRY_WORKERS.execute(again);
            } catch (java.util.concurrent.RejectedExecutionException e) {
                again.run();
            }
        }, delay, TimeUnit.MILLISECONDS);
    }

    private void fail(BinxException why) {
        stopped = true;
        done.completeExceptionally(why);
    }
}
