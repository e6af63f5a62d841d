#!/usr/bin/env python3
"""An independent check of binx's commit markers and manifests, written
from docs/PROTOCOL.md ("Spooling": the `mac` of a marker, and of a task's
manifest) alone: nothing of binx's code. Standard library only.

  marker_mac.py SECRET FILE...

For every file: its `,"mac":"<64 hex>"` member is taken out of the bytes
as stored, and HMAC-SHA256 under SHA-256("binx commit marker mac v1\\0" ||
SECRET) over what is left (a manifest, `task.json`, over
"binx manifest\\0" and what is left) must equal it. Prints "ok FILE" for
each; exits 1 naming the first file that does not check out, and why."""
import hashlib
import hmac
import os
import re
import sys

MEMBER = re.compile(rb',"mac":"([0-9a-f]{64})"')


def check(key, path):
    data = open(path, "rb").read()
    found = list(MEMBER.finditer(data))
    if len(found) != 1:
        return f"{len(found)} mac members"
    m = found[0]
    signed = data[: m.start()] + data[m.end():]
    if os.path.basename(path) == "task.json":
        signed = b"binx manifest\0" + signed
    want = hmac.new(key, signed, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(want, m.group(1)):
        return "the MAC does not match the bytes"
    return None


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    secret = sys.argv[1].encode()
    key = hashlib.sha256(b"binx commit marker mac v1\0" + secret).digest()
    for path in sys.argv[2:]:
        why = check(key, path)
        if why:
            print(f"{path}: {why}", file=sys.stderr)
            sys.exit(1)
        print(f"ok {path}")


main()
