"""The user's own functions named on the command line as MODULE:FUNCTION (--sample-stage,
--model): imported the same way for both, each failure one line naming the flag.

MODULE is a dotted module or a file in the current folder: the current folder is put on
the import path first, as `python -m` does, so that the `pipeline-train` script (whose
path starts at its own folder) finds the same files as `python -m pipeline.train`.
"""
import importlib
import os
import sys

from pipeline.errors import InputError


def user_function(flag, item):
    """`flag MODULE:FUNCTION` -> the function; InputError in one line if it cannot be had."""
    module, _, function = item.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as e:
        hint = (f"; MODULE is a file of yours, {module.replace('.', os.sep)}.py in the current folder "
                f"({os.getcwd()}), or a module on PYTHONPATH") if e.name == module.split(".")[0] else ""
        raise InputError(f"{flag} {item}: {e.__class__.__name__}: {e}{hint}") from None
    except Exception as e:  # noqa: BLE001 - whatever a user's module raises on import, in one line
        raise InputError(f"{flag} {item}: {e.__class__.__name__}: {e}") from None
    if not callable(fn):
        raise InputError(f"{flag} {item}: not a function")
    return fn
