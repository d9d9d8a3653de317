# Helpers shared by every rule: config validation, paths, code fingerprints.
from pathlib import Path

from workflow_scripts.common.config import validate_config
from workflow_scripts.common.fingerprint import code_fingerprint

validate_config(config)

RUN = config["run"]
SCRIPTS_DIR = Path(workflow.basedir) / "workflow_scripts"
VERIFIER_DIR = f"resources/verifier/{config['verifier']['name']}"


wildcard_constraints:
    shard=r"\d{5}",


def results(path):
    """Path of a run output: results/<run>/<path>."""
    return f"results/{RUN}/{path}"


def logs(name):
    return f"results/{RUN}/logs/{name}.log"


def benchmarks(name):
    return f"results/{RUN}/benchmarks/{name}.tsv"


def code(module):
    """Fingerprint of a stage's code (its module and every workflow_scripts module it imports).

    Passed as a param: Snakemake only tracks the `script:` file itself, so without this an
    edit to the stage module would not restale the rule. Comments and docstrings do not count.
    """
    return code_fingerprint(f"workflow_scripts.{module}", SCRIPTS_DIR)


def section(name):
    """A config section as a param, keys sorted at every level.

    Snakemake compares params as text: sorting makes the comparison blind to key order, so
    reordering a config file restales nothing while any changed value still does.
    """
    return _sorted(config[name])


def _sorted(value):
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def shard_paths():
    n = config["hidden_states"]["num_shards"]
    return [results(f"hidden_states/shard-{i:05d}.safetensors") for i in range(n)]


def gpus(stage):
    """GPUs one job of `stage` uses, as its config says: the `gpu` resource a cluster executor
    requests (profiles/slurm). Core Snakemake only counts it; it never sets CUDA_VISIBLE_DEVICES.

    hidden_states runs the verifier on `hidden_states.device`. train needs a GPU when the
    config picks kernels that only run there (the fused loss needs Triton; flex attention has
    no CPU backward). The vLLM serving rules are sized in the profile: they take a whole node.
    """
    if stage == "hidden_states":
        return 0 if config["hidden_states"]["device"] == "cpu" else 1
    if stage == "train":
        train = config["train"]
        gpu_only = (
            train.get("loss_implementation") == "fused"
            or train.get("attn_impl") == "simple_flex_attention"
        )
        return 1 if gpu_only else 0
    raise ValueError(f"gpus({stage!r}): only hidden_states and train declare GPUs")


def serve_verifier_path():
    """The verifier path the exported draft names: where it will be served from."""
    return config["verifier"].get("serve_path") or str(Path(VERIFIER_DIR).resolve())


def verifier_identity():
    """What identifies the verifier for synth's resume cache (its config, not its mtime)."""
    return {
        "name": config["verifier"]["name"],
        "source": config["verifier"]["source"],
        "path": config["verifier"].get("path"),
    }
