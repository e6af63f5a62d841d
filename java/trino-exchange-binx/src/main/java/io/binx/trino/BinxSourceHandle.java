package io.binx.trino;

import com.fasterxml.jackson.annotation.JsonCreator;
import com.fasterxml.jackson.annotation.JsonProperty;
import io.trino.spi.exchange.ExchangeId;
import io.trino.spi.exchange.ExchangeSourceHandle;
import java.util.List;

/**
 * Part of one output partition: buffer {@code partitionId} of each listed task attempt, with
 * where its sidecar is and what its commit says (pages and bytes), so a reader checks it read
 * exactly that.
 */
public record BinxSourceHandle(
        @JsonProperty("exchangeId") ExchangeId exchangeId,
        @JsonProperty("partitionId") int partitionId,
        @JsonProperty("entries") List<Entry> entries) implements ExchangeSourceHandle {
    @JsonCreator
    public BinxSourceHandle {
        entries = List.copyOf(entries);
    }

    /** One attempt's buffer. */
    public record Entry(
            @JsonProperty("taskId") String taskId,
            @JsonProperty("taskPartitionId") int taskPartitionId,
            @JsonProperty("attemptId") int attemptId,
            @JsonProperty("endpoint") String endpoint,
            @JsonProperty("pages") long pages,
            @JsonProperty("bytes") long bytes) {
        @JsonCreator
        public Entry {}

        long retainedSize() {
            return 64 + 2L * taskId.length() + 2L * endpoint.length();
        }
    }

    @Override
    @JsonProperty("partitionId")
    public int getPartitionId() {
        return partitionId;
    }

    @Override
    public long getDataSizeInBytes() {
        long total = 0;
        for (Entry e : entries) {
            total += e.bytes();
        }
        return total;
    }

    @Override
    public long getRetainedSizeInBytes() {
        long total = 48 + 16L * entries.size();
        for (Entry e : entries) {
            total += e.retainedSize();
        }
        return total;
    }
}
