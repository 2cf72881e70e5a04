"""The launcher supervises its children like a Kubernetes Deployment (launcher/mesh.py).

Unit level: the backoff policy and the supervisor's decisions, with fake children and a
fake clock. Process level: `python -m launcher up` as a real subprocess with a
small mesh (Redis + two scheduler replicas, which start in about a second): a child killed
with SIGKILL comes back (new pid, gRPC health SERVING) while the others keep their pids;
SIGTERM / Ctrl-C stop everything with exit code 0 and no traceback. The full-mesh variant
(tokenizer, decoder, gateway) is marked slow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from launcher.mesh import (
    BackoffPolicy,
    Mesh,
    MeshConfig,
    ServiceChild,
    ServiceSpec,
    StartProgress,
    Supervisor,
    describe_exit,
    free_ports_config,
)
from services import ports
from services.config import ServerConfig
from services.ports import free_port
from services.rpc import check_health
from services.server import GrpcServer
from tests.fake_clock import FakeClock

ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- unit level


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = BackoffPolicy(initial_s=0.5, max_s=10.0, reset_after_s=30.0)
    assert [policy.delay(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert policy.delay(10_000) == 10.0  # no overflow in a very long crash loop


def test_backoff_resets_after_a_stable_run() -> None:
    policy = BackoffPolicy(initial_s=0.5, max_s=10.0, reset_after_s=30.0)
    assert policy.failures_after(0, uptime_s=0.1) == 1
    assert policy.failures_after(4, uptime_s=29.9) == 5  # crash loop: keep backing off
    assert policy.failures_after(4, uptime_s=30.0) == 1  # it ran stably: start over
    assert policy.delay(policy.failures_after(6, uptime_s=45.0)) == 0.5


@pytest.mark.parametrize(
    "kwargs", [{"initial_s": 0}, {"initial_s": 5, "max_s": 1}, {"reset_after_s": 0}, {"factor": 0.5}]
)
def test_backoff_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BackoffPolicy(**kwargs)


def test_exit_descriptions_name_the_code_or_the_signal() -> None:
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV"


class FakeChild:
    """A child whose exit, restart and health the test decides."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status: int | None = None
        self.pid = 100
        self.fail_restart = False
        self.serving = True
        self.started = 1000.0

    def started_at(self) -> float:
        return self.started

    def exit_status(self) -> int | None:
        return self.status

    def restart(self) -> int:
        if self.fail_restart:
            raise RuntimeError("port in use")
        self.status = None
        self.pid += 1
        return self.pid

    def healthy(self) -> bool:
        return self.serving


def _supervisor(*names: str, stop: Callable[[], bool] = lambda: False) -> tuple[Supervisor, FakeClock]:
    clock = FakeClock()
    children = [FakeChild(name) for name in names]
    policy = BackoffPolicy(initial_s=0.5, max_s=10.0, reset_after_s=30.0)
    return Supervisor(children, policy, should_stop=stop, clock=clock), clock


def _child(supervisor: Supervisor, name: str) -> FakeChild:
    child = next(c for c in supervisor.children if c.name == name)
    assert isinstance(child, FakeChild)
    return child


def test_exited_child_is_restarted_after_its_backoff_and_others_are_left_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    supervisor, clock = _supervisor("tokenizer", "scheduler")
    tokenizer, scheduler = _child(supervisor, "tokenizer"), _child(supervisor, "scheduler")
    clock.now += 5
    tokenizer.status = -signal.SIGKILL
    with caplog.at_level(logging.INFO, logger="meshserve.launcher"):
        supervisor.poll()
        assert tokenizer.pid == 100, "restarted before its backoff"
        clock.now += 0.49
        supervisor.poll()
        assert tokenizer.pid == 100
        clock.now += 0.01
        supervisor.poll()
    assert tokenizer.pid == 101 and tokenizer.status is None
    assert scheduler.pid == 100, "a healthy sibling must not be touched"
    assert supervisor.restarts == {"tokenizer": 1, "scheduler": 0}
    text = caplog.text
    assert "tokenizer exited (killed by SIGKILL) after 5.0 s; restarting it in 0.5 s" in text
    assert "restarted tokenizer (pid 101, restart #1)" in text
    assert "tokenizer is serving again" in text


def test_crash_loop_backs_off_and_a_stable_run_resets_it() -> None:
    supervisor, clock = _supervisor("decoder-0")
    child = _child(supervisor, "decoder-0")
    waits = []
    for _ in range(6):
        child.status = 1  # exits at once after every start
        supervisor.poll()
        restart_at = supervisor.tracks["decoder-0"].restart_at
        assert restart_at is not None
        waits.append(restart_at - clock.now)
        clock.now = restart_at
        supervisor.poll()
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    clock.now += 31  # ran stably, then crashed once more
    child.status = 1
    supervisor.poll()
    assert supervisor.tracks["decoder-0"].restart_at == clock.now + 0.5


