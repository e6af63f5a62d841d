package io.binx.client;

/**
 * BinX request types (docs/PROTOCOL.md section 3); {@code COMMITTED} (the local-only lookup) and
 * {@code DELETE_TASK} (a task's buffers in one request) are proposed, sections 10 and 11.
 */
public enum MessageType {
    UNSPECIFIED(0),
    DATA(1),
    ACK(2),
    DELETE(3),
    PING(4),
    HELLO(5),
    OPEN_TASK(16),
    ENQUEUE(17),
    NO_MORE_PAGES(18),
    ABORT_TASK(19),
    SHM_ATTACH(20),
    COMMITTED(21),
    DELETE_TASK(22);

    private final int number;

    MessageType(int number) {
        this.number = number;
    }

    public int number() {
        return number;
    }

    /** The type with this wire number, or {@code null} when this client does not know it. */
    public static MessageType of(int number) {
        for (MessageType t : values()) {
            if (t.number == number) {
                return t;
            }
        }
        return null;
    }
}
