"""A batch's keys from the workers (pipeline.data.fields.keys): one string split only when read,
read as the list of keys was (len, index, iteration, equality, +, pickling, the trainer's key log)."""
import copy
import io
import pickle

import pytest
import torch

from helpers import HALF, train_sources
from pipeline.data.fields.keys import Keys
from pipeline.data.handover.loader import make_loader
from pipeline.data.handover.workers import pack, unpack
from pipeline.data.streams.stream import MixedStream
from pipeline.train.metrics import KeyLog, key_line, read_keys

KEYS = ["mnist-train-0000003", "cifar10-train-0000001", "a/b.c", ""]


def _keys(keys=KEYS):
    return unpack(pack({"key": list(keys), "skipped": 0}, []), len(keys))["key"]


def test_keys_read_as_the_list_did():
    k = _keys()
    assert isinstance(k, Keys)
    assert len(k) == 4 and k[0] == KEYS[0] and k[-1] == "" and k[1:3] == KEYS[1:3]
    assert list(k) == KEYS and [x for x in k] == KEYS and list(reversed(k)) == KEYS[::-1]
    assert "a/b.c" in k and "nope" not in k and k.index("a/b.c") == 2 and k.count("") == 1
    assert k == KEYS and KEYS == k and k == _keys() and not (k != KEYS)
    assert k != KEYS[:3] and k != _keys(KEYS[:3]) and k != tuple(KEYS)  # a list is no tuple either
    assert k + ["x"] == KEYS + ["x"] and ["x"] + k == ["x"] + KEYS and k + k == KEYS + KEYS
    with pytest.raises(TypeError):
        k + ("x",)  # noqa: B018 - as list + tuple
    with pytest.raises(TypeError):
        hash(k)
    with pytest.raises(IndexError):
        k[4]  # noqa: B018
    assert repr(k) == repr(KEYS) and str(k) == str(KEYS)
    again = pickle.loads(pickle.dumps(k))
    assert again == KEYS and len(again) == 4
    assert _keys([]) == [] and len(_keys([])) == 0 and list(_keys([])) == []
    assert _keys([""]) == [""] and len(_keys([""])) == 1


