package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.ByteArrayInputStream;
import java.io.ByteArrayOutputStream;
import java.io.EOFException;
import java.nio.ByteBuffer;
import java.nio.channels.Channels;
import java.util.List;
import java.util.Random;
import java.util.stream.LongStream;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.MethodSource;

/**
 * Property tests of the hand-written codec, over many seeded random cases (JUnit parameterized:
 * a failing seed is named and replays): round trips, and hostile bytes never crash it.
 */
class CodecPropertiesTest {
    static LongStream seeds() {
        return LongStream.range(0, 500);
    }

    private static String text(Random r, int max) {
        int n = r.nextInt(max + 1);
        StringBuilder b = new StringBuilder();
        for (int i = 0; i < n; i++) {
            // ASCII, Latin, CJK and a surrogate pair now and then.
            switch (r.nextInt(4)) {
                case 0 -> b.append((char) (' ' + r.nextInt(95)));
                case 1 -> b.append((char) (0xC0 + r.nextInt(64)));
                case 2 -> b.append((char) (0x4E00 + r.nextInt(500)));
                default -> b.appendCodePoint(0x1F600 + r.nextInt(50));
            }
        }
        return b.toString();
    }

    private static long[] longs(Random r, int max, boolean any) {
        long[] out = new long[r.nextInt(max + 1)];
        for (int i = 0; i < out.length; i++) {
            out[i] = any ? r.nextLong() : r.nextLong() & Long.MAX_VALUE;
        }
        return out;
    }

    static BinRequest request(Random r) {
        BinRequest q = new BinRequest();
        q.requestId = r.nextLong();
        q.type = r.nextInt(31);
        q.taskId = text(r, 40);
        q.bufferId = r.nextLong();
        q.pageToken = r.nextLong();
        q.getDataSize = r.nextBoolean();
        q.maxSizeBytes = r.nextLong();
        q.maxWaitMicros = r.nextLong();
        q.pageSizes = longs(r, 20, true);
        q.ackToken = r.nextInt(3) == 0 ? null : r.nextLong();
        q.appendToken = r.nextInt(3) == 0 ? null : (long) r.nextInt(3);
        q.remote = q.taskId.isEmpty() ? "" : "h:1";
        q.acceptEncodings = r.nextBoolean() ? List.of("lz4") : List.of();
        q.reason = text(r, 10);
        return q;
    }

    @ParameterizedTest
    @MethodSource("seeds")
    void requestsRoundTrip(long seed) throws Exception {
        BinRequest r = request(new Random(seed));
        BinRequest back = BinRequest.decode(r.encode());
        assertEquals(r.requestId, back.requestId);
        assertEquals(r.type, back.type);
        assertEquals(r.taskId, back.taskId);
        assertEquals(r.bufferId, back.bufferId);
        assertEquals(r.pageToken, back.pageToken);
        assertArrayEquals(r.pageSizes, back.pageSizes);
        assertEquals(r.ackToken, back.ackToken);
        assertEquals(r.appendToken, back.appendToken);
        assertEquals(r.remote, back.remote);
        assertEquals(r.acceptEncodings, back.acceptEncodings);
        assertEquals(r.reason, back.reason);
        assertArrayEquals(r.encode(), back.encode());
    }

    @ParameterizedTest
    @MethodSource("seeds")
    void repliesRoundTrip(long seed) throws Exception {
        Random rnd = new Random(seed);
        long[] sizes = longs(rnd, 50, false);
        String error = text(rnd, 30);
        BinReply r = new BinReply();
        r.requestId = rnd.nextLong();
        r.type = MessageType.DATA.number();
        r.status = Status.OK.number();
        r.pageToken = rnd.nextLong();
        r.pageNextToken = r.pageToken + sizes.length;
        r.bufferComplete = rnd.nextBoolean();
        r.segments.add(Segment.inline(r.pageToken, sizes));
        Segment spooled = new Segment();
        spooled.spooled = new Segment.Spooled();
        spooled.spooled.uri = "s3://b/o";
        spooled.spooled.headers.put("k", error);
        spooled.spooled.key = new byte[] {1, 2, 3};
        r.segments.add(spooled);
        r.followingSizes = sizes;
        r.error = error;
        if (rnd.nextBoolean()) {
            r.committed = new BinReply.Committed();
            r.committed.node = text(rnd, 8);
            r.committed.endpoint = "10.0.0.1:8091";
            r.committed.endTokens = longs(rnd, 9, false);
            r.committed.bytes = longs(rnd, 9, false);
        }
        BinReply back = BinReply.decode(r.encode());
        assertArrayEquals(r.encode(), back.encode());
        assertEquals(error, back.segments.get(1).spooled.headers.get("k"));
    }

