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
}
