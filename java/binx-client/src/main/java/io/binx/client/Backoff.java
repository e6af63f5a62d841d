package io.binx.client;

import java.util.concurrent.ThreadLocalRandom;

/**
 * Exponential backoff with jitter, and a maximum error duration after which the caller gives
 * up (as Presto's and Trino's exchange clients do). Reset after a success.
 */
public final class Backoff {
    private final long minNanos;
    private final long maxNanos;
    private final long giveUpNanos;
    private long failingSince = -1;
    private long next;

    public Backoff(long minMillis, long maxMillis, long giveUpMillis) {
        this.minNanos = minMillis * 1_000_000L;
        this.maxNanos = maxMillis * 1_000_000L;
        this.giveUpNanos = giveUpMillis * 1_000_000L;
        this.next = minNanos;
    }

    /** Presto's numbers: 100 ms to 10 s, give up after 3 minutes of errors. */
    public static Backoff exchangeDefaults() {
        return new Backoff(10, 2_000, 180_000);
    }

    /** Records a failure; returns the delay before the next try in ms, or -1 to give up. */
    public synchronized long failure() {
        long now = System.nanoTime();
        if (failingSince < 0) {
            failingSince = now;
        }
        if (now - failingSince > giveUpNanos) {
            return -1;
        }
        long base = next;
        next = Math.min(maxNanos, next * 2);
        long jitter = ThreadLocalRandom.current().nextLong(base / 2 + 1);
        return (base / 2 + jitter) / 1_000_000L;
    }

    /** How long it has been failing, in ms (0 when it is not). */
    public synchronized long failingForMillis() {
        return failingSince < 0 ? 0 : (System.nanoTime() - failingSince) / 1_000_000L;
    }

    public synchronized void success() {
        failingSince = -1;
        next = minNanos;
    }
}
