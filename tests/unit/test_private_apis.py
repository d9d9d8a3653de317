"""The private APIs eagleflow reads, each in one place: Snakemake's DAG and its jobs' reasons
(runtime/cache_plan.py: which planned jobs the output cache may restore) and pytest-xdist's
scope split (tests/conftest.py: which worker runs what). A release that changes one fails here,
by name, instead of quietly: a reason attribute that vanished would read as "not forced" and
let the cache restore a job the user forced."""

import inspect

import snakemake.api  # noqa: F401 (snakemake.dag and snakemake.jobs import each other: the API first)
from snakemake.dag import DAG
from snakemake.jobs import Reason

from eagleflow.runtime.cache_plan import restore_blockers


def test_snakemakes_dag_lists_the_jobs_it_will_run_and_why():
    assert list(inspect.signature(DAG.needrun_jobs).parameters) == ["self", "exclude_finished"]
    assert list(inspect.signature(DAG.reason).parameters) == ["self", "job"]


def test_snakemakes_job_reasons_carry_what_blocks_a_restore():
    reason = Reason()
    assert restore_blockers(reason) == []
    reason.forced = True
    reason.missing_output.add("results/x/draft")
    reason.incomplete_output.add("results/x/vocab")
    assert restore_blockers(reason) == [
        "forced (-R/--forcerun/--forceall/-f)",
        "output missing: results/x/draft",
        "output incomplete: results/x/vocab",
    ]


def test_xdist_splits_load_scopes_by_node_id():
    from xdist.scheduler import LoadScopeScheduling

    assert list(inspect.signature(LoadScopeScheduling._split_scope).parameters) == ["self", "nodeid"]


def test_hs_connectors_mooncake_store_keeps_its_client_in_store():
    """train/served.py closes the trainer's Mooncake client through it before the master stops."""
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    store = MooncakeHiddenStatesStore(MooncakeStoreConfig())
    assert store._store is None and not store.is_setup
    store._store = object()
    assert store.is_setup
