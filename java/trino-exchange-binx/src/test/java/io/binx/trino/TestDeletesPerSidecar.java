package io.binx.trino;

import static org.assertj.core.api.Assertions.assertThat;

import io.airlift.slice.Slices;
import io.binx.client.Binxd;
import io.trino.plugin.exchange.filesystem.TestExchangeManagerContext;
import io.trino.spi.exchange.Exchange;
import io.trino.spi.exchange.ExchangeId;
import io.trino.spi.exchange.ExchangeManager;
import io.trino.spi.exchange.ExchangeSink;
import io.trino.spi.exchange.ExchangeSinkHandle;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * Closing an exchange whose attempts were written on two workers' sidecars, one of which has
 * stopped answering (SIGSTOP): the deleter's DELETE_TASK for the silent one's attempt gets no
 * answer, so it deletes that attempt buffer by buffer; the coordinator's sidecar answers those DELETEs
 * TIMEOUT until it fails over to storage (here after a minute), and each is asked again until
 * then. Those must not take every one of the deleter's slots (review: a silent worker's tasks
 * of 64 buffers or more held back the deletes on every live sidecar for as long): the live
 * worker's output is freed at once, the silent one's once it answers again.
 */
class TestDeletesPerSidecar {
    private static final String SECRET = "deletes-test-secret";
    /** More buffers than the deleter has requests in flight, in all. */
    private static final int PARTITIONS = 2 * AttemptDeleter.IN_FLIGHT;

    /** An exchange of {@link #PARTITIONS} output partitions whose one attempt {@code worker} wrote and finished. */
    private static Exchange written(ExchangeManager coordinator, ExchangeManager worker) throws Exception {
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = coordinator.createExchange(new TestingExchangeContext("q_deletes", id), PARTITIONS, false);
        ExchangeSinkHandle handle = exchange.addSink(0);
        exchange.noMoreSinks();
        ExchangeSink sink = worker.createSink(exchange.instantiateSink(handle, 0).get());
        for (int p = 0; p < PARTITIONS; p++) {
            sink.add(p, Slices.utf8Slice("partition " + p));
        }
        sink.finish().get(60, TimeUnit.SECONDS);
        exchange.sinkFinished(handle, 0);
        exchange.allRequiredSinksFinished();
        return exchange;
    }

    @Test
    @Timeout(180)
    void aSilentSidecarsDeletesHoldNoLiveSidecarsBack() throws Exception {
        Path store = Files.createTempDirectory("binx-deletes-store");
        List<Binxd> sidecars = new ArrayList<>();
        List<ExchangeManager> managers = new ArrayList<>();
        try {
            for (String node : List.of("coordinator", "silent", "live")) {
                sidecars.add(Binxd.start("--spool-stores", "file://" + store.resolve("spool"), "--spool-node-name", node,
                        "--shared-secret", SECRET, "--spool-failover-after", "60s", "--memory-limit", "256MiB"));
                managers.add(new BinxExchangeManagerFactory().create(
                        Map.of("exchange.binx.socket", sidecars.getLast().socket.toString(),
                                "exchange.binx.max-error-duration", "3m"),
                        new TestExchangeManagerContext()));
            }
            Binxd silent = sidecars.get(1);
            Binxd live = sidecars.get(2);
            // One exchange's attempt on the silent worker, another's on the live one.
            Exchange onSilent = written(managers.get(0), managers.get(1));
            Exchange onLive = written(managers.get(0), managers.get(2));
            assertThat(live.stat("memory_used")).isGreaterThan(0);
            assertThat(silent.stat("memory_used")).isGreaterThan(0);

            silent.suspend();
            // The silent worker's buffers first in the deleter's queue: its one DELETE_TASK gets
            // no answer (the coordinator's sidecar gives up on the remote after its connect or
            // request timeout, 5 or 10 s), so they are deleted buffer by buffer.
            onSilent.close();
            long queued = System.nanoTime() + TimeUnit.SECONDS.toNanos(40);
            while (((BinxExchangeManager) managers.get(0)).deleter().deletesInFlight() < AttemptDeleter.IN_FLIGHT_PER_REMOTE) {
                assertThat(System.nanoTime()).as("the silent worker's deletes under way").isLessThan(queued);
                Thread.sleep(10);
            }
            onLive.close();
            // The live worker's output goes while every DELETE for the silent one still waits
            // for the coordinator's sidecar to fail over (a minute).
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(30);
            while (live.stat("memory_used") != 0 || live.stat("tasks") != 0) {
                assertThat(System.nanoTime())
                        .as("the live sidecar's output freed while the silent one's deletes wait")
                        .isLessThan(deadline);
                Thread.sleep(50);
            }
            // (A stopped process answers no stats.) Its output is all in storage still.
            assertThat(silent.alive()).isTrue();
            assertThat(TrinoCluster.storedFiles(store).stream().filter(f -> f.toString().endsWith(".json")).count())
                    .as("the silent worker's manifest, its markers folded in")
                    .isEqualTo(1);

            // Once the silent one answers again, its output goes too.
            silent.resume();
            deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(60);
            while (silent.stat("memory_used") != 0 || !TrinoCluster.storedFiles(store).isEmpty()) {
                assertThat(System.nanoTime()).as("the silent sidecar's output freed once it answers").isLessThan(deadline);
                Thread.sleep(100);
            }
            BinxExchangeManager coordinator = (BinxExchangeManager) managers.get(0);
            assertThat(coordinator.deleter().awaitIdle(30_000)).isTrue();
            assertThat(coordinator.stats().getBuffersDeleted()).isEqualTo(2L * PARTITIONS);
            assertThat(coordinator.stats().getTaskDeletes())
                    .as("the live worker's attempt with one DELETE_TASK, the silent one's buffer by buffer")
                    .isEqualTo(1);
            assertThat(coordinator.stats().getOutputsLeftToTtl()).isZero();
        } finally {
            TrinoCluster.stopAll(managers, sidecars, store);
        }
    }
}
