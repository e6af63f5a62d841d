package io.binx.client;

/**
 * The connection to binxd failed or closed: requests it carried without a reply may or may not
 * have taken effect (exact to retry for DATA, and for numbered ENQUEUE and NO_MORE_PAGES).
 */
public class BinxConnectionException extends BinxException {
    public BinxConnectionException(String message, Throwable cause) {
        super(message, cause);
    }

    public BinxConnectionException(String message) {
        super(message);
    }

    /**
     * Whether {@code t}, or what caused it, is a failed connection (an engine's connector may
     * wrap one in an exception of its own, naming the socket): what is worth asking again.
     */
    public static boolean causedBy(Throwable t) {
        for (Throwable c = t; c != null; c = c.getCause()) {
            if (c instanceof BinxConnectionException) {
                return true;
            }
        }
        return false;
    }
}
