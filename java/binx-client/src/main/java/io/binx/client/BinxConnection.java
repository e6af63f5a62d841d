package io.binx.client;

import java.io.IOException;
import java.net.InetSocketAddress;
import java.net.SocketAddress;
import java.net.StandardProtocolFamily;
import java.net.UnixDomainSocketAddress;
import java.nio.ByteBuffer;
import java.nio.channels.GatheringByteChannel;
import java.nio.channels.ReadableByteChannel;
import java.nio.channels.SocketChannel;
import java.nio.file.Path;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.Executor;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.Semaphore;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicLong;

/**
 * One multiplexed BinX connection (docs/PROTOCOL.md section 4, "Requests and replies": request ids): many requests in
 * flight, each with its own id, replies in any order. A reader thread matches replies to
 * requests; futures complete on the connection's executor, never on the reader, so a callback
 * that sends again cannot stall the reads its own reply needs.
 *
 * <p>At most {@link Options#maxOutstanding} requests are in flight (binxd answers BUSY past its
 * own limit); {@link #send} waits for a slot. When the connection breaks, every request without
 * a reply fails with a {@link BinxConnectionException}: it may or may not have taken effect.
 *
 * <p>{@link #send} never writes to the socket itself: it queues the frame, and one writer task
 * per connection at a time (on a shared pool whose threads are those of the connections
 * writing at that moment) writes what is queued, in order, many frames per system call,
 * through one bounded staging buffer. A caller (an engine's thread) below {@link
 * Options#maxOutstanding} requests in flight therefore never waits on a binxd that has
 * stopped reading; only the writer task does, until the liveness check below fails the
 * connection. The queue holds at most one frame per request in flight (and one PING), so it
 * is bounded by {@link Options#maxOutstanding}. Reads go through one 64 KiB buffer of the
 * connection's: one system call takes in many small replies, and the JDK keeps no
 * per-thread copy as large as the largest frame.
 *
 * <p>Liveness: binxd bounds every wait it is asked for (ENQUEUE's and DATA's {@code max_wait},
 * TIMEOUT for a silent remote), but a binxd that is stopped or wedged answers nothing, and its
 * socket stays open. While requests are outstanding and nothing has come back for {@link
 * Options#livenessMillis}, the connection sends a PING (which binxd answers at once, past its
 * limit of outstanding requests); when nothing comes back for as long after that, the
 * connection fails, so its callers retry or fail instead of waiting for good. Any byte that
 * moves, either way, counts: a large frame on a slow link is not silence, and a request sent
 * on a connection idle for long starts its clock anew. A request that takes long (a commit's
 * durable writes) on a binxd that answers PINGs is never cut.
 */
public final class BinxConnection implements AutoCloseable {
    private static final ExecutorService SHARED_CALLBACKS = DaemonThreads.cached("binx-callbacks");

    /** Runs each connection's writer task while it has frames queued (one task per connection at most). */
    private static final ExecutorService WRITERS = DaemonThreads.cached("binx-writer");

    /** Bytes a writer copies frames into before one write: small frames go out together. */
    static final int STAGING_BYTES = 256 * 1024;
    /** Bytes the reader takes from the socket at once. */
    static final int INBOUND_BYTES = 64 * 1024;
    /** A writer thread's staging buffer (direct, so the JDK adds no copy of its own). */
    private static final ThreadLocal<ByteBuffer> STAGING = ThreadLocal.withInitial(() -> ByteBuffer.allocateDirect(STAGING_BYTES));

