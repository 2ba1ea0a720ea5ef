"""The claims of README.md, docs/*.md and ops/README.md that a program can check, checked against the code:

- every `--flag` of a `pagedq ...` (or `python -m <a module of this repository>`) command in the docs is an
  option of that command's real argparse parser, and every `--flag` mentioned anywhere is an option of some
  pagedq parser or one of the few other tools' flags listed in FOREIGN_FLAGS;
- the tables of flags list the flags of the commands they describe;
- every `PAGEDQ_*` variable mentioned is read by the code, and every flag of `pagedq worker` but `--log-json`
  reads its `PAGEDQ_<FLAG>` (ops/README.md says so);
- every `pagedq_*` metric name is one that a worker or a gateway exports;
- every Redis key in the docs is one that `producer_sdk/contract/keys.py` makes (the old layout only in the
  section about migrating from it);
- the ACL users the docs have `pagedq acl` write (docs/sdk.md's producer, ops/README.md's tenant producer and
  worker) work: a real producer runs as that user against a real worker, through everything the SDK does,
  including a reader that waits more than its 2 s slice for a first token, and Redis refuses none of its
  commands (tests/service/test_acl_roles.py runs every role).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import inspect
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from producer_sdk.contract import keys

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "ops" / "README.md"])
K8S = sorted((ROOT / "ops" / "k8s").glob("*.yaml"))
PROJECT_PACKAGES = ("worker", "producer_sdk", "gateway", "ops", "pagedq_kernels")

# Flags of other tools that the docs show. A flag here is never checked against pagedq's parsers, so keep it
# to flags that no pagedq command has a near namesake of.
FOREIGN_FLAGS = {
    "--build": "docker compose up --build",
    "--scale": "docker compose up --scale worker=N",
    "--tail": "docker compose logs --tail 200",
    "--build-arg": "docker build --build-arg BASE_IMAGE=...",
    "--gpus": "docker run --gpus",
    "--init": "docker run --init",
    "--name": "docker run --name",
    "--rm": "docker run --rm",
    "--stop-timeout": "docker run --stop-timeout",
    "--runtime": "nvidia-ctk runtime configure --runtime=docker",
    "--no-deps": "pip install --no-deps / pip wheel --no-deps",
    "--check": "ruff format --check",
    "--cluster": "redis-cli --cluster reshard",
    "--from-literal": "kubectl create secret generic --from-literal",
}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- reading Markdown ----------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```+|~~~+)")


@functools.cache
def parse_markdown(path: Path) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """(heading of the section, "code" or "prose", lines) of each fenced code block and prose paragraph."""
    out: list[tuple[str, str, tuple[str, ...]]] = []
    heading, fence, lines = "", None, []

    def flush(kind: str) -> None:
        if lines:
            out.append((heading, kind, tuple(lines)))
        lines.clear()

    for line in path.read_text().splitlines():
        m = FENCE.match(line)
        if fence is not None:
            if m and line.strip() == m.group(1) and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                flush("code")
                fence = None
            else:
                lines.append(line)
        elif m:
            flush("prose")
            fence = m.group(1)
        elif line.startswith("#"):
            flush("prose")
            heading = line.lstrip("#").strip()
        elif not line.strip():
            flush("prose")
        else:
            lines.append(line)
    flush("code" if fence is not None else "prose")
    return tuple(out)


def code_lines(code: tuple[str, ...]) -> list[str]:
    """Code block lines, with shell continuations (`\\` at the end) joined."""
    out, held = [], ""
    for line in code:
        if line.rstrip().endswith("\\"):
            held += line.rstrip()[:-1] + " "
            continue
        out.append(held + line)
        held = ""
    if held:
        out.append(held)
    return out


def inline_spans(prose: str) -> list[str]:
    """Inline code spans (one may wrap over a line break)."""
    return [m.group(2).replace("\n", " ") for m in re.finditer(r"(`+)(.+?)\1", prose, re.S)]


@functools.cache
def code_pieces(path: Path) -> tuple[tuple[str, str], ...]:
    """(heading, piece) of a doc's code: each code block line (continuations joined), each inline code span."""
    out = []
    for heading, kind, lines in parse_markdown(path):
        if kind == "code":
            out += [(heading, line) for line in code_lines(lines)]
        else:
            out += [(heading, span) for span in inline_spans("\n".join(lines))]
    return tuple(out)


