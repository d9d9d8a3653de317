"""profiles/slurm: checked against the workflow (every job of the DAG, by dry run), and the
tail of the small DAG run on a real SLURM cluster.

The cluster is one node on this machine (tests/slurm/start_cluster.sh, run as root: Debian's
slurm-wlm and munge, accounting off). The run goes through the production profile with only
what that node cannot give changed (`profile_for_test_cluster`). It starts from a copy of the
run the pipeline tests share and adds a variant to it, a two-point learning curve (`lc-50`):
its train job (multi-threaded), its benchmark (a whole-node vLLM job), its report and the
comparison of the two drafts go through sbatch, without generating and extracting the same
data a second time. The comparison report it ends in is checked here too. A second run on
another copy extracts the shards again as the 8-GPU example does (vLLM's extraction, fp8, the
top-k target): one submission, one server, the values checked against transformers'.
"""

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import (
    MAX_STEPPED,
    REPO,
    SNAKEMAKE,
    START_CLUSTER,
    copy_finished_run,
    merged,
    run_start_cluster,
    shards_beside_transformers,
    storage_steps,
    vllm_processes,
)
from workflow_scripts.runtime.ledger import read_loads
from workflow_scripts.variants import draft_id

PROFILE = REPO / "profiles/slurm/config.yaml"
SMALL = REPO / "tests/config/small.yaml"
KIMI = REPO / "config/kimi-k2.5-8xgpu.yaml"
# The test node's memory is shared by concurrent jobs; SLURM does not enforce it here
# (no cgroups), it only has to fit the node for scheduling.
TEST_MEM_MB = 2000


# The small config with a learning curve: one more variant, lc-50, on the shared run's data.
WITH_CURVE = {"learning_curve": {"fractions": [0.5]}}


def load_small() -> dict:
    """The small config with the learning curve, as a run sees it: merged over config/config.yaml."""
    small = merged(yaml.safe_load((REPO / "config/config.yaml").read_text()), yaml.safe_load(SMALL.read_text()))
    return merged(small, WITH_CURVE)


def real_profile() -> dict:
    return yaml.safe_load(PROFILE.read_text())