    /** Any bytes: a header decodes or is a ProtocolException, never anything else. */
    @ParameterizedTest
    @MethodSource("seeds")
    void hostileHeadersAreRefusedCleanly(long seed) {
        Random rnd = new Random(seed);
        for (int i = 0; i < 10; i++) {
            byte[] bytes = new byte[rnd.nextInt(64)];
            rnd.nextBytes(bytes);
            if (i % 2 == 1 && bytes.length > 0) {
                // Mostly well-formed keys, to reach deeper.
                bytes[0] = (byte) ((1 + rnd.nextInt(20)) << 3 | rnd.nextInt(6));
            }
            try {
                BinReply.decode(bytes);
            } catch (ProtocolException expected) {
                // refused: fine
            }
            try {
                BinRequest.decode(bytes);
            } catch (ProtocolException expected) {
                // refused: fine
            }
        }
    }

    /** Any bytes as a stream of frames: frames, a clean end, or a refusal; never a hang or a crash. */
    @ParameterizedTest
    @MethodSource("seeds")
    void hostileStreamsAreRefusedCleanly(long seed) throws Exception {
        Random rnd = new Random(seed);
        byte[] bytes = new byte[rnd.nextInt(200)];
        rnd.nextBytes(bytes);
        if (bytes.length >= 8 && rnd.nextBoolean()) {
            // A plausible length, so frames are read.
            bytes[0] = 0;
            bytes[1] = 0;
            bytes[2] = 0;
            bytes[4] = 0;
            bytes[5] = 0;
            bytes[6] = 0;
        }
        var in = Channels.newChannel(new ByteArrayInputStream(bytes));
        try {
            while (Frames.read(in, 1 << 16) != null) {
                // keep reading
            }
        } catch (ProtocolException | EOFException expected) {
            // refused: fine
        }
    }

    private static byte[] frame(long length, long headerLength, byte[] rest) {
        ByteBuffer b = ByteBuffer.allocate(8 + rest.length);
        b.putInt((int) length).putInt((int) headerLength).put(rest);
        return b.array();
    }

    private static Exception readError(byte[] wire, int max) {
        return assertThrows(Exception.class, () -> Frames.read(Channels.newChannel(new ByteArrayInputStream(wire)), max));
    }

    @Test
    void framesOutsideTheirLimitsAreRefusedBeforeAnythingIsAllocated() {
        assertEquals(ProtocolException.class, readError(frame(3, 0, new byte[0]), 1024).getClass());
        // 4 GiB - 1: refused by its length, nothing allocated.
        assertEquals(ProtocolException.class, readError(frame(0xFFFF_FFFFL, 0, new byte[0]), Frames.DEFAULT_MAX_FRAME).getClass());
        assertEquals(ProtocolException.class, readError(frame(10, 7, new byte[6]), 1024).getClass());
        assertEquals(ProtocolException.class, readError(frame(70_000, 65_537, new byte[0]), 1 << 20).getClass());
        // A stream that ends inside a frame.
        assertEquals(EOFException.class, readError(frame(100, 2, new byte[10]), 1024).getClass());
    }

    @Test
    void prefacesOfOtherProtocolsAndVersionsAreRefused() {
        assertThrows(ProtocolException.class, () -> Frames.checkPreface("GET / HT".getBytes()));
        assertThrows(ProtocolException.class, () -> Frames.checkPreface(new byte[] {'B', 'I', 'N', 'X', 2, 0, 0, 0}));
        assertThrows(ProtocolException.class, () -> Frames.checkPreface(new byte[] {'B', 'I', 'N', 'X', 1, 0, 0, 1}));
        assertThrows(ProtocolException.class, () -> BinReply.decode(new byte[] {0x0b, 0x00}), "a group wire type");
        assertThrows(ProtocolException.class, () -> BinReply.decode(new byte[] {0x4a, 0x02, (byte) 0xc3, 0x28}), "invalid UTF-8");
        assertThrows(ProtocolException.class, () -> BinReply.decode(new byte[] {0x0a, 0x00}), "request_id as a string");
        // A later major version is named as such, whatever its reserved bytes say.
        ProtocolException newer = assertThrows(ProtocolException.class,
                () -> Frames.checkPreface(new byte[] {'B', 'I', 'N', 'X', (byte) 200, 1, 0, 7}));
        assertTrue(newer.getMessage().contains("speaks BinX 200.1"), newer.getMessage());
    }

    /** A varint's tenth byte holds one bit: more does not fit 64 bits (prost refuses it too). */
    @Test
    void varintsPastSixtyFourBitsAreRefused() throws Exception {
        byte[] max = {0x08, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0x01};
        assertEquals(-1L, BinReply.decode(max).requestId, "2^64 - 1 fits");
        byte[] over = max.clone();
        over[10] = 0x02;
        ProtocolException e = assertThrows(ProtocolException.class, () -> BinReply.decode(over));
        assertTrue(e.getMessage().contains("64 bits"), e.getMessage());
    }

    @Test
    void framesAreWrittenWhole() throws Exception {
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        Frames.write(Channels.newChannel(out), new byte[] {8, 1}, ByteBuffer.wrap(new byte[] {1, 2}), ByteBuffer.wrap(new byte[] {3}));
        assertArrayEquals(new byte[] {0, 0, 0, 9, 0, 0, 0, 2, 8, 1, 1, 2, 3}, out.toByteArray());
    }
}