# --- the parsers -----------------------------------------------------------------------------------


class Command:
    """A parser's long options, and its subcommands (None: its options come from `--help`)."""

    def __init__(self, flags: set[str], subcommands: dict[str, Command] | None = None, remainder: bool = False):
        self.flags, self.subcommands, self.remainder = flags, subcommands or {}, remainder


def from_parser(parser: argparse.ArgumentParser) -> Command:
    flags: set[str] = set()
    subs: dict[str, Command] = {}
    remainder = False
    for action in parser._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            subs.update({name: from_parser(p) for name, p in action.choices.items()})
        if action.nargs == argparse.REMAINDER:
            remainder = True
    return Command(flags, subs, remainder)


HELP_OPTION_LINE = re.compile(r"^\s{1,8}(-{1,2}\w[^\n]*?)(?:\s{2,}|$)")


@functools.cache
def module_command(module: str) -> Command:
    """The options `python -m MODULE --help` lists (for modules whose parser is built inside main())."""
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"python -m {module} --help failed:\n{out.stderr[-3000:]}"
    flags = set()
    for line in out.stdout.splitlines():
        m = HELP_OPTION_LINE.match(line)
        if m:
            flags.update(re.findall(r"(?<![\w-])--[\w-]+", m.group(1)))
    assert "--help" in flags, f"no options read from python -m {module} --help:\n{out.stdout}"
    return Command(flags)


@functools.cache
def bench_command() -> Command:
    from ops.bench.cli import DELEGATED, build_parser

    bench = from_parser(build_parser())
    for name, module in DELEGATED.items():  # `pagedq bench NAME ...` runs `python -m MODULE ...`
        bench.subcommands[name] = module_command(module)
    return bench


@functools.cache
def pagedq_command() -> Command:
    from worker.cli import build_parser

    pagedq = from_parser(build_parser())
    pagedq.subcommands["bench"] = bench_command()  # `pagedq bench ...` is ops/bench's own parser
    return pagedq


def command_for_module(module: str) -> Command | None:
    """The command `python -m MODULE` runs, when MODULE is this repository's (None: another tool's)."""
    if module.split(".")[0] not in PROJECT_PACKAGES:
        return None
    if module == "worker.cli":
        return pagedq_command()
    if module == "ops.bench":
        return bench_command()
    if module == "gateway":
        from gateway.server import build_parser

        return from_parser(build_parser())
    assert importlib.util.find_spec(module) is not None, f"the docs run `python -m {module}`, which does not exist"
    return module_command(module)


SEPARATORS = {"|", "||", "&&", ";", "&", ">", "2>&1"}


def tokens_of(piece: str) -> list[str]:
    try:
        return shlex.split(piece, posix=True)
    except ValueError:  # an unbalanced quote in a piece of prose
        return piece.split()


@functools.cache
def invocations(path: Path) -> tuple[tuple[str, Command, tuple[str, ...]], ...]:
    """(what, its command, its flags) of every `pagedq ...` and `python -m <project module> ...` in a doc's
    code, with the subcommands followed as far as the words name them."""
    found = []
    for _, piece in code_pieces(path):
        words = [w.strip("[](),") for w in tokens_of(piece)]
        for i, word in enumerate(words):
            if word == "pagedq" or word.endswith("/pagedq"):
                cmd, rest, what = pagedq_command(), words[i + 1 :], ["pagedq"]
            elif re.fullmatch(r"(.*/)?python3?", word) and words[i + 1 : i + 2] == ["-m"] and len(words) > i + 2:
                cmd, rest, what = command_for_module(words[i + 2]), words[i + 3 :], ["python -m", words[i + 2]]
                if cmd is None:
                    continue
            else:
                continue
            args = []
            for w in rest:
                if w in SEPARATORS or w.startswith("#") or w in ("pagedq", "python", "python3"):
                    break
                args.append(w)
            for w in args:  # the subcommands, up to the first option or other word
                if w.startswith("-") or w not in cmd.subcommands:
                    break
                cmd = cmd.subcommands[w]
                what.append(w)
            flags = tuple(w.split("=", 1)[0] for w in args if w.startswith("--") and len(w) > 2)
            found.append((" ".join(what), cmd, flags))
    return tuple(found)


