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
    /** A request that settles when it completes (nothing of it left in flight then). */
    private static <T> CompletableFuture<T> settling(CompletableFuture<Void> settled, CompletableFuture<T> request) {
        request.whenComplete((v, e) -> settled.complete(null));
        return request;
    }

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
            results.add(gate.submit(settled -> {
                started.add(n);
                return settling(settled, request);
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
        CompletableFuture<Integer> held = gate.submit(settled -> settling(settled, first));
        CompletableFuture<Integer> cancelled = gate.submit(settled -> {
            starts.incrementAndGet();
            return settling(settled, CompletableFuture.completedFuture(1));
        });
        CompletableFuture<Integer> throwing = gate.submit(settled -> {
            throw new IllegalArgumentException("no connection");
        });
        CompletableFuture<Integer> last = gate.submit(settled -> settling(settled, CompletableFuture.completedFuture(3)));
        cancelled.cancel(false);
        first.complete(0);
        assertThat(held.get()).isZero();
        assertThat(starts).hasValue(0);
        assertThatThrownBy(() -> throwing.get()).hasMessageContaining("no connection");
        assertThat(last.get()).isEqualTo(3);
        assertThat(gate.waiting()).isZero();
    }

    /**
     * A result ended early stops its request, and the turn stays taken until the request says
     * nothing of it is in flight any more (an answer still due holds a connection slot).
     */
    @Test
    void aResultEndedEarlyStopsItsRequestAndKeepsItsTurnUntilTheRequestSettled() throws Exception {
        RequestGate gate = new RequestGate(1, Runnable::run);
        CompletableFuture<Integer> request = new CompletableFuture<>();
        CompletableFuture<Void> inFlight = new CompletableFuture<>();
        CompletableFuture<Integer> result = gate.submit(settled -> {
            inFlight.whenComplete((v, e) -> settled.complete(null));
            return request;
        });
        CompletableFuture<Integer> next = gate.submit(settled -> settling(settled, CompletableFuture.completedFuture(2)));
        result.cancel(false);
        assertThat(request).isCancelled();
        assertThat(next).as("waits while the answer is due").isNotDone();
        inFlight.complete(null);
        assertThat(next.get()).isEqualTo(2);
    }

    /** Thousands waiting behind one that fails at once, on an executor that runs inline: no deep recursion. */
    @Test
    void manyStartsOnAnInlineExecutorDoNotRecurse() throws Exception {
        RequestGate gate = new RequestGate(1, Runnable::run);
        CompletableFuture<Integer> first = new CompletableFuture<>();
        gate.submit(settled -> settling(settled, first));
        List<CompletableFuture<Integer>> rest = new ArrayList<>();
        for (int i = 0; i < 100_000; i++) {
            rest.add(gate.submit(settled -> settling(settled, CompletableFuture.failedFuture(new IllegalStateException("closed")))));
        }
        first.complete(0);
        for (CompletableFuture<Integer> r : rest) {
            assertThat(r).isCompletedExceptionally();
        }
        assertThat(gate.waiting()).isZero();
    }
}
