package io.binx.client;

/**
 * Something a BinX exchange could not do. Its message names the request (type, task, buffer,
 * token) and what went wrong, so that an engine can put it in a query's failure as it is.
 */
public class BinxException extends RuntimeException {
    public BinxException(String message) {
        super(message);
    }

    public BinxException(String message, Throwable cause) {
        super(message, cause);
    }

    /** Names a request the way every message of this client does. */
    public static String describe(BinRequest r) {
        MessageType t = r.messageType();
        StringBuilder s = new StringBuilder(t == null ? "request type " + r.type : t.name());
        switch (t == null ? MessageType.UNSPECIFIED : t) {
            case DATA, ACK, DELETE, ENQUEUE -> s.append(" for buffer ").append(Long.toUnsignedString(r.bufferId))
                    .append(" of task ").append(r.taskId);
            case NO_MORE_PAGES -> s.append(r.bufferId == -1L ? " for every buffer" : " for buffer " + Long.toUnsignedString(r.bufferId))
                    .append(" of task ").append(r.taskId);
            case OPEN_TASK, ABORT_TASK, COMMITTED -> s.append(" for task ").append(r.taskId);
            case DELETE_TASK -> s.append(" for buffers 0..").append(Long.toUnsignedString(r.bufferCount))
                    .append(" of task ").append(r.taskId);
            default -> {}
        }
        if (t == MessageType.DATA || t == MessageType.ACK) {
            s.append(" at token ").append(Long.toUnsignedString(r.pageToken));
        }
        if (r.appendToken != null) {
            s.append(" at token ").append(Long.toUnsignedString(r.appendToken));
        }
        if (!r.remote.isEmpty()) {
            s.append(" via ").append(r.remote);
        }
        return s.toString();
    }
}
