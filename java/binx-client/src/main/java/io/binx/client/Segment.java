package io.binx.client;

import java.util.Map;
import java.util.TreeMap;

/** A run of consecutive pages in a DATA reply: inline in the frame body, or in a spooled object. */
public final class Segment {
    public long firstToken;
    public long[] pageSizes = new long[0];
    /** Set when the pages follow in the frame body. */
    public boolean inline;
    /** Set when the pages are in an object in storage. */
    public Spooled spooled;

    /** Where a spooled segment's object is (read it yourself, or ask without accept_spooled). */
    public static final class Spooled {
        public String uri = "";
        public Map<String, String> headers = new TreeMap<>();
        public long storedSize;
        public byte[] key = new byte[0];
        public long expiresAtUnixMs;

        byte[] encode() {
            Wire.Writer w = new Wire.Writer();
            w.string(1, uri);
            for (Map.Entry<String, String> e : headers.entrySet()) {
                Wire.Writer entry = new Wire.Writer();
                entry.string(1, e.getKey());
                entry.string(2, e.getValue());
                w.message(2, entry.toByteArray());
            }
            w.uint64(3, storedSize);
            w.bytes(4, key);
            w.uint64(5, expiresAtUnixMs);
            return w.toByteArray();
        }

        static Spooled decode(Wire.Reader in) throws ProtocolException {
            Spooled s = new Spooled();
            while (in.next()) {
                switch (in.field()) {
                    case 1 -> s.uri = in.string();
                    case 2 -> {
                        Wire.Reader entry = in.message();
                        String k = "";
                        String v = "";
                        while (entry.next()) {
                            switch (entry.field()) {
                                case 1 -> k = entry.string();
                                case 2 -> v = entry.string();
                                default -> entry.skip();
                            }
                        }
                        s.headers.put(k, v);
                    }
                    case 3 -> s.storedSize = in.uint64();
                    case 4 -> s.key = in.bytes();
                    case 5 -> s.expiresAtUnixMs = in.uint64();
                    default -> in.skip();
                }
            }
            return s;
        }
    }

    public static Segment inline(long firstToken, long... pageSizes) {
        Segment s = new Segment();
        s.firstToken = firstToken;
        s.pageSizes = pageSizes;
        s.inline = true;
        return s;
    }

    byte[] encode() {
        Wire.Writer w = new Wire.Writer();
        w.uint64(1, firstToken);
        w.packed(2, pageSizes);
        if (inline) {
            w.message(3, new byte[0]);
        } else if (spooled != null) {
            w.message(4, spooled.encode());
        }
        return w.toByteArray();
    }

    static Segment decode(Wire.Reader in) throws ProtocolException {
        Segment s = new Segment();
        Wire.LongList sizes = new Wire.LongList();
        while (in.next()) {
            switch (in.field()) {
                case 1 -> s.firstToken = in.uint64();
                case 2 -> in.repeatedUint64(sizes);
                case 3 -> {
                    Wire.Reader inner = in.message();
                    while (inner.next()) {
                        inner.skip();
                    }
                    // A oneof: the last member seen wins.
                    s.inline = true;
                    s.spooled = null;
                }
                case 4 -> {
                    s.spooled = Spooled.decode(in.message());
                    s.inline = false;
                }
                default -> in.skip();
            }
        }
        s.pageSizes = sizes.toArray();
        return s;
    }

    /** Bytes of its pages, or -1 when their sum overflows (a hostile header). */
    long totalBytes() {
        long total = 0;
        for (long size : pageSizes) {
            if (size < 0 || total + size < total) {
                return -1;
            }
            total += size;
        }
        return total;
    }
}
