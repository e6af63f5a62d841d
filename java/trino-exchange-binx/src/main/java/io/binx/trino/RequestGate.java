package io.binx.trino;

import java.util.ArrayDeque;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.Executor;
import java.util.function.Supplier;

/**
 * At most {@code limit} requests of one kind in flight for the whole manager, the rest waiting
 * in order without a thread. The coordinator's requests share one connection to its binxd,
 * whose sender waits for a free request slot: requests kept within this gate (and the other
 * kinds' own bounds) never wait there, so no thread of the plugin's, or of the engine's common
 * pool, is parked behind a busy sidecar (review: five exchanges laying out their handles at once
 * took every slot).
 */
final class RequestGate {
    private final int limit;
    private final Executor executor;

    // Guarded by `this`.
    private final ArrayDeque<Waiting<?>> waiting = new ArrayDeque<>();
    private int inFlight;
    private int peak;

    private record Waiting<T>(Supplier<CompletableFuture<T>> request, CompletableFuture<T> result) {}

    /** {@code executor} starts the requests (a start may connect); it must never refuse. */
    RequestGate(int limit, Executor executor) {
        if (limit < 1) {
            throw new IllegalArgumentException("a request gate needs a limit of at least 1, not " + limit);
        }
        this.limit = limit;
        this.executor = executor;
    }

    /**
     * Starts {@code request} when fewer than the limit are in flight; its future ends as the
     * request's does. Cancelled (or otherwise completed) while it waits, it is never started.
     */
    <T> CompletableFuture<T> submit(Supplier<CompletableFuture<T>> request) {
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

    /** Requests waiting for their turn. */
    synchronized int waiting() {
        return waiting.size();
    }

    private void taken() {
        inFlight++;
        peak = Math.max(peak, inFlight);
    }

    private <T> void start(Waiting<T> w) {
        executor.execute(() -> {
            if (w.result().isDone()) {
                finished();
                return;
            }
            CompletableFuture<T> started;
            try {
                started = w.request().get();
            } catch (RuntimeException e) {
                started = CompletableFuture.failedFuture(e);
            }
            CompletableFuture<T> request = started;
            // A result ended early (cancelled, timed out) stops the request's retries as well.
            w.result().whenComplete((v, e) -> {
                if (!request.isDone()) {
                    request.cancel(false);
                }
            });
            request.whenComplete((v, e) -> {
                finished();
                if (e != null) {
                    w.result().completeExceptionally(e);
                } else {
                    w.result().complete(v);
                }
            });
        });
    }

    /** A request ended: the first still wanted starts in its place. */
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
