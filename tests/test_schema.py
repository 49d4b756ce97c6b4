"""The pieces of a schema one at a time: fields' values from members (pipeline.data.fields.member_values), the
augment stages, a Column's checks, and the check of what a stage of the user's returns."""
import io
import json
import random
import re

import numpy as np
import pytest
from PIL import Image

from helpers import encode_pil
from pipeline.data.fields import augment
from pipeline.data.fields.schema import Column, Oversized, Schema
from pipeline.data.fields.member_values import check_value, npy_value, value_of


def value(col, data, ext=None):
    ext, path = col.members[0] if ext is None else (ext, None)
    return value_of(col, ext, path, data, {}, lambda: random.Random(0))


def npy(a, **kw):
    buf = io.BytesIO()
    np.save(buf, a, **kw)
    return buf.getvalue()


def test_numbers_from_text_members_and_json_paths():
    assert value(Column("y", "int", "cls"), b"7\n") == 7
    assert value(Column("y", "int", "txt", length=3), b"1, 2 3").tolist() == [1, 2, 3]
    assert value(Column("y", "float", "json:a.b.1"), json.dumps({"a": {"b": [0, 2.5]}}).encode()) == np.float32(2.5)
    bad = [(Column("y", "int", "cls"), b"3.5", "not a 64-bit integer"), (Column("y", "int", "cls"), b"x", "not a number"), (Column("y", "int", "cls"), b"1 2", "holds 2 value"),
           (Column("y", "int", "cls"), str(1 << 64).encode(), "not a 64-bit integer"),
           (Column("y", "float", "txt"), b"nan", "not finite"),
           (Column("y", "int", "json:y"), b'{"y": true}', "not a number"),
           (Column("y", "int", "json:y"), b'{"y": [1, 2]}', "not a scalar"),
           (Column("y", "int", "json:a.5"), b'{"a": [1, 2]}', "no '5' there (a list of 2)"),
           (Column("y", "text", "json:t"), b'{"t": 3}', "not a string"),
           (Column("y", "text", "json:t", max_bytes=4), b'{"t": "\\u00e9\\u00e9\\u00e9"}', "more than 4 bytes"),
           (Column("y", "text", "txt"), b"\xff\xfe", "not UTF-8 text"),
           (Column("y", "int", "json:y"), b"{" * 100000, "not valid JSON")]
    for col, data, said in bad:
        with pytest.raises(ValueError, match=re.escape(said)):
            value(col, data)


def test_a_class_field_is_one_class_index_a_sample_and_one_a_schema():
    assert value(Column("y", "class", "cls"), b"7\n") == 7 and value(Column("y", "class", "json:c"), b'{"c": 2}') == 2
    assert value(Column("y", "class", "cls"), b" cat\n") == "cat"  # a name: the manifest's classes map it
    assert value(Column("y", "class", "json:c"), b'{"c": "cat"}') == "cat"
    # one reading of a class value (labelling.class_value), as --index reads a label: ASCII digits are
    # an id ('03' and '+3' are 3), any other text a name as written, a JSON float or true no class
    assert value(Column("y", "class", "cls"), b"+03") == 3
    assert value(Column("y", "class", "cls"), b"2.0") == "2.0" and value(Column("y", "class", "cls"), "\u0663".encode()) == "\u0663"
    for data, said in ((b"-1", "not a class index"), (b"", "empty, not an integer or a class name")):
        with pytest.raises(ValueError, match=said):
            value(Column("y", "class", "cls"), data)
    for data, said in ((b'{"c": 2.0}', "2.0 is not an integer"), (b'{"c": true}', "true is not an integer")):
        with pytest.raises(ValueError, match=said):
            value(Column("y", "class", "json:c"), data)
    with pytest.raises(ValueError, match="no length"):
        Column("y", "class", "cls", length=2)
    with pytest.raises(ValueError, match="one class field"):
        Schema([Column("a", "class", "cls"), Column("b", "class", "json:c")])
    assert check_value(Column("y", "class", "cls"), 3) is None and check_value(Column("y", "class", "cls"), 0.5)


