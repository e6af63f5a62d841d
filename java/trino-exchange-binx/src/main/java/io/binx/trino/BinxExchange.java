package io.binx.trino;

import static io.binx.trino.BinxErrorCode.BINX_EXCHANGE_FAILED;

import io.binx.client.Tasks;
import io.trino.spi.TrinoException;
import io.trino.spi.exchange.Exchange;
import io.trino.spi.exchange.ExchangeContext;
import io.trino.spi.exchange.ExchangeId;
import io.trino.spi.exchange.ExchangeSinkHandle;
import io.trino.spi.exchange.ExchangeSinkInstanceHandle;
import io.trino.spi.exchange.ExchangeSourceHandle;
import io.trino.spi.exchange.ExchangeSourceHandleSource;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HexFormat;
import java.util.List;
import java.util.Map;
import java.util.Queue;
import java.util.TreeMap;
import java.util.TreeSet;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * One exchange between two stages, on the coordinator. Each attempt of each task partition
 * writes a binx task of its own (so attempts never mix); the first attempt the engine reports
 * finished is the one read ({@code sinkFinished} keeps it, as the output selector does). Once
 * every required sink finished, the coordinator's sidecar says where each selected attempt is
 * and how large each of its buffers is (COMMITTED), and the source handles list exactly those
 * buffers. Closing deletes every committed attempt's buffers on their sidecars, reported
 * finished or not.
 */
final class BinxExchange implements Exchange {
    /** binxd's limit on task ids. */
    private static final int MAX_TASK_ID = 256;
    /** COMMITTED lookups one exchange has started (in flight or waiting their turn) at most (see {@link #lookUp}). */
    static final int MAX_LOOKUPS = 64;

    private final BinxExchangeManager manager;
    private final AtomicInteger lookupsStarted = new AtomicInteger();
    /** Lookups under way: cancelled (they stop asking) once the handles failed or the exchange closed. */
    private final Queue<CompletableFuture<Tasks.CommittedTask>> lookupsInFlight = new ConcurrentLinkedQueue<>();
    private final ExchangeId exchangeId;
    private final String taskPrefix;
    private final int outputPartitionCount;
    private final CompletableFuture<List<ExchangeSourceHandle>> handles = new CompletableFuture<>();

    // Guarded by `this`.
    private final TreeSet<Integer> sinks = new TreeSet<>();
    /** Task partition -> the first attempt reported finished: the one read. */
    private final TreeMap<Integer, Integer> selected = new TreeMap<>();
    /**
     * Task partition -> every attempt a sink was made for, all deleted at close: an attempt may
     * commit and never be reported finished (Trino fails a finished task whose spooling stats
     * are empty, or aborts a speculative one after its sink finished), and its output must not
     * wait for the storage TTL.
     */
    private final Map<Integer, TreeSet<Integer>> attempts = new HashMap<>();
    /** What COMMITTED said of an attempt's task, by task id. */
    private final Map<String, Tasks.CommittedTask> commits = new HashMap<>();
    private boolean handlesStarted;
    private boolean closed;

    BinxExchange(BinxExchangeManager manager, ExchangeContext context, int outputPartitionCount) {
        this.manager = manager;
        this.exchangeId = context.getExchangeId();
        this.outputPartitionCount = outputPartitionCount;
        // Exchange ids repeat across queries: the query id and a random part keep task ids apart.
        String random = HexFormat.of().toHexDigits(ThreadLocalRandom.current().nextInt());
        String prefix = "trino." + random + "." + context.getQueryId().id() + "." + exchangeId.getId();
        if (prefix.length() > MAX_TASK_ID - 24 || !prefix.matches("[A-Za-z0-9._:-]+")) {
            prefix = "trino." + random + "." + digest(context.getQueryId().id() + "/" + exchangeId.getId());
        }
        this.taskPrefix = prefix;
    }

    private static String digest(String text) {
        try {
            byte[] d = MessageDigest.getInstance("SHA-256").digest(text.getBytes(StandardCharsets.UTF_8));
            return HexFormat.of().formatHex(d, 0, 16);
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException(e);
        }
    }

    /** The binx task an attempt writes. */
    String taskId(int taskPartitionId, int attemptId) {
        return taskPrefix + "." + taskPartitionId + "." + attemptId;
    }

