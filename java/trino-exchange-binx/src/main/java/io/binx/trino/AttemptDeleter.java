package io.binx.trino;

import io.binx.client.BinxConnectionException;
import io.binx.client.DaemonThreads;
import io.binx.client.Tasks;
import java.util.ArrayDeque;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.RejectedExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.function.BiConsumer;
import java.util.logging.Level;
import java.util.logging.Logger;

/**
 * Deletes closed exchanges' finished task attempts, in the background, for one exchange
 * manager. Each attempt's commit is looked up where the exchange did not learn it, then its
 * buffers are deleted on the sidecar that holds it, through the local one: with one DELETE_TASK
 * where the local binxd offers it ({@code task-delete}), else, or when that is not answered OK
 * (a sidecar without it, one that cannot be reached), each buffer with a DELETE. When that sidecar
 * is gone, the local one answers TIMEOUT until the remote has failed for its
 * {@code spool_failover_after}, and then deletes the buffer (marker, segments, at the last the
 * manifest) from storage: so a DELETE is asked again for up to
 * {@code exchange.binx.max-error-duration}. A task one of whose DELETEs still fails is left, the
 * rest of its buffers too, to the sidecars' abandonment and the storage TTL, with one warning.
 *
 * <p>An attempt without a commit when it is looked up may still be committing: its sink's
 * {@code finish()} was under way when the exchange closed, and Trino reports nothing of it
 * after that. Its commit is looked up again 1 s, 5 s and 30 s later, and once more after
 * {@code exchange.binx.max-error-duration} (as long as a writer keeps trying), so that what
 * lands late is deleted too rather than left to the storage TTL. An attempt that was aborted,
 * or never wrote, costs those four lookups (a storage read each), made only while no closed
 * exchange's attempt waits for its first. At most {@link #MAX_RECHECKS} attempts wait for one
 * at a time; past that, an attempt is left to the sidecars' rules and counted. Rechecks still
 * waiting when the manager shuts down, or when the local binxd could not be reached for
 * max-error-duration, are dropped uncounted (most attempts without a commit never get one).
 *
 * <p>Bounded: at most {@link #IN_FLIGHT} requests at once for the whole manager (well within a
 * connection's slots, so the coordinator's other requests are not held back), lookups only while
 * no looked-up task waits, and a looked-up task waits as one range of buffer ids. Requests are
 * started and their answers handled on the manager's background pool.
 */
final class AttemptDeleter {
    private static final Logger LOG = Logger.getLogger(AttemptDeleter.class.getName());
    /** Requests (lookups and DELETEs, each with its retries) at once. */
    static final int IN_FLIGHT = 64;
    /**
     * DELETEs at once to one remote sidecar (the local one's are bounded by {@link #IN_FLIGHT}
     * alone): a dead one's are each retried until the local sidecar fails over (its {@code
     * spool_failover_after}), and must not hold back the deletions on live ones meanwhile
     * (review: two tasks of a killed worker took every slot).
     */
    static final int IN_FLIGHT_PER_REMOTE = IN_FLIGHT / 4;
    /** Lookups at once: each may add a task's buffers (up to 65,536) to delete. */
    private static final int LOOKUPS = 4;
    /** Attempts of closed exchanges waiting for their first lookup, at most. */
    static final int MAX_QUEUED = 100_000;
    /** Attempts waiting to be looked up again, at most. */
    static final int MAX_RECHECKS = 100_000;
    /** When an attempt without a commit is looked up again, after the lookup before (ms). */
    private static final long[] RECHECK_AFTER_MILLIS = {1_000, 4_000, 25_000};

    /** Hands attempts due for another lookup back to the deleter (never runs a request itself). */
    private static final java.util.concurrent.ScheduledExecutorService RECHECKS =
            DaemonThreads.scheduler("binx-exchange-deleter-rechecks");

    private final BinxExchangeManager manager;
    private final int maxQueued;

    // Guarded by `this`.
    private final ArrayDeque<Attempt> tasks = new ArrayDeque<>();
    /** Attempts due for another lookup: looked up only while no first lookup waits. */
    private final ArrayDeque<Attempt> rechecks = new ArrayDeque<>();
    private final ArrayDeque<Range> ranges = new ArrayDeque<>();
    /** Ranges whose DELETE_TASK is in flight (out of {@link #ranges} meanwhile). */
    private final java.util.Set<Range> wholeInFlight = new java.util.HashSet<>();
    /** DELETEs in flight by remote (none: absent). */
    private final java.util.HashMap<String, Integer> inFlightTo = new java.util.HashMap<>();
    private int inFlight;
    private int lookups;
    /** Attempts waiting for their next lookup. */
    private int rechecking;