def test_arrays_are_checked_from_their_header_and_cast_within_their_kind():
    col = Column("a", "array", "npy", shape=(3, 4))
    f = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    got = npy_value(npy(f), col)
    assert got.dtype == np.float32 and (got == f).all()
    assert npy_value(npy(np.ones(3, np.int16)), Column("a", "array", "npy", shape=4)).dtype == np.float32
    for a, col, said in ((np.ones(3, np.float32), Column("a", "array", "npy", shape=4, dtype="int32"), "losing its kind"),
                         (np.ones((2, 2)), Column("a", "array", "npy", shape=4), "the field takes at most"),
                         (np.ones(5), Column("a", "array", "npy", shape=4), "the field takes at most"),
                         (np.array(["x"]), Column("a", "array", "npy", shape=4), "not numbers")):
        with pytest.raises(ValueError, match=said):
            npy_value(npy(a), col)
    with pytest.raises(ValueError, match="header claims 4 values"):
        npy_value(npy(np.ones(4, np.float32))[:-8], Column("a", "array", "npy", shape=4))


def test_a_0d_npy_is_one_value_and_a_refusal_names_its_shape_and_the_fields():
    """np.save of a scalar: one value of shape (1,) (the shape inference gives its field), within any
    one-dimensional field; a field of other dimensions refuses it naming both shapes."""
    for shape in (1, 3):
        got = npy_value(npy(np.float64(2.5)), Column("a", "array", "npy", shape=shape))
        assert got.shape == (1,) and got.dtype == np.float32 and got[0] == 2.5
    with pytest.raises(ValueError, match=re.escape(".npy of shape () (a scalar), the field takes at most (2, 2)")):
        npy_value(npy(np.float32(1)), Column("a", "array", "npy", shape="2x2"))


def test_images_fit_by_policy():
    img = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    png = encode_pil(Image.fromarray(img), "PNG")
    fit = lambda **kw: value(Column("i", "image", "png", **kw), png)  # noqa: E731
    assert fit(size=(20, 20), fit="resize").shape == (3, 20, 20)
    assert fit(size=(20, 20)).shape == (3, 20, 20) and fit(size=(20, 20), fit="random-crop").shape == (3, 20, 20)
    assert fit(size=(30, 30), fit="pad").shape == (3, 20, 30)
    assert fit(size=(100, 100), fit="pad").shape == (3, 67, 100)
    assert (fit(size=(100, 100), fit="native") == img.transpose(2, 0, 1)).all()  # never enlarged
    assert fit(size=(30, 30), fit="native").shape == (3, 20, 30)
    assert fit(size=(8, 8), fit="resize", channels=1).shape == (1, 8, 8)
    with pytest.raises(ValueError, match="times as elongated"):
        value(Column("i", "image", "png", size=(4, 4)), encode_pil(Image.new("RGB", (400, 4)), "PNG"))


def test_a_member_over_its_cap_and_a_missing_one_are_one_line_each():
    s = Schema([Column("t", "text", "txt", max_bytes=10), Column("b", "bytes", "bin;dat", optional=True)])
    assert s.pick({"__key__": "k", "txt": b"hi"}) == {"t": ("txt", None, b"hi")}
    assert s.pick({"__key__": "k", "txt": b"hi", "dat": b"1"})["b"] == ("dat", None, b"1")
    with pytest.raises(ValueError, match=r"field t: .txt of 11 bytes, more than its cap of 10"):
        s.pick({"txt": b"x" * 11})
    with pytest.raises(ValueError, match=r"field t: .txt of 1048576 bytes, more than its cap of 10"):
        s.pick({"txt": Oversized(1 << 20)})
    with pytest.raises(ValueError, match=r"field t: no .txt member \(has jpg\)"):
        s.pick({"__key__": "k", "jpg": None})


