package io.binx.trino;

import static io.binx.trino.BinxErrorCode.BINX_EXCHANGE_FAILED;

import io.airlift.slice.Slice;
import io.airlift.slice.Slices;
import io.binx.client.BinxConnection;
import io.binx.client.BinxConnectionException;
import io.binx.client.BufferPull;
import io.binx.client.DaemonThreads;
import io.binx.client.TaskWriter;
import io.trino.spi.TrinoException;
import io.trino.spi.exchange.ExchangeId;
import io.trino.spi.exchange.ExchangeSource;
import io.trino.spi.exchange.ExchangeSourceHandle;
import io.trino.spi.exchange.ExchangeSourceOutputSelector;
import java.nio.ByteBuffer;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.RejectedExecutionException;

/**
 * Reads output partitions: every buffer its handles list, through the local binxd (which reads
 * the producer's sidecar, or storage once that is gone), a few at once, each page whole and in
 * its writer's order. Nothing is read before the engine's final output selector, and only the
 * attempts it includes. Each buffer must end where its commit says, with as many bytes: a
 * short read fails the task, never passes for the output.
 *
 * <p>Memory: the pages read and not yet taken (each with 64 bytes for its objects), at most about
 * {@code exchange.binx.source-buffer-size} (the readers ask for no more than the room left, a
 * request past the next page only when its first page fits too; a reply is capped in bytes,
 * so many tiny pages may come at once), plus, per reader, the one page a request for the next
 * page always brings, which may be larger than the room (up to {@code
 * exchange.binx.max-page-size}); {@link #getMemoryUsage} reports it, counting each reader's
 * requests in flight, and the reply its unread pages are slices of, at their size cap.
 */
final class BinxExchangeSource implements ExchangeSource {
    private record Item(ExchangeId exchangeId, int partitionId, BinxSourceHandle.Entry entry) {}

    /** Where readers are started (see {@link #pumpLater}) and those that waited for room resumed (see {@link #read}). */
    private static final java.util.concurrent.ExecutorService RESUMES = DaemonThreads.cached("binx-source-resume");

    private final BinxExchangeManager manager;
    private final int concurrentReaders;
    private final long bufferBytes;
    private final BufferPull.Options pullOptions;

    // Guarded by `this`.
    private final ArrayDeque<Item> queue = new ArrayDeque<>();
    private final List<BufferPull> active = new ArrayList<>();
    /** The most readers that were active at once (for tests: the concurrency configured is used). */
    private int mostReadersAtOnce;
    private final ArrayDeque<Slice> ready = new ArrayDeque<>();
    /**
     * The pages in {@link #ready}, each with {@link TaskWriter#PAGE_OVERHEAD} for its slice and
     * buffer objects: tiny or empty pages fill the source's buffer too, so readers stop.
     */
    private long readyBytes;
    private ExchangeSourceOutputSelector selector;
    private boolean noMoreHandles;
    private boolean closed;
    private TrinoException failure;
    private final Wakeups wakeups = new Wakeups();
    private BinxConnection connection;
    /** A reader found no room and waits for {@link #read} to make some. */
    private boolean starved;
    /**
     * What {@link #getMemoryUsage} reports, kept without the lock: Trino's spooling data source
     * calls it right after {@link #read}, racing with close() on another thread, which closes
     * the memory context; the longer read() and getMemoryUsage() take, the more often Trino
     * fails the task with "ChildAggregatedMemoryContext is already closed".
     */
    private volatile long memoryUsage = 512;

    BinxExchangeSource(BinxExchangeManager manager) {
        this.manager = manager;
        BinxExchangeConfig config = manager.config();
        this.concurrentReaders = config.sourceConcurrentReaders();
        this.bufferBytes = config.sourceBufferBytes();
        this.pullOptions = new BufferPull.Options(Math.min(2L << 20, Math.max(1, bufferBytes / 4)), 2, false,
                1_000_000, config.maxErrorMillis());
        manager.stats().sourcesStarted.increment();
    }

    @Override
    public void addSourceHandles(List<ExchangeSourceHandle> handles) {
        synchronized (this) {
            if (closed) {
                return;
            }
            for (ExchangeSourceHandle h : handles) {
                BinxSourceHandle handle = (BinxSourceHandle) h;
                for (BinxSourceHandle.Entry entry : handle.entries()) {
                    queue.add(new Item(handle.exchangeId(), handle.getPartitionId(), entry));
                }
            }
        }
        pumpLater();
    }

