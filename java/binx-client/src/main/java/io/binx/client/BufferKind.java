package io.binx.client;

/** How a task's pages reach its buffers (OPEN_TASK). */
public enum BufferKind {
    /** ENQUEUE appends to the buffer it names. */
    PARTITIONED(0),
    /** Every buffer reads every page. */
    BROADCAST(1),
    /** Each page goes to the first buffer that asks. */
    ARBITRARY(2);

    private final int number;

    BufferKind(int number) {
        this.number = number;
    }

    public int number() {
        return number;
    }
}