@functools.cache
def all_flags() -> frozenset[str]:
    """Every long option of every pagedq command, ops/bench module and project module the docs run."""
    flags: set[str] = set()

    def add(cmd: Command) -> None:
        flags.update(cmd.flags)
        for sub in cmd.subcommands.values():
            add(sub)

    add(pagedq_command())
    for path in DOCS:
        for _, cmd, _ in invocations(path):
            add(cmd)
    return frozenset(flags)


def test_the_flags_of_every_pagedq_command_in_the_docs_are_its_parsers():
    wrong = []
    for path in DOCS:
        for what, cmd, flags in invocations(path):
            if cmd.remainder:  # `pagedq bench` without a benchmark name: checked as `pagedq bench NAME`
                continue
            wrong += [f"{rel(path)}: `{what}` has no {flag}" for flag in flags if flag not in cmd.flags]
    assert not wrong, "\n".join(wrong)
    assert any(what == "pagedq worker" for path in DOCS for what, _, _ in invocations(path))


FLAG = re.compile(r"(?<![\w#/-])--[a-z][a-z0-9-]*[a-z0-9](?![\w>-])")


def mentioned_flags(path: Path) -> Iterator[str]:
    for line in path.read_text().splitlines():
        if "-->" in line or "<--" in line:  # an arrow of an ASCII diagram, not a flag
            continue
        yield from FLAG.findall(line)


def test_every_flag_mentioned_is_a_pagedq_option_or_another_named_tools():
    known = all_flags()
    unknown = sorted(
        {f"{rel(p)}: {flag}" for p in [*DOCS, *K8S] for flag in mentioned_flags(p)}
        - {f"{rel(p)}: {flag}" for p in [*DOCS, *K8S] for flag in known | set(FOREIGN_FLAGS)}
    )
    assert not unknown, "flags no pagedq parser has (a typo? another tool's flag: add it to FOREIGN_FLAGS):\n" + (
        "\n".join(unknown)
    )
    shadowed = sorted(set(FOREIGN_FLAGS) & known)
    assert not shadowed, f"FOREIGN_FLAGS names flags that pagedq has too: {shadowed}"


def test_the_flag_detection_catches_a_misspelt_flag():
    """The two checks above, on made-up lines: a misspelt flag fails, another tool's flag passes."""
    pagedq = pagedq_command()
    assert "--max-num-seqs" in pagedq.subcommands["worker"].flags
    assert "--max-num-seq" not in all_flags() and "--max-num-seq" not in FOREIGN_FLAGS
    assert FLAG.findall("`pagedq worker --max-num-seq 4` and --scale; --block-size-default-16 (#--x)") == [
        "--max-num-seq",
        "--scale",
        "--block-size-default-16",
    ]
    assert tokens_of("pagedq tenant set T --weight W  # or --weigth") == [
        "pagedq", "tenant", "set", "T", "--weight", "W", "#", "or", "--weigth"
    ]  # fmt: skip


# Tables whose first column is `flag`: the commands whose flags they list.
FLAG_TABLES = {"README.md": ("pagedq worker", "pagedq up"), "docs/gateway.md": ("pagedq gateway",)}


def flag_table_rows(path: Path) -> Iterator[list[str]]:
    in_table = False
    for line in path.read_text().splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0].lower() == "flag":
            in_table = True
        elif in_table and not set(cells[0]) <= set("-: "):
            yield cells


def test_the_tables_of_flags_list_their_commands_flags():
    checked = 0
    for path in DOCS:
        rows = list(flag_table_rows(path))
        if not rows:
            continue
        assert rel(path) in FLAG_TABLES, f"{rel(path)} has a table of flags: name its commands in FLAG_TABLES"
        for what in FLAG_TABLES[rel(path)]:
            cmd = pagedq_command()
            for word in what.split()[1:]:
                cmd = cmd.subcommands[word]
            for row in rows:
                for flag in re.findall(r"`(--[\w-]+)", row[0]):
                    assert flag in cmd.flags, f"{rel(path)}: the table of `{what}`'s flags lists {flag}"
                    checked += 1
    assert checked > 40


