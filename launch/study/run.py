"""The loss-curve study's driver: ``python launch/study/run.py MATRIX... [--list] [--gpus N] ...``.

The runs are :mod:`ds_async.study.matrices`'; how they are trained is :mod:`ds_async.study.driver`'s (its docstring
has the commands).
"""
import sys

from ds_async import console

console.quiet_imports()  # before DeepSpeed and transformers are imported, which the driver's imports do

from ds_async.study.driver import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
