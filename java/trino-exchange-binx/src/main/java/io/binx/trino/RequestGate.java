package io.binx.trino;

import java.util.ArrayDeque;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.Executor;
import java.util.function.Function;

/**
 * At most {@code limit} requests of one kind in flight for the whole manager, the rest waiting
 * in order without a thread. The coordinator's requests share one connection to its binxd,
 * whose sender waits for a free request slot: requests kept within this gate (and the other
 * kinds' own bounds) never wait there, so no thread of the plugin's, or of the engine's common
 * pool, is parked behind a busy sidecar (review: five exchanges laying out their handles at once
 * took every slot). A request keeps its turn until it says it is settled (nothing of it in
 * flight any more), not merely until its caller stopped waiting: a request already sent holds
 * a slot of the connection until it is answered.
 */
final class RequestGate {
    private final int limit;
    private final Executor executor;

    // Guarded by `this`.
    private final ArrayDeque<Waiting<?>> waiting = new ArrayDeque<>();
    private int inFlight;
    private int peak;

    /** Starts requests on this thread after the one starting now (an executor that runs inline must not recurse). */
    private final ThreadLocal<ArrayDeque<Waiting<?>>> starting = new ThreadLocal<>();

    private record Waiting<T>(Function<CompletableFuture<Void>, CompletableFuture<T>> request, CompletableFuture<T> result) {}

    /** {@code executor} starts the requests (a start may connect); it must never refuse. */
    RequestGate(int limit, Executor executor) {
        if (limit < 1) {
            throw new IllegalArgumentException("a request gate needs a limit of at least 1, not " + limit);
        }
        this.limit = limit;
        this.executor = executor;
    }

    /**
     * Starts {@code request} when fewer than the limit are in flight; the future returned ends
     * as the request's does. The request is given the future it must complete once nothing of it
     * is in flight any more: its turn ends then. Cancelled (or otherwise completed) while it
     * waits, it is never started; ended early while it runs, its request is cancelled.
     */
    <T> CompletableFuture<T> submit(Function<CompletableFuture<Void>, CompletableFuture<T>> request) {
        Waiting<T> w = new Waiting<>(request, new CompletableFuture<>());
        boolean now;
        synchronized (this) {
            now = inFlight < limit;
            if (now) {
                taken();
            } else {
                waiting.add(w);
            }
        }
        if (now) {
            start(w);
        }
        return w.result();
    }

    /** Requests in flight at most so far (a test's and an operator's check of the limit). */
    synchronized int peak() {
        return peak;
    }

    /** Requests holding a turn now. */
    synchronized int inFlight() {
        return inFlight;
    }

    /** Requests waiting for their turn. */
    synchronized int waiting() {
        return waiting.size();
    }

    private void taken() {
        inFlight++;
        peak = Math.max(peak, inFlight);
    }

    private void start(Waiting<?> first) {
        ArrayDeque<Waiting<?>> later = starting.get();
        if (later != null) {
            later.add(first);
            return;
        }
        later = new ArrayDeque<>();
        starting.set(later);
        try {
            for (Waiting<?> w = first; w != null; w = later.poll()) {
                Waiting<?> next = w;
                executor.execute(() -> run(next));
            }
        } finally {
            starting.remove();
        }
    }

    private <T> void run(Waiting<T> w) {
        if (w.result().isDone()) {
            finished();
            return;
        }
        CompletableFuture<Void> settled = new CompletableFuture<>();
        CompletableFuture<T> started;
        try {
            started = w.request().apply(settled);
        } catch (RuntimeException | Error e) {
            // Its turn ends with it: a request that could not start holds nothing.
            started = CompletableFuture.failedFuture(e);
            settled.complete(null);
        }
        CompletableFuture<T> request = started;
        // A result ended early (cancelled, timed out) stops the request's retries as well.
        w.result().whenComplete((v, e) -> {
            if (!request.isDone()) {
                request.cancel(false);
            }
        });
        request.whenComplete((v, e) -> {
            if (e != null) {
                w.result().completeExceptionally(e);
            } else {
                w.result().complete(v);
            }
        });
        settled.whenComplete((v, e) -> finished());
    }

    /** A request settled: the first still wanted starts in its place. */
    private void finished() {
        Waiting<?> next;
        synchronized (this) {
            inFlight--;
            do {
                next = waiting.poll();
            } while (next != null && next.result().isDone());
            if (next != null) {
                taken();
            }
        }
        if (next != null) {
            start(next);
        }
    }
}
