"""YAML as eagleflow writes its generated files: mappings in block style, lists of plain
values on one line, long strings folded at 100 columns, keys in their given order."""

from __future__ import annotations

from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    pass


def _list(dumper: yaml.SafeDumper, value: list) -> yaml.Node:
    plain = all(not isinstance(v, (dict, list)) for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=plain)


_Dumper.add_representer(list, _list)


def dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100, default_flow_style=False)
