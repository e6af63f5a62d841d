package io.binx.client;

/** binxd answered a request with a status other than OK (its reason included). */
public class BinxRefusedException extends BinxException {
    private final Status status;
    private final BinReply reply;

    public BinxRefusedException(BinRequest request, BinReply reply) {
        super(BinxException.describe(request) + ": " + reply.status().name()
                + (reply.error.isEmpty() ? "" : ": " + reply.error));
        this.status = reply.status();
        this.reply = reply;
    }

    public Status status() {
        return status;
    }

    /** The whole reply (tokens included). */
    public BinReply reply() {
        return reply;
    }

    /** BUSY and TIMEOUT change nothing and may be retried as they are. */
    public boolean retriable() {
        return status == Status.BUSY || status == Status.TIMEOUT;
    }
}
