"""Checkout runners: ``python -m pipelines.classify`` (``extract``, ``fit``, ``tune``,
``quickstart``) from a clone of the repository runs the installed CLI
``beam_prefix.pipelines.<name>``, so a job launched either way pickles the same modules
that its workers' package holds. ``tasks/``, ``data/`` and ``yaml/`` here link to the files
shipped inside the package (``beam_prefix/shipped``). Not part of the installed package.
"""
