"""A Python launcher for scripts that start many short Python commands (tests/test_h200_check.py's dry run of
scripts/h200_check.sh: about thirty, each importing torch for a step of seconds): one server process imports
torch once, and each command runs in a process forked from it.

``PY="python -S tests/forkserver.py"`` takes a command line as ``python`` does (``-c CODE``, ``-m MODULE`` or
a script path, then the arguments) and hands it, with its working directory, its environment and its
standard streams (the file descriptors themselves), to the server at ``$REMASK_FORK_SOCKET``. The server forks:
the child takes them over and runs the command as ``python`` would (``sys.argv``, ``sys.path[0]``,
``__main__``; ``SystemExit``'s code, a traceback and exit status 1 on an exception); the client forwards
SIGTERM, SIGINT and SIGHUP to it (``timeout`` stops the client) and exits with its status (128 + N when signal
N ended it). The server runs one command at a time, as such a script does (``serve``). The client imports
only the standard library (``-S``: not even the site packages), so it starts in milliseconds.

The server's process has no threads when it forks (torch imported on one OpenMP thread starts none)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

SOCKET_ENV = "REMASK_FORK_SOCKET"
# imported once by the server: torch and what the dry run's steps import after it (sympy through torch's
# symbolic shapes, ~0.7 s), and the engine
PRELOAD = ("torch", "torch.fx.experimental.symbolic_shapes", "engine.engine")


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    size = int.from_bytes(head, "big")
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client hung up mid-request")
        data += chunk
    return json.loads(data), list(fds)


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: take over the client's streams, directory and environment, run the command as
    ``python`` would, and exit with its status (never returns)."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import runpy

        argv = request["argv"]
        if argv[:1] == ["-c"]:
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[:1] == ["-m"]:
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], request["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv and not argv[0].startswith("-"):
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        else:
            raise SystemExit(f"forkserver: a command is -c CODE, -m MODULE or a script, then its arguments; got {argv}")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # as an interpreter's exit runs them
        except BaseException:
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(path: str, preload: tuple[str, ...] = PRELOAD) -> None:
    """Import ``preload``, then run the commands that clients send to the Unix socket ``path``, one at a time,
    each in a forked child; until terminated."""
    import importlib

    for name in preload:
        importlib.import_module(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".part")
    server.listen(16)
    os.rename(path + ".part", path)  # the socket appears once it accepts
    while True:
        conn, _ = server.accept()
        with conn:
            try:
                request, fds = _recv_request(conn)
            except (OSError, ValueError, ConnectionError) as exc:
                print(f"forkserver: a bad request ({exc!r})", file=sys.stderr)
                continue
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                _run_child(request, fds)
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"{pid}\n".encode())
            except OSError:
                pass  # the client is gone: the child still runs to its end
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass


def client(argv: list[str]) -> int:
    """Run ``argv`` (``python``'s command line, without the interpreter) on the server: its exit status."""
    pending: list[int] = []
    child: list[int] = []

    def forward(signum, frame) -> None:
        if not child:
            pending.append(signum)
            return
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ[SOCKET_ENV])
    payload = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(conn, [len(payload).to_bytes(8, "big")], [0, 1, 2])
    conn.sendall(payload)
    answers = conn.makefile("rb")
    child.append(int(answers.readline()))
    for signum in pending:
        forward(signum, None)
    line = answers.readline()
    if not line:
        print("forkserver: the server hung up", file=sys.stderr)
        return 1
    status = int(line)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1:]))
