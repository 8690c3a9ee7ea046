"""Files shipped with the package, no code: the ready-made task files and their trained heads
(``tasks/``), the sample and benchmark data (``data/``) and Beam YAML pipelines (``yaml/``).

Found by name with `beam_prefix.tasks.shipped` (``shipped_tasks()``, ``resolve_task``); in a
checkout, ``pipelines/tasks``, ``pipelines/data`` and ``pipelines/yaml`` link here.
"""
