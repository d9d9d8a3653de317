"""How the benchmark names what it measured: a set at a temperature is a cell (`mt_bench@T0.7`).
Pure; imported by the report side (compare) as well as the measuring side."""

EVAL = "eval"  # the run's own held-out split: always measured, always first


def cell_key(set_name: str, temperature: float) -> str:
    """`mt_bench@T0.7`: set `set_name` measured at `temperature`. Pure."""
    return f"{set_name}@T{temperature:g}"


HEADLINE = cell_key(EVAL, 0.0)  # the eval split, greedy: the report's top-level figures
