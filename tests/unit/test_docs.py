"""The docs stay true to the repository: every config key is documented, every relative
link resolves, every module, file and function the docs and docstrings name exists, and
nothing points outside the repository."""

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

import yaml

from tests.helpers import REPO

DOCS = [
    REPO / "README.md",
    REPO / "BENCHMARKS.md",
    REPO / "config/README.md",
    REPO / "bench/README.md",
    *sorted((REPO / "docs").rglob("*.md")),
]
LINK = re.compile(r"\]\(([^)\s]*)\)")


def heading_anchors(markdown: str) -> Iterator[str]:
    """The anchors a Markdown renderer gives `markdown`'s headings, GitHub's way: lower case,
    punctuation but hyphens and underscores dropped, spaces as hyphens, repeats numbered. Pure."""
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"^#{1,6} (.*)$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, 0) + 1
            yield slug if seen[slug] == 1 else f"{slug}-{seen[slug] - 1}"


def schema_keys(props: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, spec in props.items():
        key = prefix + name
        if spec.get("type") == "object" and "properties" in spec and key != "dataset.max_defect_fraction":
            keys += schema_keys(spec["properties"], key + ".")
        else:
            keys.append(key)
    return keys


def test_every_config_key_is_in_the_reference():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    reference = (REPO / "config/README.md").read_text()
    missing = [k for k in schema_keys(schema["properties"]) if f"| `{k}` |" not in reference]
    assert not missing, f"config/README.md lacks {missing}"


def test_relative_links_resolve_with_their_anchors():
    broken = []
    for doc in DOCS:
        for link in LINK.findall(doc.read_text()):
            target, _, anchor = link.partition("#")
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path = doc.parent / target if target else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(REPO)} -> {link}")
            elif anchor and path.suffix == ".md" and anchor not in set(heading_anchors(path.read_text())):
                broken.append(f"{doc.relative_to(REPO)} -> {link} (no such heading)")
    assert not broken, broken


def test_heading_anchors_are_the_renderers():
    text = "# eagleflow's trainer: 1.644 -> 1.683 (2026-12-02)\n```\n# not a heading\n```\n## Command\n### Command\n"
    assert list(heading_anchors(text)) == ["eagleflows-trainer-1644---1683-2026-12-02", "command", "command-1"]


def test_the_results_page_fits_on_one_screen_with_one_figure_a_cell():
    page = (REPO / "BENCHMARKS.md").read_text().splitlines()
    assert len(page) <= 40, f"BENCHMARKS.md is {len(page)} lines; move detail into docs/results/"
    rows = [line.split(" | ") for line in page if line.startswith("| ") and not line.startswith(("| what", "| ---"))]
    assert len(rows) >= 10
    for row in rows:
        figure = row[1].strip("* ")
        assert len(re.findall(r"\d+(?:[.,:]\d+)*", figure)) <= 2 and ";" not in figure, row
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row[2]) and "docs/results/" in row[4], row


def test_nothing_points_outside_the_repository():
    places = [
        *DOCS,
        *REPO.glob("workflow/envs/*"),
        *REPO.glob("bench/*.py"),
        *REPO.glob("config/*.yaml"),
        *REPO.rglob("workflow/eagleflow/**/*.py"),
    ]
    offenders = [
        str(p.relative_to(REPO)) for p in places if re.search(r"shared folder|\.\./shared|DESIGN\.md", p.read_text())
    ]
    assert not offenders, offenders


def test_the_reference_defaults_are_config_yaml():
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    rows = re.findall(r"^\| `([a-z_.]+)` \| `(.*?)` \|", (REPO / "config/README.md").read_text(), flags=re.M)
    assert len(rows) >= 80
    for key, documented in rows:
        value = config
        for part in key.split("."):
            value = value[part]
        assert json.loads(documented) == value, f"config/README.md says {key} defaults to {documented}"


