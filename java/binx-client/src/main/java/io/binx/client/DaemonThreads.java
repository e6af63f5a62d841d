package io.binx.client;

import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledThreadPoolExecutor;
import java.util.concurrent.ThreadFactory;

/**
 * The client's (and the Trino plugin's) thread pools: daemon threads, so background work never
 * keeps an engine's JVM alive, each named for what it does, so a thread dump says whose it is.
 */
public final class DaemonThreads {
    private DaemonThreads() {}

    /** Daemon threads called {@code name}. */
    public static ThreadFactory named(String name) {
        return r -> {
            Thread t = new Thread(r, name);
            t.setDaemon(true);
            return t;
        };
    }

    /** A pool that grows with the tasks waiting and lets idle threads go after a minute. */
    public static ExecutorService cached(String name) {
        return Executors.newCachedThreadPool(named(name));
    }

    /**
     * One thread running tasks when due. A cancelled task leaves its queue at once, so what it
     * holds (a channel, a request) is not kept until it would have been due.
     */
    public static ScheduledExecutorService scheduler(String name) {
        ScheduledThreadPoolExecutor e = new ScheduledThreadPoolExecutor(1, named(name));
        e.setRemoveOnCancelPolicy(true);
        return e;
    }
}