    @Override
    public ExchangeId getId() {
        return exchangeId;
    }

    @Override
    public synchronized ExchangeSinkHandle addSink(int taskPartitionId) {
        sinks.add(taskPartitionId);
        return new BinxSinkHandle(taskPartitionId);
    }

    @Override
    public void noMoreSinks() {}

    @Override
    public CompletableFuture<ExchangeSinkInstanceHandle> instantiateSink(ExchangeSinkHandle sinkHandle, int taskAttemptId) {
        int partition = ((BinxSinkHandle) sinkHandle).taskPartitionId();
        boolean afterClose;
        synchronized (this) {
            afterClose = closed;
            attempts.computeIfAbsent(partition, p -> new TreeSet<>()).add(taskAttemptId);
        }
        if (afterClose) {
            // Nobody reads it, and its sink's abort after a commit changes nothing: the deleter
            // looks it up again until it commits or its time is up, as for a late sinkFinished.
            manager.deleter().delete(exchangeId.toString(), List.of(taskId(partition, taskAttemptId)), Map.of());
        }
        return CompletableFuture.completedFuture(new BinxSinkInstanceHandle(taskId(partition, taskAttemptId), outputPartitionCount));
    }

    @Override
    public CompletableFuture<ExchangeSinkInstanceHandle> updateSinkInstanceHandle(ExchangeSinkHandle sinkHandle, int taskAttemptId) {
        // A binx sink never asks for an update (isHandleUpdateRequired is false).
        return CompletableFuture.failedFuture(new UnsupportedOperationException("binx sinks need no handle update"));
    }

    @Override
    public void sinkFinished(ExchangeSinkHandle sinkHandle, int taskAttemptId) {
        int partition = ((BinxSinkHandle) sinkHandle).taskPartitionId();
        synchronized (this) {
            if (!closed) {
                selected.putIfAbsent(partition, taskAttemptId);
                attempts.computeIfAbsent(partition, p -> new TreeSet<>()).add(taskAttemptId);
                return;
            }
        }
        // Finished after the exchange closed: nobody reads it.
        manager.deleter().delete(exchangeId.toString(), List.of(taskId(partition, taskAttemptId)), Map.of());
    }

    @Override
    public void allRequiredSinksFinished() {
        Map<Integer, Integer> chosen;
        synchronized (this) {
            if (handlesStarted) {
                return;
            }
            handlesStarted = true;
            chosen = new TreeMap<>(selected);
        }
        // The lookups are started on the background pool (the first may connect) and never
        // waited on there: the handles are laid out when the last answer comes in, so a slow
        // sidecar holds no thread of the pool that also deletes and reads.
        CompletableFuture<Map<Integer, CompletableFuture<Tasks.CommittedTask>>> started;
        try {
            started = CompletableFuture.supplyAsync(() -> lookUp(chosen), manager.background());
        } catch (java.util.concurrent.RejectedExecutionException e) {
            // The manager is shutting down: the engine's wait for handles ends, with the reason.
            handles.completeExceptionally(new TrinoException(BINX_EXCHANGE_FAILED,
                    "the binx exchange manager is shutting down; no source handles for exchange " + exchangeId, e));
            return;
        }
        started
                .thenCompose(lookups -> CompletableFuture.allOf(lookups.values().toArray(new CompletableFuture<?>[0]))
                        .handle((ok, err) -> lookups))
                .thenApply(lookups -> buildHandles(chosen, lookups))
                .whenComplete((h, err) -> {
                    if (err != null) {
                        handles.completeExceptionally(err instanceof java.util.concurrent.CompletionException && err.getCause() != null
                                ? err.getCause() : err);
                    } else {
                        handles.complete(h);
                    }
                });
    }

    /**
     * Asks the local sidecar where each chosen attempt is (COMMITTED), {@link #MAX_LOOKUPS} at
     * once, and every exchange's together within the manager's {@link
     * BinxExchangeManager#MAX_LOOKUPS}: a stage of thousands of tasks, or many stages laying out
     * their handles at once, never take the shared connection's request slots (a sender past
     * them would wait, holding a thread).
     */
    private Map<Integer, CompletableFuture<Tasks.CommittedTask>> lookUp(Map<Integer, Integer> chosen) {
        // Filled before any lookup starts and only read after: safe to read from their threads.
        Map<Integer, CompletableFuture<Tasks.CommittedTask>> lookups = new TreeMap<>();
        for (Integer partition : chosen.keySet()) {
            lookups.put(partition, new CompletableFuture<>());
        }
        Queue<Map.Entry<Integer, Integer>> waiting = new ConcurrentLinkedQueue<>(chosen.entrySet());
        for (int i = 0; i < MAX_LOOKUPS; i++) {
            lookUpNext(waiting, lookups);
        }
        return lookups;
    }