    /**
     * A finished attempt to delete, with its commit when the exchange learned it, and how many
     * lookups found none so far.
     */
    private record Attempt(String exchangeId, String taskId, Tasks.CommittedTask commit, int lookedUp) {}

    /** A task's buffers still to delete: {@code next} up to {@code count}, on {@code remote}. */
    private static final class Range {
        final Attempt attempt;
        final String remote;
        final int count;
        int next;
        boolean gaveUp;
        /** One DELETE_TASK for all of it is tried first; buffer by buffer once it failed. */
        boolean whole;

        Range(Attempt attempt, String remote, int count, boolean whole) {
            this.attempt = attempt;
            this.remote = remote;
            this.count = count;
            this.whole = whole;
        }
    }

    AttemptDeleter(BinxExchangeManager manager) {
        this(manager, MAX_QUEUED);
    }

    /** With at most {@code maxQueued} attempts waiting for their first lookup (tests). */
    AttemptDeleter(BinxExchangeManager manager, int maxQueued) {
        this.manager = manager;
        this.maxQueued = maxQueued;
    }

    /**
     * {@code request} ended by its error budget and a margin if binxd never answers (the budget
     * counts only failures, and an unanswered request never fails), the shared connection
     * reconnected if it is still unanswered a margin after that: a deleter request never holds
     * its slot here, nor the connection's, for good (review: four unanswered lookups stopped
     * every deletion while closed exchanges queued up).
     */
    private <T> CompletableFuture<T> bounded(CompletableFuture<T> request, CompletableFuture<?> settled) {
        long budget = manager.config().maxErrorMillis();
        CompletableFuture<Void> answered = settled.handle((v, e) -> null);
        return manager.unstick(request.orTimeout(budget + BinxExchangeManager.margin(budget), TimeUnit.MILLISECONDS), answered);
    }

    /** Queues the attempts of a closed exchange; returns at once. */
    void delete(String exchangeId, List<String> taskIds, Map<String, Tasks.CommittedTask> known) {
        int dropped = 0;
        synchronized (this) {
            for (String taskId : taskIds) {
                if (tasks.size() >= maxQueued) {
                    dropped++;
                    continue;
                }
                tasks.add(new Attempt(exchangeId, taskId, known.get(taskId), 0));
            }
        }
        if (dropped > 0) {
            manager.stats().outputsLeftToTtl.add(dropped);
            LOG.warning("binx exchange deleter: " + maxQueued + " attempts already wait to be deleted (the local binxd at "
                    + manager.config().socket() + " answers too slowly); " + dropped + " attempts of exchange " + exchangeId
                    + " are left to the sidecars' storage TTL and abandonment");
        }
        onBackground(this::pump);
    }