def test_keys_pickle_copy_and_repeat_as_a_list_and_refuse_mutation():
    """Keys pickle as the plain list they read as (a saved batch loads without this package, and
    under weights_only with list allowed: no pickle can make a list of another type without naming
    a callable); copy(), * and + give lists; mutating the keys is refused, as of a tuple."""
    k = _keys()
    buf = io.BytesIO()
    torch.save({"key": k}, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([list]):
        again = torch.load(buf)["key"]
    assert type(again) is list and again == KEYS
    assert type(pickle.loads(pickle.dumps(k))) is list and type(copy.deepcopy(k)) is list
    assert type(copy.copy(k)) is list and copy.copy(k) == KEYS
    assert type(k.copy()) is list and k.copy() == KEYS
    assert k * 2 == KEYS * 2 and 2 * k == 2 * KEYS and type(k * 2) is list and k * 0 == []
    with pytest.raises(TypeError):
        k * "2"  # noqa: B018 - as a list
    assert not isinstance(k, list) and type(list(k)) is list
    for mutate in (lambda k: k.append("x"), lambda k: k.sort(), lambda k: k.__setitem__(0, "x")):
        with pytest.raises((AttributeError, TypeError)):
            mutate(k)
    assert k == KEYS


def test_a_key_holding_the_separator_goes_as_a_list():
    keys = ["a\0b", "c"]
    assert unpack(pack({"key": list(keys)}, []), 2)["key"] == keys


def test_keys_are_split_only_when_read():
    k = _keys()
    assert len(k) == 4 and k._list is None  # len alone: the loops that count samples
    k[0]
    assert k._list == KEYS


def test_the_trainers_key_log_writes_them(tmp_path):
    log = KeyLog(str(tmp_path), 0)
    log.add(1, _keys())
    log.flush()
    assert (tmp_path / "keys-rank0.txt").read_text() == "".join(f"1\t{k}\n" for k in KEYS)
    assert log.count == 4


def test_keys_from_two_workers_are_the_keys_of_no_workers(data):
    """The same epoch's keys in the loader's worker processes and in this one (dealt otherwise to
    2 workers, the same samples), each naming its row's source, of one type either way; a loop
    that only counts them never splits them."""
    got = {}
    for workers in (0, 2):
        s = MixedStream(train_sources(data.dir), HALF, 4, epoch_samples=40, normalize=False)
        loader = make_loader(s, workers)
        batches = list(loader)
        assert all(type(b["key"]) is Keys for b in batches)  # one type whatever the workers: code written at 0 runs at 2
        if workers:
            assert all(b["key"]._list is None for b in batches)
            assert [len(b["key"]) for b in batches] == [4] * 10
        assert all(k.startswith(("mnist", "cifar10")[int(i)]) for b in batches for k, i in zip(b["key"], b["source"]))
        got[workers] = sorted(k for b in batches for k in b["key"])
        loader.close()
    assert got[2] == got[0] and len(set(got[0])) == 40


ODD = ["cr\rx", "x\ny", "ls\u2028x", "nel\x85x", "ff\x0cx", '"quoted"', "tab\tx", "plain", "", "é☃"]


def test_every_key_log_line_is_one_sample_however_read(tmp_path):
    """A key holding a line break of any kind, or starting with '"', is a JSON string on its line:
    str.splitlines and a text-mode file see the log's lines, and read_keys gives the keys back."""
    log = KeyLog(str(tmp_path), 0)
    log.add(2, ODD)
    log.flush()
    path = tmp_path / "keys-rank0.txt"
    assert len(path.read_bytes().decode().splitlines()) == len(ODD) == len(open(path).readlines())
    assert read_keys(path) == [(2, k) for k in ODD]
    assert key_line(1, "plain") == "1\tplain\n" and key_line(1, "x\ny") == '1\t"x\\ny"\n'


def test_odd_keys_survive_a_stop_and_resume_exactly(tmp_path):
    """As the trainer does: keys logged past the checkpoint, a torn last line, then the log cut
    back to the checkpoint's count and the rest logged: the same file as an unbroken run's."""
    keys = [f"{k}{i}" for i in range(3) for k in ODD]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    whole.mkdir(), broken.mkdir()
    log = KeyLog(str(whole), 0)
    log.add(1, keys)
    log.flush()
    log = KeyLog(str(broken), 0)
    log.add(1, keys[:11])  # the checkpoint holds 7; 4 more were logged before the stop
    log.flush()
    with open(log.path, "a", encoding="utf-8") as f:
        f.write("1\ttorn")
    log = KeyLog(str(broken), 0, keep=7)
    assert log.count == 7 and read_keys(log.path) == [(1, k) for k in keys[:7]]
    log.add(1, keys[7:])
    log.flush()
    assert (broken / "keys-rank0.txt").read_bytes() == (whole / "keys-rank0.txt").read_bytes()
    assert read_keys(log.path) == [(1, k) for k in keys]


def test_a_log_with_raw_breaks_in_its_keys_is_cut_and_read_by_its_newlines(tmp_path):
    r"""A log written before keys were quoted holds "\r", "\x85", "\u2028" inside lines: resuming
    keeps the checkpoint's count of its lines (no key split in two, none lost) and reads them whole."""
    path = tmp_path / "keys-rank0.txt"
    raw = ["cr\rx", "nel\x85x", "ls\u2028x", "vt\x0bx", "plain"]
    path.write_bytes("".join(f"1\t{k}\n" for k in raw).encode())
    assert read_keys(path) == [(1, k) for k in raw]
    KeyLog(str(tmp_path), 0, keep=4)
    assert read_keys(path) == [(1, k) for k in raw[:4]]
