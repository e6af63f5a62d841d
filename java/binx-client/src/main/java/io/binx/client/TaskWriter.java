package io.binx.client;

import java.nio.ByteBuffer;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Optional;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.function.Supplier;

/**
 * Writes one task's pages into the local binxd: OPEN_TASK, pipelined ENQUEUEs with numbered
 * appends, NO_MORE_PAGES; or ABORT_TASK. Thread-safe: {@link #add} may be called from many
 * threads, and never throws; a failure is kept and fails {@link #finish}.
 *
 * <p>Exactness (docs/PROTOCOL.md section 9): every page of a buffer gets its token here, in the
 * order {@code add} was called for that buffer, and every ENQUEUE names the token of its first
 * page. An ENQUEUE refused with BUSY, or refused because an earlier one of its buffer was not
 * applied, is sent again (with every later one of its buffer, in order) once none of its buffer
 * is in flight; one refused because its tokens are taken was applied before (its reply was
 * lost). After a broken connection every ENQUEUE without a reply is sent again on a new one:
 * exactly one copy of each is applied. NO_MORE_PAGES goes only after every ENQUEUE was
 * answered OK, and its OK means what the task's spool policy makes durable is in storage.
 *
 * <p>Memory: the pages added and not yet confirmed, each its bytes and {@link #PAGE_OVERHEAD},
 * at most {@link Options#maxBufferedBytes} (plus one batch); {@link #whenRoom} tells the
 * caller when to add more. {@link #add} never waits on binxd: ENQUEUEs in flight stay below
 * the connection's request limit, and batches past it wait in the writer, each buffer's in
 * order, until replies free slots.
 */
public final class TaskWriter {
    private static final ScheduledExecutorService RETRIES = DaemonThreads.scheduler("binx-task-writer-retries");
    /** NO_MORE_PAGES for every buffer of a task. */
    public static final long ALL_BUFFERS = -1L;
    /**
     * What a held page costs besides its bytes (its buffer object and its slot in a batch),
     * counted in {@link #bufferedBytes} and against {@link Options#maxBufferedBytes}: empty or
     * tiny pages fill the writer too, so a caller adding them waits for room like any other.
     */
    public static final long PAGE_OVERHEAD = 64;
    /**
     * Connects, with the HELLO, outside the writer's lock: a binxd that is slow to answer (or
     * stopped: a connect waits up to its deadline) must not hold the engine's threads that add
     * pages or ask for the writer's memory. A connect blocks its thread, so these are many.
     */
    private static final java.util.concurrent.ExecutorService CONNECTS = DaemonThreads.cached("binx-task-writer-connect");
    /**
     * Runs what callers attached to {@link #whenRoom} and {@link #finish}: the writer completes
     * those futures under its lock, and a caller's callback run there could wait on a thread that
     * waits for that lock (an engine's lock taken before it adds a page), a deadlock.
     */
    private static final java.util.concurrent.ExecutorService CALLERS = DaemonThreads.cached("binx-task-writer-callers");
    /**
     * The HELLO on each new connection: a local binxd that cannot answer it in this is broken
     * (the connection is retried as a broken one).
     */
    private static final long HELLO_TIMEOUT_MILLIS = 5_000;
    /** The HELLO capability of numbered ENQUEUE and NO_MORE_PAGES. */
    private static final String APPEND_TOKEN = "append-token";
    /** The HELLO capability {@code max-pages-per-buffer=<n>}: the pages binxd holds in one buffer. */
    private static final String MAX_PAGES_PER_BUFFER = "max-pages-per-buffer";
    /**
     * The HELLO capability {@code max-enqueue-bytes=<n>}: an ENQUEUE whose bytes, with {@link
     * #ENQUEUE_PAGE_COST} a page, are at most n is never refused as one that can never fit
     * binxd's memory limit; a larger one may be, though each of its pages would fit.
     */
    private static final String MAX_ENQUEUE_BYTES = "max-enqueue-bytes";
    /** The HELLO capability {@code max-pages-per-enqueue=<n>}: binxd refuses an ENQUEUE of more pages. */
    private static final String MAX_PAGES_PER_ENQUEUE = "max-pages-per-enqueue";
    /** The HELLO capability {@code max-frame-bytes=<n>}: a longer frame closes the connection. */
    private static final String MAX_FRAME_BYTES = "max-frame-bytes";
    /** Beside the pages, at most: an ENQUEUE's header and its length field, without the task id and page sizes. */
    private static final long ENQUEUE_FRAME_BASE = 256;
    /** A page's size in an ENQUEUE's header, at most (a varint). */
    private static final long ENQUEUE_FRAME_PER_PAGE = 10;
    /** What a page counts against {@code max-enqueue-bytes=} besides its bytes (binxd's index entry for it). */
    static final long ENQUEUE_PAGE_COST = 128;
    /** How long an abort is tried for; binxd frees a task it never heard of by its own rules. */
    private static final long ABORT_MAX_ERROR_MILLIS = 60_000;
    /**
     * Request slots of a connection left to what is not an ENQUEUE (OPEN_TASK, NO_MORE_PAGES,
     * ABORT_TASK, PING): ENQUEUEs in flight stay below the connection's limit by this many, and
     * a batch past that waits in the writer, so {@link #add} never waits for a slot (the
     * engine's threads call it; its back-pressure is {@link #whenRoom}).
     */
    private static final int SLOTS_FOR_OTHERS = 16;

    /**
     * How a writer batches and bounds what it holds. {@code readAfterFinish}: no consumer reads
     * (so acknowledges) a page of the task before its finish, as under Trino's fault-tolerant
     * execution (whose readers, this project's plugin, never acknowledge at all); a buffer past
     * the pages its binxd holds ({@code max-pages-per-buffer=} in the
     * HELLO reply) can then never get room, and the writer fails at once, saying so, instead of
     * retrying BUSY replies for {@code maxErrorMillis}.
     */
    public record Options(int maxBatchBytes, int maxBatchPages, long maxBufferedBytes, long enqueueWaitMicros, long maxErrorMillis,
            boolean readAfterFinish) {
        public Options {
            if (maxBatchBytes < 1 || maxBatchPages < 1 || maxBufferedBytes < 1) {
                throw new IllegalArgumentException("batch and buffer limits must be positive");
            }
        }

        /** Options of a task whose consumers may read while it writes. */
        public Options(int maxBatchBytes, int maxBatchPages, long maxBufferedBytes, long enqueueWaitMicros, long maxErrorMillis) {
            this(maxBatchBytes, maxBatchPages, maxBufferedBytes, enqueueWaitMicros, maxErrorMillis, false);
        }

        /** These options for a task no consumer reads before its finish. */
        public Options withReadAfterFinish() {
            return new Options(maxBatchBytes, maxBatchPages, maxBufferedBytes, enqueueWaitMicros, maxErrorMillis, true);
        }

        /** 1 MiB batches of at most 4096 pages, 32 MiB held, 1 s waits for room, 3 minutes of errors. */
        public static Options defaults() {
            return new Options(1 << 20, 4096, 32L << 20, 1_000_000, 180_000);
        }
    }

    private final ConnectionSource connector;
    private final String taskId;
    private final int bufferCount;
    private final String spoolPolicy;
    private final Options options;
    private final Buffer[] buffers;
    private final Backoff backoff;