# What test_named_code_exists reads: the docs that describe the repository as it is, and the
# package's docstrings. docs/results/ is left out: each page there is a dated record of what was
# measured then, with the names the code had then (its links are still checked above).
DESCRIBING = [
    REPO / "README.md",
    REPO / "config/README.md",
    REPO / "bench/README.md",
    *sorted((REPO / "docs").glob("*.md")),
]
PACKAGE = REPO / "workflow/eagleflow"
BASES = (REPO, PACKAGE, REPO / "workflow")
SOURCE_SUFFIXES = (".py", ".smk", ".md", ".yaml", ".yml", ".toml", ".sh", ".rst", ".txt")
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".safetensors", ".sqlite", ".png", ".html", ".log", ".lock", ".pt")
SPAN = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"[\w.*<>{}\[\]-]+(?:/[\w.*<>{}\[\]-]*)*")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
PACKAGE_NAMES = {"eagleflow"} | {
    p.stem for p in PACKAGE.iterdir() if p.stem != "__init__" and (p.suffix == ".py" or (p / "__init__.py").is_file())
}
# Outside backticks only the unmistakable: a dotted name that starts with the package's or one
# of its modules' names, and a path with a source file's suffix.
BARE = re.compile(
    rf"(?<![\w./@:<-])(?:(?:{'|'.join(sorted(PACKAGE_NAMES))})(?:\.[A-Za-z_]\w*)+"
    rf"|(?:[\w-]+/)*[\w-]+(?:{'|'.join(re.escape(s) for s in SOURCE_SUFFIXES)})\b)"
)
CONFIG = yaml.safe_load((REPO / "config/config.yaml").read_text())
# A run's folders (.gitignore's) and the file names the rules write (`report.md`).
RUN_FOLDERS = {line.strip("/") for line in (REPO / ".gitignore").read_text().split() if line.endswith("/")}
RULES = [REPO / "workflow/Snakefile", *sorted((REPO / "workflow/rules").glob("*.smk"))]
OUTPUTS = {Path(o).name for p in RULES for o in re.findall(r"(?:results|every_variant)\(f?\"([^\"]+)\"", p.read_text())}


def named(text: str, first_line: int, markdown: bool) -> Iterator[tuple[int, str]]:
    """(line, name) for every name `text` mentions: each span in backticks, and outside them
    (and outside Markdown's fenced blocks and link targets) what BARE matches. Pure."""
    fenced = False
    for number, line in enumerate(text.splitlines(), first_line):
        if markdown and line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for span in SPAN.findall(line):
            yield number, span.strip()
        prose = re.sub(r"\]\([^)]*\)", "]", SPAN.sub(" ", line))
        for bare in BARE.findall(prose):
            yield number, bare


def docstrings(path: Path) -> Iterator[tuple[int, str]]:
    """(first line, text) of a module's docstring and of each of its classes' and functions'."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                yield first.value.lineno, first.value.value


def config_key(name: str) -> bool:
    value = CONFIG
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def binds(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The statement of `body` (a module's or a class's) that binds `name`: a def, a class, an
    assignment or an import, also inside an if or a try."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound = [node.name]
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound = [a.asname or a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.If | ast.Try):
            nested = [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            nested += [s for h in getattr(node, "handlers", []) for s in h.body]
            bound = [name] if binds(nested, name) else []
        else:
            bound = []
        if name in bound:
            return node
    return None


def module_problem(name: str) -> str | None:
    """Why dotted `name` (`eagleflow.x.y`, or `x.y` in the package) is neither a module of the
    package nor a name one binds, or None. Modules are parsed, not imported."""
    parts = name.removeprefix("eagleflow.").split(".")
    folder = PACKAGE
    while parts and (folder / parts[0] / "__init__.py").is_file():
        folder = folder / parts.pop(0)
    module = (
        folder / f"{parts.pop(0)}.py" if parts and (folder / f"{parts[0]}.py").is_file() else folder / "__init__.py"
    )
    if not parts:
        return None
    where = module.relative_to(PACKAGE)
    found = binds(ast.parse(module.read_text()).body, parts[0])
    if found is None and where.stem == "__init__":
        return f"no module {parts[0]} beside {where}, nor a name it binds"
    if found is None:
        return f"{where} binds no {parts[0]}"
    if len(parts) > 1 and isinstance(found, ast.ClassDef) and binds(found.body, parts[1]) is None:
        return f"{where}: class {parts[0]} binds no {parts[1]}"
    return None


def path_problem(path: str, folder: Path) -> str | None:
    """Why `path`, named in a file in `folder`, does not resolve, or None: it resolves, or it is
    not the repository's (another project's path, a run's output)."""
    bases = (*BASES, folder)
    head, slash, _ = path.partition("/")
    if slash and (head in RUN_FOLDERS or not any((b / head).is_dir() for b in bases)):
        return None
    if Path(path).suffix and not path.endswith(SOURCE_SUFFIXES) or not slash and path in OUTPUTS:
        return None
    pattern = re.sub(r"<[^>]*>|\{[^}]*\}|N{4,}", "*", path).rstrip("/")
    if any(list(b.glob(pattern)) if "*" in pattern else (b / pattern).exists() for b in bases):
        return None
    mine = "" if folder == REPO else f" or {folder.relative_to(REPO)}/"
    return f"no such file from the root, workflow/eagleflow/, workflow/{mine}"


