package io.binx.trino;

import io.binx.client.Tasks;
import java.util.ArrayDeque;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.RejectedExecutionException;
import java.util.function.BiConsumer;
import java.util.logging.Level;
import java.util.logging.Logger;

/**
 * Deletes a closed exchange's finished task attempts, in the background. Each attempt's commit
 * is looked up where the exchange did not learn it, then each of its buffers is deleted on the
 * sidecar that holds it, through the local one. When that sidecar is gone, the local one
 * answers TIMEOUT until the remote has failed for its {@code spool_failover_after}, and then
 * deletes the buffer (marker, segments, at the last the manifest) from storage: so every DELETE
 * is asked again for up to {@code exchange.binx.max-error-duration}. What still fails is left
 * to the sidecars' abandonment and the storage TTL, and logged once per task.
 *
 * <p>Bounded: at most {@link #IN_FLIGHT} requests at once, lookups only while few buffers wait,
 * and a looked-up task waits as one range of buffer ids, not one entry per buffer.
 */
final class AttemptDeletion {
    private static final Logger LOG = Logger.getLogger(AttemptDeletion.class.getName());
    /** Requests (lookups and DELETEs, each with its retries) at once. */
    static final int IN_FLIGHT = 256;
    /** Lookups at once: each may add a task's buffers (up to 65,536) to delete. */
    private static final int LOOKUPS = 4;

    private final BinxExchangeManager manager;
    private final String exchangeId;
    private final Map<String, Tasks.CommittedTask> known;

    // Guarded by `this`.
    private final ArrayDeque<String> tasks;
    private final ArrayDeque<Range> ranges = new ArrayDeque<>();
    private final Set<String> warned = new HashSet<>();
    private int inFlight;
    private int lookups;
    /** Completes when nothing is left to do (or the manager shut down). */
    private final CompletableFuture<Void> done = new CompletableFuture<>();

    /** A task's buffers still to delete: {@code next} up to {@code count}, on {@code remote}. */
    private static final class Range {
        final String taskId;
        final String remote;
        final int count;
        int next;

        Range(String taskId, String remote, int count) {
            this.taskId = taskId;
            this.remote = remote;
            this.count = count;
        }
    }

    AttemptDeletion(BinxExchangeManager manager, String exchangeId, List<String> tasks, Map<String, Tasks.CommittedTask> known) {
        this.manager = manager;
        this.exchangeId = exchangeId;
        this.tasks = new ArrayDeque<>(tasks);
        this.known = known;
    }

    /**
     * Starts on the manager's background pool (close() returns at once); the future completes
     * when every request was answered or gave up.
     */
    CompletableFuture<Void> start() {
        try {
            manager.background().execute(this::pump);
        } catch (RejectedExecutionException e) {
            // The manager shut down: what is left goes by the sidecars' own rules.
            done.complete(null);
        }
        return done;
    }

    /** Starts what the bounds allow: DELETEs first, then lookups of more tasks. */
    private void pump() {
        while (true) {
            Runnable next;
            synchronized (this) {
                if (inFlight >= IN_FLIGHT) {
                    return;
                }
                Range r = ranges.peek();
                if (r != null) {
                    int buffer = r.next++;
                    if (r.next >= r.count) {
                        ranges.poll();
                    }
                    next = () -> delete(r, buffer);
                } else if (lookups < LOOKUPS && !tasks.isEmpty()) {
                    String taskId = tasks.poll();
                    lookups++;
                    next = () -> lookup(taskId);
                } else {
                    if (inFlight == 0 && tasks.isEmpty()) {
                        done.complete(null);
                    }
                    return;
                }
                inFlight++;
            }
            next.run();
        }
    }

    private void lookup(String taskId) {
        Tasks.CommittedTask commit = known.get(taskId);
        CompletableFuture<Tasks.CommittedTask> found = commit != null
                ? CompletableFuture.completedFuture(commit)
                : Tasks.committed(manager::shared, taskId, manager.config().maxErrorMillis());
        then(found, (c, err) -> {
            synchronized (this) {
                lookups--;
            }
            if (err != null) {
                warn(taskId, err);
            } else if (c != null && c.bufferCount() > 0) {
                // May ask the local sidecar its address (once): on the background pool, not on
                // a connection's reader.
                Range r = new Range(taskId, manager.remoteFor(c.endpoint()), c.bufferCount());
                synchronized (this) {
                    ranges.add(r);
                }
            }
            // No commit: an attempt that failed after sinkFinished, or was aborted; its sink
            // aborted it, or its sidecar drops it when abandoned.
        });
    }

    private void delete(Range r, int buffer) {
        then(Tasks.delete(manager::shared, r.taskId, buffer, r.remote, manager.config().maxErrorMillis()), (ok, err) -> {
            if (err != null) {
                warn(r.taskId, err);
            }
        });
    }

    /** Runs {@code handler} on the manager's background pool when {@code f} completes, then goes on. */
    private <T> void then(CompletableFuture<T> f, BiConsumer<T, Throwable> handler) {
        try {
            f.whenCompleteAsync((value, err) -> {
                try {
                    handler.accept(value, err);
                } catch (RuntimeException e) {
                    LOG.log(Level.WARNING, "binx exchange " + exchangeId + ": deleting its output failed", e);
                }
                synchronized (this) {
                    inFlight--;
                }
                pump();
            }, manager.background());
        } catch (RejectedExecutionException e) {
            // The manager shut down: what is left goes by the sidecars' own rules.
            done.complete(null);
        }
    }

    private void warn(String taskId, Throwable err) {
        synchronized (this) {
            if (!warned.add(taskId)) {
                return;
            }
        }
        LOG.log(Level.WARNING, "binx exchange " + exchangeId + ": could not delete the output of task " + taskId
                + "; its sidecar frees it when abandoned, storage at its TTL: " + BinxExchange.causeOf(err));
    }
}
