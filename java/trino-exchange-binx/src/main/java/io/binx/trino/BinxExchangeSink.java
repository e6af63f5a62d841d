package io.binx.trino;

import static io.binx.trino.BinxErrorCode.BINX_EXCHANGE_FAILED;

import io.airlift.slice.Slice;
import io.binx.client.BinxException;
import io.binx.client.TaskWriter;
import io.trino.spi.TrinoException;
import io.trino.spi.exchange.ExchangeSink;
import io.trino.spi.exchange.ExchangeSinkInstanceHandle;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.atomic.AtomicReference;

/**
 * An attempt's output, written into the local binxd as one binx task (a PARTITIONED buffer per
 * output partition) under spool policy {@code commit} (or {@code always}): {@link #finish}
 * completes only once binxd committed every buffer and the task's manifest to storage, so the
 * output outlives this worker and its sidecar.
 *
 * <p>{@link #add} never throws: a Trino 483 task whose final flush throws hangs. A failure (a
 * page over the size limit, binxd refusing, the socket gone for good) is kept, and fails
 * {@link #finish} with it.
 */
final class BinxExchangeSink implements ExchangeSink {
    private static final long INSTANCE_SIZE = 256;
    private static final java.util.logging.Logger LOG = java.util.logging.Logger.getLogger(BinxExchangeSink.class.getName());

    private final BinxSinkInstanceHandle handle;
    private final TaskWriter writer;
    private final long maxPageBytes;
    private final AtomicReference<TrinoException> failure = new AtomicReference<>();
    private final BinxExchangeStats stats;
    /** The sink's outcome (committed, failed or aborted) is counted once, the first. */
    private final java.util.concurrent.atomic.AtomicBoolean outcomeCounted = new java.util.concurrent.atomic.AtomicBoolean();
    /** A page added after a successful finish is logged once a sink. */
    private final java.util.concurrent.atomic.AtomicBoolean lateAddLogged = new java.util.concurrent.atomic.AtomicBoolean();
    /** Set before the writer is aborted, so a finish that fails by it counts as aborted. */
    private volatile boolean abortAsked;

    BinxExchangeSink(BinxExchangeManager manager, BinxSinkInstanceHandle handle, TaskWriter.Options options) {
        this.handle = handle;
        this.maxPageBytes = manager.config().maxPageBytes();
        this.stats = manager.stats();
        stats.sinksStarted.increment();
        TaskWriter w = null;
        try {
            w = new TaskWriter(manager.connector(), handle.taskId(), handle.outputPartitionCount(),
                    manager.config().spoolPolicy(), options);
        } catch (RuntimeException e) {
            failure.compareAndSet(null, failed("cannot start writing", e));
        }
        this.writer = w;
    }

    private TrinoException failed(String what, Throwable cause) {
        return new TrinoException(BINX_EXCHANGE_FAILED, "binx exchange sink of task " + handle.taskId() + ": " + what
                + (cause == null ? "" : ": " + cause.getMessage()), cause);
    }

    @Override
    public boolean isHandleUpdateRequired() {
        return false;
    }

    @Override
    public void updateHandle(ExchangeSinkInstanceHandle handle) {
        // Never requested (isHandleUpdateRequired is false); nothing to do if it were.
    }

    @Override
    public CompletableFuture<Void> isBlocked() {
        if (writer == null || failure.get() != null) {
            return NOT_BLOCKED;
        }
        CompletableFuture<Void> room = writer.whenRoom();
        // The engine may cancel what it is given: hand it a copy, so cancelling never
        // reaches the writer's own future (which always completes: on room, failure or abort).
        return room.isDone() ? NOT_BLOCKED : room.copy();
    }

