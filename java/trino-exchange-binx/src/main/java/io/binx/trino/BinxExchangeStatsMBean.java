package io.binx.trino;

/**
 * The exchange manager's counters over JMX (since the manager started), on every node: what its
 * sinks wrote into the local binxd, what its sources read through it, and what the coordinator
 * deleted. binxd's own metrics (Prometheus, /v1/stats) say what the sidecar did with it.
 */
public interface BinxExchangeStatsMBean {
    /** Exchanges created (on the coordinator). */
    long getExchangesCreated();

    /** Sinks created: task attempts that began writing. */
    long getSinksStarted();

    /**
     * Sinks whose finish() completed: their output is committed to storage. Each sink counts
     * once, under its first outcome: committed, failed or aborted.
     */
    long getSinksCommitted();

    /** Sinks whose finish() failed (the attempt is retried by the engine). */
    long getSinksFailed();

    /** Sinks the engine aborted (an abort after a successful finish is not one: it changes nothing). */
    long getSinksAborted();

    /**
     * The batches (ENQUEUE requests, not counting those sent again) the sinks made of their
     * pages, counted when a sink ends: {@code PagesWritten} over it is how many pages an ENQUEUE
     * carried.
     */
    long getEnqueues();

    /** Pages added to a sink after its finish succeeded: ignored, the committed output kept whole. */
    long getPagesAddedAfterFinish();

    /** Pages sinks took to write into the local binxd (a later failure or abort drops what was not committed). */
    long getPagesWritten();

    /** Their bytes. */
    long getBytesWritten();

    /** Sources created. */
    long getSourcesStarted();

    /** Sources that failed (the reading attempt fails, and is retried). */
    long getSourcesFailed();

    /** Pages sources handed to the engine. */
    long getPagesRead();

    /** Their bytes. */
    long getBytesRead();

    /** Buffers of attempts' outputs deleted after their exchange closed (on the coordinator). */
    long getBuffersDeleted();

    /**
     * Attempts' outputs deleted with one DELETE_TASK each (their buffers are counted in {@link
     * #getBuffersDeleted()} too); the others were deleted buffer by buffer.
     */
    long getTaskDeletes();

    /**
     * Attempts' outputs whose deletion was given up (the local binxd unreachable for all of
     * max-error-duration, or refusing): left to the sidecars' own rules and the storage TTL.
     */
    long getOutputsLeftToTtl();
}
