package io.binx.client;

import java.util.function.Supplier;

/**
 * Where a writer or a reader gets its connections to the local binxd ({@link #get}: a
 * failure is a {@link BinxException}, retried), and where it gives back one it is done with.
 * Each connection is used by one at a time: binxd keeps a connection's ENQUEUEs in order, so a
 * writer's must not wait behind another's. A plain {@code Supplier<BinxConnection>} given
 * where a source is taken opens a connection each time and closes what is given back.
 */
public interface ConnectionSource extends Supplier<BinxConnection> {
    /**
     * A connection its user is done with, every request it sent answered and nothing of it left
     * on binxd (a task committed, a read ended): the source may hand it to its next user. By
     * default it is closed.
     */
    default void giveBack(BinxConnection connection) {
        connection.close();
    }

    /** {@code connector} as a source: itself when it is one, else one that closes what is given back. */
    static ConnectionSource of(Supplier<BinxConnection> connector) {
        return connector instanceof ConnectionSource source ? source : connector::get;
    }
}
