"""CPU workers forked from a server that imported torch and Lightning once, instead of a new
interpreter each.

A worker started as `python -m relpos_ablate train` spends seconds importing before it trains (torch
and Lightning: 5-8 s of one CPU core), and a small grid's runs train for about as long.
On CPU slots the runner instead asks a fork server: one process per runner, started at the first
launch, that imports what every worker imports (PRELOAD) and then forks one child per run. The
caller gives the command, the `python -m MODULE ARGS` line a new interpreter would run, and the
child runs it as `python -m` does (MODULE's `__main__`), so the server knows no command of its own.
The child is made what `worker.start_worker` makes of a new interpreter:

- its own session, so stopping the run signals its process group; stdin from /dev/null;
- stdout and stderr on the run's worker.log, the descriptor the runner opened;
- the run's lock: the locked descriptor itself, passed over the server's socket (SCM_RIGHTS);
- the runner's working directory, the slot's environment (OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES="",
  ...), sys.argv and `__main__` of `python -m MODULE ARGS` (Lightning starts the other processes of
  a multi-process run from them), and the working directory and PYTHONPATH first on sys.path;
- SIGTERM when the runner dies: the server gets it from the runner (PR_SET_DEATHSIG) and the child
  from the server, so the child checkpoints and stops as a worker of a killed runner does;
- its exit status as Popen gives it (negative: the signal), relayed by the server, and the
  interpreter's exit handlers (atexit) run when the command returns.

Nothing of the runner's own script runs in the child (unlike multiprocessing's forkserver, which
imports the parent's __main__ again), so a script that calls the runner needs no `if __name__ ==
"__main__"` guard. Only runs on CPU slots of this machine are forked (`forkable`): a GPU slot's
CUDA_VISIBLE_DEVICES must be set before CUDA starts. Of a run of several processes the worker is
rank 0; Lightning starts the others as new interpreters. `grid --fresh-workers` starts every worker
as a new interpreter.
The server never runs a torch operation, so its children start with no thread pool copied mid-use;
it runs with CUDA_VISIBLE_DEVICES="" (what torch caches about GPUs there is what a CPU slot's worker
must see). A child runs the code of PRELOAD's modules as the server imported it when the runner
started it (an edit of relpos_ablate during a grid reaches the runs of the next grid); the modules
under a run's `imports:` are imported by each child.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import functools
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import types

PRELOAD = ("relpos_ablate.train.run",)
"""What the server imports before it forks: what makes a worker's start slow (torch and Lightning,
through the training code every worker imports)."""
START_TIMEOUT_S = 300.0
"""How long a launch waits for the server to fork the child (the first waits for the server's
imports)."""
_PACKET = 1 << 20
_PR_SET_DEATHSIG = 1


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name and sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int):
    """preexec_fn (or a call in a forked child): the process gets SIGTERM when its parent dies
    (Linux), so a killed runner leaves no orphan training on its GPU; the rerun resumes those runs
    from their checkpoints."""
    libc = _libc()

    def preexec() -> None:
        if libc is not None:
            libc.prctl(_PR_SET_DEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def forkable(num_nodes: int, gpu: str | None) -> bool:
    """Whether a worker can be forked: on Linux (the server needs SOCK_SEQPACKET and
    PR_SET_DEATHSIG), a CPU slot (gpu "") and a run on this machine (its rank 0 is the worker;
    Lightning starts the others)."""
    return sys.platform.startswith("linux") and gpu == "" and num_nodes == 1


class ForkedWorker:
    """A worker forked by the server, with the part of subprocess.Popen the runner uses: pid,
    returncode, poll(), wait(timeout)."""

    def __init__(self, server: ForkServer, pid: int):
        self._server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout_s=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout_s=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
        return self.returncode

    def __repr__(self) -> str:
        return f"ForkedWorker(pid={self.pid}, returncode={self.returncode})"


class ForkServer:
    """The runner's end: starts the server process and talks to it over a SOCK_SEQPACKET socket pair
    (one packet per message: a request with its descriptors, a child's pid, a child's exit)."""

    def __init__(self):
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import serve; serve({theirs.fileno()})"],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()),
            )
        self._exits: dict[int, int] = {}
        self.alive = True

    def fork(
        self, command: list[str], env: dict[str, str], output: int, lock: int | None
    ) -> ForkedWorker:
        """A child running `command` (`python -m MODULE ARGS`) with `output` as stdout/stderr,
        holding descriptor `lock`."""
        module, argv = _module_command(command)
        request = {"module": module, "argv": argv, "env": env, "cwd": os.getcwd()}
        fds = [output] if lock is None else [output, lock]
        try:
            socket.send_fds(self.socket, [json.dumps(request).encode()], fds)
        except OSError as err:
            self.alive = False
            raise OSError(f"the fork server is gone ({err})") from None
        deadline = time.monotonic() + START_TIMEOUT_S
        reply = {"exit": None}
        while "exit" in reply:  # other children's exits may come first
            reply = self._receive(max(0.0, deadline - time.monotonic()))
            if reply is None:
                if not self.alive:
                    raise OSError("the fork server ended before it forked the worker")
                # whatever it forks now dies with it (PR_SET_DEATHSIG): never two workers
                self.process.kill()
                self.alive = False
                raise OSError(
                    f"the fork server did not fork the worker within {START_TIMEOUT_S:.0f} s"
                )
        if "error" in reply:
            raise OSError(f"the fork server could not fork the worker: {reply['error']}")
        return ForkedWorker(self, reply["pid"])

    def exit_code(self, pid: int, timeout_s: float | None) -> int | None:
        """The child's exit status once the server has reported it; None if not within `timeout_s`.
        Should the server end first (it is not meant to while the runner lives), it gave its
        children SIGTERM: a child counts as killed by SIGTERM once it has exited (its own
        status.json says how it ended)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pid not in self._exits:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self.alive:
                if self._receive(left) is None and left == 0.0:
                    return None
            elif not _running(pid):
                self._exits[pid] = -signal.SIGTERM
            elif left == 0.0:
                return None
            else:
                time.sleep(0.05 if left is None else min(0.05, left))
        return self._exits[pid]

    def _receive(self, timeout_s: float | None) -> dict | None:
        """The next message (a child's exit is also recorded), waiting up to `timeout_s`; None when
        none came."""
        ready, _, _ = select.select([self.socket], [], [], timeout_s)
        if not ready:
            return None
        packet = self.socket.recv(_PACKET)
        if not packet:
            self.alive = False
            return None
        message = json.loads(packet)
        if "exit" in message:
            self._exits[message["pid"]] = message["exit"]
        return message


