"""Reproducing the paper's experiments (E1–E8, and E9: its proposed global proxy):
``python -m gem_mpi.reproduce``.

``experiments`` says what each experiment runs, ``runner`` runs the jobs (resumably) and
estimates their time, ``results`` reads what they wrote, ``report`` and ``claims`` write
docs/results/; ``imagefolder`` generates E8's images.
"""
