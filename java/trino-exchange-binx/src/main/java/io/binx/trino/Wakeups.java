package io.binx.trino;

import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;

/**
 * The futures an engine waits on ({@code isBlocked()}), completed outside the owner's lock.
 * Not thread-safe: every method but completing what {@link #takeDue} returned runs under the
 * owner's lock. Every future handed out is completed by a later {@link #markDue} and
 * {@link #takeDue}: one marked due but not yet completed never hides a newer one (a reader's
 * page could otherwise land between the two, wake only the older future, and leave the engine
 * waiting on the newer one with pages ready).
 */
final class Wakeups {
    private CompletableFuture<Void> waiting;
    private final List<CompletableFuture<Void>> due = new ArrayList<>();

    /** The future the engine waits on until the next {@link #markDue}. */
    CompletableFuture<Void> waiting() {
        if (waiting == null) {
            waiting = new CompletableFuture<>();
        }
        return waiting;
    }

    /** Something changed: the future waited on now is due. */
    void markDue() {
        if (waiting != null) {
            due.add(waiting);
            waiting = null;
        }
    }

    /** Whether a future is due (to complete by {@link #takeDue}). */
    boolean anyDue() {
        return !due.isEmpty();
    }

    /** What is due, to complete once the lock is released. */
    List<CompletableFuture<Void>> takeDue() {
        if (due.isEmpty()) {
            return List.of();
        }
        List<CompletableFuture<Void>> out = List.copyOf(due);
        due.clear();
        return out;
    }
}