    @Override
    public void noMoreSourceHandles() {
        synchronized (this) {
            noMoreHandles = true;
        }
        pumpLater();
    }

    @Override
    public void setOutputSelector(ExchangeSourceOutputSelector newSelector) {
        synchronized (this) {
            if (selector != null) {
                if (newSelector.getVersion() <= selector.getVersion()) {
                    return;
                }
                selector.checkValidTransition(newSelector);
            }
            selector = newSelector;
        }
        pumpLater();
    }

    /**
     * {@link #pump} on a thread of the source's own: it may learn the local sidecar's address
     * (a HELLO) and connect (up to its deadline on a stuck binxd), and its callers are the
     * engine's threads (adding handles, setting the selector) and the client's reply threads.
     */
    private void pumpLater() {
        try {
            RESUMES.execute(this::pump);
        } catch (RejectedExecutionException e) {
            // No thread: here rather than never.
            pump();
        }
    }

    /** Starts readers while there is room for them, once the final selector says what to read. */
    private void pump() {
        List<BufferPull> start = new ArrayList<>();
        synchronized (this) {
            if (closed || failure != null || selector == null || !selector.isFinal()) {
                signalLater();
                start = null;
            }
        }
        if (start == null) {
            signalNow();
            return;
        }
        // The local sidecar's address, learnt once per manager by a HELLO: asked outside the lock,
        // which the engine's threads take (isBlocked, read). While it is asked again (the local
        // binxd cannot be reached yet) the readers start once it is known.
        String local = null;
        if (readerWanted()) {
            CompletableFuture<String> lookup = manager.localAddressLookup();
            if (!lookup.isDone()) {
                lookup.whenComplete((address, error) -> {
                    if (error != null) {
                        addressFailed(error);
                    } else {
                        pumpLater();
                    }
                });
                return;
            }
            try {
                local = lookup.join();
            } catch (CompletionException | java.util.concurrent.CancellationException ex) {
                addressFailed(ex);
                return;
            }
        }
        synchronized (this) {
            // Each reader started here is in `active` already: counting `start` too started
            // half as many as allowed (review).
            while (local != null && !closed && failure == null && active.size() < concurrentReaders && !queue.isEmpty()) {
                Item item = queue.poll();
                BinxSourceHandle.Entry e = item.entry();
                ExchangeSourceOutputSelector.Selection selection;
                try {
                    selection = selector.getSelection(item.exchangeId(), e.taskPartitionId(), e.attemptId());
                } catch (IllegalArgumentException ex) {
                    fail(new TrinoException(BINX_EXCHANGE_FAILED, "the output selector has no decision for task partition "
                            + e.taskPartitionId() + " of exchange " + item.exchangeId() + ": " + ex.getMessage(), ex));
                    break;
                }
                if (selection != ExchangeSourceOutputSelector.Selection.INCLUDED) {
                    // Handles list only the attempt the exchange chose (the first to finish),
                    // which the engine's selector includes too: anything else would leave the
                    // partition's output unread, a wrong answer. Fail instead.
                    fail(new TrinoException(BINX_EXCHANGE_FAILED, "the output selector says " + selection + " for attempt "
                            + e.attemptId() + " of task partition " + e.taskPartitionId() + " of exchange " + item.exchangeId()
                            + ", the attempt whose output this exchange committed"));
                    break;
                }
                String remote = e.endpoint().equals(local) ? "" : e.endpoint();
                BufferPull pull = new BufferPull(this::connection, e.taskId(), item.partitionId(), remote, e.endpoint(),
                        e.pages(), e.bytes(), pullOptions, this::room, this::accept);
                active.add(pull);
                start.add(pull);
                mostReadersAtOnce = Math.max(mostReadersAtOnce, active.size());
            }
            updateMemoryUsage();
            signalLater();
        }
        for (BufferPull pull : start) {
            pull.done().whenComplete((ok, error) -> finished(pull, error));
            pull.resume();
        }
        signalNow();
    }

