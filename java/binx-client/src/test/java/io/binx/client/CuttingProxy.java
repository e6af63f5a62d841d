package io.binx.client;

import java.io.IOException;
import java.net.UnixDomainSocketAddress;
import java.nio.ByteBuffer;
import java.nio.channels.ServerSocketChannel;
import java.nio.channels.SocketChannel;
import java.nio.file.Path;
import java.util.Random;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * A Unix-socket proxy in front of binxd that cuts every connection after a random number of
 * bytes (client to server, up to {@code maxBytes}): mid-frame, mid-reply, wherever it falls.
 * Stands for a network and a daemon that break connections under a client.
 */
final class CuttingProxy implements AutoCloseable {
    private final Path socket;
    private final ServerSocketChannel server;
    private final AtomicInteger cuts = new AtomicInteger();
    private final Random random = new Random(42);
    private final Thread acceptor;
    private volatile boolean closed;

    CuttingProxy(Path target, int maxBytes) throws IOException {
        this.socket = TestSockets.create("binx-cut", "proxy.sock");
        this.server = TestSockets.listen(socket);
        acceptor = new Thread(() -> {
            while (!closed) {
                try {
                    SocketChannel client = server.accept();
                    SocketChannel upstream = SocketChannel.open(UnixDomainSocketAddress.of(target));
                    int budget;
                    synchronized (random) {
                        budget = 2_000 + random.nextInt(maxBytes);
                    }
                    pump(client, upstream, budget, true);
                    pump(upstream, client, Integer.MAX_VALUE, false);
                } catch (IOException e) {
                    return;
                }
            }
        }, "cutting-proxy");
        acceptor.setDaemon(true);
        acceptor.start();
    }

    private void pump(SocketChannel from, SocketChannel to, int budget, boolean cutter) {
        Thread t = new Thread(() -> {
            ByteBuffer buf = ByteBuffer.allocate(4096);
            int left = budget;
            try {
                while (true) {
                    buf.clear();
                    buf.limit(Math.min(buf.capacity(), Math.max(1, left)));
                    int n = from.read(buf);
                    if (n < 0) {
                        break;
                    }
                    buf.flip();
                    while (buf.hasRemaining()) {
                        to.write(buf);
                    }
                    left -= n;
                    if (cutter && left <= 0) {
                        cuts.incrementAndGet();
                        break;
                    }
                }
            } catch (IOException ignored) {
                // the other direction closed it
            } finally {
                try {
                    from.close();
                } catch (IOException ignored) {
                    // closing both ends
                }
                try {
                    to.close();
                } catch (IOException ignored) {
                    // closing both ends
                }
            }
        }, "cutting-proxy-pump");
        t.setDaemon(true);
        t.start();
    }

    BinxConnection connect() {
        return BinxConnection.unix(socket, BinxConnection.Options.defaults().withClientName("cut"));
    }

    int cuts() {
        return cuts.get();
    }

    @Override
    public void close() throws IOException {
        closed = true;
        server.close();
        TestSockets.remove(socket);
    }
}