# --- environment variables ---------------------------------------------------------------------------

CODE_SUFFIXES = {".py", ".yml", ".yaml", ".sh", ".toml", ".cfg"}
ENV = re.compile(r"\bPAGEDQ_[A-Z0-9_]*[A-Z0-9](?:_\*)?")


def code_files() -> Iterator[Path]:
    for path in ROOT.iterdir():
        if path.is_file() and (path.suffix in CODE_SUFFIXES or path.name in ("Makefile", "Dockerfile")):
            yield path
    for top in (*PROJECT_PACKAGES, "tests", "examples"):
        for path in (ROOT / top).rglob("*"):
            if (
                path.is_file()
                and (path.suffix in CODE_SUFFIXES or path.name in ("Makefile", "Dockerfile"))
                and path != Path(__file__).resolve()
                and "__pycache__" not in path.parts
            ):
                yield path


@functools.cache
def env_vars_read() -> frozenset[str]:
    """Every PAGEDQ_* name the code spells, and those it builds: `PAGEDQ_<FIELD>` of every option of
    EngineConfig and ServiceConfig (worker/options.py), `_env("name")` / `_flag("name")` where `_env` reads
    "PAGEDQ_" + the name in upper case (the CLI, the gateway's config)."""
    import dataclasses

    from worker.engine.config import EngineConfig
    from worker.options import ENV_PREFIX
    from worker.service.config import ServiceConfig

    names: set[str] = set()
    for path in code_files():
        text = path.read_text(errors="replace")
        names.update(re.findall(r"\bPAGEDQ_[A-Z0-9_]*[A-Z0-9]\b", text))
        if path.suffix == ".py" and re.search(r'"PAGEDQ_" \+ name\.upper\(\)', text):
            names.update("PAGEDQ_" + n.upper() for n in re.findall(r'\b_(?:env|flag)\(\s*"(\w+)"', text))
    for cls in (EngineConfig, ServiceConfig):
        names.update(ENV_PREFIX + f.name.upper() for f in dataclasses.fields(cls) if "help" in f.metadata)
    return frozenset(names)


def test_every_pagedq_variable_mentioned_is_read_by_the_code():
    known = env_vars_read()
    assert {"PAGEDQ_MAX_NUM_SEQS", "PAGEDQ_GATEWAY_PORT", "PAGEDQ_CPU_GEMM"} <= known
    missing = []
    for path in [*DOCS, *K8S]:
        for name in set(ENV.findall(path.read_text())):
            if name.endswith("_*"):  # a family: PAGEDQ_FAULT_*
                ok = any(k.startswith(name[:-1]) for k in known)
            else:
                ok = name in known
            if not ok:
                missing.append(f"{rel(path)}: {name}")
    assert not missing, "variables no code reads:\n" + "\n".join(sorted(missing))


def _worker_parser() -> argparse.ArgumentParser:
    from worker.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["worker"]


