"""config/README.md's reference tables, from the one source of each config key.

    python -m devkit.config_reference [--write]

A key's type, bounds and description are the schema's (workflow/schemas/config.schema.yaml,
what Snakemake validates against); its default is config/config.yaml's (what Snakemake loads
first). Each `## \\`<section>\\`` heading of config/README.md is followed by the table of that
section's keys, generated here: without --write, the tables the README should hold are
compared with the ones it holds, and the keys that differ are named (tests/unit/
test_config_source.py runs the check). The README's prose around the tables is its own: the
reasoning behind the defaults and links to the measurements.

A key is documented where its description is: a leaf, or an object whose properties have
none (dataset.max_defect_fraction), as one row with the object's default.

Whether a key changes results is the schema's too: `x-changes-results: false` marks a key that
says how a job runs (where, how patiently, how many at once), never what it produces; absent,
it does. Such a key may still rerun rules: those that take its whole section as a param (read
here from workflow/rules/*.smk), whose job key then changes, or the ones its `x-reruns` names;
they compute outputs equal to the old ones. The rest plan no job when changed
(tests/integration/test_pipeline.py changes all of them at once on a finished run).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow/schemas/config.schema.yaml"
DEFAULTS = ROOT / "config/config.yaml"
README = ROOT / "config/README.md"
RULES = ROOT / "workflow/rules"
HEADER = ["| key | default | changes results | meaning |", "| --- | --- | --- | --- |"]
HEADING = re.compile(r"^## `([a-z_]+)`$")
# A rule's param that holds a whole config section, or one less some of its subsections:
# rule_params.section_param(config, "hidden_states", ["served"]), and a variant's or a draft's
# section (workflow/rules/common.smk: variant_section, draft_section).
WHOLE_SECTION = re.compile(
    r'\b(?:section_param\(config, |variant_section\(|draft_section\()"(\w+)"(?:, \[((?:"\w+"(?:, )?)*)\])?\)'
)


def resolved(prop: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A property with its `$ref` to `$defs` merged in (the property's own keys win)."""
    while "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        prop = {**defs[name], **{k: v for k, v in prop.items() if k != "$ref"}}
    return prop


def documented_keys(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{dotted key: its property} for every key the reference documents, in the schema's order."""
    defs = schema.get("$defs", {})
    out: dict[str, dict[str, Any]] = {}

    def walk(props: dict[str, Any], prefix: str) -> None:
        for name, prop in props.items():
            prop = resolved(prop, defs)
            children = prop.get("properties")
            described = children and any("description" in resolved(c, defs) for c in children.values())
            if prop.get("type") == "object" and described:
                walk(children, f"{prefix}{name}.")
            else:
                out[f"{prefix}{name}"] = prop

    walk(schema["properties"], "")
    return out


def default_of(config: dict[str, Any], key: str) -> Any:
    value = config
    for part in key.split("."):
        value = value[part]
    return value


def whole_section_rules(rules_dir: Path = RULES) -> dict[str, list[str]]:
    """{section: the rules that take it whole as a param}, read from the rule files; for a
    subsection some of them leave out, {section.subsection: the rules that take it}."""
    taken: list[tuple[str, str, set[str]]] = []  # (rule, section, subsections left out)
    for smk in sorted(rules_dir.glob("*.smk")):
        for block in re.split(r"(?m)^(?=rule )", smk.read_text()):
            rule = re.match(r"rule (\w+):", block)
            for name, without in WHOLE_SECTION.findall(block) if rule else ():
                taken.append((rule.group(1), name, set(re.findall(r'"(\w+)"', without))))
    out: dict[str, list[str]] = {}
    for rule, name, _ in taken:
        out.setdefault(name, []).append(rule)
    for _, name, without in taken:
        for sub in without:
            out[f"{name}.{sub}"] = [r for r, n, w in taken if n == name and sub not in w]
    return {name: sorted(rules) for name, rules in out.items()}


def reruns(key: str, prop: dict[str, Any], whole: dict[str, list[str]]) -> list[str]:
    """The rules a change to a key that changes no result still reruns: `x-reruns`, else the
    rules that take its section whole; none for a key that changes results."""
    if prop.get("x-changes-results", True):
        return []
    if prop.get("x-reruns"):
        return list(prop["x-reruns"])
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):  # the innermost section a rule takes
        if ".".join(parts[:n]) in whole:
            return list(whole[".".join(parts[:n])])
    return []


