"""The attacks of issue 11 on a tcp run, from a process that knows its ports but not its
keys: read telemetry, guess the token, a huge subscription, 300 connections of 64 x 64 KB
messages, 1,200 raw connections held open. Prints "ready" once all are under way, then
counts what it got until stdin closes, and prints that as JSON. Used by
tests/test_security.py (as another local user) and benchmarks/bench_faults.py.

    python tests/tcp_attack.py PUB_ENDPOINT CMD_ENDPOINT RUN_DIR
"""
import errno
import json
import os
import socket
import sys

import zmq

from agent.wire import protocol

pub, cmd, run_dir = sys.argv[1:4]
result = {"received": 0, "replies": 0, "raw_connections": 0}
try:
    os.listdir(run_dir)
    result["run_dir"] = "listed"
except PermissionError:
    result["run_dir"] = "refused"
context = zmq.Context()
listeners = []
for topic in (b"", b"x" * (4 << 20)):  # everything, and a 4 MB subscription (far over
    # the 1 KiB limit; issue 11's 100 MB costs ZeroMQ's own trie 10 s in the attacker)
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub)
    listeners.append(sub)
guess = context.socket(zmq.DEALER)
guess.setsockopt(zmq.LINGER, 0)
guess.connect(cmd)
guess.send_multipart(protocol.encode(protocol.envelope("command", {
    "id": "x", "knob": "accum_steps", "value": 8, "token": "0" * 32}, run="?")))
flooders = []
payload = b"x" * 65536  # one buffer for all (copy=False): the attacker stays small
for _ in range(300):
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 64)
    dealer.setsockopt(zmq.RECONNECT_IVL, 1000)  # knocks again every second, not 10x
    dealer.connect(cmd)
    for _ in range(64):
        try:
            dealer.send(payload, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break
    flooders.append(dealer)
host, port = cmd[len("tcp://"):].rsplit(":", 1)
raw = []
for _ in range(1200):  # connecting all at once, never waiting for one
    connection = socket.socket()
    connection.setblocking(False)
    if connection.connect_ex((host, int(port))) in (0, errno.EINPROGRESS):
        raw.append(connection)
result["raw_connections"] = len(raw)
print("ready", flush=True)
poller = zmq.Poller()
for sock in (*listeners, guess):
    poller.register(sock, zmq.POLLIN)
poller.register(sys.stdin.fileno(), zmq.POLLIN)
while True:
    ready = dict(poller.poll())
    if sys.stdin.fileno() in ready:
        break
    for sock in listeners:
        while sock in ready and sock.poll(0):
            sock.recv_multipart()
            result["received"] += 1
    while guess in ready and guess.poll(0):
        guess.recv_multipart()
        result["replies"] += 1
print(json.dumps(result), flush=True)
os._exit(0)  # not a teardown of 1,500 sockets
