"""Flex Template entry point of the extraction template (FLEX_TEMPLATE_PYTHON_PY_FILE set to
this file when the template is built): runs `beam_prefix.pipelines.extract` with the template's
parameters as flags."""

import logging
import sys

from beam_prefix.pipelines.extract import main

if __name__ == "__main__":
    logging.getLogger().setLevel(logging.INFO)
    sys.exit(main())
