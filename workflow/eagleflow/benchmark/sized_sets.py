"""The benchmark_sets rule's job: every set's prompts (benchmark.sets), counted in the
verifier's tokens so that what cannot fit `server.max_model_len` is skipped and counted.
Apart from benchmark.sets so that reading a set (the prompts stage's benchmark filter reads
them too) needs no tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eagleflow.benchmark.sets import SetSpec, build_sets
from eagleflow.common.atomic import read_jsonl, write_json
from eagleflow.runtime.smk import stage


def conversation_tokens(verifier_dir: str, chat_template_kwargs: dict[str, Any]) -> Callable[[dict[str, Any]], int]:
    """Tokens of a conversation's last request but its replies: every user turn, with a
    one-character stand-in for each earlier reply, templated as the benchmark sends it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)

    def count(prompt: dict[str, Any]) -> int:
        messages = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
        for i, turn in enumerate(prompt["turns"]):
            if i:
                messages.append({"role": "assistant", "content": "."})
            messages.append({"role": "user", "content": turn})
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
        )
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return count


def main(smk) -> None:
    """The benchmark_sets rule's job (workflow/rules/benchmark.smk): every set's prompts, in one file."""
    with stage(smk) as log:
        sets = build_sets(
            read_jsonl(smk.input.prompts),
            smk.params.eval_size,
            [SetSpec.of(entry) for entry in smk.params.sets],
            conversation_tokens(smk.input.verifier, smk.params.chat_template_kwargs),
            smk.params.max_tokens,
            smk.params.max_model_len,
        )
        write_json(smk.output.sets, {"sets": sets})
        for s in sets:
            log.info(
                "benchmark set %s: %d conversations, %d turns, %d skipped (too long) (%s)",
                s["name"],
                len(s["prompts"]),
                sum(len(p["turns"]) for p in s["prompts"]),
                len(s["skipped_too_long"]),
                s["source"],
            )