    @Override
    public void add(int partitionId, Slice data) {
        try {
            if (writer == null || failure.get() != null) {
                return;
            }
            if (writer.finishedWell()) {
                ignoreLatePage(partitionId);
                return;
            }
            if (data.length() > maxPageBytes) {
                failure.compareAndSet(null, failed("a page of " + data.length() + " bytes for output partition " + partitionId
                        + " exceeds exchange.binx.max-page-size (" + maxPageBytes + " bytes)", null));
                return;
            }
            // A copy (the SPI's rule): the engine may reuse the slice's memory once add returns,
            // and the writer keeps pages until binxd confirms them. The copy is also exactly the
            // page, so what the writer counts is what it holds (a slice may view a larger array).
            if (writer.add(partitionId, java.nio.ByteBuffer.wrap(data.getBytes()))) {
                stats.pagesWritten.increment();
                stats.bytesWritten.add(data.length());
            } else if (writer.finishedWell()) {
                // The finish succeeded between the check above and this page.
                ignoreLatePage(partitionId);
            }
        } catch (Throwable t) {
            failure.compareAndSet(null, failed("adding a page to output partition " + partitionId + " failed", t));
        }
    }

    /**
     * A page added after the finish succeeded: as in Trino's filesystem exchange, the committed
     * output stays as it is (it may be the attempt being read). Counted and logged, never silent.
     */
    private void ignoreLatePage(int partitionId) {
        stats.pagesAfterFinish.increment();
        if (lateAddLogged.compareAndSet(false, true)) {
            LOG.warning("binx exchange sink of task " + handle.taskId() + ": a page for output partition "
                    + partitionId + " was added after the sink finished; ignored (the output is what was committed)");
        }
    }

    @Override
    public long getMemoryUsage() {
        return INSTANCE_SIZE + (writer == null ? 0 : writer.bufferedBytes());
    }

    @Override
    public CompletableFuture<Void> finish() {
        TrinoException kept = failure.get();
        if (kept != null || writer == null) {
            if (writer != null) {
                // The engine does not abort after a failed finish: free what binxd holds.
                writer.abort("the task's output failed: " + (kept == null ? "" : kept.getMessage()));
            }
            countOutcome(stats.sinksFailed);
            return CompletableFuture.failedFuture(kept != null ? kept : failed("no writer", null));
        }
        CompletableFuture<Void> done = new CompletableFuture<>();
        writer.finish().whenComplete((ok, error) -> {
            if (error == null) {
                countOutcome(stats.sinksCommitted);
                done.complete(null);
            } else {
                // Failed by an abort the engine asked for: counted as aborted, not also failed.
                countOutcome(abortAsked ? stats.sinksAborted : stats.sinksFailed);
                Throwable cause = error instanceof java.util.concurrent.CompletionException && error.getCause() != null
                        ? error.getCause() : error;
                done.completeExceptionally(cause instanceof BinxException b
                        ? failed("its output could not be committed", b)
                        : failed("its output could not be committed", cause));
            }
        });
        return done;
    }

    private void countOutcome(java.util.concurrent.atomic.LongAdder outcome) {
        if (outcomeCounted.compareAndSet(false, true)) {
            outcome.increment();
            if (writer != null) {
                stats.enqueues.add(writer.batchesSealed());
            }
        }
    }

    @Override
    public CompletableFuture<Void> abort() {
        if (writer == null) {
            countOutcome(stats.sinksAborted);
            return CompletableFuture.completedFuture(null);
        }
        abortAsked = true;
        // After a successful finish nothing changes, as in Trino's filesystem exchange: the
        // output may be the attempt the coordinator selected; the exchange's close deletes it
        // with the others. The writer decides under its lock, so a finish succeeding meanwhile
        // is kept whole or failed by this abort, never reported committed and then deleted.
        java.util.Optional<CompletableFuture<Void>> aborting = writer.abortUnlessFinished("the task attempt was aborted");
        if (aborting.isEmpty()) {
            return CompletableFuture.completedFuture(null);
        }
        countOutcome(stats.sinksAborted);
        CompletableFuture<Void> done = new CompletableFuture<>();
        // Resolved whether binxd heard it or not: an abort it missed, it frees by its own rules.
        aborting.get().whenComplete((ok, error) -> done.complete(null));
        return done;
    }
}
