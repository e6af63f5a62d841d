package io.binx.client;

import java.util.ArrayList;
import java.util.List;

/**
 * The header of a request frame ({@code binx.v1.BinRequest}). A plain wire object: fields are
 * public and mean exactly what docs/PROTOCOL.md section 3 says; zero, empty and {@code null} are
 * "not set" (proto3), except {@link #ackToken} and {@link #appendToken}, whose presence counts.
 */
public final class BinRequest {
    public long requestId;
    public int type;
    public String taskId = "";
    public long bufferId;
    public long pageToken;
    public boolean getDataSize;
    public long maxSizeBytes;
    public long maxWaitMicros;
    public boolean acceptSpooled;
    public List<String> acceptEncodings = new ArrayList<>();
    public String authToken = "";
    public String clientName = "";
    public long[] pageSizes = new long[0];
    public int bufferKind;
    public long bufferCount;
    public String remote = "";
    public String reason = "";
    public String spoolPolicy = "";
    /** Pipelined DATA (section 10): acknowledge only below this token. */
    public Long ackToken;
    /** Numbered appends (docs/PROTOCOL.md section 9): the token the first page must get. */
    public Long appendToken;

    public BinRequest(MessageType type) {
        this.type = type.number();
    }

    /** What binxd keeps of an ABORT_TASK's reason: 4096 bytes of UTF-8. */
    public static final int MAX_REASON_BYTES = 4096;

    /**
     * {@code reason} cut to {@link #MAX_REASON_BYTES} of UTF-8 at a character's end (null is
     * empty): binxd keeps no more of it, and a longer one (a stack trace) could make the
     * request's header pass its limit, so the abort would never be sent.
     */
    public static String reasonWithin(String reason) {
        if (reason == null) {
            return "";
        }
        int bytes = 0;
        for (int i = 0; i < reason.length(); ) {
            int c = reason.codePointAt(i);
            // An unpaired surrogate is written as one byte; counted as three.
            int n = c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4;
            if (bytes + n > MAX_REASON_BYTES) {
                return reason.substring(0, i);
            }
            bytes += n;
            i += Character.charCount(c);
        }
        return reason;
    }

    BinRequest() {}

    public MessageType messageType() {
        return MessageType.of(type);
    }

    public byte[] encode() {
        Wire.Writer w = new Wire.Writer();
        w.uint64(1, requestId);
        w.uint64(2, type);
        w.string(3, taskId);
        w.uint64(4, bufferId);
        w.uint64(5, pageToken);
        w.bool(6, getDataSize);
        w.uint64(7, maxSizeBytes);
        w.uint64(8, maxWaitMicros);
        w.bool(9, acceptSpooled);
        for (String e : acceptEncodings) {
            w.bytes(10, e.getBytes(java.nio.charset.StandardCharsets.UTF_8));
        }
        w.string(11, authToken);
        w.string(12, clientName);
        w.packed(13, pageSizes);
        w.uint64(14, bufferKind);
        w.uint64(15, bufferCount);
        w.string(16, remote);
        w.string(17, reason);
        w.string(18, spoolPolicy);
        w.optionalUint64(19, ackToken);
        w.optionalUint64(20, appendToken);
        return w.toByteArray();
    }

    public static BinRequest decode(byte[] header) throws ProtocolException {
        BinRequest r = new BinRequest();
        Wire.Reader in = new Wire.Reader(header);
        Wire.LongList sizes = new Wire.LongList();
        while (in.next()) {
            switch (in.field()) {
                case 1 -> r.requestId = in.uint64();
                case 2 -> r.type = in.enumValue();
                case 3 -> r.taskId = in.string();
                case 4 -> r.bufferId = in.uint64();
                case 5 -> r.pageToken = in.uint64();
                case 6 -> r.getDataSize = in.bool();
                case 7 -> r.maxSizeBytes = in.uint64();
                case 8 -> r.maxWaitMicros = in.uint64();
                case 9 -> r.acceptSpooled = in.bool();
                case 10 -> r.acceptEncodings.add(in.string());
                case 11 -> r.authToken = in.string();
                case 12 -> r.clientName = in.string();
                case 13 -> in.repeatedUint64(sizes);
                case 14 -> r.bufferKind = in.enumValue();
                case 15 -> r.bufferCount = in.uint64();
                case 16 -> r.remote = in.string();
                case 17 -> r.reason = in.string();
                case 18 -> r.spoolPolicy = in.string();
                case 19 -> r.ackToken = in.uint64();
                case 20 -> r.appendToken = in.uint64();
                default -> in.skip();
            }
        }
        r.pageSizes = sizes.toArray();
        return r;
    }
}
