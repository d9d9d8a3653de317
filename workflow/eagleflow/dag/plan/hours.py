"""Hours each stage will take, and the time to a served draft, from the plan's tokens and the
rates in `throughput` (or those a finished run measured), for 1..N verifier replicas.

- write_prompts and generate: a start of each replica, then the tokens they write at
  `generate_tokens_per_s` per replica (written turns at `prompts.written.max_tokens`, replies
  at `throughput.reply_tokens`, else `generate.max_tokens`: the upper bound);
- hidden_states: a start of the extraction server, then every sample token the store lacks
  at `extract_tokens_per_s` (one job and one server per node; none when the store holds
  every sample, and none online, where training computes the states, nor served);
- served (`hidden_states.mode: served`): the train job's server (or the servers
  `served.endpoints` names, side by side) extracts every sample token once an epoch while the
  draft trains on them, so each draft's training takes the longer of the two, and one start;
- train: for each distinct draft, every sample token `train.epochs` times (of its
  `sample_fraction`), at its method's rate (`train_tokens_per_s`, else what a finished run
  measured for that method); the drafts one after another;
- benchmark: the baseline and one speculative run per draft, a start each, every measured
  request at its `benchmark.max_tokens`, at `generate_tokens_per_s`.
A stage whose rate is unknown has no hours, and the total says so. Pure but for
`measured_rates`, which reads a finished run.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HOUR = 3600.0
# The standard sets' conversations and turns (prompts.packaged_sets), for a whole set (`size: null`).
SET_CONVERSATIONS = {"mt_bench": 80, "humaneval": 164, "long_context": 164}
SET_TURNS = {"mt_bench": 2}


@dataclass(frozen=True)
class Rates:
    """The `throughput` config section: tokens per second of one replica per stage."""

    reply_tokens: int | None
    generate_tokens_per_s: float | None
    extract_tokens_per_s: float | None
    train_tokens_per_s: float | None  # every method's, where set
    verifier_load_s: float
    replicas: tuple[int, ...]

    def train_rate(self, method: str) -> float | None:
        """A draft method's training tokens/s: the configured rate."""
        return self.train_tokens_per_s


@dataclass(frozen=True)
class MeasuredRates(Rates):
    """The config's rates, and each draft method's training rate a finished run measured
    (measured_rates): what a method's training takes where the config sets no rate."""

    measured_train: tuple[tuple[str, float], ...] = ()

    def train_rate(self, method: str) -> float | None:
        return self.train_tokens_per_s or dict(self.measured_train).get(method)


@dataclass(frozen=True)
class Training:
    """One distinct draft's training: its method, and how many times it reads the samples'
    tokens (epochs times its sample fraction)."""

    method: str
    passes: float

    @classmethod
    def of(cls, train: dict[str, Any]) -> Training:
        return cls(train["method"], train["epochs"] * train["sample_fraction"])


@dataclass(frozen=True)
class Work:
    """What a run will do: samples, their tokens (prompt and reply), and the requests the
    verifier answers."""

    samples: int
    tokens: int
    written_tokens: int  # tokens the verifier writes as prompts
    reply_tokens: int  # tokens it writes as replies
    benchmark_tokens: int  # tokens one benchmark pass generates (baseline or speculative)
    trainings: tuple[Training, ...]  # one per distinct draft
    stored_tokens: int = 0  # of `tokens`, those the hidden states' store holds: not extracted again

    @property
    def extract_tokens(self) -> int:
        return max(0, self.tokens - self.stored_tokens)


