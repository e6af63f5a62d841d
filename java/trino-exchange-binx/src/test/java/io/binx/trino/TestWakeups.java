package io.binx.trino;

import static org.assertj.core.api.Assertions.assertThat;

import java.util.List;
import java.util.concurrent.CompletableFuture;
import org.junit.jupiter.api.Test;

/**
 * The engine's wake-ups of {@link BinxExchangeSource}, in the order a review found could leave
 * a query waiting with pages ready: a reader's page marks the waited-on future due and
 * releases the lock; the engine reads, finds nothing, and waits on a new future; a second
 * reader's page lands before the first completes anything. Both futures are completed.
 */
class TestWakeups {
    @Test
    void aFutureMarkedDueNeverHidesANewerOne() {
        Wakeups w = new Wakeups();
        CompletableFuture<Void> first = w.waiting();
        assertThat(w.waiting()).isSameAs(first);
        w.markDue();
        CompletableFuture<Void> second = w.waiting();
        assertThat(second).isNotSameAs(first);
        w.markDue();
        assertThat(w.anyDue()).isTrue();
        List<CompletableFuture<Void>> due = w.takeDue();
        assertThat(w.anyDue()).isFalse();
        assertThat(due).containsExactly(first, second);
        due.forEach(f -> f.complete(null));
        assertThat(first).isDone();
        assertThat(second).isDone();
        assertThat(w.takeDue()).isEmpty();
    }

    @Test
    void nothingWaitedOnIsNothingDue() {
        Wakeups w = new Wakeups();
        w.markDue();
        assertThat(w.anyDue()).isFalse();
        assertThat(w.takeDue()).isEmpty();
        CompletableFuture<Void> f = w.waiting();
        assertThat(w.takeDue()).isEmpty();
        assertThat(f).isNotDone();
    }
}