    /** Waits up to {@code millis} for every queued deletion to end; false if some are left. */
    synchronized boolean awaitIdle(long millis) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(millis);
        while (inFlight > 0 || !tasks.isEmpty() || !ranges.isEmpty() || !rechecks.isEmpty()) {
            long left = TimeUnit.NANOSECONDS.toMillis(deadline - System.nanoTime());
            if (left <= 0) {
                return false;
            }
            wait(left);
        }
        return true;
    }

    /** Starts what the bounds allow: DELETEs first, then lookups of more tasks. */
    private void pump() {
        while (true) {
            Runnable next;
            synchronized (this) {
                if (inFlight >= IN_FLIGHT) {
                    return;
                }
                // The first range whose remote has a slot left, in queue order.
                Range r = null;
                for (Range candidate : ranges) {
                    // The local sidecar ("") answers itself: it has every slot.
                    if (candidate.remote.isEmpty()
                            || inFlightTo.getOrDefault(candidate.remote, 0) < IN_FLIGHT_PER_REMOTE) {
                        r = candidate;
                        break;
                    }
                }
                if (r != null) {
                    Range range = r;
                    inFlightTo.merge(range.remote, 1, Integer::sum);
                    if (range.whole) {
                        // Back at the head of the queue if it fails.
                        ranges.remove(range);
                        wholeInFlight.add(range);
                        next = () -> deleteWhole(range);
                    } else {
                        int buffer = range.next++;
                        if (range.next >= range.count) {
                            ranges.remove(range);
                        }
                        next = () -> delete(range, buffer);
                    }
                } else if (lookups < LOOKUPS && (!tasks.isEmpty() || !rechecks.isEmpty())) {
                    // A closed exchange's attempts before another look at ones without a commit.
                    Attempt a = tasks.isEmpty() ? rechecks.poll() : tasks.poll();
                    lookups++;
                    next = () -> lookup(a);
                } else {
                    if (inFlight == 0) {
                        notifyAll();
                    }
                    return;
                }
                inFlight++;
            }
            next.run();
        }
    }

    private void lookup(Attempt a) {
        CompletableFuture<Tasks.CommittedTask> found;
        if (a.commit() != null) {
            found = CompletableFuture.completedFuture(a.commit());
        } else {
            CompletableFuture<Void> settled = new CompletableFuture<>();
            found = bounded(Tasks.committed(manager::shared, a.taskId(), manager.config().maxErrorMillis(),
                    manager.callbacks(), settled), settled);
        }
        then(found, (c, err) -> {
            synchronized (this) {
                lookups--;
            }
            if (err != null) {
                gaveUp(a, err);
                return;
            }
            // No commit: an attempt that failed after sinkFinished, or was aborted (its sink
            // aborted it, or its sidecar drops it when abandoned), or one still committing.
            if (c == null) {
                recheckLater(a);
                return;
            }
            if (c.bufferCount() > 0) {
                // The local sidecar's address (asked once per manager, on the plugin's threads)
                // says whether the buffers are deleted here or through it at their producer.
                CompletableFuture<String> local = manager.localAddressLookup();
                synchronized (this) {
                    inFlight++;
                }
                then(local, (address, e) -> {
                    if (e != null) {
                        // Unreachable for the whole budget: every queued attempt goes with it.
                        gaveUp(a, e);
                        return;
                    }
                    if (c.endpoint().isEmpty() && !address.isEmpty()) {
                        // Its producer's sidecar names no address (no TCP listener, or no
                        // advertise_address) and is not this one: nothing can reach it, and the
                        // local binxd never deletes another node's output. Left to the TTL, counted
                        // (it was sent here before, and counted deleted).
                        manager.stats().outputsLeftToTtl.increment();
                        LOG.fine("binx exchange deleter: the output of " + a.taskId()
                                + " is on a sidecar that names no address; left to its storage TTL");
                        return;
                    }
                    synchronized (this) {
                        ranges.add(new Range(a, c.endpoint().equals(address) ? "" : c.endpoint(), c.bufferCount(),
                                manager.localOffersTaskDelete()));
                    }
                });
            }
        });
    }

    /**
     * DELETE_TASK for all of {@code r}; any failure (the type refused by a sidecar without it,
     * a remote that cannot be reached, the local binxd gone) puts it back to be deleted buffer by
     * buffer, whose DELETEs are retried and fail over as they always were.
     */
    private void deleteWhole(Range r) {
        CompletableFuture<?> wire = Tasks.deleteTask(manager::shared, r.attempt.taskId(), r.count, r.remote);
        CompletableFuture<?> deleted = bounded(wire.copy(), wire.handle((v, e) -> null));
        then(deleted, (ok, err) -> {
            synchronized (this) {
                deleted(r.remote);
                wholeInFlight.remove(r);
                if (err != null && !r.gaveUp) {
                    r.whole = false;
                    ranges.addFirst(r);
                    return;
                }
            }
            if (err != null) {
                // The local binxd was given up on meanwhile (one warning said so for all).
                manager.stats().outputsLeftToTtl.increment();
                return;
            }
            manager.stats().buffersDeleted.add(r.count);
            manager.stats().taskDeletes.increment();
        });
    }

    private void delete(Range r, int buffer) {
        synchronized (this) {
            if (r.gaveUp) {
                inFlight--;
                deleted(r.remote);
                return;
            }
        }
        CompletableFuture<Void> settled = new CompletableFuture<>();
        CompletableFuture<?> deleted = bounded(Tasks.delete(manager::shared, r.attempt.taskId(), buffer, r.remote,
                manager.config().maxErrorMillis(), manager.callbacks(), settled), settled);
        then(deleted, (ok, err) -> {
            synchronized (this) {
                deleted(r.remote);
            }
            if (err == null) {
                manager.stats().buffersDeleted.increment();
                return;
            }
            synchronized (this) {
                if (r.gaveUp) {
                    return;
                }
                r.gaveUp = true;
                ranges.remove(r);
            }
            gaveUp(r.attempt, err);
        });
    }

    /** DELETEs in flight now, to every remote. */
    synchronized int deletesInFlight() {
        return inFlightTo.values().stream().mapToInt(Integer::intValue).sum();
    }

    /** A DELETE to {@code remote} ended (its slot is free). Guarded by {@code this}. */
    private void deleted(String remote) {
        inFlightTo.computeIfPresent(remote, (k, n) -> n > 1 ? n - 1 : null);
    }

    /** Looks {@code a} up again later (see the class comment), or leaves it when done asking. */
    private void recheckLater(Attempt a) {
        long after;
        if (a.lookedUp() < RECHECK_AFTER_MILLIS.length) {
            after = RECHECK_AFTER_MILLIS[a.lookedUp()];
        } else if (a.lookedUp() == RECHECK_AFTER_MILLIS.length) {
            // The last: a writer retries its commit for up to max-error-duration.
            after = manager.config().maxErrorMillis();
        } else {
            return;
        }
        synchronized (this) {
            // Those scheduled and those due but not yet looked up, together.
            if (rechecking + rechecks.size() >= MAX_RECHECKS) {
                manager.stats().outputsLeftToTtl.increment();
                return;
            }
            rechecking++;
        }
        Attempt again = new Attempt(a.exchangeId(), a.taskId(), null, a.lookedUp() + 1);
        RECHECKS.schedule(() -> {
            synchronized (this) {
                rechecking--;
                rechecks.add(again);
            }
            onBackground(this::pump);
        }, after, TimeUnit.MILLISECONDS);
    }

    /**
     * Handles {@code f}'s answer on the manager's background pool, then goes on; when the pool
     * is shut down, only counts it (what is left goes by the sidecars' own rules).
     */
    private <T> void then(CompletableFuture<T> f, BiConsumer<T, Throwable> handler) {
        f.whenComplete((value, err) -> onBackground(() -> {
            try {
                handler.accept(value, err);
            } catch (RuntimeException e) {
                LOG.log(Level.WARNING, "binx exchange manager: deleting an exchange's output failed", e);
            } finally {
                synchronized (this) {
                    inFlight--;
                }
                pump();
            }
        }, () -> {
            synchronized (this) {
                inFlight--;
                dropAll();
            }
        }));
    }

    private void onBackground(Runnable task) {
        onBackground(task, () -> {
            synchronized (this) {
                dropAll();
            }
        });
    }

    /** The manager's pool is shut down: nothing more is deleted. Guarded by {@code this}. */
    private void dropAll() {
        tasks.clear();
        rechecks.clear();
        ranges.clear();
        wholeInFlight.clear();
        inFlightTo.clear();
        notifyAll();
    }

    private void onBackground(Runnable task, Runnable rejected) {
        try {
            manager.background().execute(task);
        } catch (RejectedExecutionException e) {
            rejected.run();
        }
    }

    /**
     * A request for {@code a} gave up. When the local binxd itself could not be reached for all
     * of max-error-duration, every queued task is dropped too (each would wait that long in
     * turn, for the same answer), with one warning; else only {@code a}'s task is.
     */
    private void gaveUp(Attempt a, Throwable err) {
        // A broken or refused connection to the local binxd, not a refusal it sent.
        if (!BinxConnectionException.causedBy(err)) {
            warn(a, err);
            return;
        }
        int dropped;
        synchronized (this) {
            dropped = tasks.size() + ranges.size();
            tasks.clear();
            // Attempts that had no commit when last looked up: most never will; not counted.
            rechecks.clear();
            for (Range r : ranges) {
                r.gaveUp = true;
            }
            ranges.clear();
            // Not counted here: each is counted when its DELETE_TASK fails (or not, if it is OK).
            for (Range r : wholeInFlight) {
                r.gaveUp = true;
            }
        }
        if (dropped == 0) {
            warn(a, err);
            return;
        }
        // a's own and the dropped ones.
        manager.stats().outputsLeftToTtl.add(dropped + 1L);
        LOG.log(Level.WARNING, "binx exchange " + a.exchangeId() + ": the local binxd cannot be reached ("
                + BinxExchange.causeOf(err) + "): the output of task " + a.taskId() + " and of " + dropped
                + " more queued task(s) is left to the sidecars' own rules (abandonment, then the storage TTL)");
    }

    /** Gives up on {@code a}'s output alone: counted, and a warning. */
    private void warn(Attempt a, Throwable err) {
        manager.stats().outputsLeftToTtl.increment();
        LOG.log(Level.WARNING, "binx exchange " + a.exchangeId() + ": could not delete the output of task " + a.taskId()
                + "; its sidecar frees it when abandoned, storage at its TTL: " + BinxExchange.causeOf(err));
    }
}
