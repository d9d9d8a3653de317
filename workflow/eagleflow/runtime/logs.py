"""One logging setup for every process eagleflow starts: Snakemake jobs and torchrun ranks."""

from __future__ import annotations

import logging
from typing import TextIO

# HTTP client libraries log every request at INFO: thousands of lines per generate job.
QUIET = ("httpx", "httpx2", "httpcore", "httpcore2", "urllib3")


def configure_logging(stream: TextIO) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=stream, force=True
    )
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