    /** Starts the next waiting lookup, if one is left; its answer starts the one after. */
    private void lookUpNext(Queue<Map.Entry<Integer, Integer>> waiting,
            Map<Integer, CompletableFuture<Tasks.CommittedTask>> lookups) {
        Map.Entry<Integer, Integer> next = waiting.poll();
        if (next == null) {
            return;
        }
        lookupsStarted.incrementAndGet();
        CompletableFuture<Tasks.CommittedTask> result = lookups.get(next.getKey());
        CompletableFuture<Tasks.CommittedTask> lookup;
        try {
            String taskId = taskId(next.getKey(), next.getValue());
            long budget = manager.config().maxErrorMillis();
            // Timed from its start, not from its wait for a turn; a lookup whose answer never
            // comes gives its turn back by a reconnect (BinxExchangeManager#unstick). The wait
            // for a turn is bounded as well (twice a lookup's own time): the engine's wait for
            // handles always ends.
            long own = budget + BinxExchangeManager.margin(budget);
            lookup = manager.lookups()
                    .submit(settled -> manager.unstick(Tasks.committed(manager::shared, taskId, budget, manager.callbacks(), settled)
                            .orTimeout(own, TimeUnit.MILLISECONDS), settled))
                    .orTimeout(2 * own, TimeUnit.MILLISECONDS);
        } catch (RuntimeException e) {
            // Not expected (failures come back in the future), but one must not end the chain:
            // the lookups after it would never start, nor the engine's wait for handles end.
            lookup = CompletableFuture.failedFuture(e);
        }
        CompletableFuture<Tasks.CommittedTask> started = lookup;
        lookupsInFlight.add(started);
        if (handles.isDone()) {
            // Failed (or closed) meanwhile: this one is not asked either.
            started.cancel(false);
        }
        lookup
                // On the plugin's threads, which never refuse work: a refused callback would
                // leave the engine's wait for handles without an end.
                .whenCompleteAsync((commit, err) -> {
                    lookupsInFlight.remove(started);
                    if (err != null) {
                        result.completeExceptionally(err);
                    } else {
                        result.complete(commit);
                    }
                    if (err == null && commit != null) {
                        lookUpNext(waiting, lookups);
                        return;
                    }
                    // The handles cannot be laid out without this attempt's output: the
                    // engine's wait ends now, naming it, rather than once every lookup still
                    // waiting had spent its own error budget (a stage of 1000 tasks against a
                    // sidecar that is down: an hour). The rest are not started.
                    handles.completeExceptionally(noCommit(next.getKey(), next.getValue(), err));
                    for (Map.Entry<Integer, Integer> skipped; (skipped = waiting.poll()) != null; ) {
                        lookups.get(skipped.getKey()).cancel(false);
                    }
                    cancelLookups();
                }, manager.callbacks());
    }

    /** Why the output of a task partition's chosen attempt cannot be read: its lookup failed ({@code err}) or found no commit. */
    private TrinoException noCommit(int partition, int attempt, Throwable err) {
        String taskId = taskId(partition, attempt);
        if (err != null) {
            return new TrinoException(BINX_EXCHANGE_FAILED, "cannot learn where the output of task partition "
                    + partition + " attempt " + attempt + " is (binx task " + taskId + "): " + causeOf(err), err);
        }
        return new TrinoException(BINX_EXCHANGE_FAILED, "the output of task partition " + partition + " attempt " + attempt
                + " (binx task " + taskId + ") has no commit: its sidecar did not commit it, or it was deleted or expired");
    }

    /** Stops the lookups under way: nothing will read their answers. */
    private void cancelLookups() {
        for (CompletableFuture<Tasks.CommittedTask> lookup; (lookup = lookupsInFlight.poll()) != null; ) {
            lookup.cancel(false);
        }
    }