    /**
     * How a connection behaves. {@code connectTimeoutMillis} bounds the connect and the
     * server's preface: a binxd that accepts and never speaks (wedged, or stopped) fails the
     * connection, which callers retry, instead of holding their thread and locks for good.
     * {@code livenessMillis} is how long a connection with requests outstanding may hear
     * nothing before it sends a PING, and then how long that PING may go unanswered before the
     * connection fails (see the class comment).
     */
    public record Options(int maxFrameLength, int maxOutstanding, String clientName, Executor callbacks,
            long connectTimeoutMillis, long livenessMillis) {
        public Options {
            if (maxFrameLength < 4 || maxOutstanding < 1 || connectTimeoutMillis < 1 || livenessMillis < 1) {
                throw new IllegalArgumentException("maxFrameLength must be at least 4, maxOutstanding, "
                        + "connectTimeoutMillis and livenessMillis at least 1");
            }
        }

        /** 256 requests in flight, 10 s to connect, 15 s of silence before a PING and 15 s for its reply. */
        public static Options defaults() {
            return new Options(Frames.DEFAULT_MAX_FRAME, 256, "binx-java", SHARED_CALLBACKS, 10_000, 15_000);
        }

        public Options withClientName(String name) {
            return new Options(maxFrameLength, maxOutstanding, name, callbacks, connectTimeoutMillis, livenessMillis);
        }

        public Options withMaxOutstanding(int n) {
            return new Options(maxFrameLength, n, clientName, callbacks, connectTimeoutMillis, livenessMillis);
        }

        public Options withConnectTimeoutMillis(long millis) {
            return new Options(maxFrameLength, maxOutstanding, clientName, callbacks, millis, livenessMillis);
        }

        public Options withLivenessMillis(long millis) {
            return new Options(maxFrameLength, maxOutstanding, clientName, callbacks, connectTimeoutMillis, millis);
        }
    }

    /**
     * Closes connections whose connect or preface took longer than their timeout, and checks
     * open ones for liveness. Its tasks never block: a PING is written, and a silent connection
     * failed, on this client's own callback pool (whatever executor the caller gave, which may
     * run tasks inline).
     */
    private static final ScheduledExecutorService WATCHDOG = DaemonThreads.scheduler("binx-connection-watchdog");

    private final String peer;
    private final SocketChannel channel;
    /** {@link #channel} with every byte's movement stamped, for the liveness check. */
    private final Progress io;
    private final Options options;
    private final int serverMinor;
    /** Frames to write, in send order; guarded by itself, as is {@link #writing}. */
    private final ArrayDeque<ByteBuffer[]> outbox = new ArrayDeque<>();
    /** Whether a writer task runs for this connection. */
    private boolean writing;
    /**
     * What the reader took from the socket and has not handed on (read mode); reader thread
     * only. On the heap: the JDK's own direct copy for it is as small, and goes with the thread.
     */
    private final ByteBuffer inbound = ByteBuffer.allocate(INBOUND_BYTES).limit(0);
    private final Map<Long, Pending> pending = new ConcurrentHashMap<>();
    private final AtomicLong nextId = new AtomicLong();
    private final Semaphore slots;
    private final AtomicBoolean closed = new AtomicBoolean();
    private volatile BinxException failure;
    /** The HELLO reply's capabilities, once one came. */
    private volatile List<String> capabilities;
    /** When a byte last came in (System.nanoTime). */
    private volatile long lastReadNanos = System.nanoTime();
    /** When a byte last went out. */
    private volatile long lastWriteNanos = lastReadNanos;
    /** When the liveness check's PING was due to go out; 0 before the first. */
    private volatile long probeSentNanos;
    /** Kept from going quiet ({@link #holdOpen}). */
    private volatile boolean heldOpen;
    private final ScheduledFuture<?> liveness;

    /** A request without its reply; a PING of the liveness check holds no slot. */
    private record Pending(BinRequest request, CompletableFuture<Response> future, boolean slotted) {}

    private BinxConnection(String peer, SocketChannel channel, Options options, int serverMinor) {
        this.peer = peer;
        this.channel = channel;
        this.io = new Progress();
        this.options = options;
        this.serverMinor = serverMinor;
        this.slots = new Semaphore(options.maxOutstanding());
        // A quarter of the liveness period, and often enough for a held connection's PING.
        long period = Math.max(1, Math.min(options.livenessMillis() / 4, TimeUnit.NANOSECONDS.toMillis(KEEP_ALIVE_MAX_NANOS) / 4));
        this.liveness = WATCHDOG.scheduleWithFixedDelay(this::checkLiveness, period, period, TimeUnit.MILLISECONDS);
        Thread reader = new Thread(this::readLoop, "binx-reader " + peer);
        reader.setDaemon(true);
        reader.start();
    }

    /** Connects to binxd's Unix socket. */
    public static BinxConnection unix(Path socket, Options options) {
        return open("unix:" + socket, UnixDomainSocketAddress.of(socket), StandardProtocolFamily.UNIX, options);
    }

