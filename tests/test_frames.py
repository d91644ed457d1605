"""ams.wire.frames' meta encoding, alone (the frames over a real shard: tests/integration/
test_data_plane.py)."""

from __future__ import annotations

import pytest

from ams.wire import frames
from ams.wire.frames import FrameError


def test_a_repeated_meta_decodes_to_a_new_dict_each_time():
    raw = b'{"table":"fc","lr":0.5}'
    first = frames.decode_meta(bytearray(raw))
    first["table"] = "changed"
    first["extra"] = 1
    again = frames.decode_meta(memoryview(raw))
    assert again == {"table": "fc", "lr": 0.5}
    assert again is not frames.decode_meta(raw)


def test_nested_values_are_never_shared_between_decodes():
    raw = b'{"shared":{"fd":3},"list":[1]}'
    first = frames.decode_meta(raw)
    first["shared"]["fd"] = 99
    first["list"].append(2)
    assert frames.decode_meta(raw) == {"shared": {"fd": 3}, "list": [1]}


@pytest.mark.parametrize("raw", [b'{"table": "\xff"}', '{"table": "t"}'.encode("utf-16"),
                                 '{"table": "t"}'.encode("utf-32"), b"[1]", b"{nope"])
def test_a_meta_that_is_no_utf8_json_object_is_refused_even_after_good_ones(raw):
    frames.decode_meta(b'{"table":"t"}')
    with pytest.raises(FrameError, match="not JSON|JSON object"):
        frames.decode_meta(raw)


def test_a_meta_decodes_to_what_was_encoded():
    for name in ("fc", 'quo"te', "ünï"):
        assert frames.decode_meta(frames.encode_meta({"table": name})) == {"table": name}
