package io.binx.trino;

import static io.binx.trino.BinxErrorCode.BINX_UNAVAILABLE;
import static io.binx.trino.BinxErrorCode.MAX_OUTPUT_PARTITION_COUNT_EXCEEDED;

import io.binx.client.Backoff;
import io.binx.client.BinxConnection;
import io.binx.client.BinxConnectionException;
import io.binx.client.BinxConnectionPool;
import io.binx.client.ConnectionSource;
import io.binx.client.BinxException;
import io.binx.client.BinxRefusedException;
import io.binx.client.DaemonThreads;
import io.binx.client.ProtocolException;
import io.binx.client.TaskWriter;
import io.trino.spi.TrinoException;
import io.trino.spi.exchange.Exchange;
import io.trino.spi.exchange.ExchangeContext;
import io.trino.spi.exchange.ExchangeManager;
import io.trino.spi.exchange.ExchangeSink;
import io.trino.spi.exchange.ExchangeSinkInstanceHandle;
import io.trino.spi.exchange.ExchangeSource;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.Executor;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.RejectedExecutionException;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;

/**
 * The {@code binx} exchange manager: every stage's output goes into the node's own binxd over its
 * Unix socket; the sidecars own storage, credentials and peers (the plugin never touches
 * storage). Sinks write a binx task per attempt, committed to storage at their finish; the
 * coordinator learns where each finished attempt is from its own sidecar (COMMITTED); sources
 * read through their sidecar, which fetches from the producer's sidecar or, once that is gone,
 * from storage.
 */
public class BinxExchangeManager implements ExchangeManager {
    private static final java.util.logging.Logger LOG = java.util.logging.Logger.getLogger(BinxExchangeManager.class.getName());
    private final BinxExchangeConfig config;
    /** Coordinator-side work that talks to binxd (lookups, deletes): small, bounded. */
    private final ExecutorService background = Executors.newFixedThreadPool(4, DaemonThreads.named("binx-exchange-coordinator"));
    /**
     * Where follow-ups and retries of the coordinator's requests run: the background pool, or
     * once it is shut down the calling thread (the requests then fail at once: {@link #shared}
     * refuses from the start of shutdown on), never a refusal, which would leave a future
     * without an end.
     */
    private final Executor callbacks = command -> {
        try {
            background.execute(command);
        } catch (RejectedExecutionException e) {
            command.run();
        }
    };
    /**
     * COMMITTED lookups of every exchange's handles at once: with the deleter's {@link
     * AttemptDeleter#IN_FLIGHT} and the few HELLOs, well within the shared connection's request
     * slots, so a sender never waits for one.
     */
    static final int MAX_LOOKUPS = 128;
    private final RequestGate lookups = new RequestGate(MAX_LOOKUPS, callbacks);
    /** Deletes closed exchanges' output (shutdown lets it finish, a while); made on first use. */
    private AttemptDeleter deleter;
    private final Object lock = new Object();
    private BinxConnection shared;
    /** Set once the deletions under way had their time: no request is started after it. */
    private boolean shutDown;
    /**
     * The HELLO that learns the local sidecar's address, under way or done; null before the
     * first, and again after one failed (the next caller asks anew).
     */
    private CompletableFuture<String> addressLookup;
    /** The local binxd's HELLO offered DELETE_TASK ({@code task-delete}), as last looked up. */
    private volatile boolean localTaskDelete;
    /**
     * Where the local address is asked (a connect may wait up to its deadline on a stuck binxd,
     * so never on a caller's thread: the engine's included), and asked again after a delay.
     */
    private static final ExecutorService ADDRESS_LOOKUPS = DaemonThreads.cached("binx-exchange-address");
    private static final ScheduledExecutorService ADDRESS_RETRIES = DaemonThreads.scheduler("binx-exchange-address-retry");
    private final BinxExchangeStats stats = BinxExchangeStats.register();
    /**
     * The writers' and readers' connections: a node runs many tasks one after another, each
     * writing a sink and reading sources, and a connection kept from one saves the next a
     * connect, a reader thread and a HELLO. Eight kept at most, none past 30 s idle.
     */
    private final BinxConnectionPool connections;

    public BinxExchangeManager(BinxExchangeConfig config) {
        this.config = config;
        this.connections = new BinxConnectionPool(() -> BinxConnection.unix(config.socket(),
                BinxConnection.Options.defaults().withClientName("trino-exchange-binx")), 8, 30_000);
    }

    /** This manager's counters (also over JMX). */
    BinxExchangeStats stats() {
        return stats;
    }

    BinxExchangeConfig config() {
        return config;
    }

    ExecutorService background() {
        return background;
    }

