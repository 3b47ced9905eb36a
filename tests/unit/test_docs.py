"""README.md and docs/*.md cannot drift from the code.

Every relative link and #anchor resolves (GitHub's heading slugs), every `configs/NAME.py` named exists, every
`--config.KEY` (and every backticked `config.KEY` / `GROUP.KEY` of a config group) is a key of the config schema
(the base schema, or the named config's, which may add task subtrees), every flag given to `jaxgpt COMMAND`,
`train.py` or `sample.py` exists in that command's own absl parser (`jaxgpt harness`: lm-evaluation-harness's
parser, where it is installed), every Python block and `python -c` program compiles, every code fence closes and
every table row has its header's columns. A problem names the file and line. Nothing here compiles JAX programs.
The other way round, what exists is named (`undocumented`): every task in `TASKS`, every file in `configs/`, every
subpackage of `jaxgpt/` (read from the file system) and every command in `COMMANDS` has its row in its table, and
each task and command is shown in its guide; a row naming none of these fails too.
Names in capitals (`configs/NAME.py`, `--config.KEY=VALUE`, `jaxgpt COMMAND`) are placeholders.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import shutil
from pathlib import Path
from urllib.parse import unquote

import pytest
from absl import flags
from helpers import ROOT
from ml_collections import ConfigDict

from jaxgpt import commands
from jaxgpt.train.config import base_config
from jaxgpt.train.task import TASKS

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
CONFIG_FILE = re.compile(r"(?<![\w/])configs/([\w.-]+?)\.py\b")
CONFIG_FLAG = re.compile(r"--config\.([A-Za-z_][\w.]*\w)")
SPAN_KEY = re.compile(r"^(config\.)?([a-z_]\w*(?:\.[a-z_0-9]\w*)*)(?:\s*=.*|\.\*)?$", re.S)
FILE_SUFFIXES = ("json", "jsonl", "py", "md", "txt", "png", "jinja", "bin", "csv", "pkl", "tiktoken", "html")
INVOCATION = re.compile(r"(?:(?<![\w./-])jaxgpt|python -m jaxgpt)[ \t]+([A-Za-z_]+)|(?<![\w./-])(train|sample)\.py\b")
FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)(?![\w.-])")
COMMAND_END = re.compile(r"&&|;|\||\$\(|`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@dataclasses.dataclass
class Doc:
    """A Markdown file's lines, each marked with the code fence it is in (its language; None: prose)."""

    path: Path
    lines: list[str]
    fences: list[str | None]
    unclosed: int | None  # the line number of a fence that never closes

    @classmethod
    def read(cls, path: Path) -> Doc:
        lines = path.read_text(encoding="utf-8").splitlines()
        fences: list[str | None] = []
        opening, language, start = None, None, None
        for number, line in enumerate(lines, 1):
            match = FENCE.match(line)
            if opening is None and match:
                opening, language, start = match.group(1), match.group(2) or "text", number
                fences.append(None)
            elif opening is not None and match and match.group(1).startswith(opening) and not match.group(2):
                opening = None
                fences.append(None)
            else:
                fences.append(language if opening is not None else None)
        return cls(path, lines, fences, start if opening is not None else None)

    def prose(self) -> list[tuple[int, str]]:
        return [(n, line) for n, (line, lang) in enumerate(zip(self.lines, self.fences, strict=True), 1)
                if lang is None and not FENCE.match(line)]

    def paragraphs(self) -> list[tuple[int, str]]:
        """(first line number, text) of each run of prose lines, joined with newlines: spans and links may wrap."""
        found: list[tuple[int, str]] = []
        previous = None
        for n, line in self.prose():
            if not line.strip():
                continue
            if found and previous == n - 1:
                found[-1] = (found[-1][0], found[-1][1] + "\n" + line)
            else:
                found.append((n, line))
            previous = n
        return found

    def blocks(self) -> list[tuple[int, str, str]]:
        """(first line number, language, text) of every fenced block."""
        found: list[tuple[int, str, str]] = []
        for n, lang in enumerate(self.fences, 1):
            if lang is not None and (n == 1 or self.fences[n - 2] is None):
                found.append((n, lang, ""))
            if lang is not None:
                start, language, text = found[-1]
                found[-1] = (start, language, text + self.lines[n - 1] + "\n")
        return found

    def anchors(self) -> set[str]:
        seen: dict[str, int] = {}
        anchors = set()
        for _, line in self.prose():
            anchors.update(HTML_ANCHOR.findall(line))
            if match := HEADING.match(line):
                base = slug(match.group(1))
                anchors.add(f"{base}-{seen[base]}" if base in seen else base)
                seen[base] = seen.get(base, 0) + 1
        return anchors

    def shell_lines(self) -> list[tuple[int, str]]:
        """Commands to check: each code span of the prose, and each line of a shell block with its continuations
        (joined with newlines kept, so that a position still finds its line)."""
        found = [(n + text[:m.start()].count("\n"), m.group(2)) for n, text in self.paragraphs()
                 for m in CODE_SPAN.finditer(text)]
        for start, lang, text in self.blocks():
            if lang in ("bash", "sh", "shell", "console", "text"):
                pending: tuple[int, str] | None = None
                for offset, line in enumerate(text.splitlines()):
                    head = pending or (start + offset, "")
                    joined = head[1] + line
                    if line.endswith("\\"):
                        pending = (head[0], joined[:-1] + " \n")
                    elif joined.count('"') % 2:  # a quoted string goes on
                        pending = (head[0], joined + "\n")
                    else:
                        pending = None
                        found.append((head[0], joined))
        return found