    // Everything below is guarded by `this`.
    private BinxConnection connection;
    /** A connect is under way on {@link #CONNECTS}, since {@link #connectStartedNanos}. */
    private boolean connecting;
    private long connectStartedNanos;
    /** Connects started; every one after the first waits the writer's backoff, and counts. */
    private long connectsStarted;
    /**
     * The broken connection whose resends the backoff last counted, and the delay it gave:
     * one break is one failure, however many buffers it cut (counted per buffer, a break
     * with hundreds in flight pushed every resend to the backoff's 2 s ceiling).
     */
    private BinxConnection breakCounted;
    private long breakDelay;
    /** Failures the backoff was told of, over the writer's life (for tests). */
    private int failuresCounted;
    /** Buffers whose next batch found no connection: resent when one is made. */
    private final ArrayDeque<Buffer> parked = new ArrayDeque<>();
    /** NO_MORE_PAGES found no connection: sent when one is made. */
    private boolean finishParked;
    /** Why the last connect failed (named in the errors of requests that found no connection). */
    private BinxException lastConnectFailure;
    /** An ABORT_TASK is being sent (a connection is still wanted for it). */
    private boolean abortPending;
    /** The HELLO {@code instance=} of the binxd behind {@link #connection} ("" when it does not say). */
    private String connectionInstance = "";
    /**
     * The pages the binxd behind {@link #connection} holds in one buffer (its HELLO's
     * {@code max-pages-per-buffer=}; no limit known until one said it).
     */
    private long maxPagesPerBuffer = Long.MAX_VALUE;
    /**
     * binxd's {@code max-enqueue-bytes=} once a HELLO said it (kept across reconnects until
     * another says): a batch's bytes, with {@link #ENQUEUE_PAGE_COST} a page, stay within it.
     */
    private long daemonEnqueueBytes = Long.MAX_VALUE;
    /** binxd's {@code max-pages-per-enqueue=} once a HELLO said it (kept as {@link #daemonEnqueueBytes} is). */
    private long daemonEnqueuePages = Long.MAX_VALUE;
    /** binxd's {@code max-frame-bytes=} once a HELLO said it (kept as {@link #daemonEnqueueBytes} is). */
    private long daemonFrameBytes = Long.MAX_VALUE;
    /** The task id's UTF-8 bytes, in every ENQUEUE's header. */
    private final int taskIdBytes;
    /**
     * The instance that confirmed this writer's pages (null before any was): a binxd that
     * restarted lost them, and the task can never finish whole.
     */
    private String confirmedBy;
    private boolean opened;
    /** Connections put to use (a second one means the first broke, or binxd closed it). */
    private int connectionsUsed;
    /** Each buffer with pages was checked at its count on the current connection ({@link #sendBufferEnds}). */
    private boolean endsChecked;
    /** The finish's tries: replies to an earlier one's requests are stale. */
    private int finishRound;
    private long buffered;
    private CompletableFuture<Void> room;
    /** What callers of {@link #whenRoom} are given of {@link #room}: one view each time it is made. */
    private CompletableFuture<Void> roomView;
    /** What the pages in open batches count in {@link #buffered}. */
    private long openHeld;
    private long batchesSealed;
    private BinxException failure;
    private boolean finishing;
    private boolean aborted;
    private boolean finishSent;
    private CompletableFuture<Void> finished;
    /** Buffers that may have an open batch (each once). */
    private final ArrayDeque<Buffer> withOpen = new ArrayDeque<>();
    /** ENQUEUEs in flight, of every buffer. */
    private int inFlight;
    /**
     * Batches that found the writer's ENQUEUEs in flight at the connection's limit (less
     * {@link #SLOTS_FOR_OTHERS}), in the order they were to go: sent as replies come.
     */
    private final ArrayDeque<Batch> waitingForSlot = new ArrayDeque<>();

    private static final class Buffer {
        final int id;
        long nextToken;
        final List<ByteBuffer> open = new ArrayList<>();
        long openBytes;
        final ArrayDeque<Batch> unconfirmed = new ArrayDeque<>();
        int inFlight;
        boolean resync;
        boolean resendScheduled;
        /**
         * After a resync only the first unconfirmed batch is sent; its reply says how far the
         * buffer got (a batch applied before is refused with the buffer's next token, which
         * confirms every batch below it), and the rest follows. Resending everything at once
         * could resend, on a link that keeps breaking, only what was applied already.
         */
        boolean probing;
        /** In {@link #withOpen}. */
        boolean listed;
        /** In {@link #parked}. */
        boolean parked;
        /** Its batches in {@link #waitingForSlot}. */
        int waiting;
        /** The connection its last ENQUEUE went on. */
        BinxConnection sentOn;

        Buffer(int id) {
            this.id = id;
        }
    }

    private static final class Batch {
        final Buffer buffer;
        final long firstToken;
        final ByteBuffer[] pages;
        final long bytes;
        boolean inFlight;
        boolean done;
        /** Times sent: a batch sent once cannot have been applied before. */
        int sends;
        /** In {@link #waitingForSlot}. */
        boolean waiting;

        Batch(Buffer buffer, long firstToken, ByteBuffer[] pages, long bytes) {
            this.buffer = buffer;
            this.firstToken = firstToken;
            this.pages = pages;
            this.bytes = bytes;
        }
    }

    /**
     * A writer of task {@code taskId} with {@code bufferCount} PARTITIONED buffers; OPEN_TASK is
     * sent once connected (the connect starts at once, on a thread of its own; what is added
     * meanwhile waits for it, parked). {@code connector} opens a connection to the local binxd (again after one
     * breaks); the writer uses its connections alone, since binxd keeps each connection's ENQUEUEs
     * in order and one waiting for room would hold back another task's. When {@code connector} is
     * a {@link ConnectionSource} (a pool), the connection that committed the task is given back
     * to it (every request answered, the task no longer the connection's) for the next writer;
     * one that broke, or an abort's, is closed.
     */
    public TaskWriter(Supplier<BinxConnection> connector, String taskId, int bufferCount, String spoolPolicy, Options options) {
        if (bufferCount < 1) {
            throw new IllegalArgumentException("task " + taskId + " needs at least one buffer");
        }
        this.connector = ConnectionSource.of(connector);
        this.taskId = taskId;
        this.taskIdBytes = taskId.getBytes(java.nio.charset.StandardCharsets.UTF_8).length;
        this.bufferCount = bufferCount;
        this.spoolPolicy = spoolPolicy == null ? "" : spoolPolicy;
        this.options = options;
        this.backoff = new Backoff(10, 2_000, options.maxErrorMillis());
        this.buffers = new Buffer[bufferCount];
        for (int i = 0; i < bufferCount; i++) {
            buffers[i] = new Buffer(i);
        }
        // The connect starts now, in the background; the first requests wait for it parked.
        connection();
    }

    public String taskId() {
        return taskId;
    }

