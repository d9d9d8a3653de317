"""pytest fixtures; the builders behind them live in tests/helpers.py."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from devkit.verifiers import VERIFIER_BUILDERS, save_tiny_llama
from tests.helpers import REPO

# The verifier fingerprint remembers file digests (common.identity); the suite's own, in a
# directory of its own, never the user's ~/.cache. Every job and server a test starts inherits it.
os.environ.setdefault("EAGLEFLOW_DIGEST_CACHE", str(Path(tempfile.mkdtemp(prefix="eagleflow-digests-")) / "d.json"))

# The finished run (tests/integration/conftest.py) is built once per session. The modules
# that use it in place (test_pipeline edits files inside it and restores them) run on one
# worker; the modules that take a copy of it (or read vllm_store, a copy built once) go to
# any worker.
IN_PLACE_MODULES = frozenset({"test_pipeline.py", "test_parity.py"})
COPYING_MODULES = frozenset(
    {
        "test_slurm.py",
        "test_slurm_shards.py",
        "test_slurm_generate.py",
        "test_vllm_extraction.py",
        "test_output_cache_run.py",
        "test_draft_methods.py",
        "test_served_states.py",
        "test_served_mooncake.py",
        "test_served_slurm.py",
        "test_bench_smoke.py",
        "test_object_storage_run.py",
        "test_slurm_bucket.py",
    }
)
# The one-node test cluster runs one of their runs at a time (both ask for its CPUs): on two
# workers at once they queue behind each other (CI: 276 s + 225 s against 191 s + 90 s).
SLURM_MODULES = frozenset(
    {
        "test_slurm.py",
        "test_slurm_shards.py",
        "test_slurm_generate.py",
        "test_slurm_cancel.py",
        "test_served_slurm.py",
        "test_slurm_bucket.py",
    }
)
# Integration modules that run a whole DAG of their own: started first, beside the run.
LONGEST_FIRST = ("test_mla_verifier.py",)
# The units that copy the finished run, the longest first (by `make test`'s --durations): the
# last to start are short, and the unit tests fill the other worker meanwhile. (A CI run with
# the served-states module last in this tier ran it on one worker while the other ran out of
# work.) `slurm` is the SLURM modules' one unit: queued here, not where its first module
# (test_slurm_cancel, which reads no run) would put it, among the modules with runs of their
# own, where a worker that reached it before the run was built waited for it.
COPYING_LONGEST_FIRST = (
    "test_served_states.py",
    "slurm",
    "test_vllm_extraction.py",
    "test_served_mooncake.py",
    "test_draft_methods.py",
    "test_bench_smoke.py",
    "test_object_storage_run.py",
    "test_output_cache_run.py",
)


def module_name(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def xdist_scope(nodeid: str) -> str:
    """The unit of work a test goes to a worker with: the in-place modules together, the SLURM
    modules together, each other integration module whole (module fixtures: a server, a run),
    unit tests one by one."""
    if module_name(nodeid) in IN_PLACE_MODULES:
        return "finished_run"
    if module_name(nodeid) in SLURM_MODULES:
        return "slurm"
    module = nodeid.split("::", 1)[0]
    return module if "/integration/" in module else nodeid


def schedule_tier(item) -> tuple[int, int]:
    """Workers take work in this order: the finished run and its in-place tests, the
    integration modules with runs of their own, the other integration modules, the modules
    that copy the finished run (by then it is built: no worker waits for it), unit tests."""
    name = module_name(item.nodeid)
    if name in IN_PLACE_MODULES:
        return 0, 0
    if "unit" in item.path.parts:
        return 4, 0
    if name in SLURM_MODULES:
        return 3, COPYING_LONGEST_FIRST.index("slurm")
    if name in COPYING_MODULES:
        return 3, COPYING_LONGEST_FIRST.index(name) if name in COPYING_LONGEST_FIRST else len(COPYING_LONGEST_FIRST)
    return (1, LONGEST_FIRST.index(name)) if name in LONGEST_FIRST else (2, 0)


def pytest_configure(config):
    """Each xdist worker (and every process it starts: Snakemake, its jobs, vLLM) runs on its
    own share of the CPUs. Two workers whose jobs each spin two threads on both cores of a
    2-core machine run at a fraction of one core each (bench/thread_contention.py); jobs keep
    to the CPUs they may run on (runtime.smk.stage), and vLLM's CPU worker binds its threads
    within them."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return
    cpus, count = sorted(os.sched_getaffinity(0)), int(worker["workercount"])
    if len(cpus) >= count > 1:
        os.sched_setaffinity(0, cpus[int(worker["workerid"].removeprefix("gw")) :: count])


def pytest_xdist_make_scheduler(config, log):
    """Scope scheduling with xdist_scope, in collection order (xdist's own `loadgroup` marks
    are not applied under pytest 9: the group suffix it writes into node ids does not stick;
    its default reorder, by tests per scope, would undo schedule_tier)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """A module that reads the finished run is in IN_PLACE_MODULES or COPYING_MODULES (a
    test reading it in place on another worker would read files test_pipeline edits), and
    the items go in schedule_tier's order."""
    stray = [
        i.nodeid
        for i in items
        if "finished_run" in i.fixturenames and module_name(i.nodeid) not in IN_PLACE_MODULES | COPYING_MODULES
    ]
    if stray:
        raise pytest.UsageError(f"tests read finished_run outside IN_PLACE_MODULES and COPYING_MODULES: {stray}")
    items.sort(key=schedule_tier)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_think_dir(tmp_path_factory) -> Path:
    """Like tiny_llama_dir, with <think>/</think> single tokens and a thinking chat template."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-think"), think=True)


@pytest.fixture(scope="module")
def module_tmp(request, tmp_path_factory) -> Path:
    """A folder for one module's fixtures (a copy of the finished run is about 450 MB), removed
    when the module is done unless one of its tests failed: pyproject's
    `tmp_path_retention_policy` does the same for each test's `tmp_path`. CI's disk is shared
    and its free space varies; kept whole, the suite's folders came to 5.5 GB."""
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    failed = request.session.testsfailed
    yield path
    if request.session.testsfailed == failed:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith("SNAKEMAKE")}


@pytest.fixture(scope="session", params=sorted(VERIFIER_BUILDERS))
def tiny_verifier(request, tmp_path_factory) -> tuple[str, Path]:
    """(family, model dir) for each tiny verifier family; kimi_k2 needs trust_remote_code."""
    return request.param, VERIFIER_BUILDERS[request.param](tmp_path_factory.mktemp(f"tiny-{request.param}"))