    /** Lookups of where attempts' output is that this exchange started (for tests). */
    int lookupsStarted() {
        return lookupsStarted.get();
    }

    /** Lays out the handles from the answers, all in; fails naming the first partition without one. */
    private List<ExchangeSourceHandle> buildHandles(Map<Integer, Integer> chosen,
            Map<Integer, CompletableFuture<Tasks.CommittedTask>> lookups) {
        // Per output partition, the entries of every chosen attempt that has pages there.
        List<List<BinxSourceHandle.Entry>> perPartition = new ArrayList<>();
        for (int i = 0; i < outputPartitionCount; i++) {
            perPartition.add(new ArrayList<>());
        }
        for (Map.Entry<Integer, CompletableFuture<Tasks.CommittedTask>> e : lookups.entrySet()) {
            int partition = e.getKey();
            int attempt = chosen.get(partition);
            String taskId = taskId(partition, attempt);
            Tasks.CommittedTask commit;
            try {
                commit = e.getValue().getNow(null);
            } catch (RuntimeException ex) {
                throw noCommit(partition, attempt, ex);
            }
            if (commit == null) {
                throw noCommit(partition, attempt, null);
            }
            if (commit.bufferCount() != outputPartitionCount) {
                throw new TrinoException(BINX_EXCHANGE_FAILED, "binx task " + taskId + " has " + commit.bufferCount()
                        + " buffers, where this exchange has " + outputPartitionCount + " output partitions");
            }
            synchronized (this) {
                commits.put(taskId, commit);
            }
            for (int q = 0; q < outputPartitionCount; q++) {
                if (commit.endTokens()[q] > 0) {
                    perPartition.get(q).add(new BinxSourceHandle.Entry(taskId, partition, attempt, commit.endpoint(),
                            commit.endTokens()[q], commit.bytes()[q]));
                }
            }
        }
        long target = manager.config().sourceHandleTargetBytes();
        List<ExchangeSourceHandle> out = new ArrayList<>();
        for (int q = 0; q < outputPartitionCount; q++) {
            List<BinxSourceHandle.Entry> current = new ArrayList<>();
            long size = 0;
            for (BinxSourceHandle.Entry entry : perPartition.get(q)) {
                if (size > 0 && size + entry.bytes() > target) {
                    out.add(new BinxSourceHandle(exchangeId, q, current));
                    current = new ArrayList<>();
                    size = 0;
                }
                current.add(entry);
                size += entry.bytes();
            }
            if (!current.isEmpty()) {
                out.add(new BinxSourceHandle(exchangeId, q, current));
            }
        }
        return out;
    }

    static String causeOf(Throwable t) {
        Throwable c = t;
        while ((c instanceof java.util.concurrent.ExecutionException || c instanceof java.util.concurrent.CompletionException)
                && c.getCause() != null) {
            c = c.getCause();
        }
        return c.getMessage() == null ? c.toString() : c.getMessage();
    }

    @Override
    public ExchangeSourceHandleSource getSourceHandles() {
        return new ExchangeSourceHandleSource() {
            @Override
            public CompletableFuture<ExchangeSourceHandleBatch> getNextBatch() {
                return handles.thenApply(h -> new ExchangeSourceHandleBatch(h, true));
            }

            @Override
            public void close() {}
        };
    }

    /**
     * Deletes every committed attempt's buffers on the sidecar that holds them (through the local
     * one; from storage when that sidecar is gone), in the background: close returns at once.
     * What a crashed coordinator leaves, the sidecars free by their own rules (abandonment,
     * then the storage TTL).
     */
    @Override
    public void close() {
        Map<String, Tasks.CommittedTask> known;
        List<String> all = new ArrayList<>();
        synchronized (this) {
            if (closed) {
                return;
            }
            closed = true;
            known = new HashMap<>(commits);
            for (Map.Entry<Integer, TreeSet<Integer>> e : attempts.entrySet()) {
                for (int attempt : e.getValue()) {
                    all.add(taskId(e.getKey(), attempt));
                }
            }
        }
        handles.cancel(false);
        cancelLookups();
        if (all.isEmpty()) {
            return;
        }
        manager.deleter().delete(exchangeId.toString(), all, known);
    }
}