    /**
     * Adds one page to {@code buffer}, in the order of calls for that buffer; takes ownership of
     * {@code page}. Ignored after {@link #abort}, a failure (which {@link #finish} reports) or a
     * finish that succeeded (the task's output is what binxd committed, and a late page must not
     * undo it); a page added while the finish is under way fails it (the output would lack it).
     *
     * @return whether the page was taken (false when it was ignored, or failed the writer)
     */
    public synchronized boolean add(int buffer, ByteBuffer page) {
        if (notTaking(buffer)) {
            return false;
        }
        if (buffer < 0 || buffer >= bufferCount) {
            fail(new BinxException("task " + taskId + ": buffer " + buffer + " is not one of its " + bufferCount));
            return false;
        }
        Buffer b = buffers[buffer];
        if (options.readAfterFinish() && pagesOf(b) >= maxPagesPerBuffer) {
            fail(pastPageLimit(b, pagesOf(b) + 1));
            return false;
        }
        int size = page.remaining();
        if (!inAFrame(size)) {
            fail(pagePastFrame(b, size));
            return false;
        }
        if (!b.open.isEmpty() && !withinOneEnqueue(b.open.size() + 1, b.openBytes + size)) {
            seal(b);
            // Sending what was sealed may have failed the writer; or a reply handled inline, on
            // this thread, completed a future whose caller finished the writer meanwhile.
            if (notTaking(buffer)) {
                return false;
            }
        }
        b.open.add(page);
        b.openBytes += size;
        buffered += size + PAGE_OVERHEAD;
        openHeld += size + PAGE_OVERHEAD;
        if (!b.listed) {
            b.listed = true;
            withOpen.add(b);
        }
        if (b.openBytes >= options.maxBatchBytes() || b.open.size() >= Math.min(options.maxBatchPages(), daemonEnqueuePages)
                || b.openBytes + b.open.size() * ENQUEUE_PAGE_COST >= daemonEnqueueBytes
                || b.openBytes + frameOverhead(b.open.size() + 1) >= daemonFrameBytes) {
            // Full: no page more would fit it.
            seal(b);
        }
        if (buffered > options.maxBufferedBytes()) {
            // Over the limit: what is held must be able to drain while the caller waits for
            // room. When consumers read only once the task finished, open batches may keep at
            // most half the limit (once what was sent is confirmed, the writer is below it);
            // when they read meanwhile, every page goes now: a consumer may wait for a page of
            // one buffer before it reads the others, whose ENQUEUEs wait for it.
            if (!options.readAfterFinish()) {
                sealAll();
            } else if (openHeld > options.maxBufferedBytes() / 2) {
                sealLargest(options.maxBufferedBytes() / 4);
            }
            // Replies may have come already (and confirmed what they could).
            if (room == null && buffered > options.maxBufferedBytes() && !aborted && failure == null) {
                room = new CompletableFuture<>();
                roomView = outsideTheLock(room);
            }
        }
        // False when sending failed the writer (its abort dropped the page).
        return !aborted && failure == null;
    }

    /**
     * Whether a page for {@code buffer} is not taken now: after an abort, a failure or a finish
     * (a page added while the finish is under way fails it: the output would lack it).
     */
    private boolean notTaking(int buffer) {
        if (aborted || failure != null || finishing) {
            if (finishing && !aborted && failure == null && !finishedWell()) {
                fail(new BinxException("task " + taskId + ": a page was added to buffer " + buffer + " after finish"));
            }
            return true;
        }
        return false;
    }

    /** Whether a connection is in use (its HELLO answered): for tests. */
    synchronized boolean connected() {
        return connection != null;
    }

    /**
     * Whether {@code pages} pages of {@code bytes} bytes go in one ENQUEUE: within this writer's
     * batch limits, and what binxd said it takes ({@code max-pages-per-enqueue=}, {@code
     * max-enqueue-bytes=} counting {@link #ENQUEUE_PAGE_COST} a page, and {@code
     * max-frame-bytes=} counting the header {@link #frameOverhead} bounds).
     */
    private boolean withinOneEnqueue(long pages, long bytes) {
        return bytes <= options.maxBatchBytes() && pages <= options.maxBatchPages() && pages <= daemonEnqueuePages
                && bytes + pages * ENQUEUE_PAGE_COST <= daemonEnqueueBytes && bytes + frameOverhead(pages) <= daemonFrameBytes;
    }

    /** What an ENQUEUE of {@code pages} pages holds in its frame beside their bytes, at most. */
    private long frameOverhead(long pages) {
        return ENQUEUE_FRAME_BASE + taskIdBytes + ENQUEUE_FRAME_PER_PAGE * pages;
    }

    /** Whether a page of {@code size} bytes goes in a frame binxd reads (alone). */
    private boolean inAFrame(long size) {
        return size + frameOverhead(1) <= daemonFrameBytes;
    }

    private BinxException pagePastFrame(Buffer b, long size) {
        return new BinxException("task " + taskId + ": a page of " + size + " bytes for buffer " + b.id
                + " does not fit a frame its binxd reads (max-frame-bytes=" + daemonFrameBytes
                + " in its HELLO, binxd's max_frame_size): raise max_frame_size, or write smaller pages");
    }

    /** A page added before binxd said its frame limit, not sent yet, that no frame carries; null when none. */
    private BinxException unsentPagePastFrame() {
        for (Buffer b : buffers) {
            for (ByteBuffer page : b.open) {
                if (!inAFrame(page.remaining())) {
                    return pagePastFrame(b, page.remaining());
                }
            }
            for (Batch batch : b.unconfirmed) {
                if (batch.sends > 0) {
                    continue;
                }
                for (ByteBuffer page : batch.pages) {
                    if (!inAFrame(page.remaining())) {
                        return pagePastFrame(b, page.remaining());
                    }
                }
            }
        }
        return null;
    }

    /**
     * {@code pages}, from token {@code firstToken} of {@code b}, in batches that each go in one
     * ENQUEUE ({@link #withinOneEnqueue}; a page too large for any goes alone, and binxd's refusal
     * of it fails the writer with its reason), in order.
     */
    private List<Batch> cut(Buffer b, long firstToken, ByteBuffer[] pages) {
        List<Batch> batches = new ArrayList<>(1);
        int start = 0;
        long bytes = 0;
        for (int i = 0; i <= pages.length; i++) {
            long size = i < pages.length ? pages[i].remaining() : 0;
            if (i == pages.length || (i > start && !withinOneEnqueue(i - start + 1, bytes + size))) {
                if (i > start) {
                    batches.add(new Batch(b, firstToken + start, Arrays.copyOfRange(pages, start, i), bytes));
                }
                start = i;
                bytes = 0;
            }
            bytes += size;
        }
        return batches;
    }

    /**
     * Cuts the batches sealed before binxd said what one ENQUEUE takes (pages added while the
     * writer connected), and never sent, to fit it: sent as they were made, a batch past it would
     * be refused and fail the writer. Their tokens stay the same, so what follows them does too.
     * A batch sent before is left as it is: binxd may hold its pages, and a part of it sent again
     * would be taken for another writer's.
     */
    private void cutUnsentToFit() {
        // At the first HELLO nothing was sent, nor waits for a slot (a send without a connection
        // parks its buffer): every batch is cut as needed. At a later one, to a binxd with
        // smaller limits that confirmed nothing of this writer (else it failed as restarted),
        // batches sent before or queued go as they are, and may be refused.
        for (Buffer b : buffers) {
            List<Batch> kept = new ArrayList<>(b.unconfirmed.size());
            boolean cutAny = false;
            for (Batch batch : b.unconfirmed) {
                if (batch.sends == 0 && !batch.inFlight && !batch.waiting && !batch.done
                        && !withinOneEnqueue(batch.pages.length, batch.bytes)) {
                    List<Batch> pieces = cut(b, batch.firstToken, batch.pages);
                    batchesSealed += pieces.size() - 1;
                    kept.addAll(pieces);
                    cutAny = true;
                } else {
                    kept.add(batch);
                }
            }
            if (cutAny) {
                b.unconfirmed.clear();
                b.unconfirmed.addAll(kept);
            }
        }
    }

    /** Pages added to {@code b}: sealed into batches, and in its open one. */
    private static long pagesOf(Buffer b) {
        return b.nextToken + b.open.size();
    }

    private BinxException pastPageLimit(Buffer b, long pages) {
        return new BinxException("task " + taskId + ": buffer " + b.id + " would hold " + pages
                + " pages, more than the " + maxPagesPerBuffer + " its binxd holds in one buffer (max_pages_per_buffer,"
                + " said in its HELLO), and no consumer reads the buffer before the task finishes: raise"
                + " max_pages_per_buffer on the binxd, or write fewer, larger pages");
    }

    /** Seals every open batch (each buffer's pages not yet sent). */
    private void sealAll() {
        // A copy: sealing sends, and a send may fail the writer, which clears the list.
        Buffer[] listed = withOpen.toArray(new Buffer[0]);
        withOpen.clear();
        for (Buffer b : listed) {
            b.listed = false;
            if (!b.open.isEmpty()) {
                seal(b);
            }
        }
    }