class Schema:
    """The config keys a documented `--config.KEY` may name: the base schema's and each shipped config's."""

    def __init__(self, root: Path) -> None:
        self.base = base_config()
        self.configs = {p.stem: p for p in (root / "configs").glob("*.py")}
        self.loaded: dict[str, ConfigDict] = {}

    def config(self, name: str) -> ConfigDict:
        if name not in self.loaded:
            self.loaded[name] = commands.load_config_file(str(self.configs[name]), "configs/NAME.py")
        return self.loaded[name]

    def groups(self) -> set[str]:
        return {k for k, v in self.base.items() if isinstance(v, ConfigDict)}

    def has(self, key: str, named: list[str]) -> bool:
        schemas = [self.base, *(self.config(n) for n in (named or self.configs) if n in self.configs)]
        return any(_has(schema, key.split(".")) for schema in schemas)


def _has(node: object, parts: list[str]) -> bool:
    for part in parts:
        if not isinstance(node, ConfigDict) or part not in node:
            return False
        node = node[part]
    return True


class Parsers:
    """Each command's flags, from its own parser (for sub-commands, the sub-command's)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[str, str | None], set[str] | None] = {}

    def flags(self, command: str, sub: str | None) -> set[str] | None:
        """The flag names `jaxgpt COMMAND [SUB]` accepts; None when they cannot be known here."""
        if (command, sub) not in self.cache:
            self.cache[command, sub] = self._read(command, sub)
        return self.cache[command, sub]

    @staticmethod
    def _read(command: str, sub: str | None) -> set[str] | None:
        module = importlib.import_module(f"jaxgpt.commands.{command}")
        if not hasattr(module, "define"):  # `jaxgpt harness`: lm-evaluation-harness's own command line
            try:
                from lm_eval._cli import HarnessCLI
            except ImportError:
                return None
            run = HarnessCLI()._subparsers.choices["run"]  # `lm_eval run`'s parser (the harness has no public one)
            return {o.lstrip("-") for a in run._actions for o in a.option_strings}
        flags_ = flags.FlagValues()
        module.define(flags_, [f"jaxgpt {command}", *([sub] if sub else [])])
        names = set(flags_)
        return names | {"no" + n for n in names if flags_[n].boolean} | {"help", "helpfull"}


class Checker:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.schema = Schema(root)
        self.parsers = Parsers()
        self.docs: dict[Path, Doc] = {}

    def doc(self, path: Path) -> Doc:
        if path not in self.docs:
            self.docs[path] = Doc.read(path)
        return self.docs[path]

    def files(self) -> list[Path]:
        return [self.root / "README.md", *sorted((self.root / "docs").glob("*.md"))]

    def check(self) -> list[str]:
        problems = []
        for path in self.files():
            doc = self.doc(path)
            where = path.relative_to(self.root)
            for number, message in [*self.links(doc), *self.markdown(doc), *self.code(doc), *self.keys(doc),
                                    *self.commands(doc)]:
                problems.append(f"{where}:{number}: {message}")
        return problems

    def links(self, doc: Doc) -> list[tuple[int, str]]:
        problems = []
        for start, paragraph in doc.paragraphs():
            text = CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), paragraph)
            for match in [*LINK.finditer(text), *REFERENCE.finditer(text)]:
                number, target = start + text[:match.start()].count("\n"), match.group(1)
                if re.match(r"[a-z][a-z0-9+.-]*:|//", target):
                    continue  # a URL: not checked offline
                name, _, anchor = unquote(target).partition("#")
                path = (doc.path.parent / name).resolve() if name else doc.path
                if not path.exists():
                    problems.append((number, f"broken link {target!r}: {name} does not exist"))
                elif anchor and path.suffix == ".md" and anchor not in self.doc(path).anchors():
                    problems.append((number, f"broken link {target!r}: no heading #{anchor} in {path.name}"))
        return problems

    def markdown(self, doc: Doc) -> list[tuple[int, str]]:
        problems = [(doc.unclosed, "code fence never closed")] if doc.unclosed else []
        columns = None
        for number, line in doc.prose():
            cells = len(re.findall(r"(?<!\\)\|", line))  # GitHub splits cells at a pipe inside code spans too
            if not line.lstrip().startswith("|"):
                columns = None
            elif columns is None:
                columns = cells
            elif cells != columns:
                problems.append((number, f"table row has {cells - 1} columns, its header {columns - 1}"))
        return problems

    def code(self, doc: Doc) -> list[tuple[int, str]]:
        programs = [(start, text) for start, lang, text in doc.blocks() if lang in ("python", "py")]
        for number, line in doc.shell_lines():
            if (at := line.find("python -c ")) >= 0:
                try:
                    programs.append((number, shlex.split(line[at + len("python -c "):])[0]))
                except (ValueError, IndexError):
                    programs.append((number, "python -c: unparseable quoting ("))
        problems = []
        for start, text in programs:
            try:
                compile(text, str(doc.path), "exec")
            except SyntaxError as e:
                problems.append((start + (e.lineno or 1) - 1, f"Python does not compile: {e.msg}"))
        return problems

    def keys(self, doc: Doc) -> list[tuple[int, str]]:
        problems = []
        groups = self.schema.groups()
        for number, line in doc.shell_lines():
            named = CONFIG_FILE.findall(line)
            span = SPAN_KEY.match(line)  # a backticked `config.KEY`, or `GROUP.KEY` of a config group
            spans = [span.group(2)] if span and (span.group(1) or ("." in span.group(2) and
                                                                   span.group(2).split(".")[0] in groups)) else []
            for key in CONFIG_FLAG.findall(line) + spans:
                placeholder = key != key.lower() or key.rsplit(".", 1)[-1] in FILE_SUFFIXES
                if not placeholder and not self.schema.has(key, named):
                    problems.append((number + line[:line.find(key)].count("\n"),
                                     f"config key {key!r} is not in the schema of "
                                     f"{', '.join(f'configs/{n}.py' for n in named) or 'any config'}"))
        for number, line in [(n, line) for n, line in doc.prose()] + doc.shell_lines():
            for name in CONFIG_FILE.findall(line):
                if name == name.lower() and name not in self.schema.configs:
                    problems.append((number, f"configs/{name}.py does not exist"))
        return sorted(set(problems))

    def commands(self, doc: Doc) -> list[tuple[int, str]]:
        problems = []
        for number, line in doc.shell_lines():
            for match in INVOCATION.finditer(line):
                command = match.group(1) or match.group(2)
                if command != command.lower():
                    continue  # `jaxgpt COMMAND`: a placeholder
                rest = line[match.end():]
                rest = rest[:end.start()] if (end := COMMAND_END.search(rest)) else rest
                if command not in commands.COMMANDS:
                    problems.append((number, f"`jaxgpt {command}` is not a command (jaxgpt --help lists them)"))
                    continue
                sub = m.group(1) if (m := re.match(r"\s+([a-z]+)\b(?![.-])", rest)) else None
                known = self.parsers.flags(command, sub)
                for flag in FLAG.finditer(rest):
                    if known is not None and flag.group(1) not in known:
                        offset = line[:match.end() + flag.start()].count("\n")
                        problems.append((number + offset, f"--{flag.group(1)} is not a flag of "
                                                          f"`jaxgpt {command}{' ' + sub if sub else ''}`"))
        return problems


# What must be named, and where: (the file, the first header cell of its table, what a row's first cell names).
TABLES = {
    "task": ("docs/training.md", "task", re.compile(r"`([a-z0-9_]+)`")),
    "config": ("docs/training.md", "config", re.compile(r"`([\w.]+)`")),
    "subpackage": ("README.md", "folder", re.compile(r"`jaxgpt/(\w+)/`")),
    "command": ("README.md", "command", re.compile(r"`jaxgpt (\w+)\b")),
}


def table_names(doc: Doc, header: str, name: re.Pattern) -> dict[str, int]:
    """The names in the first cells of the table whose header's first cell is `header`, with their lines."""
    found, inside = {}, False
    for number, line in doc.prose():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|"):
            inside = False
        elif cells[0] == header:
            inside = True
        elif inside:
            found.update((n, number) for n in name.findall(cells[0]))
    return found