    /** Connects over TCP (a remote sidecar; plain TCP only). */
    public static BinxConnection tcp(String host, int port, Options options) {
        return open(host + ":" + port, new InetSocketAddress(host, port), null, options);
    }

    private static BinxConnection open(String peer, SocketAddress address, StandardProtocolFamily family, Options options) {
        SocketChannel channel = null;
        AtomicBoolean timedOut = new AtomicBoolean();
        ScheduledFuture<?> watchdog = null;
        try {
            channel = family == null ? SocketChannel.open() : SocketChannel.open(family);
            SocketChannel opened = channel;
            // Closing the channel ends a connect or read blocked on it.
            watchdog = WATCHDOG.schedule(() -> {
                timedOut.set(true);
                try {
                    opened.close();
                } catch (IOException ignored) {
                    // the connect fails either way
                }
            }, options.connectTimeoutMillis(), TimeUnit.MILLISECONDS);
            channel.connect(address);
            ByteBuffer ours = ByteBuffer.wrap(Frames.preface());
            while (ours.hasRemaining()) {
                channel.write(ours);
            }
            ByteBuffer theirs = ByteBuffer.allocate(Frames.PREFACE_LEN);
            while (theirs.hasRemaining()) {
                if (channel.read(theirs) < 0) {
                    throw new IOException("it closed the connection after " + theirs.position() + " of its preface's "
                            + Frames.PREFACE_LEN + " bytes");
                }
            }
            int minor = Frames.checkPreface(theirs.array());
            watchdog.cancel(false);
            if (timedOut.get()) {
                throw new IOException("closed at the deadline");
            }
            return new BinxConnection(peer, channel, options, minor);
        } catch (IOException | ProtocolException | RuntimeException e) {
            if (watchdog != null) {
                watchdog.cancel(false);
            }
            if (channel != null) {
                try {
                    channel.close();
                } catch (IOException ignored) {
                    // closing after a failed connect: nothing more to say
                }
            }
            String why = timedOut.get()
                    ? "no preface from it in " + options.connectTimeoutMillis() + " ms (is it stuck?)"
                    : e.getMessage();
            throw new BinxConnectionException("cannot connect to binxd at " + peer + ": " + why, e);
        }
    }

    /** The server's minor protocol version (from its preface). */
    public int serverMinor() {
        return serverMinor;
    }

    public String peer() {
        return peer;
    }

    /** Requests this connection lets be in flight at once ({@link Options#maxOutstanding}). */
    public int maxOutstanding() {
        return options.maxOutstanding();
    }

    public boolean isOpen() {
        return !closed.get();
    }

    /** Requests sent and not yet answered (a liveness PING among them). */
    public int outstanding() {
        return pending.size();
    }

    /**
     * Sends a request (its id is assigned here) with {@code body} as the frame body; the future
     * completes with the reply, whatever its status, or fails with a {@link BinxConnectionException}.
     */
    public CompletableFuture<Response> send(BinRequest request, ByteBuffer... body) {
        if (closed.get()) {
            return CompletableFuture.failedFuture(lost(request));
        }
        try {
            slots.acquire();
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            return CompletableFuture.failedFuture(new BinxException(BinxException.describe(request) + ": interrupted while waiting for a slot", e));
        }
        long id = nextId.incrementAndGet();
        request.requestId = id;
        CompletableFuture<Response> future = new CompletableFuture<>();
        pending.put(id, new Pending(request, future, true));
        byte[] header = request.encode();
        if (header.length > Frames.MAX_HEADER) {
            complete(id, null, new BinxException(BinxException.describe(request) + ": its header of " + header.length
                    + " bytes exceeds the limit of " + Frames.MAX_HEADER));
            return future;
        }
        ByteBuffer[] frame;
        try {
            frame = Frames.frame(header, body);
        } catch (IllegalArgumentException e) {
            complete(id, null, new BinxException(BinxException.describe(request) + ": " + e.getMessage(), e));
            return future;
        }
        post(frame);
        return future;
    }

