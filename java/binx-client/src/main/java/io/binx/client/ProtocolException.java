package io.binx.client;

/**
 * A peer sent bytes that break the wire contract (a bad preface, a frame over its limits, a
 * header that does not decode). The connection that carried them is closed.
 */
public class ProtocolException extends Exception {
    public ProtocolException(String message) {
        super(message);
    }
}