def dry_run_jobs(wf: Path, *args: str) -> list[tuple[str, dict[str, str]]]:
    """(rule, resources) of every job `snakemake -n` plans, with the given extra arguments."""
    out = subprocess.run(SNAKEMAKE + ["-n", *args], cwd=wf, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs, rule = [], None
    # Jobs of a group (the hidden-state shards, grouped by the profile) are listed indented.
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
    hidden_states shard and training the GPUs their config gives them, and the partition and
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
    for rule in ("generate", "baseline", "benchmark"):
        (resources,) = by_rule[rule]
        assert resources["gpu"] == str(kimi["server"]["gpus"]) == "8" and resources["slurm_extra"] == "--exclusive"
    shards = by_rule["hidden_states"]
    assert len(shards) == kimi["hidden_states"]["num_shards"]
    # vllm backend: the shard jobs share one extraction server, which takes server.gpus
    assert kimi["hidden_states"]["backend"] == "vllm"
    assert all(r["gpu"] == str(kimi["server"]["gpus"]) for r in shards)
    assert by_rule["train"][0]["gpu"] == str(kimi["train"]["gpus"])
    assert all(
        "gpu" not in r
        for rule in ("prepare_verifier", "prompts", "synth", "dataset", "vocab", "report", "compare")
        for r in by_rule[rule]
    )
    assert all(r["slurm_partition"] == "<your-partition>" and r["slurm_account"] == "<your-account>" for _, r in jobs)
    profile = real_profile()
    assert profile["executor"] == "slurm" and profile["slurm-status-command"] == "squeue"
    # The shard jobs: one group, bundled into one submission; so are the parity jobs (their
    # replay's extraction server takes the same GPUs). The run holds at most 8 GPUs.
    assert profile["groups"] == ["hidden_states=hidden_states", "parity=parity"]
    components = dict(c.split("=") for c in profile["group-components"])
    assert int(components["hidden_states"]) >= kimi["hidden_states"]["num_shards"]
    assert int(components["parity"]) >= 1
    (parity,) = by_rule["parity"]
    assert parity["gpu"] == str(kimi["server"]["gpus"])
    assert profile["resources"] == ["gpu=8"]


def test_cpu_config_requests_no_gpus(repo):
    jobs = dry_run_jobs(repo, "--configfile", str(SMALL))
    gpu_rules = ("generate", "hidden_states", "train", "baseline", "benchmark")
    # generate, 2 shards, train, baseline, benchmark
    assert [r["gpu"] for rule, r in jobs if rule in gpu_rules] == ["0"] * 6


# ----------------------------------------------------------------------------------------
# The small DAG on a real cluster


def start_cluster() -> str:
    """Start (or find) the test cluster; return the partition to submit to."""
    if os.geteuid() == 0:
        proc = run_start_cluster()
        if proc.returncode != 0:
            pytest.fail(f"{START_CLUSTER} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return proc.stdout.split()[-1]
    if shutil.which("sinfo") is None:
        pytest.skip(f"not root and no SLURM installed: {START_CLUSTER} must run as root to install and start one")
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True)
    defaults = [p.rstrip("*") for p in out.stdout.split() if p.endswith("*")]
    if out.returncode != 0 or not defaults:
        pytest.skip(f"not root, and the SLURM here does not answer with a default partition: {out.stderr.strip()}")
    return os.environ.get("EAGLEFLOW_SLURM_PARTITION", defaults[0])


def node_cpus() -> int:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%c"], capture_output=True, text=True, check=True)
    return min(int(c) for c in out.stdout.split())


def profile_for_test_cluster(real: dict, partition: str, cpus: int) -> dict:
    """The production profile, changed only where a one-node CPU test cluster cannot follow
    it: its partition, no account (accounting is off), no GPUs (the small config serves vLLM
    on CPU), CPUs (the run's too) and memory within the node, and status polls from 1 s on
    instead of 40 s."""
    profile = copy.deepcopy(real)
    defaults = profile["default-resources"]
    defaults["slurm_partition"] = partition
    del defaults["slurm_account"]
    defaults["mem_mb"] = min(defaults["mem_mb"], TEST_MEM_MB)
    profile["set-threads"] = {rule: min(n, cpus) for rule, n in profile["set-threads"].items()}
    for resources in profile["set-resources"].values():
        resources.pop("gpu", None)
        if "mem_mb" in resources:
            resources["mem_mb"] = min(resources["mem_mb"], TEST_MEM_MB)
    # A group of jobs asks for what its jobs hold at once, within `cores`: one node's worth.
    profile["cores"] = cpus
    profile["slurm-init-seconds-before-status-checks"] = 1
    profile["seconds-between-status-checks"] = 1
    return profile


# What forcing the lc-50 draft runs on a finished run, as SLURM job comments.
LC_DRAFT = draft_id(load_small(), "lc-50")
EXPECTED_JOBS = {
    f"rule_train_wildcards_{LC_DRAFT}",
    "rule_benchmark_wildcards_lc-50",
    "rule_report_wildcards_lc-50",
    # The run turns parity off (slurm_run): the default variant's report loses that input.
    "rule_report_wildcards_default",
    "rule_compare",
}


@pytest.fixture(scope="module")
def slurm_run(finished_run, tmp_path_factory):
    partition = start_cluster()
    wf = tmp_path_factory.mktemp("slurm") / "wf"
    copy_finished_run(finished_run, wf)
    profile_dir = wf / "profiles/slurm-test"
    profile_dir.mkdir(parents=True)
    profile = profile_for_test_cluster(real_profile(), partition, node_cpus())
    (profile_dir / "config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    # A run started from inside a SLURM job would inherit its allocation's variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SNAKEMAKE", "SLURM_", "SBATCH_", "SRUN_"))}
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
    assert "| default | 3 |" in md and "| lc-50 | 3 |" in md
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


# ----------------------------------------------------------------------------------------
# The hidden-state phase on the cluster: one submission, one server for every shard job

# The example's shard settings (config/kimi-k2.5-8xgpu.yaml): vLLM's extraction, fp8 states,
# the compact top-k target.
PRODUCTION_SHARDS = {"backend": "vllm", "dtype": "float8_e4m3fn", "target": "topk"}
# The stored top-k logits (less the largest, float16) against the same head on transformers'
# final state rounded to bfloat16 as the shard job rounds vLLM's: float16 rounds logits down to
# -30 by up to 0.008, and the two float32 forwards (~2e-6 apart) put some of the final state's
# values on the other side of a bfloat16 boundary; the state's outlier (|x| ~ 4,400 in SmolLM2)
# then moves a whole row of logits. Measured here over 128,576 logits: p99 0.006, p99.9 0.010,
# largest 0.076, and the top id equal on every token. A misplaced state or token moves logits by
# whole units.
LOGIT_TOLERANCE = {0.99: 0.0125, 1.0: 0.25}


