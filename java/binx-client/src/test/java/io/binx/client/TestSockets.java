package io.binx.client;

import java.io.IOException;
import java.net.StandardProtocolFamily;
import java.net.UnixDomainSocketAddress;
import java.nio.channels.ServerSocketChannel;
import java.nio.file.Files;
import java.nio.file.Path;

/**
 * Unix socket paths for the tests' own servers, each in a temporary directory of its own
 * (a socket path must be short and new), removed with it so a test run leaves nothing in
 * the temporary directory.
 */
public final class TestSockets {
    private TestSockets() {
    }

    /** The path {@code name} in a new temporary directory whose name starts {@code prefix}. */
    public static Path create(String prefix, String name) throws IOException {
        return Files.createTempDirectory(prefix).resolve(name);
    }

    /**
     * A server listening at {@code socket} (made by {@link #create}); if it cannot be, the
     * socket's directory is removed before the error is thrown.
     */
    public static ServerSocketChannel listen(Path socket) throws IOException {
        ServerSocketChannel channel = ServerSocketChannel.open(StandardProtocolFamily.UNIX);
        try {
            channel.bind(UnixDomainSocketAddress.of(socket));
            return channel;
        } catch (IOException | RuntimeException e) {
            channel.close();
            remove(socket);
            throw e;
        }
    }

    /** Removes the socket file and the directory {@link #create} made for it. */
    public static void remove(Path socket) throws IOException {
        Files.deleteIfExists(socket);
        Files.deleteIfExists(socket.getParent());
    }
}