def planned_work(
    samples: int,
    tokens: int,
    exact: bool,
    config: dict[str, Any],
    rates: Rates,
    stored_tokens: int = 0,
    drafts: list[dict[str, Any]] | None = None,
) -> Work:
    """The work of a run of `samples` samples of `tokens` tokens in all (`exact`: counted in
    the dataset; else the plan's upper bound, every reply at generate.max_tokens, which
    `throughput.reply_tokens` brings down to the expected length), training `drafts` (the
    train section of each distinct draft; default: the config's one). Pure."""
    written = config["prompts"]["written"]
    max_tokens = config["generate"]["max_tokens"]
    reply = rates.reply_tokens or max_tokens
    if not exact and reply < max_tokens:
        tokens = max(samples, tokens - samples * (max_tokens - reply))
    bench = config["benchmark"]
    requests = bench["num_prompts"] + sum(
        (entry.get("size") or SET_CONVERSATIONS.get(entry["name"], 0)) * SET_TURNS.get(entry["name"], 1)
        for entry in bench["sets"]
    )
    return Work(
        samples=samples,
        tokens=tokens,
        written_tokens=written["count"] * written["turns"] * written["max_tokens"],
        reply_tokens=samples * reply,
        benchmark_tokens=requests * bench["max_tokens"] * len(bench["temperatures"]),
        trainings=tuple(Training.of(t) for t in (drafts or [config["train"]])),
        stored_tokens=stored_tokens,
    )


def scaled(work: Work, samples: int) -> Work:
    """The same run at `samples` samples: prompts and tokens in proportion, the store's as it
    is (a run grown to `samples` extracts what it adds). Pure."""
    f = samples / work.samples if work.samples else 0.0
    return replace(
        work,
        samples=samples,
        tokens=round(work.tokens * f),
        written_tokens=round(work.written_tokens * f),
        reply_tokens=round(work.reply_tokens * f),
    )


def stage_hours(work: Work, rates: Rates, replicas: int, config: dict[str, Any]) -> dict[str, float | None]:
    """Hours per stage with `replicas` verifier replicas (None: its rate is unknown). Pure."""
    load = rates.verifier_load_s

    def served(tokens: int, rate: float | None, parallel: int) -> float | None:
        if not tokens:
            return 0.0
        return None if rate is None else (load + tokens / (rate * parallel)) / HOUR

    mode = config["hidden_states"]["mode"]
    per_draft = [(t.passes, rates.train_rate(t.method)) for t in work.trainings]
    train = (
        None
        if any(rate is None for _, rate in per_draft)
        else sum(work.tokens * passes / rate for passes, rate in per_draft) / HOUR
    )
    if mode == "served" and train is not None:
        # Extraction and training overlap (the feed asks ahead): the slower sets the pace. The
        # servers named in served.endpoints, or the replicas it launches, feed it side by side.
        served_cfg = config["hidden_states"]["served"]
        servers = len(served_cfg["endpoints"] or []) or served_cfg["servers"]
        extract = None if rates.extract_tokens_per_s is None else rates.extract_tokens_per_s * servers
        train = (
            None
            if extract is None
            else sum(
                (load + max(work.tokens * passes / rate, work.tokens * passes / extract)) / HOUR
                for passes, rate in per_draft
            )
        )
    return {
        "write_prompts": served(work.written_tokens, rates.generate_tokens_per_s, replicas),
        "generate": served(work.reply_tokens, rates.generate_tokens_per_s, replicas),
        # One job and one server per node (hidden_states.num_parts), side by side.
        "hidden_states": 0.0
        if mode in ("online", "served")
        else served(work.extract_tokens, rates.extract_tokens_per_s, config["hidden_states"]["num_parts"]),
        "train": train,
        # The baseline and each draft's run, one server each, one after the other.
        "benchmark": None
        if rates.generate_tokens_per_s is None
        else (1 + len(work.trainings)) * (load + work.benchmark_tokens / rates.generate_tokens_per_s) / HOUR,
    }


def total_hours(hours: dict[str, float | None]) -> float | None:
    return None if any(h is None for h in hours.values()) else sum(hours.values())


