package io.binx.trino;

import com.fasterxml.jackson.annotation.JsonCreator;
import com.fasterxml.jackson.annotation.JsonProperty;
import io.trino.spi.exchange.ExchangeId;
import io.trino.spi.exchange.ExchangeSourceHandle;
import java.util.List;
import java.util.Objects;

/**
 * Part of one output partition: buffer {@code partitionId} of each listed task attempt, with
 * where its sidecar is and what its commit says (pages and bytes), so a reader checks it read
 * exactly that.
 */
public final class BinxSourceHandle implements ExchangeSourceHandle {
    private final ExchangeId exchangeId;
    private final int partitionId;
    private final List<Entry> entries;

    @JsonCreator
    public BinxSourceHandle(
            @JsonProperty("exchangeId") ExchangeId exchangeId,
            @JsonProperty("partitionId") int partitionId,
            @JsonProperty("entries") List<Entry> entries) {
        this.exchangeId = Objects.requireNonNull(exchangeId, "exchangeId");
        if (partitionId < 0) {
            throw new IllegalArgumentException("a binx source handle of partition " + partitionId);
        }
        this.partitionId = partitionId;
        this.entries = List.copyOf(Objects.requireNonNull(entries, "entries"));
    }

    @JsonProperty
    public ExchangeId exchangeId() {
        return exchangeId;
    }

    @Override
    @JsonProperty("partitionId")
    public int getPartitionId() {
        return partitionId;
    }

    @JsonProperty
    public List<Entry> entries() {
        return entries;
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

    @Override
    public boolean equals(Object o) {
        return o instanceof BinxSourceHandle h && h.exchangeId.equals(exchangeId) && h.partitionId == partitionId
                && h.entries.equals(entries);
    }

    @Override
    public int hashCode() {
        return Objects.hash(exchangeId, partitionId, entries);
    }

    @Override
    public String toString() {
        return "BinxSourceHandle[" + exchangeId + ", partition " + partitionId + ", " + entries + "]";
    }

    /** One attempt's buffer. */
    public static final class Entry {
        private final String taskId;
        private final int taskPartitionId;
        private final int attemptId;
        private final String endpoint;
        private final long pages;
        private final long bytes;

        @JsonCreator
        public Entry(
                @JsonProperty("taskId") String taskId,
                @JsonProperty("taskPartitionId") int taskPartitionId,
                @JsonProperty("attemptId") int attemptId,
                @JsonProperty("endpoint") String endpoint,
                @JsonProperty("pages") long pages,
                @JsonProperty("bytes") long bytes) {
            this.taskId = Objects.requireNonNull(taskId, "taskId");
            this.taskPartitionId = taskPartitionId;
            this.attemptId = attemptId;
            this.endpoint = Objects.requireNonNull(endpoint, "endpoint");
            this.pages = pages;
            this.bytes = bytes;
            // A handle comes back through JSON: what a reader checks its read against must be
            // a count (a negative one would read as "unknown" and turn the check off).
            if (taskPartitionId < 0 || attemptId < 0 || pages < 0 || bytes < 0) {
                throw new IllegalArgumentException("a binx source handle entry with a negative number: " + this);
            }
            // No pages is never read: bytes claimed beside them would be skipped unchecked.
            if (pages == 0 && bytes != 0) {
                throw new IllegalArgumentException("a binx source handle entry with bytes but no pages: " + this);
            }
        }

        @JsonProperty
        public String taskId() {
            return taskId;
        }

        @JsonProperty
        public int taskPartitionId() {
            return taskPartitionId;
        }

        @JsonProperty
        public int attemptId() {
            return attemptId;
        }

        @JsonProperty
        public String endpoint() {
            return endpoint;
        }

        @JsonProperty
        public long pages() {
            return pages;
        }

        @JsonProperty
        public long bytes() {
            return bytes;
        }

        long retainedSize() {
            return 64 + 2L * taskId.length() + 2L * endpoint.length();
        }

        @Override
        public boolean equals(Object o) {
            return o instanceof Entry e && e.taskId.equals(taskId) && e.taskPartitionId == taskPartitionId
                    && e.attemptId == attemptId && e.endpoint.equals(endpoint) && e.pages == pages && e.bytes == bytes;
        }

        @Override
        public int hashCode() {
            return Objects.hash(taskId, taskPartitionId, attemptId, endpoint, pages, bytes);
        }

        @Override
        public String toString() {
            return taskId + "[" + taskPartitionId + "." + attemptId + " at " + endpoint + ": " + pages + " pages, " + bytes + " bytes]";
        }
    }
}