    /**
     * Seals the largest open batches until the open ones hold at most {@code target}. Under
     * backpressure the pages added since the last room are spread over every partition:
     * sealing them all at once (as at finish) would send about one page an ENQUEUE; the largest
     * first, and a quarter of the limit left open, keeps batches as full as the limit allows.
     */
    private void sealLargest(long target) {
        List<Buffer> open = new ArrayList<>(withOpen.size());
        for (Buffer b : withOpen) {
            if (!b.open.isEmpty()) {
                open.add(b);
            }
        }
        open.sort((x, y) -> Long.compare(y.openBytes + y.open.size() * PAGE_OVERHEAD, x.openBytes + x.open.size() * PAGE_OVERHEAD));
        for (Buffer b : open) {
            if (openHeld <= target || aborted || failure != null) {
                return;
            }
            seal(b);
        }
    }

    /**
     * The batches the writer made of the pages added: the ENQUEUEs that carried them, at least
     * (one is sent again after BUSY or a broken connection; a writer aborted drops the batches
     * it had not sent).
     */
    public synchronized long batchesSealed() {
        return batchesSealed;
    }

    /**
     * Completes once the writer holds less than its limit (or has failed, or was aborted);
     * callbacks on it run on the writer's callback threads, never under its lock.
     */
    public synchronized CompletableFuture<Void> whenRoom() {
        // A copy: a caller that cancels what it got cancels nothing another caller holds.
        return room == null ? CompletableFuture.completedFuture(null) : roomView.copy();
    }

    /**
     * What callers get of a future the writer completes under its lock: completed with its
     * outcome on {@link #CALLERS}, so their callbacks never run under the lock. A caller that
     * cancels or completes it changes nothing of the writer's.
     */
    private static CompletableFuture<Void> outsideTheLock(CompletableFuture<Void> own) {
        CompletableFuture<Void> view = new CompletableFuture<>();
        java.util.function.BiConsumer<Void, Throwable> tell = (ok, error) -> {
            if (error == null) {
                view.complete(null);
            } else {
                view.completeExceptionally(error);
            }
        };
        if (own.isDone()) {
            // Completed now, before anyone could attach a callback to it.
            own.whenComplete(tell);
        } else {
            own.whenCompleteAsync(tell, task -> {
                try {
                    CALLERS.execute(task);
                } catch (java.util.concurrent.RejectedExecutionException | OutOfMemoryError e) {
                    // No thread to be had: told here rather than never.
                    task.run();
                }
            });
        }
        return view;
    }

    /** Memory of the pages held (added and not yet confirmed by binxd): their bytes and {@link #PAGE_OVERHEAD} each. */
    public synchronized long bufferedBytes() {
        return buffered;
    }

    /**
     * Sends what is left, waits for every ENQUEUE's OK, then NO_MORE_PAGES for every buffer; the
     * future completes when binxd answers that OK, or fails with the first failure (callbacks
     * on it run on the writer's callback threads, never under its lock).
     */
    public synchronized CompletableFuture<Void> finish() {
        if (finished != null) {
            return outsideTheLock(finished);
        }
        finished = new CompletableFuture<>();
        if (failure != null) {
            finished.completeExceptionally(failure);
            return outsideTheLock(finished);
        }
        if (aborted) {
            finished.completeExceptionally(new BinxException("task " + taskId + " was aborted"));
            return outsideTheLock(finished);
        }
        finishing = true;
        sealAll();
        maybeSendFinish();
        return outsideTheLock(finished);
    }

    /** Whether {@link #finish} completed, and not with a failure. */
    public synchronized boolean finishedWell() {
        return finished != null && finished.isDone() && !finished.isCompletedExceptionally();
    }

    /** ABORT_TASK: binxd frees the task and its consumers see {@code reason}. */
    public CompletableFuture<Void> abort(String reason) {
        return abort(reason, false).orElseThrow();
    }

    /**
     * As {@link #abort}, unless {@link #finish} succeeded: then nothing changes (what binxd
     * committed stays; empty is returned). Decided under the writer's lock, so a finish that
     * succeeds meanwhile is either kept whole or was failed by this abort, never both.
     */
    public Optional<CompletableFuture<Void>> abortUnlessFinished(String reason) {
        return abort(reason, true);
    }

    private Optional<CompletableFuture<Void>> abort(String reason, boolean keepFinished) {
        boolean lostWithItsSidecar;
        synchronized (this) {
            if (keepFinished && finishedWell()) {
                return Optional.empty();
            }
            if (aborted) {
                return Optional.of(CompletableFuture.completedFuture(null));
            }
            aborted = true;
            // The binxd that took this task's pages is gone (another instance answers now):
            // the new one never had the task, and an ABORT_TASK would only leave it a tombstone
            // that keeps it from releasing what the earlier instance committed of the task when
            // the exchange deletes it.
            lostWithItsSidecar = confirmedBy != null && connectionInstance != null
                    && !confirmedBy.equals(connectionInstance);
            abortPending = true;
            for (Buffer b : buffers) {
                b.open.clear();
                b.unconfirmed.clear();
                b.listed = false;
                b.waiting = 0;
            }
            withOpen.clear();
            waitingForSlot.clear();
            buffered = 0;
            openHeld = 0;
            releaseRoom();
            if (finished != null && !finished.isDone()) {
                finished.completeExceptionally(new BinxException("task " + taskId + " was aborted: " + reason));
            }
        }
        if (lostWithItsSidecar) {
            abortDone();
            return Optional.of(CompletableFuture.completedFuture(null));
        }
        BinRequest r = new BinRequest(MessageType.ABORT_TASK);
        r.taskId = taskId;
        r.reason = BinRequest.reasonWithin(reason);
        CompletableFuture<Void> done = new CompletableFuture<>();
        // A minute: longer than a connect and its HELLO may take (10 s and 5 s by default).
        sendAbort(r, new Backoff(10, 500, ABORT_MAX_ERROR_MILLIS), done);
        return Optional.of(done);
    }

    private void sendAbort(BinRequest r, Backoff tries, CompletableFuture<Void> done) {
        BinxConnection c = connection();
        if (c == null) {
            retryAbort(r, tries, done, notConnected());
            return;
        }
        c.send(r).whenComplete((resp, err) -> {
            if (err == null && resp.header().status() == Status.OK) {
                abortDone();
                done.complete(null);
            } else if (err == null && resp.header().status() != Status.BUSY) {
                abortDone();
                done.completeExceptionally(new BinxRefusedException(r, resp.header()));
            } else {
                retryAbort(r, tries, done, err == null ? new BinxRefusedException(r, resp.header()) : err);
            }
        });
    }

    private void retryAbort(BinRequest r, Backoff tries, CompletableFuture<Void> done, Throwable why) {
        long delay = tries.failure();
        if (delay < 0) {
            abortDone();
            done.completeExceptionally(why);
            return;
        }
        RETRIES.schedule(() -> sendAbort(r, tries, done), delay, TimeUnit.MILLISECONDS);
    }

    /** The abort was answered, or given up: no connection is wanted any more. */
    private synchronized void abortDone() {
        abortPending = false;
        closeConnection();
    }

    /** Tells the backoff of a failure; the delay before the next try, or -1 to give up. */
    private long countFailure() {
        failuresCounted++;
        return backoff.failure();
    }

    /** Failures the backoff was told of so far. */
    synchronized int failuresCounted() {
        return failuresCounted;
    }

    /** The failure that will fail {@link #finish}, if any. */
    public synchronized BinxException failure() {
        return failure;
    }

    // ------------------------------------------------------------------ internals

