"""profiles/slurm: checked against the workflow (every job of the DAG, by dry run), and the
tail of the small DAG run on a real SLURM cluster (tests/slurm_cluster.py).

The cluster is one node on this machine (tests/slurm/start_cluster.sh, run as root: Debian's
slurm-wlm and munge, accounting off). The run goes through the production profile with only
what that node cannot give changed (`profile_for_test_cluster`). It starts from a copy of the
run the pipeline tests share and adds a variant to it, a two-point learning curve (`lc-50`):
its train job (multi-threaded), its benchmark (a whole-node vLLM job), its report and the
comparison of the two drafts go through sbatch, without generating and extracting the same
data a second time. The comparison report it ends in is checked here too. The extraction jobs as
the 8-GPU example runs them: test_slurm_shards.py; generate in shard jobs, one killed:
test_slurm_generate.py.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from eagleflow.dag.variants import draft_id
from tests.helpers import REPO, SNAKEMAKE, vllm_processes
from tests.slurm_cluster import (
    SMALL,
    WITH_CURVE,
    copy_for_cluster,
    load_small,
    real_profile,
)

KIMI = REPO / "config/kimi-k2.5-8xgpu.yaml"


def dry_run_jobs(wf: Path, *args: str) -> list[tuple[str, dict[str, str]]]:
    """(rule, resources) of every job `snakemake -n` plans, with the given extra arguments."""
    out = subprocess.run(SNAKEMAKE + ["-n", *args], cwd=wf, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs, rule = [], None
    # Jobs of a group (the parity jobs, grouped by the profile) are listed indented.
    for line in out.stdout.splitlines():
        if m := re.match(r"\s*(?:local)?rule (\w+):", line):
            rule = m.group(1)
        elif line.strip().startswith("resources:") and rule:
            pairs = line.split(":", 1)[1].split(", ")
            jobs.append((rule, dict(p.strip().split("=", 1) for p in pairs)))
    return jobs


def test_profile_names_only_rules_of_the_workflow(repo):
    """Snakemake ignores set-threads/set-resources for a rule that does not exist: a renamed
    rule would silently lose its GPUs and memory on the cluster."""
    out = subprocess.run(SNAKEMAKE + ["--list-rules"], cwd=repo, capture_output=True, text=True, check=True)
    rules = set(out.stdout.split())
    profile = real_profile()
    assert set(profile["set-threads"]) <= rules
    assert set(profile["set-resources"]) <= rules


def test_production_profile_asks_for_nodes_gpus_and_cluster_settings(repo):
    """With the Kimi example config: serving rules take a whole 8-GPU node, every
    hidden_states job and training the GPUs their config gives them, and the partition and
    account are the placeholders a user fills in."""
    jobs = dry_run_jobs(
        repo,
        "--workflow-profile",
        "profiles/slurm",
        "--configfile",
        str(KIMI),
        "--config",
        "prompts={source: config/prompts/demo.jsonl}",
    )
    by_rule: dict[str, list[dict]] = {}
    for rule, resources in jobs:
        by_rule.setdefault(rule, []).append(resources)
    kimi = yaml.safe_load(KIMI.read_text())
    # One benchmark per variant (the example's draft methods), each on a whole node as well.
    assert len(by_rule["benchmark"]) == 1 + len(kimi["variants"]) == len(by_rule["train"])
    for rule in ("generate", "baseline", "benchmark"):
        for resources in by_rule[rule]:
            assert resources["gpu"] == str(kimi["server"]["gpus"]) == "8"
            assert resources["slurm_extra"] == "--exclusive"
    parts = by_rule["hidden_states"]
    assert len(parts) == kimi["hidden_states"]["num_parts"]
    # vllm backend: each extraction job (one per node) launches its server on server.gpus
    assert kimi["hidden_states"]["backend"] == "vllm"
    assert all(r["gpu"] == str(kimi["server"]["gpus"]) and r["slurm_extra"] == "--exclusive" for r in parts)
    assert all(r["gpu"] == str(kimi["train"]["gpus"]) for r in by_rule["train"])
    assert all(
        "gpu" not in r
        for rule in ("prepare_verifier", "prompts", "synth", "dataset", "vocab", "report", "compare", "best_draft")
        for r in by_rule[rule]
    )
    assert all(r["slurm_partition"] == "<your-partition>" and r["slurm_account"] == "<your-account>" for _, r in jobs)
    profile = real_profile()
    assert profile["executor"] == "slurm" and profile["slurm-status-command"] == "squeue"
    # The parity jobs: one group, bundled into one submission (their replay's extraction server
    # takes the same GPUs); a hidden-state job is its own. The run holds at most 8 GPUs.
    assert profile["groups"] == ["parity=parity"]
    components = dict(c.split("=") for c in profile["group-components"])
    assert int(components["parity"]) >= 1
    assert len(by_rule["parity"]) == 1 + len(kimi["variants"])
    assert all(parity["gpu"] == str(kimi["server"]["gpus"]) for parity in by_rule["parity"])
    assert profile["resources"] == ["gpu=8"]


def test_each_generate_shard_is_a_whole_node_submission_with_one_replicas_gpus(repo, tmp_path):
    """The Kimi example in 4 shards under the production profile: 4 generate jobs, each a
    whole node with server.gpus GPUs (one replica), and one cheap join asking for none."""
    shards = tmp_path / "shards.yaml"
    shards.write_text(yaml.safe_dump({"generate": {"shards": 4}, "prompts": {"source": "config/prompts/demo.jsonl"}}))
    jobs = dry_run_jobs(repo, "--workflow-profile", "profiles/slurm", "--configfile", str(KIMI), str(shards))
    generate = [r for rule, r in jobs if rule == "generate"]
    gpus = str(yaml.safe_load(KIMI.read_text())["server"]["gpus"])
    assert len(generate) == 4 and all(r["gpu"] == gpus and r["slurm_extra"] == "--exclusive" for r in generate)
    (join,) = [r for rule, r in jobs if rule == "generate_join"]
    assert "gpu" not in join and "slurm_extra" not in join


def test_cpu_config_requests_no_gpus(repo):
    jobs = dry_run_jobs(repo, "--configfile", str(SMALL))
    gpu_rules = ("generate", "hidden_states", "train", "baseline", "benchmark")
    # generate, the one extraction job, train, baseline, benchmark
    assert [r["gpu"] for rule, r in jobs if rule in gpu_rules] == ["0"] * 5


# ----------------------------------------------------------------------------------------
# The small DAG on a real cluster


# What forcing the lc-50 draft runs on a finished run, as SLURM job comments.
LC_DRAFT = draft_id(load_small(), "lc-50")
EXPECTED_JOBS = {
    f"rule_train_wildcards_{LC_DRAFT}",
    "rule_benchmark_wildcards_lc-50",
    "rule_report_wildcards_lc-50",
    # The run turns parity off (slurm_run): the default variant's report loses that input.
    "rule_report_wildcards_default",
    "rule_compare",
    "rule_best_draft",
}


@pytest.fixture(scope="module")
def slurm_run(finished_run, module_tmp):
    wf, profile_dir, env = copy_for_cluster(finished_run, module_tmp)
    profile = yaml.safe_load((profile_dir / "config.yaml").read_text())
    # The drafts name the verifier by path (verifier.serve_path, default: the prepared dir, resolved):
    # keep the original run's, or the copy's new location would restale the default draft.
    serve_path = str((finished_run / "resources/verifier" / load_small()["verifier"]["name"]).resolve())
    # No parity job: its replay is the shared run's (test_parity.py); here it would be one
    # more submission, polled for, and one more verifier load.
    (wf / "curve.yaml").write_text(
        yaml.safe_dump(WITH_CURVE | {"verifier": {"serve_path": serve_path}, "parity": {"enabled": False}})
    )
    cmd = SNAKEMAKE + ["--workflow-profile", str(profile_dir), "--configfile", str(SMALL), "curve.yaml"]
    proc = subprocess.run(cmd, cwd=wf, env=env, capture_output=True, text=True, timeout=2400)
    if proc.returncode != 0:
        logs = sorted((wf / "results/small/logs").glob("*.log")) + sorted((wf / "logs/slurm").rglob("*.log"))
        tails = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in logs)
        pytest.fail(f"snakemake on SLURM failed ({proc.returncode}):\n{proc.stderr[-5000:]}\n{tails}")
    run_id = re.search(r"SLURM run ID: (\S+)", proc.stderr + proc.stdout)
    assert run_id, "the slurm executor did not report its run ID"
    return wf, run_id.group(1), profile


@pytest.fixture(scope="module")
def slurm_jobs(slurm_run) -> dict[str, dict[str, str]]:
    """The run's SLURM jobs by comment (rule and wildcards), as the controller reports them."""
    _, run_id, _ = slurm_run
    fields = {
        "id": "%i",
        "state": "%T",
        "comment": "%k",
        "workdir": "%Z",
        "time_limit": "%l",
        "cpus": "%C",
        "oversubscribe": "%h",
    }
    out = subprocess.run(
        ["squeue", "-h", "--states=all", "--name", run_id, "-o", "|".join(fields.values())],
        capture_output=True,
        text=True,
        check=True,
    )
    jobs = [dict(zip(fields, line.split("|"), strict=True)) for line in out.stdout.splitlines()]
    by_comment = {j["comment"]: j for j in jobs}
    assert len(by_comment) == len(jobs), f"a job was submitted twice: {[j['comment'] for j in jobs]}"
    return by_comment


