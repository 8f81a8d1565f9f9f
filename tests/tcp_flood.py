"""Issue 11's descriptor exhaustion, from a process that knows a tcp run's ports but not
its keys: it holds ``COUNT`` raw tcp connections spread over the ports, opening a new one
as soon as one is closed, until stdin closes (or ``SECONDS`` pass); then prints what it
did as JSON (``opened``, ``closed_by_peer``, ``held``, ``most_held``). Prints "ready"
once the first ``COUNT`` are under way. Used by tests/test_security.py (as another local
user).

    python tests/tcp_flood.py HOST PORT[,PORT...] COUNT [SECONDS]
"""
import errno
import json
import os
import resource
import selectors
import socket
import sys
import time

host, ports = sys.argv[1], [int(port) for port in sys.argv[2].split(",")]
count = int(sys.argv[3])
seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 60.0
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if hard == resource.RLIM_INFINITY or hard > count + 64:  # room for them all
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, count + 64), hard))
selector = selectors.DefaultSelector()
selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
held: set[socket.socket] = set()
result = {"opened": 0, "closed_by_peer": 0, "failed": 0, "held": 0, "most_held": 0}
turn = 0


def top_up() -> None:
    global turn
    while len(held) < count:
        connection = socket.socket()
        connection.setblocking(False)
        code = connection.connect_ex((host, ports[turn % len(ports)]))
        turn += 1
        if code not in (0, errno.EINPROGRESS):
            result["failed"] += 1
            connection.close()
            return
        held.add(connection)
        selector.register(connection, selectors.EVENT_READ)
        result["opened"] += 1
    result["most_held"] = max(result["most_held"], len(held))


top_up()
print("ready", flush=True)
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for key, _ in selector.select(0.1):
        if key.fileobj == sys.stdin.fileno():
            deadline = 0
            continue
        connection = key.fileobj
        try:
            data = connection.recv(4096)
        except OSError:
            data = b""
        if not data:  # closed by the other end: open another
            selector.unregister(connection)
            held.discard(connection)
            connection.close()
            result["closed_by_peer"] += 1
    top_up()
result["held"] = len(held)
print(json.dumps(result), flush=True)
os._exit(0)