    /**
     * The open connection, or null: then a connect starts in the background (one at a time),
     * and whoever found none parks its request until the connect lands ({@link
     * #connectInBackground}), never waiting here: the engine's threads that add pages hold
     * this lock.
     */
    private synchronized BinxConnection connection() {
        if (connection != null && connection.isOpen()) {
            return connection;
        }
        if (!connecting) {
            startConnect();
        }
        return null;
    }

    /**
     * Starts a connect: the first at once, every later one after the writer's backoff, which
     * it counts as a failure (a binxd that takes connections and drops them must not be asked
     * again and again without end), failing the writer once its budget is spent. Not while
     * aborting: the abort paces its own tries, and needs a connection after any failure.
     */
    private void startConnect() {
        long delay = 0;
        if (connectsStarted++ > 0 && failure == null && !aborted) {
            delay = countFailure();
            if (delay < 0) {
                BinxException last = lastConnectFailure;
                fail(new BinxException("task " + taskId + ": gave up after " + backoff.failingForMillis()
                        + " ms without a working connection to binxd" + (last == null ? "" : ": " + last.getMessage()), last));
                return;
            }
        }
        connecting = true;
        connectStartedNanos = System.nanoTime();
        // The next binxd says its own limit (a restarted one may hold more); what was added
        // meanwhile is checked against it when its HELLO comes.
        maxPagesPerBuffer = Long.MAX_VALUE;
        try {
            if (delay == 0) {
                CONNECTS.execute(this::connectInBackground);
            } else {
                RETRIES.schedule(() -> {
                    synchronized (this) {
                        if (!stillWanted()) {
                            // The writer ended while this waited: no connect, none under way.
                            connecting = false;
                            return;
                        }
                    }
                    try {
                        CONNECTS.execute(this::connectInBackground);
                    } catch (Throwable t) {
                        connectNotStarted(t);
                    }
                }, delay, TimeUnit.MILLISECONDS);
            }
        } catch (Throwable t) {
            connectNotStarted(t);
        }
    }

    /** Whether a connection is still of use: the writer goes on, or its abort is being sent. */
    private synchronized boolean stillWanted() {
        return abortPending || (!aborted && failure == null && (finished == null || !finished.isDone()));
    }

    /** No thread for a connect: what is parked tries again a little later. */
    private synchronized void connectNotStarted(Throwable t) {
        connecting = false;
        lastConnectFailure = new BinxConnectionException("task " + taskId + ": cannot start a connect to binxd: " + t, t);
        try {
            RETRIES.schedule(this::retryParked, 10, TimeUnit.MILLISECONDS);
        } catch (Throwable again) {
            // Nothing can run later either: what waits fails with its budget, or never.
        }
    }

