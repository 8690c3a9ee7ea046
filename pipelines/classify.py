"""`python -m pipelines.classify` from a checkout: runs `beam_prefix.pipelines.classify` (its docstring
and `--help` say what it does; installed, run `python -m beam_prefix.pipelines.classify`)."""

from beam_prefix.pipelines.classify import main
from beam_prefix.pipelines.launch import exit_process

if __name__ == "__main__":
    exit_process(main())
