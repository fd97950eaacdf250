"""What tests/test_docker_image.py needs to build and run docker/Dockerfile on a machine like the project's own:
a Docker engine (started here when none answers), the base image the Dockerfile names (made from Debian's
packages when no registry can give it), and the pinned CPU torch wheel served to the build from a local index.

Everything this machine needs (its CA bundle, the local index, host networking for the build) lives here and in
the stand-in base image, never in docker/Dockerfile: a user builds that file unchanged. Run it alone to prepare
the engine, the base and the wheel without the tests:

    python tests/docker_support.py
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
TORCH_PIN = "torch==2.13.0"  # README.md's "Set up" pin, which the Dockerfile installs
# The stand-in base: Debian's own Python (3.11 in bookworm, the version the real python:3.11-slim-bookworm has)
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("WORKBENCH_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
BASE_LABEL = "org.workbench.ci-base"  # set on a stand-in base, so `docker image inspect` tells it from the real one
CA_IN_BASE = "/etc/ssl/certs/workbench-ci-host-ca.pem"
CACHE = Path(os.environ.get("WORKBENCH_DOCKER_CACHE", str(Path.home() / ".cache" / "workbench-docker")))


class Unavailable(RuntimeError):
    """No Docker engine can be had on this machine; the message says why (the tests skip with it)."""


class CommandFailed(RuntimeError):
    """A docker (or apt, debootstrap, pip) command failed; the message holds the command and its output's tail."""


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def sh(cmd: Sequence[str], *, timeout: float, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run cmd, capture its output; on a non-zero exit (with check) raise CommandFailed showing what it printed."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise CommandFailed(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{tail(proc.stdout)}\n{tail(proc.stderr)}")
    return proc


def docker(*args: str, timeout: float = 60, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    return sh(["docker", *args], timeout=timeout, check=check, **kwargs)


# --- the engine ------------------------------------------------------------------------------------------------

def engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@functools.cache
def _apt_updated() -> None:
    sh(["apt-get", "update", "-q"], timeout=600)


def apt_install(*packages: str) -> None:
    """Install Debian packages (this needs root and apt-get; Unavailable says which is missing)."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"{', '.join(packages)} missing and cannot be installed here (needs root and apt-get)")
    _apt_updated()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        sh(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], timeout=900, env=env)
    except CommandFailed as e:
        raise Unavailable(f"apt-get could not install {', '.join(packages)}: {e}") from e


@dataclass
class Engine:
    """The Docker engine the tests use; `process` is set only when these tests started dockerd (and stop it)."""

    process: subprocess.Popen | None = None
    log: Path | None = None
    server_version: str = ""
    started_in_s: float = 0.0

    def stop(self) -> None:
        """Stop the dockerd these tests started (its images stay on disk for the next run); leave any other."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


def start_engine(timeout: float = 120) -> Engine:
    """An engine that answers: the one running, or dockerd started here (installing Debian's docker.io first
    where dockerd is missing). Raises Unavailable with the reason where none can be had."""
    t0 = time.monotonic()
    if engine_answers():
        return Engine(server_version=_server_version())
    if os.geteuid() != 0:
        raise Unavailable("no Docker engine answers, and starting dockerd needs root")
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        apt_install("docker.io")  # Debian's engine and CLI (a newer CLI already in /usr/local/bin stays first)
    log = Path(tempfile.gettempdir()) / "workbench-dockerd.log"
    # These machines give containers no iptables NAT and no bridge: the build and the containers use the host's
    # network or none, so dockerd must not try to set either up. overlay2 is the storage driver that works here.
    cmd = ["dockerd", "--iptables=false", "--bridge=none", "--storage-driver=overlay2"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    engine = Engine(process=proc, log=log)
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise Unavailable(f"dockerd exited {proc.returncode} at start:\n{tail(log.read_text(errors='replace'))}")
        if engine_answers():
            engine.server_version = _server_version()
            engine.started_in_s = time.monotonic() - t0
            return engine
        time.sleep(1)
    engine.stop()
    raise Unavailable(f"dockerd did not answer within {timeout:.0f} s:\n{tail(log.read_text(errors='replace'))}")


def _server_version() -> str:
    return docker("info", "--format", "{{.ServerVersion}}").stdout.strip()


# --- images ----------------------------------------------------------------------------------------------------

def base_image(dockerfile: Path = DOCKERFILE) -> str:
    """The image the Dockerfile's (first) FROM names."""
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if words and words[0].upper() == "FROM":
            return next(w for w in words[1:] if not w.startswith("--"))
    raise ValueError(f"{dockerfile}: no FROM line")


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, check=False).returncode == 0


def host_ca_bundle() -> Path:
    """The CA bundle this machine's pip trusts (registries are reached through a TLS proxy with its own CA)."""
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise FileNotFoundError("no CA bundle: set PIP_CERT or SSL_CERT_FILE to the one pip should trust")


def ensure_base(tag: str, timeout: float = 1200) -> str:
    """Make `tag` exist: kept when it does (cached between runs), else made with debootstrap from Debian's
    packages and imported under that tag. Returns what happened, for the report."""
    if image_exists(tag):
        return "cached"
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    t0 = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="base-", dir=CACHE) as tmp:
        rootfs = Path(tmp) / "rootfs"
        sh(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", DEBIAN_SUITE, str(rootfs),
            DEBIAN_MIRROR], timeout=timeout)
        # The host's CA bundle, for pip inside the build only (the Dockerfile knows nothing of it).
        shutil.copyfile(host_ca_bundle(), rootfs / CA_IN_BASE.lstrip("/"))
        shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        changes = [f"ENV PIP_CERT={CA_IN_BASE}", "ENV LANG=C.UTF-8",
                   f"LABEL {BASE_LABEL}=debootstrap-{DEBIAN_SUITE}-minbase", 'CMD ["python3"]']
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(["docker", "import", *[a for c in changes for a in ("--change", c)], "-", tag],
                             stdin=tar.stdout, capture_output=True, text=True, timeout=timeout)
        tar.stdout.close()
        if tar.wait(timeout=60) != 0 or imp.returncode != 0:
            raise CommandFailed(f"docker import of the debootstrap base failed:\n{tail(imp.stderr)}")
    return f"made with debootstrap in {time.monotonic() - t0:.0f} s"


