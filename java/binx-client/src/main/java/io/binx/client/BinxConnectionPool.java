package io.binx.client;

import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.LongAdder;
import java.util.function.Supplier;

/**
 * Connections to one binxd kept for their next user: a task's writer and a source's readers
 * each take one, and give it back when done (every request answered), so the next does not
 * pay a connect, a reader thread and a HELLO (half a millisecond on an idle machine, several
 * on one busy with a query). Each connection is used by one user at a time, as a new one would
 * be.
 *
 * <p>Bounded: at most {@code maxIdle} kept, none longer than {@code maxIdleMillis} (a sweep
 * closes older ones), none that broke or has a request without its reply (a late reply would
 * reach the next user). Closing the pool closes what it keeps; what is given back after that
 * is closed, and a get fails. Keep {@code maxIdleMillis} below binxd's {@code idle_timeout}
 * (300 s by default), or binxd may close a kept connection as it is taken again (the request
 * then fails, and is asked again: exact, but late).
 */
public final class BinxConnectionPool implements ConnectionSource, AutoCloseable {
    private static final ScheduledExecutorService SWEEPS = DaemonThreads.scheduler("binx-connection-pool-sweep");

    private final Supplier<BinxConnection> connector;
    private final int maxIdle;
    private final long maxIdleNanos;
    private final ScheduledFuture<?> sweep;
    private final LongAdder opened = new LongAdder();
    private final LongAdder reused = new LongAdder();

    // Guarded by `this`: most recently given back last.
    private final ArrayDeque<Idle> idle = new ArrayDeque<>();
    private boolean closed;

    private record Idle(BinxConnection connection, long since) {}

    /** A pool over {@code connector}, which opens a new connection (its failures are the caller's). */
    public BinxConnectionPool(Supplier<BinxConnection> connector, int maxIdle, long maxIdleMillis) {
        if (maxIdle < 0 || maxIdleMillis < 1) {
            throw new IllegalArgumentException("maxIdle must be at least 0 and maxIdleMillis at least 1");
        }
        this.connector = connector;
        this.maxIdle = maxIdle;
        this.maxIdleNanos = TimeUnit.MILLISECONDS.toNanos(maxIdleMillis);
        long period = Math.max(1, maxIdleMillis / 2);
        this.sweep = SWEEPS.scheduleWithFixedDelay(this::sweep, period, period, TimeUnit.MILLISECONDS);
    }

    /**
     * The most recently given back connection that is still open, else a new one. A kept
     * connection whose binxd went a moment ago may be handed out before its reader saw the end:
     * its first request then fails as on any broken connection, and is asked again.
     */
    @Override
    public BinxConnection get() {
        List<BinxConnection> stale = new ArrayList<>();
        BinxConnection found = null;
        synchronized (this) {
            if (closed) {
                throw new BinxConnectionException("the connection pool was closed");
            }
            long now = System.nanoTime();
            while (found == null && !idle.isEmpty()) {
                Idle i = idle.pollLast();
                if (usable(i.connection()) && now - i.since() < maxIdleNanos) {
                    found = i.connection();
                } else {
                    stale.add(i.connection());
                }
            }
        }
        stale.forEach(BinxConnection::close);
        if (found != null) {
            reused.increment();
            return found;
        }
        BinxConnection fresh = connector.get();
        opened.increment();
        return fresh;
    }

    /** Keeps {@code connection} for the next user when it is open and idle, else closes it. */
    @Override
    public void giveBack(BinxConnection connection) {
        BinxConnection evicted = null;
        boolean kept = false;
        synchronized (this) {
            if (!closed && maxIdle > 0 && usable(connection)) {
                idle.addLast(new Idle(connection, System.nanoTime()));
                kept = true;
                if (idle.size() > maxIdle) {
                    evicted = idle.pollFirst().connection();
                }
            }
        }
        if (!kept) {
            connection.close();
        }
        if (evicted != null) {
            evicted.close();
        }
    }

    private static boolean usable(BinxConnection c) {
        return c.isOpen() && c.outstanding() == 0;
    }

    /** Closes what was kept too long, or broke meanwhile. */
    void sweep() {
        List<BinxConnection> stale = new ArrayList<>();
        synchronized (this) {
            long now = System.nanoTime();
            idle.removeIf(i -> {
                boolean old = now - i.since() >= maxIdleNanos || !i.connection().isOpen();
                if (old) {
                    stale.add(i.connection());
                }
                return old;
            });
        }
        stale.forEach(BinxConnection::close);
    }

    /** Connections kept now. */
    public synchronized int idle() {
        return idle.size();
    }

    /** Connections opened, and taken again from the pool, over its life. */
    public long opened() {
        return opened.sum();
    }

    public long reused() {
        return reused.sum();
    }

    @Override
    public void close() {
        List<BinxConnection> kept = new ArrayList<>();
        synchronized (this) {
            closed = true;
            idle.forEach(i -> kept.add(i.connection()));
            idle.clear();
        }
        sweep.cancel(false);
        kept.forEach(BinxConnection::close);
    }
}
