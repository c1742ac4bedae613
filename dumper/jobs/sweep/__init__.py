"""An invariance sweep (``python -m dumper sweep``): the job (:mod:`~dumper.jobs.sweep.run`: ``SweepConfig``,
``sweep``), the grid of settings and its cells (:mod:`~dumper.jobs.sweep.grid`), what it asks of an engine
(:mod:`~dumper.jobs.sweep.engine`), its results and their JSON (:mod:`~dumper.jobs.sweep.results`), and their
terminal rendering (:mod:`~dumper.jobs.sweep.table`).
"""