def test_stages_crop_flip_jitter_and_tokenise_from_their_generator():
    a = np.random.default_rng(1).integers(0, 256, (3, 30, 40), dtype=np.uint8)
    rrc = augment.RandomResizedCrop("i", (8, 6))
    out = [rrc(a, random.Random(s)) for s in range(20)]
    assert all(o.shape == (3, 8, 6) and o.dtype == np.uint8 for o in out)
    assert (rrc(a, random.Random(3)) == out[3]).all() and len({o.tobytes() for o in out}) == 20
    assert (augment.RandomCrop("i", (30, 40))(a, random.Random(0)) == a).all()
    with pytest.raises(ValueError, match="image of 30x40 is smaller than the 31x10 crop"):
        augment.RandomCrop("i", (31, 10))(a, random.Random(0))
    assert (augment.Flip("i", p=1)(a, random.Random(0)) == a[:, :, ::-1]).all()
    assert augment.Flip("i", p=0)(a, random.Random(0)) is a
    assert (augment.ColorJitter("i", 0, 0, 0)(a, random.Random(0)) == a).all()
    j = augment.ColorJitter("i")(a, random.Random(0))
    assert j.dtype == np.uint8 and j.shape == a.shape and (j != a).any()
    assert augment.Tokenize("t", lambda s: [1] * len(s), 4)("abcdef", None).tolist() == [1, 1, 1, 1]
    col = augment.Tokenize("t", len, 4).column(Column("t", "text", "txt"))
    assert col.tokens == 4 and not col.listed and col.padded
    with pytest.raises(ValueError, match="an image field expected"):
        Schema([Column("t", "text", "txt")], [augment.Flip("t")])
    with pytest.raises(ValueError, match="no field 'x'"):
        Schema([Column("t", "text", "txt")], [augment.Flip("x")])


def test_what_a_users_stage_returns_is_checked_against_the_fields():
    image = Column("i", "image", "png", size=(4, 4))
    assert check_value(image, np.zeros((3, 4, 4), np.uint8)) is None
    assert "uint8 (3, H, W)" in check_value(image, np.zeros((3, 4, 4), np.float32))
    assert "the field takes 4x4" in check_value(image, np.zeros((3, 5, 4), np.uint8))
    pad = Column("i", "image", "png", size=(4, 4), fit="pad")
    assert check_value(pad, np.zeros((3, 2, 4), np.uint8)) is None
    assert check_value(Column("t", "text", "txt"), b"x") == "a str expected, got bytes"
    assert check_value(Column("n", "float", "cls", length=2), [1.0, 2.0]) is None
    assert "shape (2,)" in check_value(Column("n", "float", "cls", length=2), [1.0])


def test_a_column_says_what_it_lacks():
    for kw, said in ((dict(kind="image", member="png"), "needs its size"),
                     (dict(kind="array", member="npy"), "needs its shape"),
                     (dict(kind="array", member="bin", shape=4), "reads .npy members"),
                     (dict(kind="bytes", member="json:x"), "whole member"),
                     (dict(kind="text", member="txt", max_bytes=0), "max_bytes 0"),
                     (dict(kind="int", member="cls", length=1 << 20), "length"),
                     (dict(kind="image", member="png", size=(4, 4), fit="stretch"), "fit 'stretch'"),
                     (dict(kind="text", member="a b"), "member 'a b'")):
        with pytest.raises(ValueError, match=said):
            Column("x", **kw)
    with pytest.raises(ValueError, match="clashes"):
        Schema([Column("a", "image", "png", size=4, fit="pad"), Column("a_size", "int", "cls")])


def test_an_integer_the_fields_dtype_cannot_hold_exactly_is_refused_naming_it():
    """int64 2**53+1 as float32 was 9007199254740992.0 and uint64's largest as int64 was -1, without a
    word; an int64 field keeps 2**53+1, and small integers still read into float32."""
    big = np.array([1, 2 ** 53 + 1], np.int64)
    for a, dtype, said in ((big, "float32", "value 9007199254740993 (int64) is not exactly a float32"),
                           (np.array([2 ** 64 - 1], np.uint64), "int64",
                            "value 18446744073709551615 (uint64) is not exactly a int64")):
        with pytest.raises(ValueError, match=re.escape(said)):
            npy_value(npy(a), Column("a", "array", "npy", shape=2, dtype=dtype))
    assert npy_value(npy(big), Column("a", "array", "npy", shape=2, dtype="int64")).tolist() == big.tolist()
    assert npy_value(npy(np.int64(2 ** 24)), Column("a", "array", "npy", shape=1)).tolist() == [2 ** 24]


