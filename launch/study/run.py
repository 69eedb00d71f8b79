"""The loss-curve study's driver: ``python launch/study/run.py MATRIX... [--list] [--gpus N] ...``.

The runs are :mod:`ds_async.study.matrices`'; how they are trained is :mod:`ds_async.study.driver`'s (its docstring
has the commands).
"""
import sys

from ds_async.study.driver import main

if __name__ == "__main__":
    sys.exit(main())
