"""Flex Template entry point (FLEX_TEMPLATE_PYTHON_PY_FILE): runs `beam_prefix.pipelines.classify`
with the template's parameters as flags."""

import logging
import sys

from beam_prefix.pipelines.classify import main

if __name__ == "__main__":
    logging.getLogger().setLevel(logging.INFO)
    sys.exit(main())