def test_a_failed_restart_is_retried_with_more_backoff() -> None:
    supervisor, clock = _supervisor("redis")
    child = _child(supervisor, "redis")
    child.status = -signal.SIGTERM
    child.fail_restart = True
    supervisor.poll()
    clock.now += 0.5
    supervisor.poll()  # restart raises: counted as a second failure
    track = supervisor.tracks["redis"]
    assert track.failures == 2 and track.restart_at == clock.now + 1.0
    child.fail_restart = False
    clock.now += 1.0
    supervisor.poll()
    assert child.pid == 101 and track.restart_at is None


def test_no_restart_once_a_stop_is_requested() -> None:
    stopping = {"now": False}
    supervisor, clock = _supervisor("gateway", stop=lambda: stopping["now"])
    child = _child(supervisor, "gateway")
    child.status = 0
    supervisor.poll()
    stopping["now"] = True  # e.g. Ctrl-C: the children exit because the launcher stops them
    clock.now += 60
    supervisor.poll()
    assert child.pid == 100 and child.status == 0


# -------------------------------------------------------------------------- process level


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _serving(address: str) -> bool:
    return asyncio.run(check_health(address, timeout=1.0))


def _redis_pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.1)


def _free_ports(count: int) -> int:
    """A free port P such that P .. P+count-1 are free too (replicas take consecutive ports)."""
    while True:
        base = free_port()
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


