package io.binx.client;

import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.Executor;
import java.util.concurrent.TimeUnit;
import java.util.function.Function;
import java.util.function.Supplier;

/** Task-level requests an engine's coordinator needs: where a finished task's output is, and deleting it. */
public final class Tasks {
    private Tasks() {}

    /** What a task's commit says (COMMITTED, docs/PROTOCOL.md section 10), all its buffers. */
    public record CommittedTask(String taskId, String node, String endpoint, long[] endTokens, long[] bytes) {
        public int bufferCount() {
            return endTokens.length;
        }

        public long totalBytes() {
            long total = 0;
            for (long b : bytes) {
                total += b;
            }
            return total;
        }
    }

    /** The most buffers a lookup accepts (binxd's own limit per task). */
    public static final long MAX_BUFFERS = 65_536;

    /**
     * COMMITTED on the local binxd: where {@code taskId}'s output is and how large each buffer
     * is, read from the commit its sidecar wrote. Completes with {@code null} when there is no
     * commit (the task did not finish, or it was deleted); fails on a refusal. The reply comes in
     * pages of buffers; every page must agree on the node, endpoint and count.
     */
    public static CompletableFuture<CommittedTask> committed(BinxConnection c, String taskId) {
        CompletableFuture<CommittedTask> result = new CompletableFuture<>();
        lookup(c, taskId, 0, null, new Wire.LongList(), new Wire.LongList(), result);
        return result;
    }

    /**
     * {@link #committed(BinxConnection, String)}, asked again (which is exact) on BUSY, TIMEOUT
     * and broken connections, on a connection {@code connection} gives each time, with backoff,
     * for up to {@code maxErrorMillis}; each try after the first starts on {@code retries}.
     */
    public static CompletableFuture<CommittedTask> committed(Supplier<BinxConnection> connection, String taskId, long maxErrorMillis,
            Executor retries) {
        return retrying(connection, c -> committed(c, taskId), maxErrorMillis, retries, null);
    }

    /**
     * {@link #committed(Supplier, String, long, Executor)} that also completes {@code settled}
     * once none of its requests is in flight any more, however its result ended: cancelled or
     * timed out by the caller, a request already sent still holds a request slot of its
     * connection until answered, and a caller that bounds its requests counts it until then.
     */
    public static CompletableFuture<CommittedTask> committed(Supplier<BinxConnection> connection, String taskId, long maxErrorMillis,
            Executor retries, CompletableFuture<Void> settled) {
        return retrying(connection, c -> committed(c, taskId), maxErrorMillis, retries, settled);
    }

    /**
     * Runs {@code request} on a connection {@code connection} gives each time, again with
     * backoff on BUSY, TIMEOUT and broken connections, for up to {@code maxErrorMillis}; then
     * fails with the last error. Only for requests that are exact when repeated. A try after
     * the first starts on {@code retries} (it may connect, which can wait up to the connect
     * deadline): an application gives its own threads, so that no shared pool of its waits. It
     * must run what it is given, or run it on the calling thread: a refused try would leave the
     * future without an end.
     */
    static <T> CompletableFuture<T> retrying(Supplier<BinxConnection> connection,
            Function<BinxConnection, CompletableFuture<T>> request, long maxErrorMillis, Executor retries,
            CompletableFuture<Void> settled) {
        CompletableFuture<T> result = new CompletableFuture<>();
        CompletableFuture<Void> idle = settled != null ? settled : new CompletableFuture<>();
        retry(connection, request, new Backoff(10, 1_000, maxErrorMillis), retries, result, idle);
        return result;
    }

    /**
     * One try. What the supplier throws is a connection failure (retried) when a
     * BinxConnectionException caused it (a connector of the engine's may wrap it in its own
     * exception, naming the socket); anything else is not asked again.
     */
    private static <T> CompletableFuture<T> start(Supplier<BinxConnection> connection,
            Function<BinxConnection, CompletableFuture<T>> request) {
        BinxConnection c;
        try {
            c = connection.get();
        } catch (BinxException e) {
            return CompletableFuture.failedFuture(e);
        } catch (RuntimeException e) {
            return CompletableFuture.failedFuture(
                    BinxConnectionException.causedBy(e) ? new BinxConnectionException(e.getMessage(), e) : e);
        } catch (Error e) {
            // A connect that could not start its reader thread (OutOfMemoryError): the try
            // fails, and the caller's future with it, rather than never ending.
            return CompletableFuture.failedFuture(e);
        }
        try {
            return request.apply(c);
        } catch (RuntimeException | Error e) {
            return CompletableFuture.failedFuture(e);
        }
    }

