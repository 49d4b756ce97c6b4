"""A batch's keys from the workers (pipeline.data.handover.keys): one string split only when read,
read as the list of keys was (len, index, iteration, equality, +, pickling, the trainer's key log)."""
import pickle

import pytest

from helpers import HALF, train_sources
from pipeline.data.handover.keys import Keys
from pipeline.data.handover.loader import make_loader
from pipeline.data.handover.workers import pack, unpack
from pipeline.data.streams.stream import MixedStream
from pipeline.train.metrics import KeyLog

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
    2 workers, the same samples), each naming its row's source; a loop that only counts them
    never splits them."""
    got = {}
    for workers in (0, 2):
        s = MixedStream(train_sources(data.dir), HALF, 4, epoch_samples=40, normalize=False)
        loader = make_loader(s, workers)
        batches = list(loader)
        if workers:
            assert all(isinstance(b["key"], Keys) and b["key"]._list is None for b in batches)
            assert [len(b["key"]) for b in batches] == [4] * 10
        assert all(k.startswith(("mnist", "cifar10")[int(i)]) for b in batches for k, i in zip(b["key"], b["source"]))
        got[workers] = sorted(k for b in batches for k in b["key"])
        loader.close()
    assert got[2] == got[0] and len(set(got[0])) == 40
