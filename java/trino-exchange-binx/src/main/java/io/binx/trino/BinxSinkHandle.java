package io.binx.trino;

import io.trino.spi.exchange.ExchangeSinkHandle;

/** A task partition's sink, on the coordinator (never serialized). */
public record BinxSinkHandle(int taskPartitionId) implements ExchangeSinkHandle {}