    private static <T> void retry(Supplier<BinxConnection> connection, Function<BinxConnection, CompletableFuture<T>> request,
            Backoff backoff, Executor retries, CompletableFuture<T> result, CompletableFuture<Void> settled) {
        if (result.isDone()) {
            // Cancelled by the caller: nothing more is asked.
            settled.complete(null);
            return;
        }
        start(connection, request).whenComplete((value, err) -> {
            // `settled` first: whoever watches the result for an unanswered request (a
            // reconnect after a grace) sees this one answered.
            if (err == null) {
                settled.complete(null);
                result.complete(value);
                return;
            }
            Throwable cause = err instanceof CompletionException && err.getCause() != null ? err.getCause() : err;
            boolean again = cause instanceof BinxConnectionException
                    || (cause instanceof BinxRefusedException refused && refused.retriable());
            long delay = again && !result.isDone() ? backoff.failure() : -1;
            if (delay < 0) {
                settled.complete(null);
                result.completeExceptionally(cause);
                return;
            }
            CompletableFuture.delayedExecutor(delay, TimeUnit.MILLISECONDS, retries)
                    .execute(() -> retry(connection, request, backoff, retries, result, settled));
        });
    }

    private static void lookup(BinxConnection c, String taskId, long from, BinReply.Committed first,
            Wire.LongList ends, Wire.LongList bytes, CompletableFuture<CommittedTask> result) {
        BinRequest r = new BinRequest(MessageType.COMMITTED);
        r.taskId = taskId;
        r.pageToken = from;
        c.send(r).whenComplete((resp, err) -> {
            if (err != null) {
                result.completeExceptionally(err);
                return;
            }
            BinReply h = resp.header();
            if (h.status() == Status.NO_DATA && from == 0) {
                result.complete(null);
                return;
            }
            if (h.status() != Status.OK) {
                result.completeExceptionally(new BinxRefusedException(r, h));
                return;
            }
            BinReply.Committed part = h.committed;
            String bad = null;
            if (part == null) {
                bad = "an OK reply without its commit";
            } else if (part.endTokens.length != part.bytes.length) {
                bad = part.endTokens.length + " end tokens but " + part.bytes.length + " byte counts";
            } else if (h.pageToken != from || h.pageNextToken != from + part.endTokens.length) {
                bad = "buffers " + h.pageToken + ".." + h.pageNextToken + " where " + from + " on were asked for";
            } else if (Long.compareUnsigned(part.bufferCount, MAX_BUFFERS) > 0) {
                bad = part.bufferCount + " buffers, more than " + MAX_BUFFERS;
            } else if (first != null && (!first.node.equals(part.node) || !first.endpoint.equals(part.endpoint)
                    || first.bufferCount != part.bufferCount)) {
                bad = "parts of one commit that disagree";
            } else if (h.pageNextToken > part.bufferCount || (!h.bufferComplete && part.endTokens.length == 0)) {
                bad = "buffers past the task's " + part.bufferCount;
            } else {
                // Java's longs are signed: 2^63 pages or bytes and up would read as negative,
                // which a reader takes for "unknown" and would not check a read against.
                for (int i = 0; i < part.endTokens.length && bad == null; i++) {
                    if (part.endTokens[i] < 0 || part.bytes[i] < 0) {
                        bad = "buffer " + (from + i) + " ending at token " + Long.toUnsignedString(part.endTokens[i])
                                + " with " + Long.toUnsignedString(part.bytes[i]) + " bytes, past 2^63";
                    } else if (part.endTokens[i] == 0 && part.bytes[i] != 0) {
                        // A buffer of no pages is never read: bytes it claims would be lost unseen.
                        bad = "buffer " + (from + i) + " with no pages but " + part.bytes[i] + " bytes";
                    }
                }
            }
            if (bad != null) {
                result.completeExceptionally(new BinxException(BinxException.describe(r) + ": binxd answered " + bad));
                return;
            }
            for (int i = 0; i < part.endTokens.length; i++) {
                ends.add(part.endTokens[i]);
                bytes.add(part.bytes[i]);
            }
            if (h.bufferComplete || h.pageNextToken == part.bufferCount) {
                long[] e = ends.toArray();
                if (e.length != part.bufferCount) {
                    result.completeExceptionally(new BinxException(BinxException.describe(r) + ": the commit lists "
                            + e.length + " of its " + part.bufferCount + " buffers"));
                    return;
                }
                result.complete(new CommittedTask(taskId, part.node, part.endpoint, e, bytes.toArray()));
            } else {
                lookup(c, taskId, h.pageNextToken, first == null ? part : first, ends, bytes, result);
            }
        });
    }