def existing(root: Path, tasks: dict, command_table: dict) -> dict[str, set[str]]:
    """What the code has: tasks, config files, subpackages (read from the file system) and commands."""
    return {"task": set(tasks), "config": {p.stem for p in (root / "configs").glob("*.py")},
            "subpackage": {p.parent.name for p in (root / "jaxgpt").glob("*/__init__.py")},
            "command": set(command_table)}


def undocumented(root: Path, tasks: dict = TASKS, command_table: dict = commands.COMMANDS) -> list[str]:
    """What exists but has no row in its table or is not shown in its guide, and rows that name nothing."""
    problems = []
    for kind, names in existing(root, tasks, command_table).items():
        where, header, pattern = TABLES[kind]
        rows = table_names(Doc.read(root / where), header, pattern)
        problems += [f"{where}: {kind} {n!r} has no row in the table headed {header!r}"
                     for n in sorted(names - set(rows))]
        problems += [f"{where}:{rows[n]}: the {header!r} table names {kind} {n!r}, which does not exist"
                     for n in sorted(set(rows) - names)]
    for name, (_, guide, _) in tasks.items():
        if not re.search(rf"task `{name}`|task = \"{name}\"", (root / guide).read_text()):
            problems.append(f"{guide}: never names task {name!r} (as task `{name}` or config.task = \"{name}\")")
    for name, (_, guide) in command_table.items():
        text = (root / guide).read_text()
        if f"jaxgpt {name}" not in text and f"{name}.py" not in text:
            problems.append(f"{guide}: never shows `jaxgpt {name}`")
    return problems