class LauncherRun:
    """`python -m launcher up ARGS` as a subprocess; its output collected by a
    thread, the pids of the children it started read from its log lines."""

    def __init__(self, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "launcher", "up", *args]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def pids(self, name: str) -> list[int]:
        """Pids `name` had, oldest first: a service logs "started" on each start, Redis
        "started" once and "restarted" after that."""
        found = re.findall(rf"(?:launcher: started|restarted) {re.escape(name)} \(pid (\d+)", self.output)
        return list(dict.fromkeys(int(p) for p in found))

    def all_pids(self) -> set[int]:
        return {int(p) for p in re.findall(r"(?:launcher: started|restarted) \S+ \(pid (\d+)", self.output)}

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while (found := re.search(pattern, self.output)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} within {timeout:.0f} s; output:\n{self.output}")
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the reader thread catch up, then look one last time
                if (found := re.search(pattern, self.output)) is None:
                    raise AssertionError(f"launcher exited before {pattern!r}; output:\n{self.output}")
                break
            time.sleep(0.05)
        return found

    def wait_exit(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        time.sleep(0.2)  # the reader thread gets the last lines
        return code

    def cleanup(self) -> None:
        """Whatever a failed test left: the launcher, then each child it started."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.all_pids():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., LauncherRun]]:
    runs: list[LauncherRun] = []

    def _launch(*args: str) -> LauncherRun:
        common = ["--log-dir", str(tmp_path / "logs"), "--embedding-model-dir", "none"]
        runs.append(LauncherRun([*common, *args]))
        return runs[-1]

    yield _launch
    for run in runs:
        run.cleanup()


def _assert_clean_stop(run: LauncherRun, code: int) -> None:
    assert code == 0, run.output
    assert "Traceback" not in run.output, run.output
    assert "meshserve stopped" in run.output
    left = sorted(pid for pid in run.all_pids() if _alive(pid))
    assert not left, f"children still running after the launcher exited: {left}"


def test_killed_children_come_back_while_the_others_keep_serving(launch: Callable[..., LauncherRun]) -> None:
    port = _free_ports(2)
    run = launch(
        "--model-dir", "unused", "--only", "scheduler", "--num-schedulers", "2", "--scheduler-port", str(port)
    )
    run.wait_for(r"meshserve is up", 60)
    redis_port = int(run.wait_for(r"started redis \(pid \d+\) at redis://127\.0\.0\.1:(\d+)", 1).group(1))
    first = {name: run.pids(name)[0] for name in ("redis", "scheduler", "scheduler-1")}

    os.kill(first["scheduler-1"], signal.SIGKILL)
    run.wait_for(r"scheduler-1 exited \(killed by SIGKILL\) after [\d.]+ s; restarting it in 0\.5 s", 10)
    run.wait_for(r"restarted scheduler-1 \(pid \d+, restart #1\)", 10)
    _wait_until(lambda: _serving(f"127.0.0.1:{port + 1}"), 30, "the restarted scheduler-1 SERVING")
    [old, new] = run.pids("scheduler-1")
    assert new != old and _alive(new) and not _alive(old)
    assert run.pids("scheduler") == [first["scheduler"]] and _alive(first["scheduler"])
    assert _serving(f"127.0.0.1:{port}"), "the other replica must keep serving"

    os.kill(first["redis"], signal.SIGKILL)
    run.wait_for(r"redis exited \(killed by SIGKILL\)", 10)
    run.wait_for(r"restarted redis", 15)
    assert _redis_pong(redis_port), "redis must come back on the port the services know"
    [_, new_redis] = run.pids("redis")
    assert _alive(new_redis) and not _alive(first["redis"])
    assert run.pids("scheduler") == [first["scheduler"]] and len(run.pids("scheduler-1")) == 2

    run.proc.send_signal(signal.SIGTERM)
    _assert_clean_stop(run, run.wait_exit(60))
    assert "stopping meshserve (SIGTERM)" in run.output


def test_second_ctrl_c_while_stopping_is_ignored_and_stuck_children_get_sigkill(
    launch: Callable[..., LauncherRun],
) -> None:
    port = free_port()
    run = launch(
        "--model-dir", "unused", "--only", "scheduler", "--scheduler-port", str(port), "--stop-timeout-s", "2"
    )
    run.wait_for(r"meshserve is up", 60)
    [scheduler] = run.pids("scheduler")
    os.kill(scheduler, signal.SIGSTOP)  # a child that will not drain when told to
    started = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    run.wait_for(r"stopping meshserve \(SIGINT\)", 10)
    run.proc.send_signal(signal.SIGINT)  # impatient user: must not abandon the children
    run.wait_for(rf"scheduler \(pid {scheduler}\) still running after the stop timeout: SIGKILL", 15)
    code = run.wait_exit(30)
    assert time.monotonic() - started >= 2.0
    _assert_clean_stop(run, code)


def test_a_service_that_cannot_start_fails_the_launch_without_a_restart_loop(
    launch: Callable[..., LauncherRun],
) -> None:
    run = launch(
        "--model-dir",
        "unused",
        "--only",
        "scheduler",
        "--scheduler-port",
        str(free_port()),
        "--routing-policy",
        "bogus",
    )
    code = run.wait_exit(60)
    assert code == 1, run.output
    assert re.search(
        r"meshserve did not start: scheduler exited with code \d+ \(see .*scheduler\.log\)", run.output
    )
    assert "restarted" not in run.output and "Traceback" not in run.output
    assert not [pid for pid in run.all_pids() if _alive(pid)]


def test_a_failed_mesh_start_stops_what_it_started(tmp_path: Path) -> None:
    """Mesh.start used as a library (tests, benches): when one service exits at start, the
    others it started (Redis, the tokenizer) are stopped before the error reaches the caller."""
    config = free_ports_config(
        model_dir="unused", only="scheduler,tokenizer", routing_policy="bogus", log_dir=str(tmp_path)
    )
    mesh = Mesh(config)
    with pytest.raises(RuntimeError, match="scheduler exited"):
        mesh.start(timeout=60)
    assert mesh.procs and mesh.redis is not None
    assert not [name for name, proc in mesh.procs.items() if proc.poll() is None]
    assert not mesh.redis.is_running()


@pytest.mark.slow
def test_full_mesh_tokenizer_kill9_is_restarted_and_sigterm_stops_everything(
    launch: Callable[..., LauncherRun], model_dir: Path
) -> None:
    ports = {name: free_port() for name in ("gateway", "tokenizer", "scheduler", "decoder")}
    run = launch(
        "--model-dir", str(model_dir),
        "--gateway-port", str(ports["gateway"]),
        "--tokenizer-port", str(ports["tokenizer"]),
        "--scheduler-port", str(ports["scheduler"]),
        "--decoder-base-port", str(ports["decoder"]),
        "--kv-cache-memory-mb", "16",
    )  # fmt: skip
    run.wait_for(r"meshserve is up: http://127\.0\.0\.1:\d+/v1", 300)
    names = ("redis", "scheduler", "tokenizer", "decoder-0", "gateway")
    first = {name: run.pids(name)[0] for name in names}

    os.kill(first["tokenizer"], signal.SIGKILL)
    run.wait_for(r"tokenizer exited \(killed by SIGKILL\)", 10)
    run.wait_for(r"restarted tokenizer \(pid \d+", 10)
    _wait_until(lambda: _serving(f"127.0.0.1:{ports['tokenizer']}"), 120, "the restarted tokenizer SERVING")
    assert run.pids("tokenizer")[-1] != first["tokenizer"]
    for name in names:
        if name != "tokenizer":
            assert run.pids(name) == [first[name]] and _alive(first[name]), name
    assert _serving(f"127.0.0.1:{ports['scheduler']}") and _serving(f"127.0.0.1:{ports['decoder']}")

    run.proc.send_signal(signal.SIGTERM)
    _assert_clean_stop(run, run.wait_exit(120))


# ------------------------------------------------------------------ the launcher's own ports


def test_a_busy_port_fails_the_launch_at_once_naming_the_port_and_its_holder(
    launch: Callable[..., LauncherRun],
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        run = launch("--model-dir", "unused", "--only", "scheduler", "--scheduler-port", str(port))
        code = run.wait_exit(30)
    assert code == 1, run.output
    assert time.monotonic() - started < 30
    assert f"port {port} (scheduler) is in use by pid {os.getpid()}" in run.output
    assert not run.all_pids(), "nothing may start beside a busy port"


def test_a_health_answer_from_another_process_on_the_port_is_not_the_service_serving(
    tmp_path: Path,
) -> None:
    """A second mesh's launcher reached the first mesh's service on the same port and took it
    for its own: readiness counts only the process the mesh started."""

    async def serve_other() -> tuple[GrpcServer, int]:
        other = GrpcServer("other-mesh", ServerConfig(host="127.0.0.1", port=0))
        port = await other.start()
        await other.set_serving(True)
        return other, port

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    other, port = asyncio.run_coroutine_threadsafe(serve_other(), loop).result(10)
    mesh = Mesh(MeshConfig(model_dir="unused", log_dir=str(tmp_path)))
    mesh.specs["scheduler"] = ServiceSpec("scheduler", "scheduler_svc", port)
    mesh.procs["scheduler"] = subprocess.Popen(["sleep", "30"])  # started, but it cannot bind
    try:
        assert _serving(f"127.0.0.1:{port}"), "the other process answers SERVING on the port"
        assert not mesh.serving("scheduler")
        assert not ServiceChild(mesh, "scheduler").healthy(), (
            "no 'serving again' for a service that cannot bind"
        )
    finally:
        mesh.procs["scheduler"].kill()
        mesh.procs["scheduler"].wait()
        asyncio.run_coroutine_threadsafe(other.server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_ports_knows_who_listens() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.listen()
        assert ports.listens(os.getpid(), port)
        assert ports.listeners(port) == [os.getpid()]
        assert f"pid {os.getpid()} (" in (ports.busy("127.0.0.1", port) or "")
    assert not ports.listens(os.getpid(), port)
    assert ports.busy("127.0.0.1", port) is None


def test_every_launcher_option_has_a_help_string() -> None:
    for f in dataclasses.fields(MeshConfig):
        if f.name not in ("extra_env", "metrics_ports"):
            assert f.metadata.get("help"), f.name
    out = subprocess.run(
        [sys.executable, "-m", "launcher", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "the gateway's HTTP port (default: 8000)" in " ".join(out.split())


def test_a_start_says_what_it_waits_on_its_elapsed_and_expected_time_and_latest_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While a decoder compiles, the launcher is not silent: it names the decoder, how long
    it has been starting against how long its last start took, and what its log last said;
    once it is healthy its time is kept for the next start."""
    mesh = Mesh(MeshConfig(model_dir="unused", log_dir=str(tmp_path)))
    mesh.specs["decoder-0"] = ServiceSpec("decoder-0", "worker_svc", 1)
    mesh.started_at["decoder-0"] = time.monotonic() - 42
    (tmp_path / "ready_s.json").write_text(json.dumps({"decoder-0": 150.0}))
    (tmp_path / "decoder-0.log").write_text(
        "2026-11-29 00:11:54,106 INFO [worker:decoder] worker_svc.main: 2 torch threads, CPUs 0-1\n"
        "2026-11-29 00:11:55,001 INFO [worker:decoder] worker_svc.engine.async_engine: compiling the forward\n"
        "/torch/_inductor/x.py:12: UserWarning: not a line of the service's own logger\n"
    )
    progress = StartProgress(mesh, every_s=0.01)
    time.sleep(0.02)
    with caplog.at_level(logging.INFO, logger="meshserve.launcher"):
        progress.update(["decoder-0"])
    assert (
        "waiting on decoder-0: 42 s of ~150 s, as its last start took: compiling the forward" in caplog.text
    )
    progress.update([])
    progress.save()
    assert json.loads((tmp_path / "ready_s.json").read_text())["decoder-0"] == pytest.approx(42, abs=2)
