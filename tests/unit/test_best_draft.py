"""The best draft (report/best.py): ranked by the figure vLLM measured on one cell, ties to the
variant listed first, unmeasured variants never win."""

import pytest

from eagleflow.report.best import choose, rank


def report(method: str, k: int, cells: dict[str, tuple[float, float]]) -> dict:
    return {
        "method": method,
        "num_speculative_tokens": k,
        "cells": {c: {"speculative": {"mean_acceptance_length": al}, "speedup": s} for c, (al, s) in cells.items()},
    }


REPORTS = {
    "default": report("eagle3", 3, {"eval@T0": (1.52, 1.10), "mt_bench@T0.7": (1.30, 0.95)}),
    "peagle": report("peagle", 4, {"eval@T0": (1.33, 1.20), "mt_bench@T0.7": (1.31, 1.02)}),
    "dflash": report("dflash", 7, {"eval@T0": (1.28, 0.90)}),
}
DRAFTS = {"default": "drafts/default/draft", "peagle": "drafts/d-1/draft", "dflash": "drafts/d-2/draft"}


def test_the_highest_measured_figure_on_the_cell_wins():
    choice = choose(REPORTS, DRAFTS, "mean_acceptance_length", "eval@T0")
    assert choice["winner"] == "default" and choice["draft"] == "drafts/default/draft"
    assert [r["variant"] for r in choice["ranking"]] == ["default", "peagle", "dflash"]
    assert choose(REPORTS, DRAFTS, "speedup", "eval@T0")["winner"] == "peagle"
    assert choose(REPORTS, DRAFTS, "mean_acceptance_length", "mt_bench@T0.7")["winner"] == "peagle"


def test_an_unmeasured_variant_ranks_last_and_a_tie_goes_to_the_first_listed():
    ranking = rank(REPORTS, "mean_acceptance_length", "mt_bench@T0.7")
    assert ranking[-1] == {"variant": "dflash", "method": "dflash", "k": 7, "mean_acceptance_length": None}
    tied = {"b": report("eagle3", 2, {"eval@T0": (1.5, 1.0)}), "a": report("dflash", 7, {"eval@T0": (1.5, 1.0)})}
    assert [r["variant"] for r in rank(tied, "mean_acceptance_length", "eval@T0")] == ["b", "a"]


def test_a_cell_no_variant_measured_or_an_unknown_figure_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"best.cell: no variant measured humaneval@T0; the benchmark measured eval@T0"
    ):
        choose(REPORTS, DRAFTS, "mean_acceptance_length", "humaneval@T0")
    with pytest.raises(ValueError, match=r"best.by: 'tokens'"):
        choose(REPORTS, DRAFTS, "tokens", "eval@T0")
