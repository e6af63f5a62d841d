#!/usr/bin/env python3
"""A shared memory client written from docs/PROTOCOL.md section 6 alone, in
another language than binx, for the end-to-end tests to play engines that
misbehave. Standard library only.

  shm_client.py ping-then-garbage <socket>
      attaches, sends PING through region A, reads its reply from region B,
      then scribbles over region A's submit_head and prints what binxd says
      on the socket before closing it.
  shm_client.py half-enqueue <socket> <task>
      attaches and sends the first 600 KiB of a 1 MiB ENQUEUE, prints
      "ready" and sleeps (the test kills it there).
  shm_client.py flood <socket> <task> <mib>
      attaches and sends <mib> MiB of ENQUEUEs of 64 KiB pages for buffer 0
      of <task>, using every slot of region A in turn (the contract lets a
      writer take any free slot), reading and dropping the replies; prints
      how many ENQUEUEs were answered OK.
  shm_client.py blocking-wakes <socket>
      attaches, clears O_NONBLOCK on the eventfds binxd waits on and wakes
      through (the open files are shared), fills region B's submit
      eventfd's count, sets region B's reader-waiting flag, sends a PING
      and wakes binxd once more, prints "ready" and sleeps (the test kills
      it there): binxd must make no system call that waits on them.
"""
import ctypes
import mmap
import os
import socket
import struct
import sys
import time

# Major 1, minor 1; a server of any minor version of major 1 answers.
PREFACE = b"BINX\x01\x02\x00\x00"
PING, ENQUEUE, SHM_ATTACH = 4, 17, 20


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_varint(num, value):
    return varint(num << 3) + varint(value)


def field_bytes(num, data):
    return varint(num << 3 | 2) + varint(len(data)) + data


def frame(header, body=b"", declared_body=None):
    body_len = len(body) if declared_body is None else declared_body
    return struct.pack(">II", 4 + len(header) + body_len, len(header)) + header + body