    /** DELETE of one buffer, on {@code remote}'s sidecar when it is not "" (forwarded by the local one). */
    public static CompletableFuture<Response> delete(BinxConnection c, String taskId, long bufferId, String remote) {
        BinRequest r = deleting(MessageType.DELETE, taskId, remote);
        r.bufferId = bufferId;
        return okOrRefused(c, r);
    }

    /**
     * {@link #delete(BinxConnection, String, long, String)}, asked again (DELETE is repeatable)
     * on BUSY, TIMEOUT and broken connections for up to {@code maxErrorMillis}. A local binxd
     * answers TIMEOUT while {@code remote} cannot be reached, and deletes the buffer from
     * storage once that has lasted its {@code spool_failover_after}: asking again is what lets
     * it. Each try after the first starts on {@code retries}.
     */
    public static CompletableFuture<Response> delete(Supplier<BinxConnection> connection, String taskId, long bufferId,
            String remote, long maxErrorMillis, Executor retries) {
        return retrying(connection, c -> delete(c, taskId, bufferId, remote), maxErrorMillis, retries, null);
    }

    /**
     * {@link #delete(Supplier, String, long, String, long, Executor)}, completing {@code settled}
     * once its last try was answered or failed (or it was cancelled before one started): until
     * then a try may hold one of the connection's request slots.
     */
    public static CompletableFuture<Response> delete(Supplier<BinxConnection> connection, String taskId, long bufferId,
            String remote, long maxErrorMillis, Executor retries, CompletableFuture<Void> settled) {
        return retrying(connection, c -> delete(c, taskId, bufferId, remote), maxErrorMillis, retries, settled);
    }

    /**
     * DELETE_TASK (docs/PROTOCOL.md section 11, capability {@code task-delete}): buffers 0 up to
     * {@code buffers} of {@code taskId} in one request, as DELETEs of each would, on {@code
     * remote}'s sidecar when it is not "" (forwarded by the local one). Fails on anything but
     * OK: a binxd without it refuses the type, and a forwarding one answers TIMEOUT for a remote
     * it cannot reach without failing over to storage, which only a DELETE of each buffer does.
     */
    public static CompletableFuture<Response> deleteTask(BinxConnection c, String taskId, long buffers, String remote) {
        BinRequest r = deleting(MessageType.DELETE_TASK, taskId, remote);
        r.bufferCount = buffers;
        return okOrRefused(c, r);
    }

    /**
     * {@link #deleteTask(BinxConnection, String, long, String)} once, on a connection {@code
     * connection} gives (what it throws fails the future).
     */
    public static CompletableFuture<Response> deleteTask(Supplier<BinxConnection> connection, String taskId, long buffers,
            String remote) {
        return start(connection, c -> deleteTask(c, taskId, buffers, remote));
    }

    /** ABORT_TASK on the local binxd. */
    public static CompletableFuture<Response> abort(BinxConnection c, String taskId, String reason) {
        BinRequest r = new BinRequest(MessageType.ABORT_TASK);
        r.taskId = taskId;
        r.reason = BinRequest.reasonWithin(reason);
        return okOrRefused(c, r);
    }

    /** A DELETE or DELETE_TASK of {@code taskId}, forwarded to {@code remote} when it is not "" or null. */
    private static BinRequest deleting(MessageType type, String taskId, String remote) {
        BinRequest r = new BinRequest(type);
        r.taskId = taskId;
        r.remote = remote == null ? "" : remote;
        return r;
    }

    /** Sends {@code r}; its reply, or a {@link BinxRefusedException} for anything but OK. */
    private static CompletableFuture<Response> okOrRefused(BinxConnection c, BinRequest r) {
        return c.send(r).thenApply(resp -> {
            if (resp.header().status() != Status.OK) {
                throw new BinxRefusedException(r, resp.header());
            }
            return resp;
        });
    }
}