@pytest.mark.slurm
@pytest.mark.vllm
def test_every_job_ran_as_a_completed_slurm_job(slurm_run, slurm_jobs):
    wf, _, _ = slurm_run
    assert set(slurm_jobs) == EXPECTED_JOBS
    for comment, job in slurm_jobs.items():
        assert job["state"] == "COMPLETED", (comment, job)
        assert Path(job["workdir"]) == wf
        rule, _, wildcards = comment.removeprefix("rule_").partition("_wildcards_")
        log = wf / "logs/slurm" / f"rule_{rule}" / wildcards / f"{job['id']}.log"
        assert log.is_file(), f"no SLURM log for {comment} at {log}"
        text = log.read_text()
        # The job's own Snakemake ran the rule inside the allocation and finished it.
        assert f"rule {rule}:" in text and "Finished job" in text, f"{log}:\n{text[-2000:]}"


@pytest.mark.slurm
@pytest.mark.vllm
def test_jobs_got_what_the_profile_asks(slurm_run, slurm_jobs):
    _, _, profile = slurm_run
    job = slurm_jobs["rule_benchmark_wildcards_lc-50"]
    assert job["oversubscribe"] == "NO", job  # --exclusive: the whole node
    assert job["time_limit"] == minutes(profile["set-resources"]["benchmark"]["runtime"])
    assert slurm_jobs["rule_report_wildcards_lc-50"]["time_limit"] == minutes(profile["default-resources"]["runtime"])
    assert int(slurm_jobs[f"rule_train_wildcards_{LC_DRAFT}"]["cpus"]) == profile["set-threads"]["train"]


