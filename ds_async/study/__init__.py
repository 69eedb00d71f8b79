"""The loss-curve study (``launch/study/``): the paper's sync / 2BW / 2BW + EF comparison and the questions around it.

- :mod:`~ds_async.study.matrices`: the study's runs as ordinary ds_async JSON configs;
- :mod:`~ds_async.study.driver`: the driver that trains them (``python launch/study/run.py``);
- :mod:`~ds_async.study.runs`: reading run folders and the committed results into tables (pandas), and the tables
  of ``launch/study/RESULTS.md`` (``python -m ds_async.study.runs report [--check]``);
- :mod:`~ds_async.study.time_to_loss`: synchronous 1F1B against 2BW + Muon + EF on the same wall-clock through the
  engine (``python launch/study/time_to_loss.py``).

The notebooks (``notebooks/loss_curves.ipynb``, ``notebooks/plots.py``) draw from :mod:`~ds_async.study.runs`.
Nothing else in ``ds_async`` imports this package.
"""
