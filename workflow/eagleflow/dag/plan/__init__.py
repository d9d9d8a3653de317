"""The plan before a run (`python -m eagleflow.plan`): what a config will need, stage by
stage, before any GPU hour is spent. DAG-only: no rule runs it.

- needs: the plan itself: bytes per stage and free space, GPU memory, what fits, the settings
  that would make a run fit, its rendering and the one line `snakemake -n` prints;
- tokens: the tokens the hidden-state stage will see;
- sizes: the verifier's weights, the draft's parameters and memory;
- hours: hours per stage and to a served draft for 1..N verifier replicas;
- loads: the verifier loads the jobs Snakemake plans will take.
"""
