package io.binx.trino;

import static io.trino.spi.ErrorType.EXTERNAL;
import static io.trino.spi.ErrorType.USER_ERROR;

import io.trino.spi.ErrorCode;
import io.trino.spi.ErrorCodeSupplier;
import io.trino.spi.ErrorType;

/** The errors this exchange reports to a query (codes 0x0521_0000 on). */
public enum BinxErrorCode implements ErrorCodeSupplier {
    /** More output partitions than exchange.binx.max-output-partition-count. */
    MAX_OUTPUT_PARTITION_COUNT_EXCEEDED(0, USER_ERROR),
    /** The local binxd could not be reached, or refused what it was asked. */
    BINX_UNAVAILABLE(1, EXTERNAL),
    /** A task's output could not be written, committed, found or read exactly. */
    BINX_EXCHANGE_FAILED(2, EXTERNAL);

    private final ErrorCode errorCode;

    BinxErrorCode(int code, ErrorType type) {
        errorCode = new ErrorCode(code + 0x0521_0000, name(), type);
    }

    @Override
    public ErrorCode toErrorCode() {
        return errorCode;
    }
}
