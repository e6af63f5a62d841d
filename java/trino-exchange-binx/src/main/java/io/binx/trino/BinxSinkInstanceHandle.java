package io.binx.trino;

import com.fasterxml.jackson.annotation.JsonCreator;
import com.fasterxml.jackson.annotation.JsonProperty;
import io.binx.client.Tasks;
import io.trino.spi.exchange.ExchangeSinkInstanceHandle;
import java.util.Objects;

/**
 * One attempt's sink, sent to the worker that runs it: the binx task its output goes to (one
 * per attempt, so attempts never mix), with one PARTITIONED buffer per output partition.
 *
 */
public final class BinxSinkInstanceHandle implements ExchangeSinkInstanceHandle {
    private final String taskId;
    private final int outputPartitionCount;

    @JsonCreator
    public BinxSinkInstanceHandle(
            @JsonProperty("taskId") String taskId,
            @JsonProperty("outputPartitionCount") int outputPartitionCount) {
        // A handle comes back through JSON: a partition count past what a binx task holds would
        // size the sink's arrays before binxd could refuse it.
        if (taskId == null || taskId.isEmpty() || outputPartitionCount < 1 || outputPartitionCount > Tasks.MAX_BUFFERS) {
            throw new IllegalArgumentException("a binx sink needs a task id and 1 to " + Tasks.MAX_BUFFERS
                    + " output partitions, not " + outputPartitionCount);
        }
        this.taskId = taskId;
        this.outputPartitionCount = outputPartitionCount;
    }

    @JsonProperty
    public String taskId() {
        return taskId;
    }

    @JsonProperty
    public int outputPartitionCount() {
        return outputPartitionCount;
    }

    @Override
    public boolean equals(Object o) {
        return o instanceof BinxSinkInstanceHandle h && h.taskId.equals(taskId) && h.outputPartitionCount == outputPartitionCount;
    }

    @Override
    public int hashCode() {
        return Objects.hash(taskId, outputPartitionCount);
    }

    @Override
    public String toString() {
        return "BinxSinkInstanceHandle[" + taskId + ", " + outputPartitionCount + " partitions]";
    }
}
