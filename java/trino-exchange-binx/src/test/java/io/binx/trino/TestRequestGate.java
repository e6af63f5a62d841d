package io.binx.trino;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.Test;

/** The manager-wide bound on the coordinator's lookups: what waits, what starts, what frees a turn. */
class TestRequestGate {
    @Test
    void atMostTheLimitRunAndEachEndStartsTheNextInOrder() throws Exception {
        RequestGate gate = new RequestGate(2, Runnable::run);
        List<CompletableFuture<Integer>> requests = new ArrayList<>();
        List<Integer> started = new ArrayList<>();
        List<CompletableFuture<Integer>> results = new ArrayList<>();
        for (int i = 0; i < 5; i++) {
            int n = i;
            CompletableFuture<Integer> request = new CompletableFuture<>();
            requests.add(request);
            results.add(gate.submit(() -> {
                started.add(n);
                return request;
            }));
        }
        assertThat(started).containsExactly(0, 1);
        assertThat(gate.waiting()).isEqualTo(3);
        requests.get(1).complete(11);
        assertThat(results.get(1).get()).isEqualTo(11);
        assertThat(started).containsExactly(0, 1, 2);
        requests.get(0).completeExceptionally(new IllegalStateException("refused"));
        assertThatThrownBy(() -> results.get(0).get()).isInstanceOf(ExecutionException.class).hasMessageContaining("refused");
        assertThat(started).containsExactly(0, 1, 2, 3);
        requests.get(2).complete(12);
        requests.get(3).complete(13);
        requests.get(4).complete(14);
        assertThat(results.get(4).get()).isEqualTo(14);
        assertThat(gate.peak()).isEqualTo(2);
        assertThat(gate.waiting()).isZero();
    }

    @Test
    void aCancelledWaiterNeverStartsAndAThrowingStartFreesItsTurn() throws Exception {
        RequestGate gate = new RequestGate(1, Runnable::run);
        CompletableFuture<Integer> first = new CompletableFuture<>();
        AtomicInteger starts = new AtomicInteger();
        CompletableFuture<Integer> held = gate.submit(() -> first);
        CompletableFuture<Integer> cancelled = gate.submit(() -> {
            starts.incrementAndGet();
            return CompletableFuture.completedFuture(1);
        });
        CompletableFuture<Integer> throwing = gate.submit(() -> {
            throw new IllegalArgumentException("no connection");
        });
        CompletableFuture<Integer> last = gate.submit(() -> CompletableFuture.completedFuture(3));
        cancelled.cancel(false);
        first.complete(0);
        assertThat(held.get()).isZero();
        assertThat(starts).hasValue(0);
        assertThatThrownBy(() -> throwing.get()).hasMessageContaining("no connection");
        assertThat(last.get()).isEqualTo(3);
        assertThat(gate.waiting()).isZero();
    }

    @Test
    void aResultEndedEarlyStopsItsRequestAndFreesItsTurn() throws Exception {
        RequestGate gate = new RequestGate(1, Runnable::run);
        CompletableFuture<Integer> request = new CompletableFuture<>();
        CompletableFuture<Integer> result = gate.submit(() -> request);
        CompletableFuture<Integer> next = gate.submit(() -> CompletableFuture.completedFuture(2));
        result.cancel(false);
        assertThat(request).isCancelled();
        assertThat(next.get()).isEqualTo(2);
    }
}
