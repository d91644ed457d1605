"""The one exception type the data layer raises for bad or missing data."""

from __future__ import annotations


class DatasetError(Exception):
    """A dataset file, record or input is missing, corrupt or inconsistent.

    The message names what is wrong and where (path, sample id, field) so a person can act on it.
    """
