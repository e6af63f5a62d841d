package io.binx.client;

/** Reply statuses (docs/PROTOCOL.md section 3). */
public enum Status {
    UNSPECIFIED(0),
    OK(1),
    NO_DATA(2),
    SERVER_ERROR(3),
    /** A forwarding sidecar got no answer from the remote: retry like a lost reply. */
    TIMEOUT(4),
    BAD_REQUEST(5),
    UNAUTHENTICATED(6),
    /** Backpressure: retry later; the request changed nothing. */
    BUSY(7);

    private final int number;

    Status(int number) {
        this.number = number;
    }

    public int number() {
        return number;
    }

    /** The status with this wire number; {@code UNSPECIFIED} for a number this client does not know. */
    public static Status of(int number) {
        for (Status s : values()) {
            if (s.number == number) {
                return s;
            }
        }
        return UNSPECIFIED;
    }
}
