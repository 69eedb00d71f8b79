"""Time to loss through the real engine: ``python launch/study/time_to_loss.py --budget S --gpus N --out DIR``.

The comparison is :mod:`ds_async.study.time_to_loss`'s (its docstring has the commands and what it writes).
"""
import sys

from ds_async.study.time_to_loss import main

if __name__ == "__main__":
    sys.exit(main())
