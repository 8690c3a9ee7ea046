"""Flex Template entry point of the fit template (FLEX_TEMPLATE_PYTHON_PY_FILE set to this
file when the template is built): runs `beam_prefix.pipelines.fit` with the template's parameters as
flags. The features are computed by the job's workers and staged beside the head file on
its own file system (gs://); the launcher reads them back, fits the head and writes it."""

import logging
import sys

from beam_prefix.pipelines.fit import main

if __name__ == "__main__":
    logging.getLogger().setLevel(logging.INFO)
    sys.exit(main())
