"""`python -m pipelines.fit` from a checkout: runs `beam_prefix.pipelines.fit` (its docstring
and `--help` say what it does; installed, run `python -m beam_prefix.pipelines.fit`)."""

from beam_prefix.pipelines.fit import main
from beam_prefix.pipelines.launch import exit_process

if __name__ == "__main__":
    exit_process(main())
