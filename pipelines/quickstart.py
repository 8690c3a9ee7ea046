"""`python -m pipelines.quickstart` from a checkout: runs `beam_prefix.pipelines.quickstart`
(installed, run `python -m beam_prefix.pipelines.quickstart`)."""

import logging

from beam_prefix.pipelines.quickstart import run

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run()
