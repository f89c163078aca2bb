import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engine.core.errors import ModelFormatError
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter
from engine.nnet.config_line import ConfigLine
from engine.core.errors import ConfigError


@pytest.mark.parametrize("binary", [False, True])
def test_roundtrip_basic_types(binary):
    m = (np.arange(12, dtype=np.float32).reshape(3, 4) / 7).astype(np.float32)
    w = KaldiWriter(binary, header=True)
    w.write_token("<A>")
    w.write_int(-5)
    w.write_float(0.001)
    w.write_bool(True)
    w.write_matrix(m)
    w.write_vector([1.0, 2.5])
    w.write_int_vector([3, -4])
    w.write_matrix(np.zeros((0, 0), np.float32))
    w.write_token("</A>")
    r = KaldiReader(w.getvalue())
    assert r.binary == binary
    assert r.read_token() == "<A>"
    assert r.read_int() == -5
    assert np.float32(r.read_float()) == np.float32(0.001)
    assert r.read_bool() is True
    np.testing.assert_array_equal(r.read_matrix(), m)
    np.testing.assert_array_equal(r.read_vector(), [1.0, 2.5])
    assert r.read_int_vector() == [3, -4]
    assert r.read_matrix().size == 0
    r.expect_token("</A>")
    assert r.at_eof()


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_reader_fuzz_only_typed_errors(data):
    r = KaldiReader(data)
    try:
        r.read_token()
        r.read_int()
        r.read_matrix()
        r.read_vector()
        r.read_float()
        r.read_bool()
    except ModelFormatError as e:
        assert "byte" in str(e)


def test_truncated_binary_matrix_names_offset():
    w = KaldiWriter(True, header=True)
    w.write_matrix(np.ones((4, 4), np.float32))
    data = w.getvalue()[:-5]
    with pytest.raises(ModelFormatError, match="at byte"):
        KaldiReader(data).read_matrix()


def test_config_line_typed_getters_and_errors():
    c = ConfigLine("component name=a type=AffineComponent input-dim=3 scale=x", source="f", line=7)
    assert c.first_token == "component"
    assert c.get_str("name") == "a"
    assert c.get_int("input-dim") == 3
    with pytest.raises(ConfigError, match=r"f:7: option scale='x' is not a number"):
        c.get_float("scale")
    assert c.unused() == ["type"]
    with pytest.raises(ConfigError, match="given twice"):
        ConfigLine("a b=1 b=2")