def test_what_exists_is_in_the_readme_and_guides() -> None:
    problems = undocumented(ROOT)
    assert not problems, "\n".join(problems)


def test_train_help_names_every_task_with_its_guide(capsys: pytest.CaptureFixture) -> None:
    from jaxgpt.commands import train

    assert train.main(["jaxgpt train", "--help"]) == 0
    out = capsys.readouterr().out
    for name, (what, guide, _) in TASKS.items():
        assert re.search(rf"^  {name} +{re.escape(what)} \({re.escape(guide)}\)$", out, re.M), (name, out)


def test_a_planted_task_config_package_and_command_fail_until_documented(tmp_path: Path) -> None:
    """A copy of the tree where each kind gains one thing the docs do not name, and the training guide one row
    whose config is gone: each is reported; once the rows and the guide are written, nothing is."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "README.md", tmp_path)
    for folder in ("configs", "jaxgpt"):
        (tmp_path / folder).mkdir()
        for path in (ROOT / folder).iterdir():
            (tmp_path / folder / path.name).symlink_to(path)
    (tmp_path / "configs" / "chat_kto.py").write_text("")
    (tmp_path / "configs" / "seq2seq_copy.py").unlink()
    (tmp_path / "jaxgpt" / "adapters").mkdir()
    (tmp_path / "jaxgpt" / "adapters" / "__init__.py").write_text("")
    tasks = {**TASKS, "kto": ("preference tuning", "docs/chat.md", "jaxgpt.tasks.kto.KTO")}
    command_table = {**commands.COMMANDS, "lint": ("check a config", "docs/training.md")}
    config_rows = table_names(Doc.read(ROOT / "docs" / "training.md"), "config", TABLES["config"][2])
    assert undocumented(tmp_path, tasks, command_table) == [
        "docs/training.md: task 'kto' has no row in the table headed 'task'",
        "docs/training.md: config 'chat_kto' has no row in the table headed 'config'",
        f"docs/training.md:{config_rows['seq2seq_copy']}: the 'config' table names config 'seq2seq_copy', "
        "which does not exist",
        "README.md: subpackage 'adapters' has no row in the table headed 'folder'",
        "README.md: command 'lint' has no row in the table headed 'command'",
        "docs/chat.md: never names task 'kto' (as task `kto` or config.task = \"kto\")",
        "docs/training.md: never shows `jaxgpt lint`"]
    (tmp_path / "configs" / "seq2seq_copy.py").symlink_to(ROOT / "configs" / "seq2seq_copy.py")
    for where, row in (("docs/training.md", "| `kto` | preference pairs | `chat_kto` | [chat](chat.md) |"),
                       ("docs/training.md", "| `chat_kto` | preference tuning (task `kto`; `jaxgpt lint`) |"),
                       ("README.md", "| `jaxgpt/adapters/` | low-rank adapters |"),
                       ("README.md", "| `jaxgpt lint` | check a config | [training](docs/training.md) |")):
        text = (tmp_path / where).read_text()
        header = {"`kto`": "| `rl` |", "`chat_kto`": "| `chat_rl` |", "`jaxgpt/adapters/`": "| `jaxgpt/ops/` |",
                  "`jaxgpt lint`": "| `jaxgpt aot "}[row.split(" | ")[0][2:]]
        at = text.index(header)
        (tmp_path / where).write_text(text[:at] + row + "\n" + text[at:])
    (tmp_path / "docs" / "chat.md").write_text((tmp_path / "docs" / "chat.md").read_text() + "\nAnd task `kto`.\n")
    assert undocumented(tmp_path, tasks, command_table) == []


def test_readme_and_guides_hold() -> None:
    problems = Checker(ROOT).check()
    assert not problems, "\n".join(problems)


def test_the_readme_is_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize(("heading", "anchor"), [
    ("5. Ahead of time: will it fit?", "5-ahead-of-time-will-it-fit"),
    ("GPT-2 1.5B on v5p:4x4x4, remat full, splash + loss", "gpt-2-15b-on-v5p4x4x4-remat-full-splash--loss"),
    ("GPT-2 124M on v5e:2x2, block_size 8192", "gpt-2-124m-on-v5e2x2-block_size-8192"),
    ("Word tokens and seed 004's recipe", "word-tokens-and-seed-004s-recipe"),
    ("`jaxgpt serve` and [the API](x.md)", "jaxgpt-serve-and-the-api"),
])
def test_anchors_follow_githubs_slugs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


PLANTED = """# Title