def python_version_in(tag: str) -> str:
    """"3.11" for the image's python3 (the torch wheel to serve must be built for it)."""
    code = "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"
    return docker("run", "--rm", "--network", "none", tag, "python3", "-c", code).stdout.strip()


def image_size_mb(tag: str) -> float:
    return int(docker("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip()) / 1e6


# --- the torch wheel, served from a one-file index -------------------------------------------------------------

def download_torch(python_version: str, dest: Path) -> Path:
    """`pip download` the pinned torch for the image's Python (pip takes this machine's CPU wheel where its
    find-links hold one, as the README's set-up does)."""
    dest.mkdir(parents=True, exist_ok=True)
    sh([sys.executable, "-m", "pip", "download", TORCH_PIN, "--no-deps", "--only-binary=:all:",
        "--python-version", python_version, "--platform", "manylinux_2_28_x86_64", "-d", str(dest)], timeout=1200)
    version = TORCH_PIN.split("==")[1]
    wheels = sorted(dest.glob(f"torch-{version}*-cp{python_version.replace('.', '')}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download left no {TORCH_PIN} wheel for Python {python_version} in {dest}")
    return wheels[-1]


def write_index(root: Path, wheel: Path) -> None:
    """A PEP 503 simple index under root/simple that lists only this wheel (pip asks it for torch only; for
    every other name it gets 404 and goes on to PyPI)."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    page = root / "simple" / "torch" / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(wheel, page.parent)
    page.write_text(f'<!DOCTYPE html><html><body><a href="{rel}#sha256={digest}">{wheel.name}</a></body></html>\n')


# The index's port. A fixed one, because the classic builder keys its layer cache on the build args' values: a new
# port each run would rebuild every layer after the ARG (torch included). A free port is the fallback.
INDEX_PORT = int(os.environ.get("WORKBENCH_DOCKER_INDEX_PORT", "47613"))


@contextlib.contextmanager
def serve(root: Path) -> Iterator[str]:
    """Serve root over HTTP on 127.0.0.1 (INDEX_PORT, or a free port when that is taken) while the block runs;
    yields the base URL. The build uses the host's network, so it reaches it; pip accepts plain HTTP from
    127.0.0.1."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
            pass

    handler = functools.partial(Quiet, directory=str(root))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
    except OSError:  # taken: the build still works, only without the layer cache
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def torch_index(python_version: str) -> Iterator[str]:
    """The URL of a local index holding the pinned torch wheel for python_version, for PIP_EXTRA_INDEX_URL."""
    root = CACHE / "index"
    wheel = download_torch(python_version, root / "files")
    write_index(root, wheel)
    with serve(root) as url:
        yield f"{url}/simple"


def build(tag: str, build_args: dict[str, str], dockerfile: Path = DOCKERFILE, timeout: float = 1800) -> float:
    """`docker build --network host` of dockerfile from the repository root; returns its seconds. The full log
    goes to CACHE/build.log; a failure raises with its tail."""
    cmd = ["docker", "build", "--network", "host", "-f", str(dockerfile), "-t", tag]
    for key, value in build_args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    CACHE.mkdir(parents=True, exist_ok=True)
    log = CACHE / "build.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run([*cmd, str(ROOT)], stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise CommandFailed(f"`{' '.join(cmd)}` exited {proc.returncode} (log {log}):\n{tail(log.read_text())}")
    seconds = time.monotonic() - t0
    # The image the tag named before is untagged now (1.8 GB each run): drop untagged images no tag builds on
    # (the cached layers under the new image stay).
    docker("image", "prune", "--force", timeout=600, check=False)
    return seconds


# --- a running container ---------------------------------------------------------------------------------------

@dataclass
class Container:
    name: str
    timings: dict[str, float] = field(default_factory=dict)

    def exec(self, *cmd: str, env: dict[str, str] | None = None, timeout: float = 120,
             check: bool = False) -> subprocess.CompletedProcess:
        flags = [a for k, v in (env or {}).items() for a in ("-e", f"{k}={v}")]
        return docker("exec", *flags, self.name, *cmd, timeout=timeout, check=check)

    def state(self) -> tuple[str, str]:
        """(the container's status, its health status)."""
        out = docker("inspect", "--format", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
                     self.name).stdout.split()
        return out[0], (out[1] if len(out) > 1 else "")

    def logs(self) -> str:
        proc = docker("logs", self.name, check=False)
        return proc.stdout + proc.stderr

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until the HEALTHCHECK says healthy; raises (with the log) when it says unhealthy, the container
        stops, or timeout passes."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            status, health = self.state()
            if health == "healthy":
                return time.monotonic() - t0
            if status != "running" or health == "unhealthy":
                raise AssertionError(f"container {status}, health {health!r}:\n{tail(self.logs())}")
            time.sleep(2)
        raise AssertionError(f"not healthy within {timeout:.0f} s (health {self.state()[1]!r}):\n{tail(self.logs())}")

    def remove(self) -> None:
        docker("rm", "--force", "--volumes", self.name, check=False)


def start_container(tag: str, name: str, env: dict[str, str], network: str = "none") -> Container:
    """Start the image's own command (JupyterLab) as a user would (`--init --shm-size=1g`). The network is
    `none` by default: the tests reach JupyterLab from inside with `docker exec`, so nothing is published on this
    shared machine (the engine here has no bridge to publish through anyway)."""
    docker("rm", "--force", name, check=False)  # a container left by a killed earlier run
    flags = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
    docker("run", "--detach", "--init", "--shm-size=1g", "--network", network, "--name", name, *flags, tag)
    return Container(name)


def main() -> int:
    engine = start_engine()
    started = f", dockerd started (log {engine.log})" if engine.process else ""
    print(f"engine: Docker {engine.server_version}{started}")
    tag = base_image()
    print(f"base {tag}: {ensure_base(tag)}")
    python = python_version_in(tag)
    wheel = download_torch(python, CACHE / "index" / "files")
    print(f"torch for Python {python}: {wheel}")
    if engine.process:
        print(f"dockerd left running (pid {engine.process.pid}); stop it with: kill {engine.process.pid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