    /** Queues a frame for the writer task, and starts one when none runs. */
    private void post(ByteBuffer[] frame) {
        boolean start;
        synchronized (outbox) {
            if (closed.get()) {
                start = false;
            } else {
                outbox.add(frame);
                start = !writing;
                writing = true;
            }
        }
        if (closed.get()) {
            // Closed before or while this was queued: fail what is pending again, this request
            // included (the close may have swept the pending requests before it was added).
            fail(new BinxConnectionException("the connection to binxd at " + peer + " is closed"));
            return;
        }
        if (start) {
            try {
                WRITERS.execute(this::drain);
            } catch (RuntimeException | Error e) {
                // No thread for the writer ("unable to create native thread"): nothing queued
                // would ever go, so the connection fails now rather than at the liveness check.
                fail(new BinxConnectionException("cannot start the writer of the connection to binxd at " + peer + ": " + e, e));
            }
        }
    }

    /**
     * The writer task: writes every queued frame, in order, copying them into the thread's
     * staging buffer so that small frames share a system call. Ends when the queue is empty or
     * the connection fails (a write error fails it; a close ends a write blocked on it).
     */
    private void drain() {
        ByteBuffer staging = STAGING.get();
        List<ByteBuffer[]> frames = new ArrayList<>();
        try {
            while (true) {
                frames.clear();
                synchronized (outbox) {
                    if (outbox.isEmpty() || closed.get()) {
                        outbox.clear();
                        writing = false;
                        return;
                    }
                    frames.addAll(outbox);
                    outbox.clear();
                }
                staging.clear();
                for (ByteBuffer[] frame : frames) {
                    for (ByteBuffer b : frame) {
                        while (b.hasRemaining()) {
                            if (!staging.hasRemaining()) {
                                flush(staging);
                            }
                            int n = Math.min(b.remaining(), staging.remaining());
                            staging.put(staging.position(), b, b.position(), n);
                            staging.position(staging.position() + n);
                            b.position(b.position() + n);
                        }
                    }
                }
                flush(staging);
            }
        } catch (IOException | RuntimeException | Error e) {
            // Failed first, so that no post starts another writer behind a partial frame; then
            // the queue is dropped (its requests failed with the connection).
            fail(new BinxConnectionException("the connection to binxd at " + peer + " broke while sending: " + e, e));
            synchronized (outbox) {
                outbox.clear();
                writing = false;
            }
            if (e instanceof Error error) {
                throw error;
            }
        }
    }

    /** Writes the staging buffer whole and empties it. */
    private void flush(ByteBuffer staging) throws IOException {
        staging.flip();
        while (staging.hasRemaining()) {
            io.write(staging);
        }
        staging.clear();
    }

    /**
     * Every quarter of {@link Options#livenessMillis}: with requests outstanding and no byte
     * moved either way for that long, a PING; with nothing come in since it went out and
     * nothing moved for as long again, the connection fails.
     */
    private void checkLiveness() {
        if (closed.get()) {
            return;
        }
        long now = System.nanoTime();
        long limit = TimeUnit.MILLISECONDS.toNanos(options.livenessMillis());
        long read = lastReadNanos;
        long moved = read - lastWriteNanos > 0 ? read : lastWriteNanos;
        if (pending.isEmpty()) {
            long probe = probeSentNanos;
            long quiet = Math.min(KEEP_ALIVE_LIVENESS_PERIODS * limit, KEEP_ALIVE_MAX_NANOS);
            if (heldOpen && now - moved >= quiet && (probe == 0 || now - probe >= quiet)) {
                // Its answer is then awaited as any PING's.
                probeSentNanos = now;
                SHARED_CALLBACKS.execute(this::ping);
            }
            return;
        }
        if (now - moved < limit) {
            return;
        }
        long probe = probeSentNanos;
        if (probe == 0 || read - probe > 0) {
            // Silent, and no PING out since the last byte came in (its write stamps progress
            // again, so the deadline runs from when it went out).
            probeSentNanos = now;
            SHARED_CALLBACKS.execute(this::ping);
            return;
        }
        if (now - probe < limit) {
            // The PING has not had its time yet (its write may wait behind a stuck one).
            return;
        }
        long silentMillis = TimeUnit.NANOSECONDS.toMillis(now - read);
        SHARED_CALLBACKS.execute(() -> {
            if (lastReadNanos == read) {
                fail(new BinxConnectionException("binxd at " + peer + " sent nothing for " + silentMillis
                        + " ms, not even the answer to a PING, with " + pending.size()
                        + " requests outstanding (is it stopped or stuck?)"));
            }
        });
    }

