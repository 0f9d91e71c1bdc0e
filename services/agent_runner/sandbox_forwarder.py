"""The black-box agent's one way out of its sandbox: a TCP listener on the sandbox's own loopback
(127.0.0.1:PORT, where the agent's base URLs point) that pipes every connection, byte for byte and both
ways at once, to the agent-runner's unix socket bound into the sandbox. The agent-runner's end of that
socket (gateway_forwarder.py) forwards to the gateway only the requests for the episode's own session.
Bytes go on as they come, so streamed answers (SSE) arrive as the gateway sends them.

It runs inside the sandbox with the sandbox's own python3 (bubblewrap: the host's /usr/bin/python3;
docker: the task image's), so it is standalone: the standard library only, Python 3.6 or later, nothing
of rollstream (agent_sandbox.py stages a copy of this file read-only into each sandbox).

    python3 sandbox_forwarder.py SOCKET PORT

It prints READY and returns once it listens (exit 0; the server goes on in a child, in a session of its
own, so the agent killing its own process group leaves it alone), so the agent's command starts after it;
on failure it exits 1 with the reason on stderr. It also holds one idle connection to the socket, its
lifeline: the agent-runner never writes on it, so its end means that the agent-runner is gone (or the
episode is over), and the forwarder then kills every process in the sandbox: kill(-1), which reaches the
processes of its pid namespace, done only where that namespace's pid 1 is the sandbox's shell that started
this file (never on a host, or in a container, where someone runs it by hand). Under docker nothing else
would stop the container of an agent-runner that was killed.
"""

import os
import signal
import socket
import sys
import threading
import time

CHUNK = 65536
THREAD_STACK = 256 * 1024
"""Per thread: the sandbox's memory limit (RLIMIT_DATA) counts every thread's stack mapping."""
READY = "rs-agent: gateway forwarder listening"
"""Printed on stdout once it listens: the sandbox, not the agent's command, failed when it is missing."""
UNREACHABLE = (b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Content-Length: %d\r\n\r\n%s")


def pipe(source, target):
    """Copy until `source` ends, then tell `target` that nothing more comes (its reader sees the end)."""
    try:
        while True:
            data = source.recv(CHUNK)
            if not data:
                break
            target.sendall(data)
    except OSError:
        pass
    finally:
        try:
            target.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def serve(client, socket_path):
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            upstream.connect(socket_path)
        except OSError as exc:
            detail = str(exc).replace('"', "'")
            body = ('{"error": {"message": "the agent-runner\'s gateway forwarder does not answer: '
                    + detail + '"}}').encode()
            client.sendall(UNREACHABLE % (len(body), body))
            return
        back = threading.Thread(target=pipe, args=(upstream, client))
        back.daemon = True
        back.start()
        pipe(client, upstream)
        back.join()
    except (OSError, RuntimeError):  # RuntimeError: no thread could be started (the sandbox's process limit)
        pass
    finally:
        client.close()
        upstream.close()


def started_by_pid_1(script):
    """Whether this pid namespace's pid 1 is the shell that ran `script`: the sandbox's own, whose end is the
    sandbox's end."""
    try:
        with open("/proc/1/cmdline", "rb") as cmdline:
            return script.encode() in cmdline.read()
    except OSError:
        return False


def watch(lifeline, script):
    """Wait for the end of the lifeline, then end everything in the sandbox."""
    try:
        while lifeline.recv(CHUNK):
            pass
    except OSError:
        pass
    if started_by_pid_1(script):
        os.kill(-1, signal.SIGKILL)  # every process of the sandbox but pid 1, which then ends too
    os._exit(0)


def main():
    if len(sys.argv) != 3 or not sys.argv[2].isdigit():
        sys.stderr.write("usage: sandbox_forwarder.py SOCKET PORT\n")
        return 2
    socket_path, port = sys.argv[1], int(sys.argv[2])
    lifeline = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lifeline.connect(socket_path)
    except OSError as exc:
        sys.stderr.write(f"rs-agent forwarder: cannot reach the agent-runner at {socket_path}: {exc}\n")
        return 1
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
    except OSError as exc:
        sys.stderr.write(f"rs-agent forwarder: cannot listen on 127.0.0.1:{port}: {exc}\n")
        return 1
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    if os.fork():
        os._exit(0)  # it listens: the agent may start
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # nothing of the sandbox's output pipes is held by the server
        os.dup2(devnull, fd)
    threading.stack_size(THREAD_STACK)
    watcher = threading.Thread(target=watch, args=(lifeline, sys.argv[0]))
    watcher.daemon = True
    watcher.start()
    while True:
        try:
            client, _ = listener.accept()
        except OSError:  # out of file descriptors, for a moment
            time.sleep(0.1)
            continue
        try:
            handler = threading.Thread(target=serve, args=(client, socket_path))
            handler.daemon = True
            handler.start()
        except RuntimeError:
            client.close()


if __name__ == "__main__":
    sys.exit(main())
