package io.binx.client;

import java.nio.ByteBuffer;
import java.nio.CharBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CharsetDecoder;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;

/**
 * Protobuf's wire format, the little of it BinX headers use (proto3: varints, length-delimited
 * fields, packed repeated varints). Written by hand so the client needs no protoc and no
 * protobuf runtime (docs/PROTOCOL.md section 3).
 */
final class Wire {
    static final int VARINT = 0;
    static final int FIXED64 = 1;
    static final int LEN = 2;
    static final int FIXED32 = 5;

    private Wire() {}

    /** Appends protobuf fields to a growing buffer, in field-number order as the caller writes them. */
    static final class Writer {
        private byte[] buf = new byte[64];
        private int len;

        private void ensure(int more) {
            if (len + more > buf.length) {
                buf = Arrays.copyOf(buf, Math.max(buf.length * 2, len + more));
            }
        }

        void rawVarint(long value) {
            ensure(10);
            while ((value & ~0x7FL) != 0) {
                buf[len++] = (byte) ((value & 0x7F) | 0x80);
                value >>>= 7;
            }
            buf[len++] = (byte) value;
        }

        private void tag(int field, int wireType) {
            rawVarint(((long) field << 3) | wireType);
        }

        /** A uint64 (or enum, or bool) field; proto3 leaves out zero. */
        void uint64(int field, long value) {
            if (value != 0) {
                tag(field, VARINT);
                rawVarint(value);
            }
        }

        /** An optional uint64 (explicit presence): written whenever present, zero included. */
        void optionalUint64(int field, Long value) {
            if (value != null) {
                tag(field, VARINT);
                rawVarint(value);
            }
        }

        void bool(int field, boolean value) {
            uint64(field, value ? 1 : 0);
        }

        void string(int field, String value) {
            if (value != null && !value.isEmpty()) {
                bytes(field, value.getBytes(StandardCharsets.UTF_8));
            }
        }

        void bytes(int field, byte[] value) {
            if (value != null && value.length > 0) {
                tag(field, LEN);
                rawVarint(value.length);
                ensure(value.length);
                System.arraycopy(value, 0, buf, len, value.length);
                len += value.length;
            }
        }

        /** A nested message, written even when empty (a oneof member or a present message). */
        void message(int field, byte[] encoded) {
            tag(field, LEN);
            rawVarint(encoded.length);
            ensure(encoded.length);
            System.arraycopy(encoded, 0, buf, len, encoded.length);
            len += encoded.length;
        }

        void packed(int field, long[] values) {
            if (values == null || values.length == 0) {
                return;
            }
            Writer inner = new Writer();
            for (long v : values) {
                inner.rawVarint(v);
            }
            bytes(field, inner.toByteArray());
        }

        byte[] toByteArray() {
            return Arrays.copyOf(buf, len);
        }
    }

    /**
     * Reads fields from one encoded message. Every malformed input is a {@link ProtocolException}
     * naming what was wrong; nothing is trusted before it is checked.
     */
    static final class Reader {
        private final byte[] buf;
        private int pos;
        private final int end;
        private int field;
        private int wireType;

        Reader(byte[] buf) {
            this(buf, 0, buf.length);
        }

        Reader(byte[] buf, int offset, int length) {
            this.buf = buf;
            this.pos = offset;
            this.end = offset + length;
        }

        /** Moves to the next field; false at the end of the message. */
        boolean next() throws ProtocolException {
            if (pos >= end) {
                return false;
            }
            long key = rawVarint();
            field = (int) (key >>> 3);
            wireType = (int) (key & 7);
            if (field <= 0 || key >>> 3 > 0x1FFFFFFFL) {
                throw new ProtocolException("field number " + (key >>> 3) + " is not valid");
            }
            return true;
        }

        int field() {
            return field;
        }

        long rawVarint() throws ProtocolException {
            long result = 0;
            for (int shift = 0; shift < 64; shift += 7) {
                if (pos >= end) {
                    throw new ProtocolException("a varint runs past the end of the header");
                }
                byte b = buf[pos++];
                if (shift == 63 && (b & 0x7E) != 0) {
                    // Bits past the 64th: binxd (prost) refuses such a varint, and so does this.
                    throw new ProtocolException("a varint does not fit 64 bits");
                }
                result |= (long) (b & 0x7F) << shift;
                if ((b & 0x80) == 0) {
                    return result;
                }
            }
            throw new ProtocolException("a varint is longer than 10 bytes");
        }

        private void expect(int type) throws ProtocolException {
            if (wireType != type) {
                throw new ProtocolException("field " + field + " has wire type " + wireType + ", expected " + type);
            }
        }

        long uint64() throws ProtocolException {
            expect(VARINT);
            return rawVarint();
        }

        boolean bool() throws ProtocolException {
            return uint64() != 0;
        }

        int enumValue() throws ProtocolException {
            return (int) uint64();
        }

        /** The bounds of a length-delimited field's content: {offset, length}. */
        private int[] delimited() throws ProtocolException {
            expect(LEN);
            long length = rawVarint();
            if (length < 0 || length > end - pos) {
                throw new ProtocolException("field " + field + " says " + length + " bytes, but " + (end - pos) + " are left");
            }
            int[] range = {pos, (int) length};
            pos += (int) length;
            return range;
        }

        String string() throws ProtocolException {
            int[] r = delimited();
            CharsetDecoder decoder = StandardCharsets.UTF_8.newDecoder()
                    .onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT);
            try {
                CharBuffer chars = decoder.decode(ByteBuffer.wrap(buf, r[0], r[1]));
                return chars.toString();
            } catch (CharacterCodingException e) {
                throw new ProtocolException("field " + field + " is not valid UTF-8");
            }
        }

        byte[] bytes() throws ProtocolException {
            int[] r = delimited();
            return Arrays.copyOfRange(buf, r[0], r[0] + r[1]);
        }

        /** A nested message's reader. */
        Reader message() throws ProtocolException {
            int[] r = delimited();
            return new Reader(buf, r[0], r[1]);
        }

        /** Appends a repeated uint64, packed or not, to {@code into}. */
        void repeatedUint64(LongList into) throws ProtocolException {
            if (wireType == VARINT) {
                into.add(rawVarint());
                return;
            }
            int[] r = delimited();
            Reader inner = new Reader(buf, r[0], r[1]);
            while (inner.pos < inner.end) {
                into.add(inner.rawVarint());
            }
        }

        /** Skips a field this client does not know, as protobuf prescribes. */
        void skip() throws ProtocolException {
            switch (wireType) {
                case VARINT -> rawVarint();
                case FIXED64 -> advance(8);
                case LEN -> delimited();
                case FIXED32 -> advance(4);
                default -> throw new ProtocolException("field " + field + " has wire type " + wireType + ", which proto3 does not use");
            }
        }

        private void advance(int n) throws ProtocolException {
            if (end - pos < n) {
                throw new ProtocolException("field " + field + " runs past the end of the header");
            }
            pos += n;
        }
    }

    /** A growable list of longs without boxing. */
    static final class LongList {
        private long[] values = new long[8];
        private int size;

        void add(long v) {
            if (size == values.length) {
                values = Arrays.copyOf(values, size * 2);
            }
            values[size++] = v;
        }

        long[] toArray() {
            return Arrays.copyOf(values, size);
        }
    }
}