## Usage

See [the guide](docs/guide.md#usage), [missing](docs/nothing.md), [bad anchor](#no-such-heading) and
[usage](#usage); `configs/NAME.py` is a placeholder, configs/no_such_config.py is not.

```bash
python train.py --config configs/stdlib_char.py --config.optim.lr=1e-3 \\
    --config.optim.lrr=1e-3 --config.model.n_layer=2
jaxgpt serve --workdir runs/x --slots 4 --follow
jaxgpt hf export --workdir runs/x --out y --colour red
jaxgpt serv --workdir runs/x
```

```python
print("fine")
def broken(:
```

| a | b |
|---|---|
| 1 | 2 | 3 |
"""


def planted_tree(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "README.md").write_text(PLANTED)
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Usage\n\nBack to [the README](../README.md#title).\n")
    return tmp_path


def test_planted_mistakes_fail_naming_file_and_line(tmp_path: Path) -> None:
    problems = Checker(planted_tree(tmp_path)).check()
    expected = [
        "README.md:5: broken link 'docs/nothing.md'",
        "README.md:5: broken link '#no-such-heading': no heading #no-such-heading in README.md",
        "README.md:6: configs/no_such_config.py does not exist",
        "README.md:10: config key 'optim.lrr' is not in the schema of configs/stdlib_char.py",
        "README.md:12: --colour is not a flag of `jaxgpt hf export`",
        "README.md:13: `jaxgpt serv` is not a command",
        "README.md:18: Python does not compile",
        "README.md:23: table row has 3 columns, its header 2",
    ]
    for message in expected:
        assert any(p.startswith(message) for p in problems), (message, problems)
    assert len(problems) == len(expected), problems


def test_a_flag_removed_from_a_parser_fails_the_guide_that_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxgpt.commands import serve

    define = serve.define

    def without_follow(flags_: flags.FlagValues, argv: list[str]) -> None:
        define(flags_, argv)
        delattr(flags_, "follow")

    monkeypatch.setattr(serve, "define", without_follow)
    problems = Checker(ROOT).check()
    lines = (ROOT / "docs" / "serving.md").read_text().splitlines()
    named = [n for n, line in enumerate(lines, 1) if re.search(r"jaxgpt serve [^`]*--follow\b", line)]
    assert named and all(f"docs/serving.md:{n}: --follow is not a flag of `jaxgpt serve`" in problems
                         for n in named), problems


def test_an_unknown_config_key_fails_in_prose_and_commands(tmp_path: Path) -> None:
    root = planted_tree(tmp_path)
    (root / "README.md").write_text("# Title\n\nSet `optim.muon_lr` or `optim.muon_rate`, and `config.workdir`.\n\n"
                                    "```bash\npython train.py --config.chat.pakc=False\n```\n")
    assert Checker(root).check() == [
        "README.md:3: config key 'optim.muon_rate' is not in the schema of any config",
        "README.md:6: config key 'chat.pakc' is not in the schema of any config"]


def test_jaxgpt_help_lists_every_command_with_its_guide(capsys: pytest.CaptureFixture) -> None:
    assert commands.dispatch(["jaxgpt", "--help"]) == 0
    out = capsys.readouterr().out
    for name, (what, guide) in commands.COMMANDS.items():
        assert re.search(rf"^  {name} +{re.escape(guide)} +{re.escape(what)}$", out, re.M), (name, out)
