package io.binx.client;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.channels.Channels;
import java.nio.file.Files;
import java.nio.file.Path;
import org.junit.jupiter.api.Test;

/**
 * The client's codec against the hex test vectors of docs/PROTOCOL.md, byte for byte: what the
 * Rust implementation checks in crates/binx-proto/tests/vectors.rs, from the same text.
 */
class VectorsTest {
    static byte[] vector(String name) throws IOException {
        Path doc = Path.of(System.getProperty("binx.protocol", "../../docs/PROTOCOL.md"));
        String text = Files.readString(doc);
        int at = text.indexOf("<!-- vector: " + name + " -->");
        if (at < 0) {
            throw new IllegalStateException("no vector " + name + " in " + doc.toAbsolutePath());
        }
        int start = text.indexOf("```hex\n", at) + 7;
        int end = text.indexOf("```", start);
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        for (String line : text.substring(start, end).split("\n")) {
            String hex = line.strip().split("  ")[0];
            for (String pair : hex.trim().split("\\s+")) {
                if (!pair.isEmpty()) {
                    out.write(Integer.parseInt(pair, 16));
                }
            }
        }
        return out.toByteArray();
    }

    private static Frames.Frame frame(byte[] wire) throws Exception {
        Frames.Frame f = Frames.read(Channels.newChannel(new java.io.ByteArrayInputStream(wire)), Frames.DEFAULT_MAX_FRAME);
        assertTrue(f != null);
        return f;
    }

    private static byte[] encode(byte[] header, byte[] body) throws IOException {
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        Frames.write(Channels.newChannel(out), header, ByteBuffer.wrap(body));
        return out.toByteArray();
    }

    @Test
    void preface() throws Exception {
        assertArrayEquals(vector("preface"), Frames.preface());
        assertEquals(2, Frames.checkPreface(vector("preface")));
    }

    @Test
    void dataRequest() throws Exception {
        byte[] wire = vector("data-request");
        BinRequest r = BinRequest.decode(frame(wire).header());
        assertEquals(7, r.requestId);
        assertEquals(MessageType.DATA, r.messageType());
        assertEquals("q1.2.0", r.taskId);
        assertEquals(3, r.bufferId);
        assertEquals(42, r.pageToken);
        assertEquals(1 << 20, r.maxSizeBytes);
        assertEquals(1_000_000, r.maxWaitMicros);
        assertEquals(null, r.ackToken);
        assertArrayEquals(wire, encode(r.encode(), new byte[0]));
    }

    @Test
    void dataReplyAndPipelined() throws Exception {
        byte[] wire = vector("data-reply");
        Frames.Frame f = frame(wire);
        BinReply r = BinReply.decode(f.header());
        assertEquals(Status.OK, r.status());
        assertEquals(42, r.pageToken);
        assertEquals(44, r.pageNextToken);
        assertEquals(1, r.segments.size());
        assertArrayEquals(new long[] {3, 5}, r.segments.get(0).pageSizes);
        assertTrue(r.segments.get(0).inline);
        byte[] body = new byte[f.body().remaining()];
        f.body().get(body);
        assertEquals("abchello", new String(body, java.nio.charset.StandardCharsets.US_ASCII));
        assertArrayEquals(wire, encode(r.encode(), body));

        byte[] pipelined = vector("pipelined-data-request");
        BinRequest p = BinRequest.decode(frame(pipelined).header());
        assertEquals(Long.valueOf(42), p.ackToken);
        assertArrayEquals(pipelined, encode(p.encode(), new byte[0]));
        byte[] reply = vector("pipelined-data-reply");
        Frames.Frame rf = frame(reply);
        BinReply pr = BinReply.decode(rf.header());
        assertArrayEquals(new long[] {3, 300}, pr.followingSizes);
        byte[] rb = new byte[rf.body().remaining()];
        rf.body().get(rb);
        assertArrayEquals(reply, encode(pr.encode(), rb));
    }

    @Test
    void numberedEnqueue() throws Exception {
        byte[] wire = vector("numbered-enqueue-request");
        Frames.Frame f = frame(wire);
        BinRequest r = BinRequest.decode(f.header());
        assertEquals(MessageType.ENQUEUE, r.messageType());
        assertEquals(Long.valueOf(5), r.appendToken);
        assertArrayEquals(new long[] {2, 3}, r.pageSizes);
        byte[] body = new byte[f.body().remaining()];
        f.body().get(body);
        assertArrayEquals(wire, encode(r.encode(), body));
        for (String name : new String[] {"numbered-enqueue-ok", "numbered-enqueue-refusal", "committed-request", "committed-reply",
                "delete-task-request", "delete-task-reply"}) {
            byte[] w = vector(name);
            Frames.Frame rf = frame(w);
            byte[] encoded = name.endsWith("request")
                    ? BinRequest.decode(rf.header()).encode()
                    : BinReply.decode(rf.header()).encode();
            assertArrayEquals(w, encode(encoded, new byte[0]), name);
        }
        BinReply refusal = BinReply.decode(frame(vector("numbered-enqueue-refusal")).header());
        assertEquals(Status.BAD_REQUEST, refusal.status());
        assertEquals(5, refusal.pageToken);
        assertEquals(2, refusal.pageNextToken);
        BinReply committed = BinReply.decode(frame(vector("committed-reply")).header());
        assertEquals("10.0.0.7:8091", committed.committed.endpoint);
        assertArrayEquals(new long[] {2, 0, 1}, committed.committed.endTokens);
        BinRequest deleteTask = BinRequest.decode(frame(vector("delete-task-request")).header());
        assertEquals(MessageType.DELETE_TASK, deleteTask.messageType());
        assertEquals("q1.2.0", deleteTask.taskId);
        assertEquals(5, deleteTask.bufferCount);
        assertEquals(MessageType.DELETE_TASK, BinReply.decode(frame(vector("delete-task-reply")).header()).messageType());
    }
}