@pytest.fixture(scope="module")
def slurm_shards(finished_run, tmp_path_factory):
    """The shard jobs and the index of the shared run again through the test cluster, as the
    8-GPU example runs them: the `vllm` backend (vLLM's extraction, eagleflow's connector),
    fp8 storage and the compact top-k target (new content: no shard comes from the cache)."""
    partition = start_cluster()
    wf = tmp_path_factory.mktemp("slurm-shards") / "wf"
    copy_finished_run(finished_run, wf)
    profile_dir = wf / "profiles/slurm-test"
    profile_dir.mkdir(parents=True)
    (profile_dir / "config.yaml").write_text(
        yaml.safe_dump(profile_for_test_cluster(real_profile(), partition, node_cpus()), sort_keys=False)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SNAKEMAKE", "SLURM_", "SBATCH_", "SRUN_"))}
    (wf / "production.yaml").write_text(yaml.safe_dump({"hidden_states": PRODUCTION_SHARDS}))
    servers = wf / "results/small/logs/servers"
    loads_before = len(read_loads(servers))
    target = "results/small/hidden_states/index.json"
    cmd = SNAKEMAKE + [target, "--workflow-profile", str(profile_dir), "--configfile", str(SMALL), "production.yaml"]
    proc = subprocess.run(cmd, cwd=wf, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        logs = sorted((wf / "results/small/logs").glob("hidden_states*.log")) + sorted(
            (wf / "logs/slurm").rglob("*.log")
        )
        tails = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in logs)
        pytest.fail(f"snakemake on SLURM failed ({proc.returncode}):\n{proc.stderr[-5000:]}\n{tails}")
    return wf, proc.stderr + proc.stdout, read_loads(servers)[loads_before:]


@pytest.mark.slurm
@pytest.mark.vllm
def test_the_shard_jobs_run_in_one_submission_against_one_server(slurm_shards):
    wf, out, loads = slurm_shards
    submissions = re.findall(r"submitted with SLURM jobid (\d+) \(log: (\S+)\)", out)
    shard_logs = [log for _, log in submissions if "group_hidden_states" in log]
    assert len(shard_logs) == 1, submissions  # the shard jobs: one sbatch
    text = Path(shard_logs[0].rstrip(").")).read_text()
    num_shards = yaml.safe_load(SMALL.read_text())["hidden_states"]["num_shards"]
    assert num_shards > 1 and text.count("Finished jobid") >= num_shards, text[-3000:]
    assert [(r["stage"], r["kind"]) for r in loads] == [("hidden_states", "start")]
    logs = [(wf / f"results/small/logs/hidden_states.shard-{k:05d}.log").read_text() for k in range(num_shards)]
    assert sum("this job started the phase's shared vLLM" in t for t in logs) == 1
    assert sum("using the phase's shared vLLM" in t for t in logs) == num_shards - 1
    index = json.loads((wf / "results/small/hidden_states/index.json").read_text())
    assert index["dtype"] == "F8_E4M3" and index["backends"] == ["vllm"]
    assert vllm_processes(str(wf)) == [] and list((wf / "results/small/logs/servers").glob("*.json")) == []


@pytest.mark.slurm
@pytest.mark.vllm
def test_the_clusters_fp8_shards_and_topk_targets_are_those_of_transformers_states(slurm_shards):
    """The production shard format through vLLM's extraction, checked value by value against
    transformers' float32 forward on the same tokens, taken through the same storage: bfloat16
    then fp8 for the aux states (at most one e4m3 step apart, on few values: the two float32
    forwards differ by ~3e-7), and the top-k head on the bfloat16 final state for the target."""
    from workflow_scripts.hidden_states.storage import FP8
    from workflow_scripts.hidden_states.targets import TopkHead

    wf, _, _ = slurm_shards
    verifier_dir = wf / "resources/verifier" / load_small()["verifier"]["name"]
    head = TopkHead(str(verifier_dir), load_small()["hidden_states"]["topk"])
    steps, logit_errors, top_equal, tokens = [], [], 0, 0
    shards = sorted((wf / "results/small/hidden_states").glob("shard-*.safetensors"))
    for meta, pairs in shards_beside_transformers(shards, verifier_dir, torch.bfloat16):
        assert meta.backend == "vllm"
        for s, (aux, final) in pairs:
            assert s.final is None and s.target_ids.shape == (len(s.input_ids), head.k)
            steps.append(storage_steps(s.aux, aux.float(), FP8, len(meta.aux_layer_ids)))
            # Stored: ids of the k largest logits and those logits less the largest, in float16.
            logits = head.logits(final)
            logits -= logits.max(-1, keepdim=True).values
            at_ids = logits.gather(-1, s.target_ids)
            logit_errors.append((s.target_logits - at_ids).abs().flatten())
            kth = logits.topk(head.k, dim=-1).values[:, -1:]
            assert (at_ids >= kth - LOGIT_TOLERANCE[1.0]).all(), "a stored id is not among transformers' k largest"
            top_equal += int((s.target_ids[:, 0] == logits.argmax(-1)).sum())
            tokens += len(s.input_ids)
    errors = torch.cat(logit_errors)
    for share, tolerance in LOGIT_TOLERANCE.items():
        assert errors.quantile(share) <= tolerance, (share, errors.quantile(share))
    assert top_equal >= 0.99 * tokens, (top_equal, tokens)
    steps = torch.cat(steps)
    assert tokens > 0 and steps.max() <= 1, f"{int((steps > 1).sum())} of {steps.numel()} values over one step"
    assert (steps > 0).float().mean() <= MAX_STEPPED[FP8], f"{int((steps > 0).sum())} of {steps.numel()} stepped"
