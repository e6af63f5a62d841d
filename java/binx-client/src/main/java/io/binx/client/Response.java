package io.binx.client;

import java.nio.ByteBuffer;

/** A reply frame: its header, and its body (the pages of a DATA reply; empty otherwise). */
public record Response(BinReply header, ByteBuffer body) {}
