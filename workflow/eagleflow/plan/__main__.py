import sys

from eagleflow.plan.needs import main

sys.exit(main())