    /**
     * While {@code held}, this connection never stays quiet: with nothing outstanding and no byte
     * moved for four times {@link Options#livenessMillis}, at most a minute, it sends a PING.
     * binxd closes a connection with nothing outstanding that sends nothing for its {@code
     * idle_timeout} (5 min by default), and a task no connection of its producer holds may be
     * dropped after {@code abandon_after} and later forgotten: a task writer holds its connection
     * open while its task is, however long the engine adds nothing.
     */
    public void holdOpen(boolean held) {
        heldOpen = held;
    }

    /** A held connection's quiet time before its PING, in liveness periods ... */
    private static final int KEEP_ALIVE_LIVENESS_PERIODS = 4;
    /** ... and at most this, well below binxd's default idle_timeout (5 min). */
    private static final long KEEP_ALIVE_MAX_NANOS = TimeUnit.SECONDS.toNanos(60);

    /** The liveness check's PING: no slot (binxd answers PING past its limit), its reply unused. */
    private void ping() {
        if (closed.get()) {
            return;
        }
        BinRequest r = new BinRequest(MessageType.PING);
        long id = nextId.incrementAndGet();
        r.requestId = id;
        pending.put(id, new Pending(r, new CompletableFuture<>(), false));
        post(Frames.frame(r.encode()));
    }

    /**
     * The socket, with the time of each read and write that moved a byte. Reads are buffered
     * in {@link #inbound} (the reader thread's alone).
     */
    private final class Progress implements GatheringByteChannel, ReadableByteChannel {
        @Override
        public int read(ByteBuffer dst) throws IOException {
            if (!dst.hasRemaining()) {
                return 0;
            }
            if (!inbound.hasRemaining()) {
                inbound.clear();
                int n;
                try {
                    n = channel.read(inbound);
                } finally {
                    // Read mode again, whatever happened: no stale byte is ever handed on.
                    inbound.flip();
                }
                if (n <= 0) {
                    return n;
                }
                lastReadNanos = System.nanoTime();
            }
            int n = Math.min(inbound.remaining(), dst.remaining());
            dst.put(dst.position(), inbound, inbound.position(), n);
            dst.position(dst.position() + n);
            inbound.position(inbound.position() + n);
            return n;
        }

        @Override
        public int write(ByteBuffer src) throws IOException {
            return (int) wrote(channel.write(src));
        }

        @Override
        public long write(ByteBuffer[] srcs, int offset, int length) throws IOException {
            return wrote(channel.write(srcs, offset, length));
        }

        private long wrote(long n) {
            if (n > 0) {
                lastWriteNanos = System.nanoTime();
            }
            return n;
        }

        @Override
        public long write(ByteBuffer[] srcs) throws IOException {
            return write(srcs, 0, srcs.length);
        }

        @Override
        public boolean isOpen() {
            return channel.isOpen();
        }

        @Override
        public void close() throws IOException {
            channel.close();
        }
    }