def test_every_worker_flag_but_log_json_reads_its_pagedq_variable(monkeypatch):
    """ops/README.md: "Every worker flag except `--log-json` also reads `PAGEDQ_<FLAG>`"."""
    assert "also reads `PAGEDQ_<FLAG>`" in (ROOT / "ops" / "README.md").read_text()
    plain = {a.dest: a.default for a in _worker_parser()._actions}
    without = []
    for action in _worker_parser()._actions:
        long = [s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-")]
        if not long or action.dest in ("help", "log_json"):
            continue
        env = "PAGEDQ_" + long[0][2:].replace("-", "_").upper()
        read = False
        for value in ("7", "false", "true", "x"):  # one of them differs from the default and converts
            monkeypatch.setenv(env, value)
            try:
                read = {a.dest: a.default for a in _worker_parser()._actions}[action.dest] != plain[action.dest]
            except (ValueError, TypeError):
                read = True  # it tried to convert the variable: it reads it
            monkeypatch.delenv(env)
            if read:
                break
        if not read:
            without.append(f"{long[0]} ({env})")
    assert not without, f"worker flags that read no PAGEDQ_ variable: {without}"


# --- metrics -------------------------------------------------------------------------------------------


@functools.cache
def exported_metrics() -> frozenset[str]:
    """Every name a worker's or a gateway's /metrics can show (with the suffixes Prometheus adds), and the
    families' own names."""
    from gateway.metrics import GatewayMetrics
    from worker.service.metrics import WorkerMetrics

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
    names: set[str] = set()
    for registry in (WorkerMetrics("default").registry, GatewayMetrics().registry):
        for family in registry.collect():
            names.add(family.name)
            names.update(family.name + s for s in suffixes.get(family.type, ()))
            names.update(sample.name for sample in family.samples)
    return frozenset(names)


# `pagedq_` names that are not metrics.
NOT_METRICS = {
    "pagedq_kernels": "the kernels' Python package",
    "pagedq_models": "the compose project's `models` volume (`-v pagedq_models:/models`)",
}


def test_every_metric_name_mentioned_is_exported():
    known = exported_metrics()
    assert "pagedq_generation_tokens_total" in known and "pagedq_gateway_open_streams" in known
    missing = []
    for path in DOCS:
        for name in set(re.findall(r"\bpagedq_[a-z0-9_]*[a-z0-9]\b", path.read_text())):
            if name not in known and name not in NOT_METRICS:
                missing.append(f"{rel(path)}: {name}")
    assert not missing, "metrics neither a worker nor a gateway exports:\n" + "\n".join(sorted(missing))
    assert importlib.util.find_spec("pagedq_kernels") is not None


# --- Redis keys ----------------------------------------------------------------------------------------

SAMPLES = {
    "model": ("default", "tenant-a", "llama1b"),
    "lane": keys.LANES,
    "worker": ("w1",),
    "client_id": ("c1",),
    "request_id": ("0123456789abcdef",),
    "tenant": ("default", "tenant-a", "team-a"),
    "batch_id": ("batch_0123abcd",),
    "file_id": ("file-0123abcd",),
}


def _calls(fn) -> Iterator[tuple]:
    params = list(inspect.signature(fn).parameters)
    missing = [p for p in params if p not in SAMPLES]
    assert not missing, f"keys.{fn.__name__} takes {missing}: add sample values to SAMPLES"
    combos: list[tuple] = [()]
    for p in params:
        combos = [(*c, v) for c in combos for v in SAMPLES[p]]
    yield from combos


@functools.cache
def made_keys() -> frozenset[str]:
    """Every key and channel keys.py makes, for the sample arguments (not the consumer group's name)."""
    made = set()
    for name, fn in inspect.getmembers(keys, inspect.isfunction):
        if fn.__module__ != keys.__name__ or name.startswith("_") or name in ("lane_for_priority", "group"):
            continue
        made.update(fn(*args) for args in _calls(fn))
    return frozenset(made)


@functools.cache
def other_names() -> frozenset[str]:
    """Names that are not keys of a model or a request but that the docs may spell out: the consumer
    group (a name inside the lane streams, pagedq:<model>:workers) and the arq bridge's default queue."""
    from producer_sdk.arq_bridge import DEFAULT_QUEUE

    return frozenset({DEFAULT_QUEUE, *(keys.group(m) for m in SAMPLES["model"])})


@functools.cache
def old_layout_keys() -> frozenset[str]:
    """The layout before hash tags, as `pagedq migrate` knows it."""
    from producer_sdk.contract import migrate

    old = set()
    for m in SAMPLES["model"]:
        old.update(f"{keys.PREFIX}:{m}:{suffix}" for suffix in migrate._OLD_MODEL_KEYS)
    for rid in SAMPLES["request_id"]:
        old.update(f"{keys.PREFIX}:{kind}:{rid}" for kind in migrate._OLD_REQUEST_KEYS)
    return frozenset(old)


KEY = re.compile(r"pagedq:(?:<[^<>\n]*>|\{[^{}\n]*\}|\[[^\]\n]*\]|[\w.*:@+=-])+")


@functools.cache
def fixed_words() -> frozenset[str]:
    """The words keys.py writes itself (`resp`, `dead`, `tenant`, ...), as opposed to names it is given."""
    given = {str(v) for values in SAMPLES.values() for v in values}
    words = set()
    for key in made_keys():
        words.update(w for w in re.split(r"[:{}]", key) if w and w not in given)
    return frozenset(words)


def key_pattern(text: str) -> re.Pattern:
    """A key as the docs write it, as a regex: `<placeholder>` is a name given to keys.py (`<kind>`: any
    word), `*` anything, `[:a|:b]` optional."""
    words = "|".join(map(re.escape, sorted(fixed_words())))
    name = rf"(?!(?:{words})(?:[:{{}}]|$))[^:{{}}]+"
    out = ""
    for part in re.split(r"(<[^<>]*>|\*|\[[^\]]*\])", text.rstrip(":.")):
        if part.startswith("<"):
            out += r"[^:{}]+" if part == "<kind>" else name
        elif part == "*":
            out += ".*"
        elif part.startswith("["):
            out += "(?:" + "|".join(re.escape(a) for a in part[1:-1].split("|")) + ")?"
        else:
            out += re.escape(part)
    return re.compile(out)


def doc_keys(path: Path) -> Iterator[tuple[str, str]]:
    """(section heading, key) of every key-like name in a doc's code."""
    for heading, piece in code_pieces(path):
        for key in KEY.findall(piece):
            yield heading, key


def test_the_redis_keys_in_the_docs_are_those_keys_py_makes():
    made, old = made_keys(), old_layout_keys()
    assert "pagedq:{default}:dead" in made and "pagedq:resp:{0123456789abcdef}" in made
    wrong, checked = [], 0
    for path in DOCS:
        for heading, key in doc_keys(path):
            pattern = key_pattern(key)
            # The section on upgrading from the layout before hash tags names that layout's keys.
            allowed = made | old if "before hash tags" in heading else made
            if "*" not in key:  # a pattern (an ACL's, a namespace) covers keys only
                allowed = allowed | other_names()
            checked += 1
            if not any(pattern.fullmatch(k) for k in allowed):
                wrong.append(f"{rel(path)} ({heading}): {key}")
    assert not wrong, "keys that keys.py does not make:\n" + "\n".join(sorted(set(wrong)))
    assert checked > 30
    assert not key_pattern("pagedq:default:dead").fullmatch("pagedq:{default}:dead")
    assert key_pattern("pagedq:{<model>}:requests[:high|:low]").fullmatch("pagedq:{x}:requests:low")
    assert not key_pattern("pagedq:<name>:*").fullmatch("pagedq:tenant:default:quota")


# --- the ACL users of the docs, against a real redis-server and a real worker ----------------------------


def acl_users(path: Path) -> dict[str, list[str]]:
    """user -> rules of every `ACL SETUSER` in the doc's code blocks (continuation lines joined)."""
    users: dict[str, list[str]] = {}
    for _, kind, lines in parse_markdown(path):
        if kind != "code":
            continue
        current: list[str] | None = None
        for line in lines:
            words = line.replace("\\", " ").split()
            if words[:2] == ["ACL", "SETUSER"]:
                current = users.setdefault(words[2], [])
                current += words[3:]
            elif current is not None and line.startswith((" ", "\t")) and words:
                current += words
            else:
                current = None
    return users


def test_the_docs_have_pagedq_acl_write_the_users():
    """No hand-written ACL user: the docs show the `pagedq acl` commands these tests run."""
    for path in (ROOT / "docs" / "sdk.md", ROOT / "ops" / "README.md", ROOT / "docs" / "tenants.md"):
        assert acl_users(path) == {}, path
    assert "pagedq acl --role producer" in (ROOT / "docs" / "sdk.md").read_text()
    ops = (ROOT / "ops" / "README.md").read_text()
    assert "pagedq acl --role producer --user producer=tenant-a --model-name tenant-a --tenant tenant-a" in ops
    assert "pagedq acl --role worker" in ops


def generated(role: str, password: str, **narrow) -> list[str]:
    """The rules `pagedq acl` writes for the role (after the user name)."""
    from producer_sdk.contract import acl

    return acl.rules(role, password, **narrow)


PASSWORD = "secret"


def create_user(admin, name: str, rules: list[str], redis_url: str) -> str:
    """Create the user with these rules (made with `PASSWORD`; after removing an older one), return its URL."""
    admin.execute_command("ACL", "DELUSER", name)
    admin.execute_command("ACL", "SETUSER", name, *rules)
    password = PASSWORD
    parts = urlsplit(redis_url)
    return f"redis://{name}:{password}@{parts.hostname}:{parts.port}/0"


def xrange_calls(admin) -> int:
    """XRANGE calls the server took or refused (INFO commandstats)."""
    stats = admin.info("commandstats").get("cmdstat_xrange", {})
    return int(stats.get("calls", 0)) + int(stats.get("rejected_calls", 0))


async def run_producer(url: str, model: str, tenant: str, admin, start_worker) -> None:
    """Everything a producer does, as the doc's user: submit (one request before any worker runs, read by
    two streams of one AsyncClient while it waits more than the 2 s slice), generate, stream, cancel,
    re-attach by id, submit_many and queue_stats, with AsyncClient and Client."""
    from producer_sdk import AsyncClient, Cancelled, Client

    async def drain(stream) -> tuple[list, float]:
        chunks, first = [], None
        async for chunk in stream:
            first = first or time.monotonic()
            chunks.append(chunk)
        return chunks, first

    async with AsyncClient(url, model, tenant=tenant) as client:
        early = [await client.submit(f"before any worker {i}", max_tokens=4, ignore_eos=True) for i in range(2)]
        t0 = time.monotonic()
        before = xrange_calls(admin)
        reading = [asyncio.create_task(drain(early[0].stream(timeout=120)))]
        await asyncio.sleep(0.2)
        # a second reader joins the blocked read: the client writes its wake stream
        reading.append(asyncio.create_task(drain(early[1].stream(timeout=120))))
        # No worker runs, so nothing can arrive: the readers' XREAD slice (2 s) ends idle, and they check that
        # their requests still exist (EXISTS, and XRANGE of the entry in its lane) before they read on.
        deadline = time.monotonic() + 30
        while xrange_calls(admin) == before and time.monotonic() < deadline and not any(t.done() for t in reading):
            await asyncio.sleep(0.05)
        assert xrange_calls(admin) > before, "the readers made no liveness check"
        assert time.monotonic() - t0 > 2.0
        await asyncio.to_thread(start_worker)
        for (chunks, first), handle in zip(await asyncio.gather(*reading), early, strict=True):
            assert first - t0 > 2.0 and sum(len(c.token_ids) for c in chunks) == 4
            assert handle.finish_reason == "length"

        done = await client.generate("whole", max_tokens=3, ignore_eos=True, timeout=60)
        assert done.finish_reason == "length" and len(done.token_ids) == 3
        assert len([c async for c in client.stream("streamed", max_tokens=3, ignore_eos=True, timeout=60)]) >= 1
        long = await client.submit("long", max_tokens=400, ignore_eos=True)
        async for _ in long.stream(timeout=60):
            await client.cancel(long.request_id)
            break
        with pytest.raises(Cancelled):
            await long.result(timeout=60)
        assert (await client.handle(done.request_id).result(timeout=60)).token_ids == done.token_ids
        many = await client.submit_many(["a", "b"], max_tokens=2, ignore_eos=True)
        assert [len((await h.result(timeout=60)).token_ids) for h in many] == [2, 2]
        # a minute-old heartbeat without a worker state (a worker gone): queue_stats drops it from the heartbeats
        admin.zadd(keys.heartbeats(model), {"gone-worker": int(time.time() * 1000) - 60_000})
        stats = await client.queue_stats()
        assert stats.model == model and [w.worker for w in stats.workers] == ["w1"]
        assert admin.zscore(keys.heartbeats(model), "gone-worker") is None

    with Client(url, model, tenant=tenant) as sync:
        assert len(sync.generate("sync", max_tokens=2, ignore_eos=True, timeout=60).token_ids) == 2
        assert list(sync.stream("sync stream", max_tokens=2, ignore_eos=True, timeout=60))
        long = sync.submit("long", max_tokens=400, ignore_eos=True)
        for _ in long.stream(timeout=60):
            long.cancel()
            break
        assert long.result(timeout=60, partial_ok=True).finish_reason == "abort"
        assert sync.queue_stats().model == model


# 10 ms a step at least (the tests' fault hook), so that a 400-token request is still running when it is cancelled
SLOW_STEPS = {"PAGEDQ_FAULT_STEP_DELAY_S": "0.01"}


def acl_refusals(admin) -> list:
    return [entry for entry in admin.execute_command("ACL", "LOG") if entry]


@pytest.fixture
def admin(redis_url):
    from producer_sdk.contract.connection import connect

    client = connect(redis_url, asyncio=False, socket_timeout=10, decode_responses=True)
    client.execute_command("ACL", "LOG", "RESET")
    client.script_flush()  # the producer's first submit then loads the enqueue step itself (SCRIPT LOAD)
    users_before = set(client.execute_command("ACL", "USERS"))
    yield client
    for user in set(client.execute_command("ACL", "USERS")) - users_before:
        client.execute_command("ACL", "DELUSER", user)
    client.close()


@pytest.mark.single_node  # ACL users on one server
@pytest.mark.slow
async def test_the_producer_acl_of_sdk_md_runs_everything_the_sdk_does(redis_url, admin, llama_dir):
    from producer_sdk import tenants
    from tests.service.worker_proc import WorkerProc

    url = create_user(admin, "agent", generated("producer", PASSWORD), redis_url)  # pagedq acl --role producer
    # a tenant with every kind of quota, so the enqueue step runs its quota part too
    tenants.set_quota(admin, "team-a", max_queued=100, requests_per_minute=1000, tokens_per_minute=100_000)
    worker = WorkerProc(llama_dir, redis_url, env=SLOW_STEPS)
    try:
        await run_producer(url, "default", "team-a", admin, worker.start)
    finally:
        worker.stop()
    assert not acl_refusals(admin), f"Redis refused commands of the producer's user: {acl_refusals(admin)}"


@pytest.mark.single_node
@pytest.mark.slow
async def test_the_tenant_and_worker_users_of_ops_readme_serve_a_tenant(redis_url, admin, llama_dir):
    from producer_sdk import tenants
    from tests.service.worker_proc import WorkerProc

    # `pagedq acl --role worker` and `pagedq acl --role producer --user producer=tenant-a --model-name tenant-a
    # --tenant tenant-a`: "this user's clients must submit as tenant `tenant-a`", to the model `tenant-a`
    model = tenant = "tenant-a"
    worker_url = create_user(admin, "pagedq-worker", generated("worker", PASSWORD), redis_url)
    tenant_url = create_user(admin, tenant, generated("producer", PASSWORD, models=[model], tenant=tenant), redis_url)
    tenants.set_quota(admin, tenant, max_queued=100, requests_per_minute=1000, tokens_per_minute=100_000)
    admin.zadd(keys.models(), {model: int(time.time() * 1000)})  # served before (the client checks the name)
    worker = WorkerProc(llama_dir, worker_url, model=model, env=SLOW_STEPS)
    try:
        await run_producer(tenant_url, model, tenant, admin, worker.start)
    finally:
        worker.stop()
    assert not acl_refusals(admin), f"Redis refused the tenant's or the worker's commands: {acl_refusals(admin)}"
    assert "NOPERM" not in worker.log()


@pytest.mark.single_node
def test_a_missing_command_is_what_the_acl_test_catches(redis_url, admin):
    """The ACL test's probe: XRANGE refused to a user without +xrange shows in ACL LOG and commandstats."""
    import redis

    from producer_sdk.contract.connection import connect

    rules = [r.replace(" +xrange", "") for r in generated("producer", PASSWORD)]
    url = create_user(admin, "agent", rules, redis_url)
    before = xrange_calls(admin)
    user = connect(url, asyncio=False, socket_timeout=10)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.xrange(keys.lane_stream("default"), "0", "+", count=1)
    user.close()
    assert xrange_calls(admin) > before and acl_refusals(admin)
