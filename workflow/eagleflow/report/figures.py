"""What every report's plots share: a headless pyplot, and a figure written atomically."""

from __future__ import annotations

from eagleflow.common.atomic import atomic_path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out: str) -> None:
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    pyplot().close(fig)
