"""`python -m eagleflow.train SPEC.json`: one training process (torchrun starts N of these).

SPEC.json holds run_train's arguments (see loop.run_from_json). Logs go to stderr, which the
Snakemake entry redirects to the rule's log.
"""

import json
import sys

from eagleflow.runtime.logs import configure_logging
from eagleflow.runtime.process import terminate_on_sigterm
from eagleflow.train.loop import run_from_json

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m eagleflow.train SPEC.json")
    configure_logging(sys.stderr)
    terminate_on_sigterm()
    with open(sys.argv[1]) as fh:
        run_from_json(json.load(fh))
