package io.binx.client;

import java.util.ArrayList;
import java.util.List;

/** The header of a reply frame ({@code binx.v1.BinReply}); fields as docs/PROTOCOL.md section 3 says. */
public final class BinReply {
    public long requestId;
    public int type;
    public int status;
    public boolean bufferComplete;
    public long pageToken;
    public long pageNextToken;
    public long[] remainingBytes = new long[0];
    public List<Segment> segments = new ArrayList<>();
    public String error = "";
    public String serverName = "";
    public List<String> capabilities = new ArrayList<>();
    public long[] followingSizes = new long[0];
    /** COMMITTED (proposed, docs/PROTOCOL.md section 10): what a task's commit says. */
    public Committed committed;

    public Status status() {
        return Status.of(status);
    }

    public MessageType messageType() {
        return MessageType.of(type);
    }

    /** The reply to COMMITTED: where a finished task's output is and how large each buffer is. */
    public static final class Committed {
        /** The spool node name of the binxd that wrote it. */
        public String node = "";
        /** host:port other sidecars reach that binxd under (its advertise_address). */
        public String endpoint = "";
        /** Buffers the task has in all. */
        public long bufferCount;
        /** Per buffer from the reply's page_token on: its page count (the token it ends at). */
        public long[] endTokens = new long[0];
        /** Per buffer from the reply's page_token on: the bytes of its pages. */
        public long[] bytes = new long[0];

        byte[] encode() {
            Wire.Writer w = new Wire.Writer();
            w.string(1, node);
            w.string(2, endpoint);
            w.uint64(3, bufferCount);
            w.packed(4, endTokens);
            w.packed(5, bytes);
            return w.toByteArray();
        }

        static Committed decode(Wire.Reader in) throws ProtocolException {
            Committed c = new Committed();
            Wire.LongList ends = new Wire.LongList();
            Wire.LongList bytes = new Wire.LongList();
            while (in.next()) {
                switch (in.field()) {
                    case 1 -> c.node = in.string();
                    case 2 -> c.endpoint = in.string();
                    case 3 -> c.bufferCount = in.uint64();
                    case 4 -> in.repeatedUint64(ends);
                    case 5 -> in.repeatedUint64(bytes);
                    default -> in.skip();
                }
            }
            c.endTokens = ends.toArray();
            c.bytes = bytes.toArray();
            return c;
        }
    }

    public byte[] encode() {
        Wire.Writer w = new Wire.Writer();
        w.uint64(1, requestId);
        w.uint64(2, type);
        w.uint64(3, status);
        w.bool(4, bufferComplete);
        w.uint64(5, pageToken);
        w.uint64(6, pageNextToken);
        w.packed(7, remainingBytes);
        for (Segment s : segments) {
            w.message(8, s.encode());
        }
        w.string(9, error);
        w.string(10, serverName);
        for (String c : capabilities) {
            w.bytes(11, c.getBytes(java.nio.charset.StandardCharsets.UTF_8));
        }
        w.packed(12, followingSizes);
        if (committed != null) {
            w.message(13, committed.encode());
        }
        return w.toByteArray();
    }

    public static BinReply decode(byte[] header) throws ProtocolException {
        BinReply r = new BinReply();
        Wire.Reader in = new Wire.Reader(header);
        Wire.LongList remaining = new Wire.LongList();
        Wire.LongList following = new Wire.LongList();
        while (in.next()) {
            switch (in.field()) {
                case 1 -> r.requestId = in.uint64();
                case 2 -> r.type = in.enumValue();
                case 3 -> r.status = in.enumValue();
                case 4 -> r.bufferComplete = in.bool();
                case 5 -> r.pageToken = in.uint64();
                case 6 -> r.pageNextToken = in.uint64();
                case 7 -> in.repeatedUint64(remaining);
                case 8 -> r.segments.add(Segment.decode(in.message()));
                case 9 -> r.error = in.string();
                case 10 -> r.serverName = in.string();
                case 11 -> r.capabilities.add(in.string());
                case 12 -> in.repeatedUint64(following);
                case 13 -> r.committed = Committed.decode(in.message());
                default -> in.skip();
            }
        }
        r.remainingBytes = remaining.toArray();
        r.followingSizes = following.toArray();
        return r;
    }
}
