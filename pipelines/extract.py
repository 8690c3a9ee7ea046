"""`python -m pipelines.extract` from a checkout: runs `beam_prefix.pipelines.extract` (its docstring
and `--help` say what it does; installed, run `python -m beam_prefix.pipelines.extract`)."""

from beam_prefix.pipelines.extract import main
from beam_prefix.pipelines.launch import exit_process

if __name__ == "__main__":
    exit_process(main())
