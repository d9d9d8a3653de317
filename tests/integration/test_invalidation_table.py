"""docs/invalidation.md's module -> rules table is exactly what the code fingerprints do."""

import re
import subprocess
import sys
import tempfile

import yaml

from eagleflow.common.fingerprint import ROOT, _module_file, module_digests
from eagleflow.dag.plan.loads import planned_loads
from tests.helpers import REPO

DOC = REPO / "docs/invalidation.md"
COLUMNS = ("module", "rules that run it", "also rebuilt downstream", "verifier loads", "requests", "tokens extracted")
HEADER = "| " + " | ".join((*COLUMNS, "training steps")) + " |"


def rule_scripts() -> dict[str, str]:
    """{rule: the entry script it runs}, read from workflow/rules/*.smk."""
    found = {}
    for smk in sorted((REPO / "workflow/rules").glob("*.smk")):
        for block in re.split(r"(?m)^(?=rule )", smk.read_text()):
            rule = re.match(r"rule (\w+):", block)
            script = re.search(r'script:\s*"\.\./eagleflow/entry/(\w+)\.py"', block)
            if rule and script:
                code = re.search(r'code=code\("(\w+)"\)', block)
                assert code and code.group(1) == script.group(1), (
                    f"rule {rule.group(1)}: code() must name its own script"
                )
                found[rule.group(1)] = script.group(1)
    return found


def downstream() -> dict[str, set[str]]:
    """{rule: itself and every rule downstream of it}, from Snakemake's own rule graph of the
    default config with the verifier writing prompts (write_prompts is in the DAG only then)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as written:
        written.write("prompts: {written: {count: 1}}\n")
        written.flush()
        dot = subprocess.run(
            [sys.executable, "-m", "snakemake", "--rulegraph", "--quiet", "all", "--configfile", written.name],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    names = dict(re.findall(r'^\s*(\d+)\[label = "(\w+)"', dot, re.M))
    edges = [(names[a], names[b]) for a, b in re.findall(r"^\s*(\d+) -> (\d+)", dot, re.M)]
    closure = {}
    for rule in names.values():
        todo, seen = [rule], set()
        while todo:
            r = todo.pop()
            if r not in seen:
                seen.add(r)
                todo.extend(b for a, b in edges if a == r)
        closure[rule] = seen - {"all"}
    return closure


def edit_cost(rerun: set[str], runs: set[str]) -> tuple[str, str, str, str]:
    """What an edit that changes the outputs of the rules in `runs` costs on the default config,
    when the rules in `rerun` run again: verifier loads (plan.loads.planned_loads), requests,
    tokens extracted again (the samples an upstream edit changed: the store holds the rest;
    every sample when the extraction's own code changes, which keys every sample), training
    steps run again."""
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    jobs = {rule: config["hidden_states"]["num_parts"] if rule == "hidden_states" else 1 for rule in rerun}
    loads = sum(planned_loads(jobs, config).values())
    requests = "changed ones" if "generate" in runs else "0"
    extracted = "all" if "hidden_states" in runs else "changed ones" if "hidden_states" in rerun else "0"
    return str(loads), requests, extracted, "all" if "train" in rerun else "0"


def expected_table() -> list[tuple[str, ...]]:
    """(module file, rules that run it, rules rebuilt downstream of those, and what such an
    edit costs: loads, requests, tokens extracted, training steps), one row per module."""
    scripts, after = rule_scripts(), downstream()
    runs: dict[str, set[str]] = {}
    for rule, script in scripts.items():
        for module in module_digests(f"eagleflow.entry.{script}", ROOT):
            runs.setdefault(_module_file(module, ROOT).relative_to(ROOT).as_posix(), set()).add(rule)
    # Upstream first: a rule with more downstream of it comes earlier.
    order = sorted(after, key=lambda r: (-len(after[r]), r))
    fmt = lambda rules: ", ".join(sorted(rules, key=order.index))  # noqa: E731
    rows = []
    for module in sorted(m for m in runs if m not in ("__init__.py", "common/__init__.py")):
        rebuilt = set().union(*(after[r] for r in runs[module])) - runs[module]
        rows.append(
            (
                f"`{module}`",
                "every rule" if runs[module] == set(scripts) else fmt(runs[module]),
                fmt(rebuilt) or "-",
                *edit_cost(runs[module] | rebuilt, runs[module]),
            )
        )
    return rows


def documented_table() -> list[tuple[str, str, str]]:
    text = DOC.read_text()
    block = text.split("<!-- module-table -->")[1]
    return [
        tuple(c.strip() for c in line.strip("|").split("|"))
        for line in block.strip().splitlines()[2:]
        if line.startswith("|")
    ]


def test_the_documented_module_table_is_what_the_fingerprints_do():
    expected = expected_table()
    table = "\n".join(
        [HEADER, "| --- | --- | --- | --- | --- | --- | --- |"] + ["| " + " | ".join(r) + " |" for r in expected]
    )
    assert documented_table() == expected, f"docs/invalidation.md is out of date; the table is now:\n{table}"


def test_generate_runs_none_of_the_parsing_or_dataset_code():
    generate = {m.removeprefix("eagleflow.") for m in module_digests("eagleflow.entry.generate", ROOT)}
    assert not {m for m in generate if m.startswith(("synth", "dataset", "common.defects"))}, generate
    synth = {m.removeprefix("eagleflow.") for m in module_digests("eagleflow.entry.synth", ROOT)}
    assert not {m for m in synth if m.startswith(("generate", "runtime.", "dataset"))}, synth