def decode_reply(header):
    """The fields of a BinReply this script needs: status (3), error (9)."""
    fields, i = {}, 0
    while i < len(header):
        key, i = read_varint(header, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = read_varint(header, i)
        elif wire == 2:
            length, i = read_varint(header, i)
            value, i = header[i:i + length], i + length
        else:
            raise ValueError(f"wire type {wire}")
        fields[num] = value
    return fields.get(3, 0), fields.get(9, b"").decode()


def read_varint(data, i):
    shift = value = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


class Region:
    def __init__(self, fd):
        self.map = mmap.mmap(fd, os.fstat(fd).st_size)
        magic, version, self.n, self.size, _, self.submit, self.complete, self.slots = \
            struct.unpack_from("<IIIIQQQQ", self.map, 0)
        assert magic == 0x4D535842 and version == 1, (hex(magic), version)
        self.head = 0  # entries submitted (writer) or taken (reader)
        self.done = 0  # entries completed (reader)
        self.generation = [0] * self.n
        # The heads are published with one aligned 8-byte store each:
        # struct.pack_into writes byte by byte, and binxd may read a torn
        # value in between (it then closes the connection, rightly).
        self.submit_head = ctypes.c_uint64.from_buffer(self.map, 64)
        self.complete_head = ctypes.c_uint64.from_buffer(self.map, 192)

    def word(self, at):
        return struct.unpack_from("<Q", self.map, at)[0]

    # Writer side (region A).
    def send(self, data, event_fd):
        slot = self.head % self.n
        assert len(data) <= self.size
        start = self.slots + slot * self.size
        self.map[start:start + len(data)] = data
        self.generation[slot] += 1
        struct.pack_into("<IIII", self.map, self.submit + 16 * (self.head % self.n),
                         slot, self.generation[slot], 0, len(data))
        self.head += 1
        self.submit_head.value = self.head
        os.write(event_fd, (1).to_bytes(8, "little"))

    # Reader side (region B): the next run of bytes. With `complete_fd`
    # (the region's complete eventfd), wakes the writer, which may be
    # asleep waiting for a slot; always, since Python cannot fence between
    # publishing the completion and reading the writer's waiting flag.
    def receive(self, timeout=5.0, complete_fd=None):
        deadline = time.monotonic() + timeout
        while self.word(64) == self.head:
            if time.monotonic() > deadline:
                raise TimeoutError("nothing arrived in region B")
            time.sleep(0.001)
        slot, generation, offset, length = struct.unpack_from(
            "<IIII", self.map, self.submit + 16 * (self.head % self.n))
        self.head += 1
        start = self.slots + slot * self.size + offset
        data = bytes(self.map[start:start + length])
        struct.pack_into("<II", self.map, self.complete + 8 * (self.done % self.n), slot, generation)
        self.done += 1
        self.complete_head.value = self.done
        if complete_fd is not None:
            os.write(complete_fd, (1).to_bytes(8, "little"))
        return data


def attach(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(PREFACE)
    theirs = sock.recv(8, socket.MSG_WAITALL)
    assert theirs[:5] == PREFACE[:5] and theirs[6:] == b"\x00\x00", theirs
    sock.sendall(frame(field_varint(1, 1) + field_varint(2, SHM_ATTACH)))
    data, fds, _, _ = socket.recv_fds(sock, 65536, 6)
    length, header_len = struct.unpack_from(">II", data, 0)
    status, error = decode_reply(data[8:8 + header_len])
    if status != 1:
        sys.exit(f"SHM_ATTACH refused with status {status}: {error}")
    assert len(fds) == 6, fds
    a, b = Region(fds[0]), Region(fds[1])
    return sock, a, b, fds


def ping_then_garbage(path):
    sock, a, b, fds = attach(path)
    a.send(frame(field_varint(1, 7) + field_varint(2, PING)), fds[2])
    reply = b.receive()
    length, header_len = struct.unpack_from(">II", reply, 0)
    status, _ = decode_reply(reply[8:8 + header_len])
    print(f"ping status {status}", flush=True)
    # Scribble: claim far more submitted entries than there are slots.
    struct.pack_into("<Q", a.map, 64, 1 << 40)
    os.write(fds[2], (1).to_bytes(8, "little"))
    said = bytearray()
    sock.settimeout(10)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        said += chunk
    length, header_len = struct.unpack_from(">II", said, 0)
    status, error = decode_reply(bytes(said[8:8 + header_len]))
    print(f"closed with status {status}: {error}", flush=True)


def half_enqueue(path, task):
    sock, a, b, fds = attach(path)
    page = 1 << 20
    header = (field_varint(1, 9) + field_varint(2, ENQUEUE) + field_bytes(3, task.encode())
              + field_bytes(13, varint(page)))
    head = frame(header, declared_body=page)
    sent = head + bytes(range(256)) * ((600 << 10) // 256)
    for at in range(0, len(sent), a.size):
        a.send(sent[at:at + a.size], fds[2])
    print("ready", flush=True)
    time.sleep(60)


def flood(path, task, mib):
    sock, a, b, fds = attach(path)
    page = 64 << 10
    body = bytes(range(256)) * (page // 256)
    stream = bytearray()
    sent = 0
    request_id = 100
    answered = ok = 0

    def drain_replies():
        nonlocal answered, ok
        while b.word(64) != b.head:
            # fds[5]: region B's complete eventfd (binxd's writer sleeps on
            # it once every slot of region B is in flight).
            run = b.receive(complete_fd=fds[5])
            replies.extend(run)
            while len(replies) >= 8:
                length, header_len = struct.unpack_from(">II", replies, 0)
                if len(replies) < 4 + length:
                    break
                status, _ = decode_reply(bytes(replies[8:8 + header_len]))
                answered += 1
                ok += status == 1
                del replies[:4 + length]

    replies = bytearray()
    requests = 0
    while sent < mib << 20:
        header = (field_varint(1, request_id) + field_varint(2, ENQUEUE)
                  + field_bytes(3, task.encode()) + field_bytes(13, varint(page)))
        stream += frame(header, body)
        request_id += 1
        requests += 1
        sent += page
        while len(stream) >= a.size or (sent >= mib << 20 and stream):
            # Slot head % n is free once binxd completed everything before it.
            deadline = time.monotonic() + 30
            while a.head - a.word(192) >= a.n:
                drain_replies()
                if time.monotonic() > deadline:
                    sys.exit("binxd completed no slot of region A for 30 s")
                time.sleep(0.0005)
            chunk = bytes(stream[:a.size])
            del stream[:a.size]
            a.send(chunk, fds[2])
            drain_replies()
    deadline = time.monotonic() + 30
    while answered < requests:
        if time.monotonic() > deadline:
            sys.exit(f"only {answered} of {requests} ENQUEUEs answered; region A: "
                     f"submitted {a.head}, completed {a.word(192)}, reader waiting "
                     f"{struct.unpack_from('<I', a.map, 128)[0]}; region B: submitted "
                     f"{b.word(64)}, taken {b.head}, writer waiting "
                     f"{struct.unpack_from('<I', b.map, 256)[0]}; {len(replies)} bytes "
                     f"of replies unparsed")
        drain_replies()
        time.sleep(0.001)
    print(f"ok {ok} of {requests}", flush=True)


def blocking_wakes(path):
    import fcntl
    sock, a, b, fds = attach(path)
    for fd in fds[2:]:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    # Region B's submit eventfd at its largest count: a write of 1 waits.
    os.write(fds[4], (0xFFFFFFFFFFFFFFFE).to_bytes(8, "little"))
    struct.pack_into("<I", b.map, 128, 1)
    a.send(frame(field_varint(1, 7) + field_varint(2, PING)), fds[2])
    time.sleep(0.2)
    # Once more, after binxd took the first: a read of the count would wait.
    os.write(fds[2], (1).to_bytes(8, "little"))
    print("ready", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    if sys.argv[1] == "ping-then-garbage":
        ping_then_garbage(sys.argv[2])
    elif sys.argv[1] == "half-enqueue":
        half_enqueue(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "blocking-wakes":
        blocking_wakes(sys.argv[2])
    elif sys.argv[1] == "flood":
        flood(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(f"unknown mode {sys.argv[1]}")
