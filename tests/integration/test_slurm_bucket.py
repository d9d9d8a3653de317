"""The extraction on a SLURM node that shares only the bucket with the submitting host.

The test cluster's second node (tests/slurm/start_cluster.sh: its own network namespace and
hostname) runs the hidden-state job, under Snakemake's S3 storage provider with
`--shared-fs-usage software-deployment sources source-cache` (the software and the code on
every node, as a node image carries them; no data shared): the job retrieves its inputs from
the bucket into a storage prefix of its own, extracts, uploads its samples and its manifest,
and the index job reads them back from the bucket. The S3 server (SeaweedFS) listens on the
address both nodes reach, the first node's end of their link; the credentials travel in the
job's environment only."""

import json
import re
import subprocess

import pytest

from devkit.seaweedfs import SeaweedFS
from tests.helpers import SNAKEMAKE
from tests.object_storage import PREFIX, STORAGE, client, objects, put_run
from tests.slurm_cluster import SMALL, copy_for_cluster, rules_on_two_nodes

HOST_ADDR = "10.77.0.1"  # the first node's end of the link to the second (start_cluster.sh)
NODE2 = "eagleflow-n2"
SHARED = ["software-deployment", "sources", "source-cache"]


@pytest.fixture(scope="module")
def on_the_second_node(finished_run, module_tmp):
    wf, profile_dir, env = copy_for_cluster(finished_run, module_tmp)
    rules_on_two_nodes(profile_dir, ["hidden_states", "hidden_states_index"], nodelist=NODE2)
    server = SeaweedFS(module_tmp / "s3", ip=HOST_ADDR).start()
    try:
        s3 = client(server)
        put_run(wf, s3)
        node_storage = module_tmp / "node-storage"
        cmd = SNAKEMAKE + ["--until", "hidden_states_index", "--workflow-profile", str(profile_dir)]
        # The data share nothing: only the software and the workflow's code are on every node, as
        # a node image carries them.
        cmd += ["--configfile", str(SMALL), *STORAGE, "--shared-fs-usage", *SHARED]
        cmd += ["--remote-job-local-storage-prefix", str(node_storage)]
        proc = subprocess.run(cmd, cwd=wf, env={**env, **server.env()}, capture_output=True, text=True, timeout=1200)
        out = proc.stderr + proc.stdout
        slurm_logs = {p: p.read_text() for p in (wf / "logs/slurm").rglob("*.log")}
        if proc.returncode != 0:
            tails = "\n".join(f"--- {p}\n{text[-3000:]}" for p, text in slurm_logs.items())
            pytest.fail(f"snakemake on SLURM failed ({proc.returncode}):\n{out[-4000:]}\n{tails}")
        yield {"wf": wf, "s3": s3, "out": out, "slurm_logs": slurm_logs, "secret": server.secret_key}
    finally:
        server.stop()


def read(s3, key: str) -> bytes:
    return s3.get_object(Bucket="eagleflow", Key=key)["Body"].read()


@pytest.mark.slurm
def test_the_extraction_ran_on_the_other_node_and_left_its_samples_in_the_bucket(on_the_second_node):
    run = on_the_second_node
    s3, wf = run["s3"], run["wf"]
    (hs_log,) = [text for p, text in run["slurm_logs"].items() if "rule_hidden_states/" in str(p)]
    assert re.search(rf"Host: {NODE2}\b", hs_log), hs_log[-2000:]
    # It read its inputs from the bucket into its own storage prefix, not from this host's copies.
    assert re.search(rf"Retrieving from storage: {PREFIX}/results/small/dataset/train.parquet", hs_log), hs_log[-3000:]
    index = json.loads(
        s3.get_object(Bucket="eagleflow", Key="run/results/small/hidden_states/index.json")["Body"].read()
    )
    states = objects(s3, "run/states/small/")
    assert index["store"] == f"{PREFIX}/states/small" and len(states) == len({s["key"] for s in index["samples"]}) > 0
    part = json.loads(read(s3, "run/results/small/hidden_states/part-00000.json"))
    assert part["stats"]["uploaded_samples"] == len(states)
    # This host holds nothing of the phase: no output, no sample, beside its workflow.
    assert not (wf / "results").exists() or not list((wf / "results").rglob("part-*.json"))
    assert not [
        p for p in wf.rglob("*.safetensors") if "resources-on-disk" not in str(p) and "results-on-disk" not in str(p)
    ]
    # The secret key went to the jobs in their environment, and into no log.
    assert all(run["secret"] not in text for text in [run["out"], *run["slurm_logs"].values()])