    /**
     * Sends and waits for the reply (at most {@code timeoutMillis}: past it the connection fails
     * as broken); a status other than OK is still a reply.
     */
    public Response call(BinRequest request, long timeoutMillis, ByteBuffer... body) {
        try {
            return send(request, body).get(timeoutMillis, TimeUnit.MILLISECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new BinxException(BinxException.describe(request) + ": interrupted", e);
        } catch (java.util.concurrent.ExecutionException e) {
            throw e.getCause() instanceof BinxException b ? b : new BinxException(BinxException.describe(request) + ": " + e.getCause(), e.getCause());
        } catch (java.util.concurrent.TimeoutException e) {
            // The connection is taken as broken: its request would keep a slot until a reply that
            // may never come, and a late reply must reach nobody.
            BinxConnectionException why = new BinxConnectionException(BinxException.describe(request) + ": no reply from binxd at "
                    + peer + " in " + timeoutMillis + " ms");
            fail(why);
            throw why;
        }
    }

    /**
     * The value of capability {@code name=<value>} in a HELLO reply's list, or "" when the
     * server does not name one.
     */
    public static String capability(List<String> capabilities, String name) {
        String prefix = name + "=";
        for (String c : capabilities) {
            if (c.startsWith(prefix)) {
                return c.substring(prefix.length());
            }
        }
        return "";
    }

    /**
     * HELLO: the server's name and capabilities (on the Unix socket no token is needed). Asked
     * once a connection: what a binxd says of itself does not change while a connection lasts
     * (a restarted one is a new connection), so a connection taken again from a pool does not
     * ask again.
     */
    public List<String> capabilities(long timeoutMillis) {
        List<String> known = capabilities;
        if (known != null) {
            return new ArrayList<>(known);
        }
        BinRequest hello = new BinRequest(MessageType.HELLO);
        hello.clientName = options.clientName();
        Response r = call(hello, timeoutMillis);
        if (r.header().status() != Status.OK) {
            throw new BinxRefusedException(hello, r.header());
        }
        capabilities = List.copyOf(r.header().capabilities);
        return new ArrayList<>(r.header().capabilities);
    }

    private void readLoop() {
        try {
            while (!closed.get()) {
                Frames.Frame frame = Frames.read(io, options.maxFrameLength());
                if (frame == null) {
                    fail(new BinxConnectionException("binxd at " + peer + " closed the connection"));
                    return;
                }
                BinReply header = BinReply.decode(frame.header());
                if (header.requestId == 0) {
                    fail(new BinxConnectionException("binxd at " + peer + " closed the connection: "
                            + header.status().name() + ": " + header.error));
                    return;
                }
                Pending asked = pending.get(header.requestId);
                if (asked != null && asked.request().type != header.type) {
                    // A reply to another request than the one of its id: nothing in it can be believed.
                    throw new ProtocolException("a reply of type " + header.type + " to request "
                            + Long.toUnsignedString(header.requestId) + ", which is of type " + asked.request().type);
                }
                if (!complete(header.requestId, new Response(header, frame.body()), null)) {
                    throw new ProtocolException("a reply to request " + Long.toUnsignedString(header.requestId)
                            + ", which is not outstanding on this connection");
                }
            }
        } catch (IOException e) {
            fail(new BinxConnectionException("the connection to binxd at " + peer + " broke: " + e.getMessage(), e));
        } catch (ProtocolException e) {
            fail(new BinxConnectionException("binxd at " + peer + " broke the protocol: " + e.getMessage(), e));
        } catch (RuntimeException e) {
            fail(new BinxConnectionException("reading from binxd at " + peer + " failed: " + e, e));
        }
    }

    private boolean complete(long id, Response response, BinxException error) {
        Pending p = pending.remove(id);
        if (p == null) {
            return false;
        }
        if (p.slotted()) {
            slots.release();
        }
        try {
            options.callbacks().execute(() -> {
                if (error != null) {
                    p.future().completeExceptionally(error);
                } else {
                    p.future().complete(response);
                }
            });
        } catch (RuntimeException rejected) {
            // The executor is gone (shutdown): complete here rather than never.
            if (error != null) {
                p.future().completeExceptionally(error);
            } else {
                p.future().complete(response);
            }
        }
        return true;
    }

    private BinxConnectionException lost(BinRequest request) {
        BinxException why = failure;
        return new BinxConnectionException(BinxException.describe(request) + ": "
                + (why == null ? "the connection to binxd at " + peer + " is closed" : why.getMessage()), why);
    }

    private void fail(BinxException why) {
        if (failure == null) {
            failure = why;
        }
        closed.set(true);
        if (liveness != null) {
            // null only while the constructor runs
            liveness.cancel(false);
        }
        try {
            channel.close();
        } catch (IOException ignored) {
            // already failing
        }
        for (Long id : List.copyOf(pending.keySet())) {
            Pending p = pending.get(id);
            if (p != null) {
                complete(id, null, lost(p.request()));
            }
        }
    }

    /**
     * Closes the socket; every request without a reply fails, those still queued and not yet
     * written too (so a request must have its reply before the connection is closed, if it is
     * to count).
     */
    @Override
    public void close() {
        fail(new BinxConnectionException("the connection to binxd at " + peer + " was closed by this client"));
    }
}