def measured_rates(root: Path, run: str, rates: Rates) -> tuple[MeasuredRates, list[str]]:
    """`rates` with each unset rate taken from what run `run` under `root` measured, and a
    line per rate taken: generate's sent tokens over its server time, the part jobs' tokens
    over their wall time, each draft method's median training tokens/s (the median of its
    drafts' medians)."""
    base = root / f"results/{run}"
    found: dict[str, float] = {}
    notes = []
    stats = base / "generate/stats.json"
    if rates.generate_tokens_per_s is None and stats.exists():
        s = json.loads(stats.read_text())
        if s.get("sent_tokens") and s.get("server_s"):
            found["generate_tokens_per_s"] = s["sent_tokens"] / s["server_s"]
            notes.append(f"generate_tokens_per_s {found['generate_tokens_per_s']:.0f}: measured by {stats}")
    # The tokens the part jobs extracted over the time they took once their server answered
    # (stats.json): the store answered the rest, and a planned load counts the start.
    extracted = base / "hidden_states/stats.json"
    stats = json.loads(extracted.read_text()) if extracted.exists() else {}
    tokens, seconds = stats.get("extracted_tokens", 0), stats.get("extract_s", 0)
    if rates.extract_tokens_per_s is None and tokens and seconds:
        found["extract_tokens_per_s"] = tokens / seconds
        notes.append(
            f"extract_tokens_per_s {found['extract_tokens_per_s']:.0f}: measured by the extraction jobs "
            f"({extracted}; per server, its start left out)"
        )
    by_method: dict[str, list[float]] = {}
    for metrics in sorted((base / "drafts").glob("*/train/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        speeds = [r["tokens_per_s"] for r in rows if r.get("split") == "train" and r.get("tokens_per_s")]
        method = trained_method(metrics.parent)
        if speeds and method:
            by_method.setdefault(method, []).append(statistics.median(speeds))
    if rates.train_tokens_per_s is None and by_method:
        found["measured_train"] = tuple(sorted((m, statistics.median(v)) for m, v in by_method.items()))
        for method, rate in found["measured_train"]:
            notes.append(f"train_tokens_per_s of {method} {rate:.0f}: measured by {base / 'drafts'}")
    return MeasuredRates(**(asdict(rates) | found)), notes


def trained_method(train_dir: Path) -> str | None:
    """The method of the draft a training exported (its config.json, as speculators names
    it), None before the export."""
    from eagleflow.benchmark.speculative import read_draft_config
    from eagleflow.train.methods import method_of

    exported = train_dir.parent / "draft"
    return method_of(read_draft_config(str(exported))).name if (exported / "config.json").exists() else None


def render_hours(work: Work, rates: Rates, config: dict[str, Any], samples: list[int] | None = None) -> str:
    """Hours per stage for each replica count, and the time to a served draft at each of
    `samples` (default: the run's own). Pure."""
    counts = samples or [work.samples]
    stages = list(stage_hours(work, rates, 1, config))
    lines = [
        "| samples | replicas | " + " | ".join(stages) + " | to a served draft |",
        "|---|---|" + "---|" * (len(stages) + 1),
    ]
    for n in counts:
        w = scaled(work, n)
        for r in rates.replicas:
            hours = stage_hours(w, rates, r, config)
            cells = [_h(hours[s]) for s in stages]
            lines.append(f"| {n:,} | {r} | " + " | ".join(cells) + f" | {_h(total_hours(hours))} |")
    unknown = [k for k in ("generate_tokens_per_s", "extract_tokens_per_s") if getattr(rates, k) is None]
    unknown += [
        f"train_tokens_per_s ({t.method})" for t in dict.fromkeys(work.trainings) if rates.train_rate(t.method) is None
    ]
    if unknown:
        lines += ["", "Unknown rates (set them under `throughput`, or run once to measure them): " + ", ".join(unknown)]
    return "\n".join(lines) + "\n"


def _h(hours: float | None) -> str:
    if hours is None:
        return "?"
    if hours == 0:
        return "-"
    return f"{hours * 60:.0f} min" if hours < 1 else f"{hours:.1f} h"
