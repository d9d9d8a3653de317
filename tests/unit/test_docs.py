"""The docs stay true to the repository: every config key is documented, every relative
link resolves, and nothing points outside the repository."""

import json
import re

import yaml

from tests.helpers import REPO

DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "config/README.md", *sorted((REPO / "docs").glob("*.md"))]


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


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://")) and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not broken, broken


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