@pytest.mark.parametrize("a, dtype, said", [
    (np.array([1, 2 ** 53 + 1], np.int64), "float64", "value 9007199254740993 (int64) is not exactly a float64"),
    (np.array([2 ** 63 - 1], np.int64), "float64", "value 9223372036854775807 (int64) is not exactly a float64"),
    (np.array([2 ** 64 - 1], np.uint64), "float64", "value 18446744073709551615 (uint64) is not exactly a float64"),
    (np.array([2 ** 31 - 1], np.int32), "float32", "value 2147483647 (int32) is not exactly a float32"),
    (np.array([65535], np.uint16), "float16", "value 65535 (uint16) is not exactly a float16"),
    (np.array([1.0, 1e40]), "float32", "value 1e+40 (float64) is past the range of float32"),
    (np.array([70000.0]), "float16", "value 70000.0 (float64) is past the range of float16")])
def test_a_number_a_float_field_would_change_or_make_inf_is_refused(a, dtype, said):
    """int64 2**53+1 as float64 was 2**53 (numpy calls that cast safe, so no check ran), uint64's largest
    as float64 was 2**64, 1e40 as float32 was inf with only numpy's warning."""
    with pytest.raises(ValueError, match=re.escape(said)):
        npy_value(npy(a), Column("a", "array", "npy", shape=len(a), dtype=dtype))


def test_what_a_float_field_holds_as_it_was_still_reads():
    """NaN and inf stay themselves, -2**63 and 2**53 are floats exactly, 1.1 rounds as a float does."""
    kept = npy_value(npy(np.array([np.nan, np.inf, -np.inf, 1.1])), Column("a", "array", "npy", shape=4))
    assert np.isnan(kept[0]) and kept[1:3].tolist() == [np.inf, -np.inf] and kept[3] == np.float32(1.1)
    ints = np.array([-2 ** 63, 2 ** 53], np.int64)
    assert npy_value(npy(ints), Column("a", "array", "npy", shape=2, dtype="float64")).tolist() == ints.tolist()
    assert value(Column("y", "float", "txt", length=2), b"16777216 1.1").tolist() == [2 ** 24, np.float32(1.1)]


@pytest.mark.parametrize("col, data, said", [
    (Column("y", "float", "json:a"), b'{"a": 16777217}', "json:a: 16777217 is not exactly a float32"),
    (Column("y", "float", "json:a"), b'{"a": 1e40}', "json:a: 1e+40 is past the range of float32"),
    (Column("y", "float", "txt"), b"16777217", ".txt: 16777217 is not exactly a float32"),
    (Column("y", "float", "cls", length=2), b"1, -1e300", ".cls: -1e+300 is past the range of float32")])
def test_a_number_of_a_text_or_json_member_a_float_field_would_change_is_refused(col, data, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        value(col, data)


def test_a_stages_number_the_batch_would_change_is_refused():
    """What a user's stage returns is cast into its field's dtype in the batch: checked as a member's is."""
    f = Column("y", "float", "txt")
    assert check_value(f, 2 ** 53 + 1) == "value 9007199254740993 (int64) is not exactly a float32, the field's dtype"
    assert check_value(f, 1e40) == "value 1e+40 (float64) is past the range of float32, the field's dtype"
    assert check_value(f, float("inf")) is None and check_value(f, 3) is None and check_value(f, 1.1) is None
    assert "not exactly a int64" in check_value(Column("y", "int", "txt"), np.uint64(2 ** 64 - 1))
    arr = Column("a", "array", "npy", shape=2, dtype="int64")
    assert check_value(arr, np.array([1.5, 1])) == "an array of int64 expected, got float64 (2,)"
    assert "past the range of float32" in check_value(Column("a", "array", "npy", shape=2), np.array([1e40]))
