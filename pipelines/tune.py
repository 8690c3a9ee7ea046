"""`python -m pipelines.tune` from a checkout: runs `beam_prefix.pipelines.tune` (its docstring
and `--help` say what it does; installed, run `python -m beam_prefix.pipelines.tune`)."""

from beam_prefix.pipelines.tune import main
from beam_prefix.pipelines.launch import exit_process

if __name__ == "__main__":
    exit_process(main())
