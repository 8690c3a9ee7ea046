"""The command-line pipelines (classify, extract, fit, tune) and the options and IO layer
they share. Importing the package first sets up `console`, which holds the log records and
warnings the CLIs' libraries emit while they import (before any CLI imports Beam), for
`console.run_cli` to show as one line each."""

from beam_prefix.pipelines import console  # noqa: F401