    private void addressFailed(Throwable error) {
        Throwable why = error instanceof CompletionException && error.getCause() != null ? error.getCause() : error;
        synchronized (this) {
            if (closed) {
                // Closed while it waited for the address: nothing failed the engine saw.
                return;
            }
            fail(new TrinoException(BINX_EXCHANGE_FAILED, "cannot reach the local binxd: " + why.getMessage(), why));
        }
        signalNow();
    }

    /** The most readers this source had reading at once. */
    synchronized int mostReadersAtOnce() {
        return mostReadersAtOnce;
    }

    /** Whether a reader could start now (then the local address is needed). */
    private synchronized boolean readerWanted() {
        return !closed && failure == null && active.size() < concurrentReaders && !queue.isEmpty();
    }

    /**
     * The connection the readers share. One reader at a time makes a new one ({@link
     * #connecting}), and the others then share it: readers that start together would otherwise
     * each connect (a socket, a thread and a HELLO each) and close all but one, emptying the
     * manager's pool of kept connections. A reader that waited while another's connect failed
     * fails with it rather than try again in turn (on a stuck binxd each try waits out the
     * connect deadline). It is made outside this source's lock (a connect may wait up to its
     * deadline, and the engine's threads take the lock).
     */
    private BinxConnection connection() {
        long attemptsSeen = connectAttempts;
        synchronized (connecting) {
            synchronized (this) {
                if (closed || failure != null) {
                    // A reader not yet stopped must not open a socket nobody would close.
                    throw new BinxConnectionException(closed ? "the exchange source was closed" : "the exchange source failed");
                }
                if (connection != null && connection.isOpen()) {
                    return connection;
                }
            }
            RuntimeException failed = lastConnectFailure;
            if (connectAttempts != attemptsSeen && failed != null) {
                throw new BinxConnectionException("connecting to the local binxd failed: " + failed.getMessage(), failed);
            }
            connectAttempts++;
            BinxConnection fresh;
            try {
                fresh = manager.connector().get();
            } catch (RuntimeException e) {
                lastConnectFailure = e;
                throw e;
            }
            lastConnectFailure = null;
            synchronized (this) {
                if (closed) {
                    fresh.close();
                    throw new BinxConnectionException("the exchange source was closed");
                }
                connection = fresh;
                return fresh;
            }
        }
    }

    /** Taken before this source's lock, never after it: held while a reader connects. */
    private final Object connecting = new Object();
    /** Connects begun, read before waiting for {@link #connecting} (written holding it). */
    private volatile long connectAttempts;
    /** Why the last connect failed; null once one succeeded (guarded by {@link #connecting}). */
    private RuntimeException lastConnectFailure;

    /** Room the readers may ask for now. */
    private synchronized long room() {
        long room = closed ? 0 : bufferBytes - readyBytes;
        if (room <= 0) {
            starved = true;
        }
        return room;
    }

    /**
     * Under the lock: the memory held now, for {@link #getMemoryUsage}: the pages read, and per
     * reader its requests in flight at their size cap (its depth, and a request at the next page
     * sent while guesses a larger reply proved wrong are still on their way) and the reply whose
     * memory its unread pages keep (a page is a slice of its reply).
     */
    private void updateMemoryUsage() {
        long perReader = pullOptions.maxReplyBytes() * (pullOptions.depth() + 2L);
        memoryUsage = closed ? 0 : 512 + readyBytes + active.size() * perReader;
    }

    /**
     * A page a reader read, in its buffer's order. The reader hands it over holding its own lock,
     * so the engine's future is completed on another thread: its callbacks never run under it.
     */
    private void accept(ByteBuffer page) {
        synchronized (this) {
            if (closed) {
                return;
            }
            Slice s = Slices.wrappedHeapBuffer(page);
            ready.add(s);
            readyBytes += s.length() + TaskWriter.PAGE_OVERHEAD;
            updateMemoryUsage();
            signalLater();
            if (!wakeups.anyDue() && toStop.isEmpty()) {
                return;
            }
        }
        try {
            RESUMES.execute(this::signalNow);
        } catch (RejectedExecutionException e) {
            // No thread: here rather than never.
            signalNow();
        }
    }