    /** The plugin's threads for what follows a coordinator request's answer; never refuses. */
    Executor callbacks() {
        return callbacks;
    }

    /** The manager-wide bound on COMMITTED lookups in flight. */
    RequestGate lookups() {
        return lookups;
    }

    /**
     * Time past a request's error budget ({@code exchange.binx.max-error-duration}) before it is
     * taken as never answered: its last try's own time, 30 s, or the budget when shorter.
     */
    static long margin(long budgetMillis) {
        return Math.min(30_000, budgetMillis);
    }

    /**
     * {@code request}, and if it ends without an answer (timed out, or cancelled: a lookup whose
     * wait for its turn outlasted its own time is cancelled by the outer deadline) while something
     * of it ({@code settled}) is still unanswered {@link #margin} later, the shared connection is
     * closed: binxd
     * answers every request or is broken, and a request it never answers would hold its slot
     * of the connection, and its lookup's turn, for good. Closing fails every request of the
     * connection (the deleter's retry on a new one).
     */
    <T> CompletableFuture<T> unstick(CompletableFuture<T> request, CompletableFuture<Void> settled) {
        request.whenComplete((v, e) -> {
            if (e != null && !settled.isDone()) {
                long grace = margin(config.maxErrorMillis());
                CompletableFuture.delayedExecutor(grace, TimeUnit.MILLISECONDS, callbacks).execute(() -> {
                    if (settled.isDone()) {
                        return;
                    }
                    BinxConnection stuck;
                    synchronized (lock) {
                        stuck = shared;
                    }
                    if (stuck != null) {
                        LOG.warning("binx exchange manager: the local binxd at " + config.socket() + " left a request unanswered for "
                                + (config.maxErrorMillis() + 2 * grace) + " ms; reconnecting");
                        stuck.close();
                    }
                });
            }
        });
        return request;
    }

    AttemptDeleter deleter() {
        synchronized (lock) {
            if (deleter == null) {
                deleter = new AttemptDeleter(this);
            }
            return deleter;
        }
    }

    /** A new connection to the local binxd; a failure says which socket and why. */
    BinxConnection connect() {
        try {
            return BinxConnection.unix(config.socket(), BinxConnection.Options.defaults().withClientName("trino-exchange-binx"));
        } catch (BinxException e) {
            throw new TrinoException(BINX_UNAVAILABLE, "cannot reach the local binxd at " + config.socket()
                    + " (exchange.binx.socket): " + e.getMessage(), e);
        }
    }

    /**
     * Connections for writers and readers, each used by one at a time and kept for the next
     * when given back idle: a failure is a BinxConnectionException they retry.
     */
    ConnectionSource connector() {
        return connections;
    }

    /**
     * The coordinator's own connection, opened again after it broke. The connect is made
     * outside the manager's lock (up to its deadline on a stuck binxd): the engine's scheduler
     * thread takes that lock for the deleter ({@code Exchange.close}, a late {@code
     * sinkFinished}), and must not wait behind it.
     */
    BinxConnection shared() {
        synchronized (lock) {
            if (shutDown) {
                // Not a connection failure: nothing asks again.
                throw new IllegalStateException("the binx exchange manager was shut down");
            }
            if (shared != null && shared.isOpen()) {
                return shared;
            }
        }
        BinxConnection fresh = connect();
        synchronized (lock) {
            if (shutDown || (shared != null && shared.isOpen())) {
                // Shut down meanwhile, or another caller's connect landed first.
                fresh.close();
                if (shutDown) {
                    throw new IllegalStateException("the binx exchange manager was shut down");
                }
                return shared;
            }
            shared = fresh;
            return shared;
        }
    }

    /**
     * host:port other sidecars reach the local binxd under (its HELLO says {@code address=}):
     * a buffer there is read without forwarding. Asked once per manager, on a thread of the
     * plugin's own; while the local binxd cannot be reached (its container restarting) it is
     * asked again with backoff for {@code exchange.binx.max-error-duration}, as every other
     * request of the plugin is, and the future fails only then, or at once when binxd answers
     * without what this exchange needs.
     */
    CompletableFuture<String> localAddressLookup() {
        CompletableFuture<String> lookup;
        synchronized (lock) {
            if (addressLookup != null) {
                return addressLookup;
            }
            lookup = new CompletableFuture<>();
            addressLookup = lookup;
        }
        Backoff backoff = new Backoff(10, 2_000, config.maxErrorMillis());
        ADDRESS_LOOKUPS.execute(() -> askLocalAddress(lookup, backoff));
        return lookup;
    }

    /**
     * Whether the local binxd answers DELETE_TASK, as its HELLO said when {@link
     * #localAddressLookup()} completed (false before).
     */
    boolean localOffersTaskDelete() {
        return localTaskDelete;
    }

