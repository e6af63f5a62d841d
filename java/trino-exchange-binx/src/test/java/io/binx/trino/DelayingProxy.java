package io.binx.trino;

import io.binx.client.TestSockets;
import java.io.IOException;
import java.net.UnixDomainSocketAddress;
import java.nio.ByteBuffer;
import java.nio.channels.ServerSocketChannel;
import java.nio.channels.SocketChannel;
import java.nio.file.Path;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * A Unix-socket proxy in front of binxd that holds each new connection for a while before it
 * passes bytes either way: a sidecar slow to take a connection, as on saturated cores, which
 * makes a window in which every other would-be connector is seen. Counts the connections it
 * accepted.
 */
final class DelayingProxy implements AutoCloseable {
    final Path socket;
    private final ServerSocketChannel server;
    private final AtomicInteger accepted = new AtomicInteger();
    private final List<SocketChannel> open = new CopyOnWriteArrayList<>();

    DelayingProxy(Path target, long delayMillis) throws IOException {
        socket = TestSockets.create("binx-delay", "proxy.sock");
        server = TestSockets.listen(socket);
        Thread acceptor = new Thread(() -> {
            try {
                while (true) {
                    SocketChannel client = server.accept();
                    accepted.incrementAndGet();
                    open.add(client);
                    Thread connect = new Thread(() -> {
                        try {
                            Thread.sleep(delayMillis);
                            SocketChannel upstream = SocketChannel.open(UnixDomainSocketAddress.of(target));
                            open.add(upstream);
                            pump(client, upstream);
                            pump(upstream, client);
                        } catch (IOException | InterruptedException e) {
                            closeQuietly(client);
                        }
                    }, "delaying-proxy-connect");
                    connect.setDaemon(true);
                    connect.start();
                }
            } catch (IOException e) {
                // closed
            }
        }, "delaying-proxy");
        acceptor.setDaemon(true);
        acceptor.start();
    }

    private static void pump(SocketChannel from, SocketChannel to) {
        Thread t = new Thread(() -> {
            ByteBuffer buf = ByteBuffer.allocate(64 << 10);
            try {
                while (from.read(buf.clear()) >= 0) {
                    buf.flip();
                    while (buf.hasRemaining()) {
                        to.write(buf);
                    }
                }
            } catch (IOException e) {
                // the other direction closed it
            } finally {
                closeQuietly(from);
                closeQuietly(to);
            }
        }, "delaying-proxy-pump");
        t.setDaemon(true);
        t.start();
    }

    private static void closeQuietly(SocketChannel c) {
        try {
            c.close();
        } catch (IOException ignored) {
            // closing both ends
        }
    }

    /** Connections accepted so far. */
    int accepted() {
        return accepted.get();
    }

    @Override
    public void close() throws IOException {
        server.close();
        for (SocketChannel c : open) {
            closeQuietly(c);
        }
        TestSockets.remove(socket);
    }
}
