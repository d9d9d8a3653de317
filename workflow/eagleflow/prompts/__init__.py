"""The prompts stage: where the conversations the verifier answers come from.

- `load`: prompt files, their canonical form, and the train/eval split;
- `template`: where a user turn opens and ends in the verifier's chat template;
- `written`: prompts the verifier writes itself (the write_prompts rule);
- `filters`: what a prompt set is cleaned of (duplicates, lengths, garbage, benchmark items);
- `packaged_sets`: MT-Bench and HumanEval from the packages that ship them (the benchmark
  measures on them; the filters keep training prompts away from them);
- `run`: the prompts rule's job (sources mixed, filtered, split, described).

Nothing is imported here: a module of the package restales only the rules that import it.
"""