    private void askLocalAddress(CompletableFuture<String> lookup, Backoff backoff) {
        try {
            List<String> caps = shared().capabilities(30_000);
            if (!caps.contains("committed") || !caps.contains("append-token")) {
                throw new TrinoException(BINX_UNAVAILABLE, "the binxd at " + config.socket()
                        + " does not offer what this exchange needs (committed, append-token, and a spool store); it offers "
                        + caps);
            }
            localTaskDelete = caps.contains("task-delete");
            lookup.complete(BinxConnection.capability(caps, "address"));
        } catch (Throwable e) {
            boolean again = worthAskingAgain(e);
            long delay = again ? backoff.failure() : -1;
            synchronized (lock) {
                if (delay >= 0 && !shutDown) {
                    ADDRESS_RETRIES.schedule(() -> ADDRESS_LOOKUPS.execute(() -> askLocalAddress(lookup, backoff)),
                            delay, TimeUnit.MILLISECONDS);
                    return;
                }
                if (addressLookup == lookup) {
                    addressLookup = null;
                }
            }
            lookup.completeExceptionally(again && delay < 0
                    ? new TrinoException(BINX_UNAVAILABLE, "gave up after " + backoff.failingForMillis()
                            + " ms (exchange.binx.max-error-duration) asking the local binxd at " + config.socket()
                            + " its address: " + e.getMessage(), e)
                    : e);
            if (e instanceof Error error) {
                throw error;
            }
        }
    }

    /**
     * Whether {@code e} is worth asking again: the local binxd could not be reached (not one
     * that answered in another protocol), or it answered BUSY (at its connection limit).
     */
    private static boolean worthAskingAgain(Throwable e) {
        for (Throwable c = e; c != null; c = c.getCause()) {
            if (c instanceof ProtocolException) {
                return false;
            }
        }
        return BinxConnectionException.causedBy(e) || (e instanceof BinxRefusedException r && r.retriable());
    }

    @Override
    public Exchange createExchange(ExchangeContext context, int outputPartitionCount, boolean preserveOrderWithinPartition) {
        if (outputPartitionCount > config.maxOutputPartitionCount()) {
            throw new TrinoException(MAX_OUTPUT_PARTITION_COUNT_EXCEEDED, String.format(
                    "Max number of output partitions exceeded for exchange '%s'. Allowed: %s. Requested: %s. (exchange.binx.max-output-partition-count)",
                    context.getExchangeId(), config.maxOutputPartitionCount(), outputPartitionCount));
        }
        BinxExchange exchange = new BinxExchange(this, context, outputPartitionCount);
        stats.exchangesCreated.increment();
        return exchange;
    }

    @Override
    public ExchangeSink createSink(ExchangeSinkInstanceHandle handle) {
        BinxSinkInstanceHandle h = (BinxSinkInstanceHandle) handle;
        // Trino reads an attempt only once its sink finished, and this plugin's readers never
        // acknowledge pages (an output may be read again until the exchange closes): nothing
        // frees a buffer's page slots while it writes, so past binxd's page limit the writer
        // fails at once, saying so, and the sink's finish reports it.
        TaskWriter.Options options = new TaskWriter.Options(config.sinkBatchBytes(), 4096, config.sinkBufferBytes(),
                1_000_000, config.maxErrorMillis()).withReadAfterFinish();
        return new BinxExchangeSink(this, h, options);
    }

    @Override
    public ExchangeSource createSource() {
        return new BinxExchangeSource(this);
    }

    /** The FTE scheduler reads a stage only after the stages it reads finished. */
    @Override
    public boolean supportsConcurrentReadAndWrite() {
        return false;
    }

    /** Lets deletions under way finish (10 s at most), then closes the connections. */
    @Override
    public void shutdown() {
        try {
            // What is not done by then goes by the sidecars' own rules (abandonment, the TTL).
            deleter().awaitIdle(10_000);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
        synchronized (lock) {
            // Retries and follow-ups run on the calling thread from now on: they must fail at
            // once rather than connect there.
            shutDown = true;
        }
        background.shutdown();
        try {
            background.awaitTermination(10, TimeUnit.SECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
        // What was queued still runs (each fails at once: shared() refuses), so no future of
        // it is left without an end.
        for (Runnable queued : background.shutdownNow()) {
            try {
                queued.run();
            } catch (RuntimeException e) {
                LOG.log(java.util.logging.Level.FINE, "binx exchange manager: queued work failed at shutdown", e);
            }
        }
        synchronized (lock) {
            shutDown = true;
            if (shared != null) {
                shared.close();
            }
        }
        connections.close();
        stats.unregister();
    }
}
