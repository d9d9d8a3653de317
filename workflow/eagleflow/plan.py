"""`python -m eagleflow.plan`: the plan before a run (eagleflow.dag.plan), under the name the
docs, the Makefile and the stages' messages give it."""

import sys

from eagleflow.dag.plan.needs import main

sys.exit(main())
