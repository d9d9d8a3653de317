"""What builds the DAG and no rule runs: the variants (variants), what the rules' params hold
(rule_params) and the plan before a run (plan). In no stage's fingerprint: an edit here restales
a job only through what its params or its inputs become."""