    /** Why there is no connection now, for an error. */
    private synchronized BinxConnectionException notConnected() {
        StringBuilder why = new StringBuilder("task " + taskId + ": not connected to binxd");
        if (connecting) {
            why.append(" (a connect under way for ")
                    .append(TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - connectStartedNanos)).append(" ms)");
        }
        if (lastConnectFailure != null) {
            why.append(": ").append(lastConnectFailure.getMessage());
        }
        return new BinxConnectionException(why.toString(), lastConnectFailure);
    }

    /**
     * Connects and says HELLO (outside the lock), then puts the connection to use: OPEN_TASK
     * first on it, or, when the binxd is not the instance that confirmed this writer's pages
     * (it restarted and lost them), the writer fails at once (its task could only end short)
     * and the abort goes to the new instance, which may hold pages this writer resent.
     */
    private void connectInBackground() {
        BinxConnection c = null;
        String instance = "";
        long maxPages = Long.MAX_VALUE;
        long maxEnqueue = Long.MAX_VALUE;
        long maxEnqueuePages = Long.MAX_VALUE;
        long maxFrame = Long.MAX_VALUE;
        String missing = null;
        BinxException why = null;
        try {
            c = connect();
            List<String> capabilities = c.capabilities(HELLO_TIMEOUT_MILLIS);
            instance = BinxConnection.capability(capabilities, "instance");
            maxPages = pageLimit(BinxConnection.capability(capabilities, MAX_PAGES_PER_BUFFER));
            maxEnqueue = pageLimit(BinxConnection.capability(capabilities, MAX_ENQUEUE_BYTES));
            maxEnqueuePages = pageLimit(BinxConnection.capability(capabilities, MAX_PAGES_PER_ENQUEUE));
            maxFrame = pageLimit(BinxConnection.capability(capabilities, MAX_FRAME_BYTES));
            missing = !capabilities.contains(APPEND_TOKEN) ? APPEND_TOKEN : instance.isEmpty() ? "instance=" : null;
        } catch (BinxConnectionException e) {
            why = e;
        } catch (BinxException e) {
            why = new BinxConnectionException("task " + taskId + ": HELLO to binxd failed: " + e.getMessage(), e);
        } catch (Throwable t) {
            why = new BinxConnectionException("task " + taskId + ": connecting to binxd failed: " + t, t);
        } finally {
            if (why != null && c != null) {
                c.close();
            }
        }
        synchronized (this) {
            connecting = false;
            if (why != null) {
                lastConnectFailure = why;
                retryParked();
                return;
            }
            if (!stillWanted()) {
                // The writer ended while this connected (its abort given up): nothing to send.
                c.close();
                return;
            }
            if (!c.isOpen()) {
                // Closed between its HELLO and now: a failed connect, counted as one.
                lastConnectFailure = new BinxConnectionException("task " + taskId
                        + ": binxd closed the connection right after its HELLO");
                retryParked();
                return;
            }
            connection = c;
            connectionsUsed++;
            // Checked again on this one: the task may have been dropped before it, too.
            endsChecked = false;
            // While the task is open binxd must never see it quiet: it closes a connection silent
            // for idle_timeout, and drops a task no connection holds after abandon_after.
            c.holdOpen(true);
            connectionInstance = instance;
            maxPagesPerBuffer = maxPages;
            if (maxEnqueue != Long.MAX_VALUE) {
                daemonEnqueueBytes = maxEnqueue;
            }
            if (maxEnqueuePages != Long.MAX_VALUE) {
                daemonEnqueuePages = maxEnqueuePages;
            }
            if (maxFrame != Long.MAX_VALUE) {
                daemonFrameBytes = maxFrame;
            }
            opened = false;
            if (missing != null) {
                // Without numbered ENQUEUEs a resend may be applied twice, or at other tokens;
                // without an instance a restart that lost pages goes unseen.
                recordFailure(new BinxException("task " + taskId + ": binxd does not advertise `" + missing
                        + "` in its HELLO reply (docs/PROTOCOL.md section 9), which this writer needs to write exactly"));
            } else if (confirmedBy != null && !confirmedBy.equals(instance)) {
                recordFailure(restarted(instance));
            } else if (unsentPagePastFrame() != null) {
                // Added while it connected: sent, it would close the connection at every try.
                recordFailure(unsentPagePastFrame());
            } else if (options.readAfterFinish() && !aborted) {
                // Pages added before this binxd said its limit.
                for (Buffer b : buffers) {
                    if (pagesOf(b) > maxPages) {
                        recordFailure(pastPageLimit(b, pagesOf(b)));
                        break;
                    }
                }
            }
            if (failure != null) {
                // Nothing more goes to this binxd but the abort (sent now, or by its retry).
                abort("the task's output could not be written: " + failure.getMessage());
                return;
            }
            cutUnsentToFit();
            sendOpen();
            sendParked();
        }
    }

    /**
     * The limit a HELLO's {@code max-pages-per-buffer=} (or {@code max-enqueue-bytes=}) says;
     * none (the largest long) when it says nothing, or what is not a positive number (a binxd
     * that does not say cannot be held to it: its BUSY replies are retried as before).
     */
    static long pageLimit(String said) {
        try {
            long n = Long.parseLong(said);
            return n > 0 ? n : Long.MAX_VALUE;
        } catch (NumberFormatException e) {
            return Long.MAX_VALUE;
        }
    }

    /** Sends what found no connection: each parked buffer from its first unconfirmed batch, then NO_MORE_PAGES. */
    private void sendParked() {
        // Those parked now, once: a connection that breaks meanwhile parks them again, for the
        // next connect.
        Buffer[] now = parked.toArray(new Buffer[0]);
        parked.clear();
        for (Buffer b : now) {
            b.parked = false;
            if (b.inFlight == 0 && !b.resendScheduled) {
                resend(b);
            }
            // Else its replies, or its scheduled resend, go on with it.
        }
        if (finishParked) {
            finishParked = false;
            sendFinish();
        }
        // What waited for a slot on the connection that broke goes on this one.
        sendWaiting();
    }

    /** After a failed connect: another one, when something is parked (its backoff applies). */
    private synchronized void retryParked() {
        if ((!parked.isEmpty() || finishParked) && failure == null && !aborted) {
            connection();
        }
    }

    /**
     * Parks {@code b} until a connection is made: nothing of it goes out before then, and then
     * its first unconfirmed batch does (as after any resync).
     */
    private void park(Buffer b) {
        b.resync = true;
        unqueue(b);
        if (!b.parked) {
            b.parked = true;
            parked.add(b);
        }
    }

    /** A new connection; whatever the connector throws is a connection failure (retried). */
    private BinxConnection connect() {
        try {
            return connector.get();
        } catch (BinxException e) {
            throw e;
        } catch (RuntimeException e) {
            throw new BinxConnectionException("task " + taskId + ": cannot connect to binxd: " + e.getMessage(), e);
        }
    }

    private BinxException restarted(String instance) {
        return new BinxException("task " + taskId + ": binxd restarted (instance " + confirmedBy + ", now "
                + (instance.isEmpty() ? "one that does not say" : instance)
                + "): the pages it had confirmed are gone, so this task attempt cannot finish");
    }

    /**
     * Records that the binxd {@code instance} confirmed pages; false, with the writer failed,
     * when another instance had confirmed some before.
     */
    private boolean confirmedOn(String instance) {
        if (confirmedBy == null) {
            confirmedBy = instance;
        } else if (!confirmedBy.equals(instance)) {
            fail(restarted(instance));
            return false;
        }
        return true;
    }

    /** Gives {@code c} back when it is still the writer's connection (else it was replaced or closed). */
    private synchronized void giveBackConnection(BinxConnection c) {
        if (connection == c) {
            connection = null;
            c.holdOpen(false);
            connector.giveBack(c);
        }
    }

    private synchronized void closeConnection() {
        if (connection != null) {
            connection.close();
            connection = null;
        }
    }

    /** OPEN_TASK (idempotent) ahead of everything else on a new connection. */
    private void sendOpen() {
        if (opened || aborted || failure != null || connection == null || !connection.isOpen()) {
            // Without a connection: the connect under way sends it first when it lands.
            return;
        }
        BinxConnection c = connection;
        opened = true;
        BinRequest r = new BinRequest(MessageType.OPEN_TASK);
        r.taskId = taskId;
        r.bufferKind = BufferKind.PARTITIONED.number();
        r.bufferCount = bufferCount;
        r.spoolPolicy = spoolPolicy;
        c.send(r).whenComplete((resp, err) -> {
            if (err == null && resp.header().status() != Status.OK && resp.header().status() != Status.BUSY) {
                synchronized (this) {
                    fail(new BinxRefusedException(r, resp.header()));
                }
            }
            // BUSY or a broken connection: the ENQUEUEs behind it fail too and resend it first.
            if (err != null || resp.header().status() == Status.BUSY) {
                synchronized (this) {
                    if (connection == c) {
                        opened = false;
                    }
                }
            }
        });
    }

    /**
     * Seals {@code b}'s open batch, in as many batches as one ENQUEUE's limits need (more than
     * one only when a HELLO said smaller limits than those it was filled under), and sends them.
     */
    private void seal(Buffer b) {
        ByteBuffer[] pages = b.open.toArray(new ByteBuffer[0]);
        List<Batch> batches = cut(b, b.nextToken, pages);
        b.nextToken += pages.length;
        openHeld -= b.openBytes + pages.length * PAGE_OVERHEAD;
        b.open.clear();
        b.openBytes = 0;
        // Every batch is the buffer's before any goes: a reply handled on this thread (one that
        // came before its callback was attached) may confirm the first, and a finish under way
        // must not find the buffer empty and commit the task without the rest (review).
        batchesSealed += batches.size();
        b.unconfirmed.addAll(batches);
        for (Batch batch : batches) {
            // Per batch: sending one may park the buffer, or fail the writer.
            if (aborted || failure != null) {
                return;
            }
            if (!b.resync && !b.probing) {
                send(batch);
            }
        }
    }

    private void send(Batch batch) {
        send(batch, false);
    }

    /** {@code turn}: the batch's turn in {@link #waitingForSlot} came (none of its buffer before it waits). */
    private void send(Batch batch, boolean turn) {
        Buffer b = batch.buffer;
        BinRequest r = new BinRequest(MessageType.ENQUEUE);
        r.taskId = taskId;
        r.bufferId = b.id;
        r.maxWaitMicros = options.enqueueWaitMicros();
        r.appendToken = batch.firstToken;
        long[] sizes = new long[batch.pages.length];
        for (int i = 0; i < sizes.length; i++) {
            sizes[i] = batch.pages[i].remaining();
        }
        r.pageSizes = sizes;
        if (failure != null || aborted) {
            return;
        }
        BinxConnection c = connection();
        if (c == null) {
            park(b);
            return;
        }
        String instance = connectionInstance;
        if (confirmedBy != null && !confirmedBy.equals(instance)) {
            // Checked where the connection was made; here too, before any ENQUEUE goes out.
            fail(restarted(instance));
            return;
        }
        if (!opened) {
            sendOpen();
            if (aborted || failure != null) {
                // Its refusal, handled inline, failed the writer.
                return;
            }
        }
        if (batch.waiting) {
            // Goes in its turn.
            return;
        }
        if ((!turn && b.waiting > 0) || inFlight >= enqueueLimit(c)) {
            // Behind its buffer's earlier batches, which wait: a buffer's ENQUEUEs go in order.
            batch.waiting = true;
            b.waiting++;
            waitingForSlot.addLast(batch);
            if (inFlight < enqueueLimit(c)) {
                // Queued for order alone: what is ahead of it goes now, so something is in
                // flight whenever something waits (its reply drains the rest).
                sendWaiting();
            }
            return;
        }
        batch.inFlight = true;
        batch.sends++;
        b.inFlight++;
        b.sentOn = c;
        inFlight++;
        try {
            c.send(r, batch.pages).whenComplete((resp, err) -> onReply(batch, r, resp, err, instance, c));
        } catch (RuntimeException e) {
            // Not a reply, so no onReply: undo what it would have, and fail rather than wait for ever.
            batch.inFlight = false;
            b.inFlight--;
            inFlight--;
            fail(new BinxException(BinxException.describe(r) + ": sending it failed: " + e, e));
        }
    }

    /**
     * Sends the batches that waited for a slot, in their order, while the writer is below its
     * limit. One whose buffer resyncs meanwhile is left to that (its resend, or the probe's
     * answer, sends it again); a probing buffer sends only its probe, alone.
     */
    private void sendWaiting() {
        // Each at most once per call: one that goes back to the queue is not taken again here.
        for (int n = waitingForSlot.size(); n > 0 && failure == null && !aborted; n--) {
            BinxConnection c = connection;
            if (c == null || !c.isOpen()) {
                // The connection is gone (maybe after answering all it had): what waits goes
                // on the next one, as a parked buffer's batches do (parking unqueues them).
                for (Batch waiting : List.copyOf(waitingForSlot)) {
                    park(waiting.buffer);
                }
                connection();
                return;
            }
            if (inFlight >= enqueueLimit(c)) {
                return;
            }
            // A reply handled on this thread meanwhile may have emptied the queue.
            Batch batch = waitingForSlot.pollFirst();
            if (batch == null) {
                return;
            }
            Buffer b = batch.buffer;
            batch.waiting = false;
            b.waiting--;
            if (batch.done || batch.inFlight || b.resync || b.parked) {
                continue;
            }
            if (b.inFlight > 0 && b.sentOn != c) {
                // Earlier batches of its buffer are still out on a connection that broke: their
                // failures resync it, and the last one's resend sends it again from its first
                // unconfirmed batch, on this connection. Not parked: parked buffers go only at
                // the next connect, and this one is open (review: parked here, what its
                // resend then queued for a slot was dropped as parked, and finish waited for
                // ever).
                b.resync = true;
                unqueue(b);
                continue;
            }
            if (b.probing && (b.inFlight > 0 || firstUnsent(b) != batch)) {
                continue;
            }
            send(batch, true);
        }
    }

    /**
     * Takes a buffer that resyncs (or is parked) out of {@link #waitingForSlot}: its resend
     * sends its batches again from its first unconfirmed one, in order, and nothing of it may
     * go ahead of that.
     */
    private void unqueue(Buffer b) {
        if (b.waiting == 0) {
            return;
        }
        waitingForSlot.removeIf(batch -> {
            if (batch.buffer != b) {
                return false;
            }
            batch.waiting = false;
            return true;
        });
        b.waiting = 0;
    }

    /** ENQUEUEs this writer lets be in flight on {@code c}. */
    private static int enqueueLimit(BinxConnection c) {
        return Math.max(1, c.maxOutstanding() - SLOTS_FOR_OTHERS);
    }

    /** The buffer's first batch neither confirmed nor in flight (what a resync sends first). */
    private static Batch firstUnsent(Buffer b) {
        for (Batch batch : b.unconfirmed) {
            if (!batch.done && !batch.inFlight) {
                return batch;
            }
        }
        return null;
    }

    private synchronized void onReply(Batch batch, BinRequest r, Response resp, Throwable err, String instance,
            BinxConnection sentVia) {
        try {
            answered(batch, r, resp, err, instance, sentVia);
        } finally {
            // A slot is free: what waited for one goes.
            sendWaiting();
        }
    }

    /** {@code batch}'s reply (or failure) from {@code sentVia}, the connection it was sent on. */
    private void answered(Batch batch, BinRequest r, Response resp, Throwable err, String instance, BinxConnection sentVia) {
        Buffer b = batch.buffer;
        batch.inFlight = false;
        b.inFlight--;
        inFlight--;
        if (aborted || failure != null) {
            return;
        }
        if (err instanceof BinxConnectionException) {
            // The connection broke: the ENQUEUE may or may not have been applied; its numbers
            // make sending it again exact.
            b.resync = true;
        } else if (err != null) {
            // Failed here, not on the way (a header over the limit, an interrupt): the same
            // again would fail the same way.
            fail(err instanceof BinxException e ? e
                    : new BinxException(BinxException.describe(r) + ": " + err, err));
            return;
        } else {
            BinReply h = resp.header();
            Status s = h.status();
            long first = batch.firstToken;
            long count = batch.pages.length;
            if (s == Status.OK && (h.pageToken != first || h.pageNextToken != first + count)) {
                // Every reply to a numbered ENQUEUE carries its number, and its OK the token after
                // its pages (docs/PROTOCOL.md section 9): anything else applied other pages.
                fail(new BinxException(BinxException.describe(r) + ": binxd answered OK for tokens " + h.pageToken
                        + ".." + h.pageNextToken + ", not " + first + ".." + (first + count)
                        + ": it does not number appends as it advertised"));
                return;
            } else if (s == Status.OK) {
                if (!confirmedOn(instance)) {
                    return;
                }
                confirm(batch);
                endProbe(b);
            } else if (s == Status.BUSY) {
                b.resync = true;
            } else if (s == Status.BAD_REQUEST && h.pageNextToken != h.pageToken && h.pageToken == first) {
                long next = h.pageNextToken;
                String wrong = tokensImpossible(batch, next);
                if (wrong != null) {
                    fail(new BinxException(BinxException.describe(r) + ": binxd's buffer " + b.id + " continues at token "
                            + next + ", " + wrong));
                    return;
                }
                if (Long.compareUnsigned(next, first + count) >= 0) {
                    if (!confirmedOn(instance)) {
                        return;
                    }
                    // Applied before (its reply was lost), and so was every batch below `next`.
                    for (Batch earlier : List.copyOf(b.unconfirmed)) {
                        if (Long.compareUnsigned(earlier.firstToken + earlier.pages.length, next) <= 0) {
                            confirm(earlier);
                        }
                    }
                    confirm(batch);
                    endProbe(b);
                } else if (Long.compareUnsigned(next, first) < 0) {
                    b.resync = true;
                } else {
                    fail(new BinxRefusedException(r, h));
                    return;
                }
            } else {
                fail(new BinxRefusedException(r, h));
                return;
            }
        }
        if (b.resync) {
            unqueue(b);
        }
        if (b.resync && b.inFlight == 0 && !b.resendScheduled) {
            long delay;
            if (err instanceof BinxConnectionException && sentVia == breakCounted) {
                delay = breakDelay;
            } else {
                delay = countFailure();
                if (err instanceof BinxConnectionException) {
                    breakCounted = sentVia;
                    breakDelay = delay;
                }
            }
            if (delay < 0) {
                fail(new BinxException(BinxException.describe(r) + ": gave up after " + backoff.failingForMillis()
                        + " ms of refusals and broken connections"
                        + (err != null ? ": " + err.getMessage() : resp != null ? ": " + resp.header().error : "")));
                return;
            }
            b.resendScheduled = true;
            RETRIES.schedule(() -> resend(b), delay, TimeUnit.MILLISECONDS);
        }
        maybeSendFinish();
    }

    /**
     * Why binxd's next token {@code next}, in a refusal of {@code batch}, cannot be this
     * writer's doing, or null when it can: binxd holds pages this writer never sent (another
     * writer of the task, or a task id reused), or lost pages it had confirmed. Resending would
     * end the buffer with pages not this writer's, or short.
     */
    private static String tokensImpossible(Batch batch, long next) {
        Buffer b = batch.buffer;
        if (Long.compareUnsigned(next, b.nextToken) > 0) {
            return "past the " + b.nextToken + " pages this writer has made: another writer of the task?";
        }
        if (batch.sends == 1 && Long.compareUnsigned(next, batch.firstToken + batch.pages.length) >= 0) {
            return "past pages " + batch.firstToken + ".." + (batch.firstToken + batch.pages.length)
                    + " sent for the first time: another writer of the task?";
        }
        Batch oldest = b.unconfirmed.peekFirst();
        if (oldest != null && Long.compareUnsigned(next, oldest.firstToken) < 0) {
            return "below the " + oldest.firstToken + " pages it had confirmed: it lost some";
        }
        return null;
    }

    private synchronized void resend(Buffer b) {
        b.resendScheduled = false;
        if (aborted || failure != null) {
            return;
        }
        b.resync = false;
        for (Batch batch : b.unconfirmed) {
            if (!batch.done && !batch.inFlight) {
                b.probing = true;
                send(batch);
                return;
            }
        }
    }

    /** The probe after a resync was answered: the rest of the buffer follows, pipelined. */
    private void endProbe(Buffer b) {
        if (!b.probing || b.resync) {
            return;
        }
        b.probing = false;
        for (Batch batch : List.copyOf(b.unconfirmed)) {
            // A reply handled inline (a send that failed at once) may have resynced the buffer or
            // failed the writer: the rest goes with that resync, or not at all.
            if (b.resync || b.probing || aborted || failure != null) {
                return;
            }
            if (!batch.done && !batch.inFlight) {
                send(batch);
            }
        }
    }

    private void confirm(Batch batch) {
        if (batch.done) {
            return;
        }
        batch.done = true;
        buffered -= batch.bytes + batch.pages.length * PAGE_OVERHEAD;
        backoff.success();
        Buffer b = batch.buffer;
        while (!b.unconfirmed.isEmpty() && b.unconfirmed.peekFirst().done) {
            b.unconfirmed.removeFirst();
        }
        if (room != null && buffered <= options.maxBufferedBytes()) {
            releaseRoom();
        }
    }

    private void releaseRoom() {
        if (room != null) {
            CompletableFuture<Void> r = room;
            room = null;
            roomView = null;
            r.complete(null);
        }
    }

    private void fail(BinxException why) {
        if (recordFailure(why)) {
            // Nothing more can be written: free what binxd holds now (the engine may never
            // abort, and binxd keeps a task whose producer holds its connection), then the
            // connection.
            abort("the task's output could not be written: " + why.getMessage());
        }
    }

    /** The writer's first failure fails {@link #finish}; false when it had failed before. */
    private boolean recordFailure(BinxException why) {
        if (failure != null) {
            return false;
        }
        failure = why;
        releaseRoom();
        if (finished != null && !finished.isDone()) {
            finished.completeExceptionally(why);
        }
        return true;
    }

    private void maybeSendFinish() {
        if (!finishing || finishSent || failure != null || aborted) {
            return;
        }
        for (Buffer b : buffers) {
            if (!b.unconfirmed.isEmpty() || !b.open.isEmpty()) {
                return;
            }
        }
        finishSent = true;
        sendFinish();
    }

    private void sendFinish() {
        BinRequest r = new BinRequest(MessageType.NO_MORE_PAGES);
        r.taskId = taskId;
        r.bufferId = ALL_BUFFERS;
        if (failure != null || aborted) {
            return;
        }
        BinxConnection c = connection();
        if (c == null) {
            finishParked = true;
            return;
        }
        if (confirmedBy != null && !confirmedBy.equals(connectionInstance)) {
            // The request that commits the task goes only to the instance that took its pages.
            fail(restarted(connectionInstance));
            return;
        }
        if (connectionsUsed > 1 && !endsChecked) {
            sendBufferEnds(c);
            return;
        }
        int round = ++finishRound;
        c.send(r).whenComplete((resp, err) -> {
            synchronized (this) {
                if (aborted || failure != null || round != finishRound) {
                    return;
                }
                if (err == null && resp.header().status() == Status.OK) {
                    backoff.success();
                    // The task-wide NO_MORE_PAGES released the task from this connection: it
                    // is given back before the finish is told, so a writer started right after
                    // may take it.
                    giveBackConnection(c);
                    finished.complete(null);
                } else if (err != null || resp.header().status() == Status.BUSY) {
                    // NO_MORE_PAGES again is exact (a repeated one is OK).
                    retryFinish(r, err != null ? err.getMessage() : resp.header().error);
                } else {
                    fail(new BinxRefusedException(r, resp.header()));
                }
            }
        });
    }

    /**
     * Before the task-wide NO_MORE_PAGES of a writer that used more than one connection: a
     * numbered ENQUEUE of no page at each written buffer's page count. Between two connections
     * no connection of this writer held the task; binxd drops such a task after abandon_after
     * and forgets it later, and OPEN_TASK on the next connection then opened it anew, empty. A
     * buffer that had pages sent after that met a token check; one whose pages were all
     * confirmed before would not, and the task would commit short. binxd checks the token of an
     * ENQUEUE of no page and adds nothing (docs/PROTOCOL.md section 9): a buffer it took as new
     * is refused (its next token is 0), and the attempt fails. Nothing is written, so the
     * task-wide commit still folds its markers into one manifest. At most the connection's
     * ENQUEUE limit of them are in flight; the rest go as replies come.
     */
    private void sendBufferEnds(BinxConnection c) {
        ArrayDeque<Buffer> written = new ArrayDeque<>();
        for (Buffer b : buffers) {
            if (b.nextToken != 0) {
                written.add(b);
            }
        }
        if (written.isEmpty()) {
            endsChecked = true;
            sendFinish();
            return;
        }
        int round = ++finishRound;
        int[] inFlightChecks = {0};
        Runnable[] next = new Runnable[1];
        next[0] = () -> {
            while (!written.isEmpty() && inFlightChecks[0] < enqueueLimit(c) && round == finishRound && !aborted
                    && failure == null) {
                Buffer b = written.poll();
                BinRequest r = new BinRequest(MessageType.ENQUEUE);
                r.taskId = taskId;
                r.bufferId = b.id;
                r.maxWaitMicros = options.enqueueWaitMicros();
                r.appendToken = b.nextToken;
                r.pageSizes = new long[0];
                inFlightChecks[0]++;
                CompletableFuture<Response> reply;
                try {
                    reply = c.send(r);
                } catch (RuntimeException e) {
                    // Not a reply, so no callback: fail rather than wait for ever.
                    fail(new BinxException(BinxException.describe(r) + ": sending it failed: " + e, e));
                    return;
                }
                reply.whenComplete((resp, err) -> {
                    synchronized (this) {
                        inFlightChecks[0]--;
                        if (aborted || failure != null || round != finishRound) {
                            return;
                        }
                        BinReply h = err == null ? resp.header() : null;
                        if (h != null && h.status() == Status.OK && h.pageToken == b.nextToken && h.pageNextToken == b.nextToken) {
                            backoff.success();
                            if (connection != c) {
                                // Another connection replaced this one meanwhile: the task may
                                // have been dropped before it too, so the round starts over there.
                                finishRound++;
                                retryFinish(r, "the connection the check went on was replaced");
                            } else if (written.isEmpty() && inFlightChecks[0] == 0) {
                                endsChecked = true;
                                sendFinish();
                            } else {
                                next[0].run();
                            }
                        } else if (h == null || h.status() == Status.BUSY) {
                            // The others of this round are stale now; the retry checks every
                            // buffer again (an ENQUEUE of no page adds nothing).
                            finishRound++;
                            retryFinish(r, err != null ? err.getMessage() : h.error);
                        } else if (h.status() == Status.BAD_REQUEST && h.pageNextToken != h.pageToken) {
                            fail(new BinxException(BinxException.describe(r) + ": binxd's buffer " + b.id + " continues at token "
                                    + h.pageNextToken + ", not after the " + b.nextToken + " pages it confirmed to this writer:"
                                    + " it dropped the task while no connection of this writer held it, and took it as new;"
                                    + " those pages are lost, so this task attempt cannot finish"));
                        } else {
                            fail(new BinxRefusedException(r, h));
                        }
                    }
                });
            }
        };
        next[0].run();
    }

    private synchronized void retryFinish(BinRequest r, String why) {
        if (failure != null || aborted) {
            return;
        }
        long delay = countFailure();
        if (delay < 0) {
            fail(new BinxException(BinxException.describe(r) + ": gave up after " + backoff.failingForMillis() + " ms: " + why));
            return;
        }
        RETRIES.schedule(() -> {
            synchronized (this) {
                if (!aborted && failure == null) {
                    sendFinish();
                }
            }
        }, delay, TimeUnit.MILLISECONDS);
    }
}