def name_problem(name: str, folder: Path) -> str | None:
    """Why `name`, named in a file in `folder`, resolves to nothing, or None (it resolves, or
    it is no name of the repository's)."""
    name = re.sub(r"(\(\)|:\d+)$", "", name)  # a call, `file.py:123`
    if not NAME.fullmatch(name) or name.startswith(("/", "-", "~", ".", "*")) or Path(name).suffix in DATA_SUFFIXES:
        return None
    if "/" in name or name.endswith(SOURCE_SUFFIXES):
        return path_problem(name, folder)
    if DOTTED.fullmatch(name) and name.split(".")[0] in PACKAGE_NAMES and not config_key(name):
        return module_problem(name)
    return None


def test_named_code_exists():
    """Every module, file and function that README.md, config/README.md, bench/README.md,
    docs/*.md and the package's docstrings (module, class, function) name exists. A name is
    what the text puts in backticks, and outside them a dotted name that starts with
    `eagleflow` or one of the package's modules (`train.loop`) or a path ending in a source
    suffix (`train/served.py`); a span with a space (a command, an expression) is no name.
    - A path resolves from the repository's root, workflow/eagleflow/ (`train/served.py`),
      workflow/ (`rules/train.smk`) or the folder of the file that names it (a sibling
      module, bench/'s scripts); `<...>`, `{...}` and `NNNN` are wildcards, a line
      (`loop.py:120`) is dropped. A path is the repository's when it starts with a folder of
      one of those (not one .gitignore names: `results/`, `logs/`), or is a file name with a
      source suffix (.py, .md, .yaml, ...): `vllm/platforms/cpu.py` is vLLM's, `drafts/<id>/`
      a run's. A run's files are not checked: a data suffix (.json, .parquet, ...), or a name
      the rules pass to results() (`report.md`).
    - A dotted name is a module of the package, from `eagleflow.` or from one of its modules
      (`train.loop`, `runtime.shared_server`), then maybe a name the module binds and a name
      that class binds (`train.served.ServedStates`), found by parsing, not importing. A key
      of config/config.yaml (`train.method`, `hidden_states.served`) is a config key, not a
      module; a name that starts with anything else (`vllm.`, `torch.`) is another project's.
    """
    texts = [(doc, 1, doc.read_text(), True) for doc in DESCRIBING]
    texts += [(p, line, text, False) for p in sorted(PACKAGE.rglob("*.py")) for line, text in docstrings(p)]
    unresolved = [
        f"{path.relative_to(REPO)}:{line}: `{name}`: {problem}"
        for path, first_line, text, markdown in texts
        for line, name in named(text, first_line, markdown)
        if (problem := name_problem(name, path.parent))
    ]
    assert not unresolved, "names that resolve to nothing:\n" + "\n".join(unresolved)


def test_names_are_found_in_backticks_and_in_prose():
    text = "`train.loop` and `a b` at train/served.py:3\n```\n`x.y`\n```\n[link](train/x.py) eagleflow.plan.\n"
    assert list(named(text, 10, markdown=True)) == [
        (10, "train.loop"),
        (10, "a b"),
        (10, "train/served.py"),
        (14, "eagleflow.plan"),
    ]


def test_names_resolve_as_modules_paths_or_config_keys():
    assert name_problem("train.served.ServedStates", REPO) is None
    assert name_problem("train.method", REPO) is None  # a config key
    assert name_problem("vllm.entrypoints.openai", REPO) is None  # another project's
    assert name_problem("results/<run>/report.md", REPO) is None
    assert name_problem("report.md", REPO) is None  # a run's output
    assert name_problem("train/served.py:12", REPO) is None
    assert (
        name_problem("benchmark.replay", REPO) == "no module replay beside benchmark/__init__.py, nor a name it binds"
    )
    assert name_problem("train.loop.to_device", REPO) == "train/loop.py binds no to_device"
    assert name_problem("common/vllm_cpu.py", REPO / "docs").startswith("no such file")