def minutes(n: int) -> str:
    """A time limit as squeue prints it: [D-]HH:MM:SS."""
    days, rest = divmod(n, 24 * 60)
    hours, mins = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{mins:02d}:00"
    return f"{hours}:{mins:02d}:00" if hours else f"{mins}:00"


@pytest.mark.slurm
@pytest.mark.vllm
def test_the_slurm_run_ends_in_the_report_and_leaves_no_vllm(slurm_run):
    wf, _, _ = slurm_run
    md = (wf / "results/small/variants/lc-50/report/report.md").read_text()
    assert "mean acceptance length" in md and "speedup" in md
    assert vllm_processes(str(wf)) == []
    assert list((wf / "results/small/logs/servers").glob("*.json")) == [], "a server lease was left behind"


@pytest.mark.slurm
@pytest.mark.vllm
def test_the_run_report_compares_its_variants(slurm_run):
    """Two variants (the default draft and lc-50, a two-point learning curve) end to end."""
    wf, _, _ = slurm_run
    r = wf / "results/small"
    md = (r / "report.md").read_text()
    assert "| default | eagle3 | 3 |" in md and "| lc-50 | eagle3 | 3 |" in md
    assert "## Learning curve" in md and "do not support a fit: 2 training size(s)" in md
    for png in ("acceptance_by_variant.png", "learning_curve.png", "speculative_tokens.png"):
        assert (r / "report" / png).read_bytes()[:4] == b"\x89PNG"
    baseline = json.loads((r / "baseline/report.json").read_text())
    for variant in ("default", "lc-50"):
        report = json.loads((r / f"variants/{variant}/benchmark/report.json").read_text())
        assert report["baseline"]["output_tokens_per_s"] == baseline["output_tokens_per_s"]
        assert report["baseline_measurement"].startswith("the run's baseline job")
    rows = [json.loads(line) for line in (r / f"drafts/{LC_DRAFT}/train/metrics.jsonl").read_text().splitlines()]
    full = [json.loads(line) for line in (r / "drafts/default/train/metrics.jsonl").read_text().splitlines()]
    assert 0 < rows[-1]["train_samples"] < full[-1]["train_samples"]
