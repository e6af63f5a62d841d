package io.binx.trino;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import io.binx.client.BinReply;
import io.binx.client.Frames;
import io.binx.client.HostileServerTest;
import io.binx.client.Status;
import io.binx.client.TestSockets;
import io.trino.plugin.exchange.filesystem.TestExchangeManagerContext;
import io.trino.spi.exchange.ExchangeId;
import io.trino.spi.exchange.ExchangeSource;
import io.trino.spi.exchange.ExchangeSourceOutputSelector;
import java.nio.channels.ServerSocketChannel;
import java.nio.channels.SocketChannel;
import java.nio.file.Path;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * A local sidecar that takes connections and says nothing (a stopped or wedged binxd): a
 * connect to it waits for its deadline (10 s), and the engine's threads must never wait with
 * it (review of the SPI contract): a source takes its handles and its selector at once, and the
 * coordinator's scheduler gets the deleter at once while another thread connects. What waits
 * is the plugin's own threads; the source then fails, naming the socket.
 */
class TestStuckSidecar {
    @Test
    @Timeout(120)
    void theEnginesThreadsNeverWaitForAStuckSidecar() throws Exception {
        Path socket = TestSockets.create("binx-stuck", "binx.sock");
        List<SocketChannel> held = new CopyOnWriteArrayList<>();
        try (ServerSocketChannel server = TestSockets.listen(socket)) {
            Thread acceptor = new Thread(() -> {
                try {
                    while (true) {
                        held.add(server.accept());
                    }
                } catch (java.io.IOException e) {
                    // the test ended
                }
            });
            acceptor.setDaemon(true);
            acceptor.start();
            // Threads of their own (the common pool may have one thread on a small machine).
            java.util.concurrent.ExecutorService threads = java.util.concurrent.Executors.newCachedThreadPool();
            BinxExchangeManager manager = (BinxExchangeManager) new BinxExchangeManagerFactory().create(
                    Map.of("exchange.binx.socket", socket.toString(), "exchange.binx.max-error-duration", "3s"),
                    new TestExchangeManagerContext());
            try {
                // A thread of the plugin's connects for the coordinator (up to the connect
                // deadline), the caller never waits for it...
                CompletableFuture<String> lookup = CompletableFuture.supplyAsync(manager::localAddressLookup, threads)
                        .get(5, TimeUnit.SECONDS);
                long connected = System.nanoTime() + TimeUnit.SECONDS.toNanos(5);
                while (held.isEmpty() && System.nanoTime() < connected) {
                    Thread.sleep(10);
                }
                assertThat(held).as("the lookup's connect is under way").isNotEmpty();
                // ... while the scheduler's thread gets the deleter (Exchange.close, a late
                // sinkFinished) without waiting for it.
                assertThat(CompletableFuture.supplyAsync(manager::deleter, threads).get(5, TimeUnit.SECONDS)).isNotNull();

                // A source takes handles and a final selector at once; its readers start on
                // the plugin's threads, and it fails once the lookup gives up (a connect is
                // asked again until max-error-duration: about two connect deadlines here).
                ExchangeId id = ExchangeId.createRandomExchangeId();
                BinxSourceHandle handle = new BinxSourceHandle(id, 0,
                        List.of(new BinxSourceHandle.Entry("q_stuck.0.0.0", 0, 0, "10.0.0.9:8091", 1, 1)));
                ExchangeSource source = manager.createSource();
                CompletableFuture.runAsync(() -> {
                    source.addSourceHandles(List.of(handle));
                    source.noMoreSourceHandles();
                    source.setOutputSelector(ExchangeSourceOutputSelector.builder(Set.of(id))
                            .include(id, 0, 0).setPartitionCount(id, 1).setFinal().build());
                }, threads).get(5, TimeUnit.SECONDS);
                Throwable failure = null;
                long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(60);
                while (failure == null && !source.isFinished() && System.nanoTime() < deadline) {
                    try {
                        assertThat(source.read()).isNull();
                        source.isBlocked().get(60, TimeUnit.SECONDS);
                    } catch (RuntimeException e) {
                        failure = e;
                    }
                }
                assertThat(failure).as("the source fails").isNotNull();
                assertThat(failure.getMessage()).contains(socket.toString());
                source.close();
                // The stuck sidecar never says HELLO: the lookup fails, naming the socket.
                assertThatThrownBy(() -> lookup.get(60, TimeUnit.SECONDS)).hasMessageContaining(socket.toString());
            } finally {
                threads.shutdownNow();
                manager.shutdown();
                TestSockets.remove(socket);
                for (SocketChannel c : held) {
                    c.close();
                }
            }
        }
    }
    /**
     * A local sidecar at its connection limit answers the HELLO that learns its address BUSY
     * ("retry later"): the lookup asks again, as every other request of the plugin does, and
     * gets the address; it used to fail the source at once.
     */
    @Test
    @Timeout(60)
    void aBusyHelloIsAskedAgain() throws Exception {
        try (HostileServerTest.Server busyOnce = new HostileServerTest.Server((r, n) -> {
            BinReply h = new BinReply();
            h.requestId = r.requestId;
            h.type = r.type;
            if (n == 0) {
                h.status = Status.BUSY.number();
                h.error = "binxd is at max_connections (2); retry later";
            } else {
                h.status = Status.OK.number();
                h.capabilities.addAll(List.of("pipelined-data", "append-token", "committed", "address=10.0.0.7:8091"));
            }
            return new Frames.Frame(h.encode(), java.nio.ByteBuffer.allocate(0));
        })) {
            BinxExchangeManager manager = (BinxExchangeManager) new BinxExchangeManagerFactory().create(
                    Map.of("exchange.binx.socket", busyOnce.socket.toString(), "exchange.binx.max-error-duration", "30s"),
                    new TestExchangeManagerContext());
            try {
                assertThat(manager.localAddressLookup().get(30, TimeUnit.SECONDS)).isEqualTo("10.0.0.7:8091");
            } finally {
                manager.shutdown();
            }
        }
    }
}
