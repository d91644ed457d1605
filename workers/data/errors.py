"""The one exception type the data layer raises for bad or missing data."""

from __future__ import annotations


class DatasetError(Exception):
    """A dataset file, record or input is missing, corrupt or inconsistent.

    The message names what is wrong and where (path, sample id, field) so a person can act on it.
    """


# How torch re-raises an exception of a DataLoader worker in the loading process: the same type,
# its message the worker's whole traceback (torch.utils._utils.ExceptionWrapper.reraise).
_FROM_WORKER = "Caught DatasetError in DataLoader worker"
_LAST_LINE = f"\n{DatasetError.__module__}.{DatasetError.__qualname__}: "


def unwrap_worker_error(error: DatasetError) -> DatasetError:
    """``error`` with the message it was raised with, when torch re-raised it from a DataLoader
    worker process: the traceback's last line, which ``traceback`` writes as the qualified type
    and the message. Any other error is returned as it is."""
    text = str(error)
    at = text.rfind(_LAST_LINE)
    if not text.startswith(_FROM_WORKER) or at < 0:
        return error
    return DatasetError(text[at + len(_LAST_LINE):].strip())
