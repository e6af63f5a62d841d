package io.binx.trino;

import java.lang.management.ManagementFactory;
import java.util.concurrent.atomic.LongAdder;
import java.util.logging.Level;
import java.util.logging.Logger;
import javax.management.InstanceAlreadyExistsException;
import javax.management.JMException;
import javax.management.MBeanServer;
import javax.management.ObjectName;

/**
 * The counters of one exchange manager, registered with the platform MBean server as {@code
 * io.binx.trino:type=BinxExchangeStats,name=N}, N the lowest free: 0 in a Trino server, which has
 * one manager; 0, 1, 2 ... in a test cluster of several nodes in one JVM, where each node loads
 * the plugin in a class loader of its own (so no static counter of ours is shared). Trino's JMX
 * connector reads them as {@code jmx.current."io.binx.trino:type=binxexchangestats,name=0"}.
 */
public final class BinxExchangeStats implements BinxExchangeStatsMBean {
    private static final Logger LOG = Logger.getLogger(BinxExchangeStats.class.getName());
    /** Names tried before giving up (and going without JMX). */
    private static final int MAX_NAMES = 1024;

    final LongAdder exchangesCreated = new LongAdder();
    final LongAdder sinksStarted = new LongAdder();
    final LongAdder sinksCommitted = new LongAdder();
    final LongAdder sinksFailed = new LongAdder();
    final LongAdder sinksAborted = new LongAdder();
    final LongAdder pagesWritten = new LongAdder();
    final LongAdder bytesWritten = new LongAdder();
    final LongAdder pagesAfterFinish = new LongAdder();
    final LongAdder enqueues = new LongAdder();
    final LongAdder sourcesStarted = new LongAdder();
    final LongAdder sourcesFailed = new LongAdder();
    final LongAdder pagesRead = new LongAdder();
    final LongAdder bytesRead = new LongAdder();
    final LongAdder buffersDeleted = new LongAdder();
    final LongAdder taskDeletes = new LongAdder();
    final LongAdder outputsLeftToTtl = new LongAdder();
    private final ObjectName name;
    /** Cleared by the first unregister: a second must not remove a name another manager took since. */
    private final java.util.concurrent.atomic.AtomicBoolean registered = new java.util.concurrent.atomic.AtomicBoolean();

    private BinxExchangeStats(ObjectName name) {
        this.name = name;
    }

    /**
     * New counters, registered under the lowest free name; a registration that fails costs
     * only a warning (the exchange works without its metrics).
     */
    static BinxExchangeStats register() {
        MBeanServer server;
        try {
            server = ManagementFactory.getPlatformMBeanServer();
        } catch (RuntimeException | Error e) {
            LOG.log(Level.WARNING, "binx exchange manager: no MBean server for its counters", e);
            return new BinxExchangeStats(null);
        }
        for (int n = 0; n < MAX_NAMES; n++) {
            ObjectName name;
            try {
                name = new ObjectName("io.binx.trino:type=BinxExchangeStats,name=" + n);
            } catch (JMException e) {
                LOG.log(Level.WARNING, "binx exchange manager: no JMX name for its counters", e);
                break;
            }
            BinxExchangeStats stats = new BinxExchangeStats(name);
            try {
                server.registerMBean(stats, name);
                stats.registered.set(true);
                return stats;
            } catch (InstanceAlreadyExistsException taken) {
                // Another manager in this JVM has it: the next.
            } catch (JMException | RuntimeException e) {
                LOG.log(Level.WARNING, "binx exchange manager: its counters could not be registered as " + name, e);
                break;
            }
        }
        LOG.warning("binx exchange manager: its counters are not in JMX (no free name among " + MAX_NAMES + ")");
        return new BinxExchangeStats(null);
    }

    /** The JMX name (null when none could be made). */
    ObjectName objectName() {
        return name;
    }

    /** Leaves the MBean server (the manager shut down): its name is free for another. */
    void unregister() {
        if (name == null || !registered.compareAndSet(true, false)) {
            return;
        }
        try {
            // The name is ours alone: registered by this object, never by another.
            ManagementFactory.getPlatformMBeanServer().unregisterMBean(name);
        } catch (JMException | RuntimeException e) {
            LOG.log(Level.FINE, "binx exchange manager: " + name + " was unregistered already", e);
        }
    }

    @Override
    public long getExchangesCreated() {
        return exchangesCreated.sum();
    }

    @Override
    public long getSinksStarted() {
        return sinksStarted.sum();
    }

    @Override
    public long getSinksCommitted() {
        return sinksCommitted.sum();
    }

    @Override
    public long getSinksFailed() {
        return sinksFailed.sum();
    }

    @Override
    public long getSinksAborted() {
        return sinksAborted.sum();
    }

    @Override
    public long getEnqueues() {
        return enqueues.sum();
    }

    @Override
    public long getPagesAddedAfterFinish() {
        return pagesAfterFinish.sum();
    }

    @Override
    public long getPagesWritten() {
        return pagesWritten.sum();
    }

    @Override
    public long getBytesWritten() {
        return bytesWritten.sum();
    }

    @Override
    public long getSourcesStarted() {
        return sourcesStarted.sum();
    }

    @Override
    public long getSourcesFailed() {
        return sourcesFailed.sum();
    }

    @Override
    public long getPagesRead() {
        return pagesRead.sum();
    }

    @Override
    public long getBytesRead() {
        return bytesRead.sum();
    }

    @Override
    public long getBuffersDeleted() {
        return buffersDeleted.sum();
    }

    @Override
    public long getTaskDeletes() {
        return taskDeletes.sum();
    }

    @Override
    public long getOutputsLeftToTtl() {
        return outputsLeftToTtl.sum();
    }
}
