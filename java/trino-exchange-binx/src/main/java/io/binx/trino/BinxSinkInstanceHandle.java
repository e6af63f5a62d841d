package io.binx.trino;

import com.fasterxml.jackson.annotation.JsonCreator;
import com.fasterxml.jackson.annotation.JsonProperty;
import io.trino.spi.exchange.ExchangeSinkInstanceHandle;

/**
 * One attempt's sink, sent to the worker that runs it: the binx task its output goes to (one
 * per attempt, so attempts never mix), with one PARTITIONED buffer per output partition.
 */
public record BinxSinkInstanceHandle(
        @JsonProperty("taskId") String taskId,
        @JsonProperty("outputPartitionCount") int outputPartitionCount) implements ExchangeSinkInstanceHandle {
    @JsonCreator
    public BinxSinkInstanceHandle {
        if (taskId == null || taskId.isEmpty() || outputPartitionCount < 1) {
            throw new IllegalArgumentException("a binx sink needs a task id and at least one output partition");
        }
    }
}
