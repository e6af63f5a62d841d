#!/usr/bin/env python3
"""An independent reader of binx's spooled segment objects, written from
shared/PROTOCOL.md sections 6 (format 1) and 6b (format 2) alone: nothing
of binx's code. For every object named on the command line it checks the
magic, the CRC-32C, the header and the body length, and prints one line per
page: "token length sha256". It reads codec none; with --key HEX it opens
encrypted objects with AES-256-GCM (the `cryptography` package). Exits 1,
naming the object, on anything the contract does not allow."""
import hashlib
import struct
import sys


def crc32c(data):
    table = crc32c.table
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _table():
    out = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        out.append(c)
    return out


crc32c.table = _table()


def fail(name, why):
    print(f"{name}: {why}", file=sys.stderr)
    sys.exit(1)


def read(name, data, key):
    if len(data) < 24:
        fail(name, "too short")
    magic = data[:4]
    if magic not in (b"BXS1", b"BXS2"):
        fail(name, f"magic {magic!r}")
    content, crc = data[:-4], struct.unpack(">I", data[-4:])[0]
    if crc32c(content) != crc:
        fail(name, "CRC-32C mismatch")
    codec, flags, reserved = content[4], content[5], content[6:8]
    if reserved != b"\0\0" or flags & ~1:
        fail(name, "reserved bits set")
    count, first = struct.unpack(">IQ", content[8:20])
    fixed = 20
    chunk = None
    if magic == b"BXS2":
        chunk = struct.unpack(">I", content[20:24])[0]
        if not 65536 <= chunk <= 16777216:
            fail(name, f"chunk size {chunk}")
        fixed = 24
    sizes = list(struct.unpack(f">{count}Q", content[fixed:fixed + 8 * count]))
    header_end = fixed + 8 * count
    encrypted = flags & 1
    if encrypted and magic == b"BXS2":
        header_end += 7
    header, body = content[:header_end], content[header_end:]
    if encrypted:
        if key is None:
            fail(name, "encrypted, and no key given")
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        aes = AESGCM(key)
        if magic == b"BXS1":
            body = aes.decrypt(body[:12], body[12:], header)
        else:
            prefix, sealed, out = header[-7:], chunk + 16, b""
            n = max(1, -(-len(body) // sealed))
            for i in range(n):
                nonce = prefix + struct.pack(">I", i) + bytes([1 if i == n - 1 else 0])
                out += aes.decrypt(nonce, body[i * sealed:(i + 1) * sealed], header)
            body = out
    elif key is not None:
        fail(name, "not encrypted, but a key was given")
    if codec != 0:
        fail(name, f"codec {codec}: this reader reads codec none only")
    if len(body) != sum(sizes):
        fail(name, f"body of {len(body)} bytes, page sizes add up to {sum(sizes)}")
    offset = 0
    for i, size in enumerate(sizes):
        page = body[offset:offset + size]
        offset += size
        print(first + i, size, hashlib.sha256(page).hexdigest())


def main():
    args = sys.argv[1:]
    key = None
    if args[:1] == ["--key"]:
        key = bytes.fromhex(args[1])
        args = args[2:]
    for path in args:
        with open(path, "rb") as f:
            read(path, f.read(), key)


main()
