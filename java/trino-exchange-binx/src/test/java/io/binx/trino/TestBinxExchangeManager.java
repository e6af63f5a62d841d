package io.binx.trino;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import io.airlift.slice.Slice;
import io.airlift.slice.Slices;
import io.binx.client.Binxd;
import io.trino.plugin.exchange.filesystem.AbstractTestExchangeManager;
import io.trino.plugin.exchange.filesystem.TestExchangeManagerContext;
import io.trino.spi.exchange.Exchange;
import io.trino.spi.exchange.ExchangeId;
import io.trino.spi.exchange.ExchangeManager;
import io.trino.spi.exchange.ExchangeSink;
import io.trino.spi.exchange.ExchangeSinkHandle;
import io.trino.spi.exchange.ExchangeSource;
import io.trino.spi.exchange.ExchangeSourceHandle;
import io.trino.spi.exchange.ExchangeSourceOutputSelector;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.Test;

/**
 * Trino's own conformance suite for exchange managers, against the binx exchange and a real
 * binxd. Two of its checks are the filesystem exchange's own and are replaced here: how many
 * handles its file-splitting makes of large pages (binx hands out whole buffers; the data
 * check stays), and its 50-partition limit with its error code (binx's limit, with binx's
 * code).
 */
public class TestBinxExchangeManager extends AbstractTestExchangeManager {
    private Binxd binxd;
    private ExchangeManager manager;

    @Override
    protected ExchangeManager createExchangeManager() {
        try {
            binxd = Binxd.start("--memory-limit", "256MiB", "--task-memory-limit", "256MiB");
        } catch (Exception e) {
            throw new IllegalStateException(e);
        }
        manager = new BinxExchangeManagerFactory().create(
                Map.of("exchange.binx.socket", binxd.socket.toString(),
                        "exchange.binx.source-handle-target-data-size", "1MB",
                        "exchange.binx.max-output-partition-count", "50"),
                new TestExchangeManagerContext());
        return manager;
    }

    @Override
    @AfterAll
    public void destroy() throws Exception {
        super.destroy();
        if (manager != null) {
            manager.shutdown();
        }
        if (binxd != null) {
            binxd.close();
        }
    }

    private static TestingExchangeContext context(ExchangeId id) {
        return new TestingExchangeContext("query", id);
    }

    @Override
    @Test
    public void testLargePages() throws Exception {
        String small = "x".repeat(123);
        String medium = "m".repeat(66 * 1024);
        String large = "l".repeat(5 * 1024 * 1024 - 4);
        String max = "M".repeat(16 * 1024 * 1024 - 4);
        ExchangeId id = ExchangeId.createRandomExchangeId();
        Exchange exchange = manager.createExchange(context(id), 3, false);
        List<ExchangeSinkHandle> sinks = List.of(exchange.addSink(0), exchange.addSink(1), exchange.addSink(2));
        exchange.noMoreSinks();
        List<List<Map.Entry<Integer, String>>> data = List.of(
                List.of(Map.entry(0, small), Map.entry(1, max), Map.entry(1, medium)),
                List.of(Map.entry(0, medium), Map.entry(1, large), Map.entry(2, small)),
                List.of(Map.entry(0, large), Map.entry(0, max), Map.entry(1, small), Map.entry(2, max),
                        Map.entry(2, large), Map.entry(2, medium)));
        for (int s = 0; s < 3; s++) {
            ExchangeSink sink = manager.createSink(exchange.instantiateSink(sinks.get(s), 0).get());
            data.get(s).forEach(e -> sink.add(e.getKey(), Slices.utf8Slice(e.getValue())));
            sink.finish().get(60, TimeUnit.SECONDS);
            exchange.sinkFinished(sinks.get(s), 0);
        }
        exchange.allRequiredSinksFinished();
        List<ExchangeSourceHandle> handles = exchange.getSourceHandles().getNextBatch().get(60, TimeUnit.SECONDS).handles();
        // Whole buffers, grouped up to the target size: p0 [s0, s1] [s2], p1 [s0] [s1] [s2], p2 [s1] [s2].
        assertThat(handles).hasSize(7);
        assertThat(handles.stream().mapToLong(ExchangeSourceHandle::getDataSizeInBytes).sum())
                .isEqualTo(3L * (123 + 66 * 1024 + 5 * 1024 * 1024 - 4 + 16 * 1024 * 1024 - 4));
        ExchangeSourceOutputSelector selector = ExchangeSourceOutputSelector.builder(Set.of(id))
                .include(id, 0, 0).include(id, 1, 0).include(id, 2, 0)
                .setPartitionCount(id, 3).setFinal().build();
        for (int p = 0; p < 3; p++) {
            int partition = p;
            List<ExchangeSourceHandle> mine = handles.stream().filter(h -> h.getPartitionId() == partition).toList();
            assertThat(read(mine, selector)).containsExactlyInAnyOrder(small, medium, large, max);
        }
        exchange.close();
    }

    private List<String> read(List<ExchangeSourceHandle> handles, ExchangeSourceOutputSelector selector) throws Exception {
        List<String> out = new ArrayList<>();
        try (ExchangeSource source = manager.createSource()) {
            source.setOutputSelector(selector);
            source.addSourceHandles(handles);
            source.noMoreSourceHandles();
            while (!source.isFinished()) {
                Slice s = source.read();
                if (s != null) {
                    out.add(s.toStringUtf8());
                } else {
                    source.isBlocked().get(60, TimeUnit.SECONDS);
                }
            }
        }
        return out;
    }

    @Override
    @Test
    public void testMaxOutputPartitionCountCheck() {
        assertThatThrownBy(() -> manager.createExchange(context(ExchangeId.createRandomExchangeId()), 51, false))
                .hasMessageContaining("Max number of output partitions exceeded for exchange")
                .hasMessageContaining("exchange.binx.max-output-partition-count")
                .hasFieldOrPropertyWithValue("errorCode", BinxErrorCode.MAX_OUTPUT_PARTITION_COUNT_EXCEEDED.toErrorCode());
    }
}