    private void finished(BufferPull pull, Throwable error) {
        // Outside this source's lock: a pull calls into the source holding its own lock.
        String what = pull.describe();
        synchronized (this) {
            active.remove(pull);
            updateMemoryUsage();
            if (error != null && !closed) {
                Throwable cause = error instanceof java.util.concurrent.CompletionException && error.getCause() != null
                        ? error.getCause() : error;
                fail(new TrinoException(BINX_EXCHANGE_FAILED, "reading " + what + " failed: " + cause.getMessage(), cause));
            }
            signalLater();
        }
        pumpLater();
    }

    /** Keeps the first failure; the readers stop once the lock is released ({@link #signalNow}). */
    private void fail(TrinoException e) {
        if (failure == null) {
            failure = e;
            manager.stats().sourcesFailed.increment();
        }
        toStop.addAll(active);
        signalLater();
    }

    private final List<BufferPull> toStop = new ArrayList<>();

    /** Marks the blocked future to complete once the lock is released. */
    private void signalLater() {
        wakeups.markDue();
    }

    /** Outside the lock: stops readers and wakes the engine (their locks come after ours). */
    private void signalNow() {
        List<CompletableFuture<Void>> due;
        List<BufferPull> stop;
        synchronized (this) {
            due = wakeups.takeDue();
            stop = List.copyOf(toStop);
            toStop.clear();
        }
        for (BufferPull p : stop) {
            p.stop();
        }
        for (CompletableFuture<Void> f : due) {
            f.complete(null);
        }
    }

    @Override
    public CompletableFuture<Void> isBlocked() {
        synchronized (this) {
            if (!ready.isEmpty() || closed || failure != null || done()) {
                return NOT_BLOCKED;
            }
            // A copy: the engine cancels what it is given, which must not cancel ours.
            return wakeups.waiting().copy();
        }
    }

    private boolean done() {
        return noMoreHandles && selector != null && selector.isFinal() && queue.isEmpty() && active.isEmpty() && ready.isEmpty();
    }

    @Override
    public synchronized boolean isFinished() {
        return closed || (failure == null && done());
    }

    /**
     * Takes the next page. Readers that stopped for want of room are resumed on a background
     * thread, not on the engine's driver thread: resuming sends requests.
     */
    @Override
    public Slice read() {
        List<BufferPull> resume = null;
        Slice page;
        synchronized (this) {
            if (failure != null) {
                throw failure;
            }
            page = ready.poll();
            if (page == null) {
                return null;
            }
            readyBytes -= page.length() + TaskWriter.PAGE_OVERHEAD;
            updateMemoryUsage();
            if (starved && bufferBytes - readyBytes > 0) {
                starved = false;
                resume = List.copyOf(active);
            }
        }
        if (resume != null) {
            List<BufferPull> pulls = resume;
            try {
                // Not on the manager's small background pool: a resume may wait on a pull that
                // is connecting to a stuck binxd (up to its connect deadline).
                RESUMES.execute(() -> pulls.forEach(BufferPull::resume));
            } catch (RejectedExecutionException e) {
                // The manager is closing: resume here rather than leave a reader waiting.
                pulls.forEach(BufferPull::resume);
            }
        }
        manager.stats().pagesRead.increment();
        manager.stats().bytesRead.add(page.length());
        return page;
    }

    @Override
    public long getMemoryUsage() {
        return memoryUsage;
    }

    @Override
    public void close() {
        List<BufferPull> stop;
        BinxConnection toClose;
        boolean clean;
        synchronized (this) {
            if (closed) {
                return;
            }
            // No reader left, and none stopped by a failure (one stopped may still be sending).
            clean = active.isEmpty() && failure == null;
            closed = true;
            stop = List.copyOf(active);
            active.clear();
            queue.clear();
            ready.clear();
            readyBytes = 0;
            updateMemoryUsage();
            signalLater();
            toClose = connection;
        }
        // Outside the lock: closing a socket may take a while, and the engine's threads must not
        // wait for it (see memoryUsage). The readers stop first, so none asks on a new one.
        for (BufferPull p : stop) {
            p.stop();
        }
        if (toClose != null) {
            // Kept for the next source when every read ended and nothing is in flight on it
            // (the pool checks); closed otherwise.
            if (clean) {
                manager.connector().giveBack(toClose);
            } else {
                toClose.close();
            }
        }
        signalNow();
    }
}