def run_only_keys(schema: dict[str, Any], whole: dict[str, list[str]]) -> list[str]:
    """The keys whose change plans no job: they change no result and rerun no rule."""
    return [
        key
        for key, prop in documented_keys(schema).items()
        if not prop.get("x-changes-results", True) and not reruns(key, prop, whole)
    ]


def changes_results(key: str, prop: dict[str, Any], whole: dict[str, list[str]]) -> str:
    """The table's cell: yes; no; or no, with the rules it still reruns."""
    if prop.get("x-changes-results", True):
        return "yes"
    rules = reruns(key, prop, whole)
    return f"no (reruns {', '.join(rules)})" if rules else "no"


def tables(schema: dict[str, Any], config: dict[str, Any]) -> dict[str, list[str]]:
    """{section: the lines of its table}. A key without a description is a ValueError."""
    out: dict[str, list[str]] = {}
    whole = whole_section_rules()
    for key, prop in documented_keys(schema).items():
        if "description" not in prop:
            raise ValueError(f"{key}: the schema gives it no description")
        default = json.dumps(default_of(config, key), ensure_ascii=False)
        meaning = " ".join(prop["description"].split())
        results = changes_results(key, prop, whole)
        out.setdefault(key.split(".")[0], list(HEADER)).append(f"| `{key}` | `{default}` | {results} | {meaning} |")
    return out


def rendered(readme: str, schema: dict[str, Any], config: dict[str, Any]) -> str:
    """`readme` with the table after each section's heading replaced by the generated one.
    A section the schema has and no heading names is a ValueError."""
    expected = tables(schema, config)
    lines, out, i, seen = readme.splitlines(), [], 0, set()
    while i < len(lines):
        out.append(lines[i])
        heading = HEADING.match(lines[i])
        i += 1
        if not heading or heading.group(1) not in expected:
            continue
        section = heading.group(1)
        seen.add(section)
        while i < len(lines) and not lines[i].startswith("|") and not lines[i].startswith("## "):
            out.append(lines[i])
            i += 1
        while i < len(lines) and lines[i].startswith("|"):
            i += 1  # the table as it was
        out.extend(expected[section])
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"{README.name}: no `## \\`<section>\\`` heading for {', '.join(missing)}")
    return "\n".join(out) + "\n"


def drift(readme: str, schema: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The README's rows that differ from the generated ones, each named by its key."""
    want = rendered(readme, schema, config).splitlines()
    have = readme.splitlines()
    w, h = keyed_rows(want), keyed_rows(have)
    return [
        f"{k}: README {h.get(k, '(no row)')!r}, source {w.get(k, '(no key)')!r}"
        for k in {**h, **w}
        if w.get(k) != h.get(k)
    ]


def keyed_rows(lines: list[str]) -> dict[str, str]:
    """{key: its table row} of the rows in `lines`."""
    return {m.group(1): line for line in lines if (m := re.match(r"\| `([^`]+)`", line))}


def load() -> tuple[str, dict[str, Any], dict[str, Any]]:
    return README.read_text(), yaml.safe_load(SCHEMA.read_text()), yaml.safe_load(DEFAULTS.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite config/README.md's tables")
    args = parser.parse_args()
    readme, schema, config = load()
    if args.write:
        README.write_text(rendered(readme, schema, config))
        return 0
    problems = drift(readme, schema, config)
    print("\n".join(problems) or "config/README.md's tables are the schema's and the defaults'")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