def _running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie has: nobody may reap an orphan in a
    container)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


_server: ForkServer | None = None


def _forget_server() -> None:
    """In a child forked from a process with a server (a runner started by fork): the server is the
    parent's; the child starts its own when it launches."""
    global _server
    if _server is not None:
        _server.socket.close()
        _server = None


os.register_at_fork(after_in_child=_forget_server)


def start_forked(
    command: list[str], env: dict[str, str], output: int, lock: int | None
) -> ForkedWorker:
    """Fork `command`, a `python -m MODULE ARGS` line (what a new interpreter would run), from this
    process's fork server, started (again) when there is none."""
    global _server
    if _server is None or not _server.alive:
        _server = ForkServer()
    return _server.fork(command, env, output, lock)


def _module_command(command: list[str]) -> tuple[str, list[str]]:
    """(MODULE, ARGS) of `python -m MODULE ARGS`: the only form of command the server runs."""
    if len(command) < 3 or command[1] != "-m":
        raise ValueError(f"the fork server runs `python -m MODULE ARGS` commands, not {command}")
    return command[2], list(command[3:])


def _main_module(name: str) -> types.ModuleType:
    """`__main__` as `python -m NAME` makes it, its code not run yet (a package's NAME.__main__):
    Lightning starts the other processes of a multi-process run as `python -m
    <__main__.__spec__.name> <sys.argv[1:]>`."""
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(f"{name}.__main__")
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    module = importlib.util.module_from_spec(spec)
    module.__name__ = "__main__"
    return module


# --- the server process
# --------------------------------------------------------------------------------------
def serve(fd: int) -> None:
    """The server's loop: import PRELOAD, then fork a child per request and report each child's
    exit, until the runner's end of the socket closes (then the children get SIGTERM from
    PR_SET_DEATHSIG)."""
    # Ctrl-C is the runner's to handle; it stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = socket.socket(fileno=fd)
    for module in PRELOAD:
        __import__(module)
    children: set[int] = set()
    try:
        while True:
            ready, _, _ = select.select([channel], [], [], 0.05)
            for pid in list(children):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    channel.send(
                        json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}).encode()
                    )
            if not ready:
                continue
            packet, fds, _, _ = socket.recv_fds(channel, _PACKET, 2)
            if not packet:
                return
            try:
                pid = os.fork()
            except OSError as err:
                channel.send(json.dumps({"error": str(err)}).encode())
                pid = None
            if pid == 0:
                _child(json.loads(packet), fds, channel)
            for received in fds:
                os.close(received)
            if pid is not None:
                children.add(pid)
                channel.send(json.dumps({"pid": pid}).encode())
    except (BrokenPipeError, ConnectionResetError):
        return  # the runner is gone


def _child(request: dict, fds: list[int], channel: socket.socket) -> None:
    """In the forked child: become the worker process, run the command (its module's code as
    `__main__`), exit as the interpreter would."""
    code = 1
    try:
        channel.close()
        os.setsid()
        die_with_parent(os.getppid())()  # SIGTERM when the server ends
        signal.signal(signal.SIGINT, signal.default_int_handler)
        output = fds[0]
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        first = (request["cwd"], *request["env"].get("PYTHONPATH", "").split(os.pathsep))
        sys.path[:0] = [path for path in dict.fromkeys(first) if path and path not in sys.path]
        main = sys.modules["__main__"] = _main_module(request["module"])
        sys.argv = [main.__file__, *request["argv"]]
        # as runpy runs `python -m`: the module's code in `__main__`'s namespace
        exec(main.__spec__.loader.get_code(main.__spec__.name), vars(main))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # any error: printed as the interpreter would, then the exit status 1
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
