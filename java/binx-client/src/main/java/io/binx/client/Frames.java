package io.binx.client;

import java.io.EOFException;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.channels.ReadableByteChannel;
import java.nio.channels.WritableByteChannel;
import java.nio.charset.StandardCharsets;

/**
 * The preface and the frame layout (PROTOCOL.md sections 2 and 3): {@code u32 length}, {@code u32
 * header_length}, the protobuf header, the body; big-endian. Every length is checked against its
 * limit before anything is allocated for it.
 */
public final class Frames {
    /** Bytes of a preface. */
    public static final int PREFACE_LEN = 8;
    /** Major and minor version this client speaks. */
    public static final int MAJOR = 1;
    public static final int MINOR = 2;
    /** The largest header any peer accepts. */
    public static final int MAX_HEADER = 64 * 1024;
    /** binxd's default frame limit: 64 MiB of pages and a header. */
    public static final int DEFAULT_MAX_FRAME = 64 * 1024 * 1024 + 64 * 1024;

    private Frames() {}

    public static byte[] preface() {
        return new byte[] {'B', 'I', 'N', 'X', MAJOR, MINOR, 0, 0};
    }

    /** Checks the server's preface; returns its minor version. */
    public static int checkPreface(byte[] theirs) throws ProtocolException {
        if (theirs.length != PREFACE_LEN || theirs[0] != 'B' || theirs[1] != 'I' || theirs[2] != 'N' || theirs[3] != 'X') {
            throw new ProtocolException("the peer is not a BinX server: its first bytes are "
                    + new String(theirs, 0, Math.min(4, theirs.length), StandardCharsets.ISO_8859_1).replaceAll("[^ -~]", "?"));
        }
        if (theirs[4] != MAJOR) {
            throw new ProtocolException("the peer speaks BinX " + (theirs[4] & 0xFF) + "." + (theirs[5] & 0xFF)
                    + "; this client speaks major version " + MAJOR);
        }
        if (theirs[6] != 0 || theirs[7] != 0) {
            throw new ProtocolException("the peer's preface has non-zero reserved bytes");
        }
        return theirs[5] & 0xFF;
    }

    /** Writes one frame (header and body buffers) whole. */
    public static void write(WritableByteChannel channel, byte[] header, ByteBuffer... body) throws IOException {
        ByteBuffer[] all = frame(header, body);
        if (channel instanceof java.nio.channels.GatheringByteChannel gathering) {
            int first = 0;
            while (first < all.length) {
                gathering.write(all, first, all.length - first);
                while (first < all.length && !all[first].hasRemaining()) {
                    first++;
                }
            }
        } else {
            for (ByteBuffer b : all) {
                while (b.hasRemaining()) {
                    channel.write(b);
                }
            }
        }
    }

    /**
     * One frame as buffers to write in order: the length prefix with the header, then views of
     * the body's buffers (their positions are the caller's, untouched).
     */
    static ByteBuffer[] frame(byte[] header, ByteBuffer... body) {
        long bodyLen = 0;
        for (ByteBuffer b : body) {
            bodyLen += b.remaining();
        }
        long length = 4L + header.length + bodyLen;
        if (length > 0xFFFF_FFFFL) {
            throw new IllegalArgumentException("a frame of " + length + " bytes does not fit a u32 length");
        }
        ByteBuffer prefix = ByteBuffer.allocate(8 + header.length);
        prefix.putInt((int) length).putInt(header.length).put(header).flip();
        ByteBuffer[] all = new ByteBuffer[body.length + 1];
        all[0] = prefix;
        for (int i = 0; i < body.length; i++) {
            all[i + 1] = body[i].duplicate();
        }
        return all;
    }

    /** A frame as read: its header bytes and its body. */
    public record Frame(byte[] header, ByteBuffer body) {}

    /**
     * Reads one frame, or returns {@code null} at a clean end of stream before its first byte.
     * A frame outside the limits, or a stream that ends inside a frame, is an error.
     */
    public static Frame read(ReadableByteChannel channel, int maxFrame) throws IOException, ProtocolException {
        ByteBuffer prefix = ByteBuffer.allocate(8);
        if (!readFully(channel, prefix, true)) {
            return null;
        }
        prefix.flip();
        long length = Integer.toUnsignedLong(prefix.getInt());
        long headerLength = Integer.toUnsignedLong(prefix.getInt());
        if (length < 4) {
            throw new ProtocolException("a frame's length is " + length + ", below 4");
        }
        if (length > maxFrame) {
            throw new ProtocolException("a frame of " + length + " bytes exceeds the limit of " + maxFrame);
        }
        if (headerLength > length - 4 || headerLength > MAX_HEADER) {
            throw new ProtocolException("a frame's header_length " + headerLength + " exceeds its length " + length
                    + " less 4, or the header limit of " + MAX_HEADER);
        }
        ByteBuffer header = ByteBuffer.allocate((int) headerLength);
        readFully(channel, header, false);
        ByteBuffer body = ByteBuffer.allocate((int) (length - 4 - headerLength));
        readFully(channel, body, false);
        body.flip();
        return new Frame(header.array(), body);
    }

    /** Fills {@code buf}; false if the stream ended before any byte and {@code eofOk}. */
    static boolean readFully(ReadableByteChannel channel, ByteBuffer buf, boolean eofOk) throws IOException {
        boolean any = false;
        while (buf.hasRemaining()) {
            int n = channel.read(buf);
            if (n < 0) {
                if (eofOk && !any) {
                    return false;
                }
                throw new EOFException("the connection ended in the middle of a frame");
            }
            any |= n > 0;
        }
        return true;
    }
}
