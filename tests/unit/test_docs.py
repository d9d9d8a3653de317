"""The docs stay true to the repository: every config key is documented, every relative
link resolves, and nothing points outside the repository."""

import json
import re
from collections.abc import Iterator

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
