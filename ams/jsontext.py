"""JSON from files and frames another process wrote: one parser whose every refusal is a
ValueError."""

from __future__ import annotations

import json


def parse_json(text: str | bytes) -> object:
    """``json.loads(text)``, with nesting too deep for the parser (a ``RecursionError`` from
    ``json``) refused as ``ValueError`` too, like every other text that is not JSON (invalid
    UTF-8 included), so a reader of hostile input catches one type."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
