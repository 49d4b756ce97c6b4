"""pipeline.topology: rank, world and worker read the way webdataset reads them, and handed
to webdataset's splitters unchanged."""
from types import SimpleNamespace

import pytest
import torch

from pipeline.ordering.topology import Topology, Worker, own_items, stride


def test_from_env_reads_torchruns_variables(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert Topology.from_env() == Topology(3, 4, 1)
    monkeypatch.delenv("WORLD_SIZE")  # webdataset needs both
    assert Topology.from_env() == Topology(0, 1, 1)


def test_worker_comes_from_the_environment_or_the_dataloader(monkeypatch):
    assert Worker.current() == Worker(0, 1)
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(id=2, num_workers=5))
    assert Worker.current() == Worker(2, 5)
    monkeypatch.setenv("WORKER", "1")
    monkeypatch.setenv("NUM_WORKERS", "3")
    assert Worker.current() == Worker(1, 3)  # webdataset's own variables win, as in wds.utils


def test_bad_values_are_refused():
    for bad in ((2, 2), (-1, 1), (0, 0)):
        with pytest.raises(ValueError):
            Topology(*bad)
        with pytest.raises(ValueError):
            Worker(*bad)


@pytest.mark.parametrize("world, workers", [(1, 1), (3, 2), (8, 4)])
def test_the_stride_rule_is_where_webdatasets_splitters_put_a_process(world, workers, monkeypatch):
    import webdataset as wds

    urls = list(range(world * workers * 3))
    for r in range(world):
        for w in range(workers):
            k, n = stride(r, world, w, workers)
            for key, v in dict(RANK=r, WORLD_SIZE=world, WORKER=w, NUM_WORKERS=workers).items():
                monkeypatch.setenv(key, str(v))
            assert list(wds.split_by_worker(wds.split_by_node(urls))) == urls[k::n]
            # in that environment the stream's own lookup calls webdataset's splitters
            assert own_items(urls, Topology(r, world), Worker(w, workers)) == urls[k::n]


def test_own_items_calls_webdatasets_splitters_where_the_environment_is_the_topology(monkeypatch):
    import webdataset as wds

    calls = []
    real = wds.split_by_node
    monkeypatch.setattr(wds, "split_by_node", lambda src, **kw: calls.append(1) or real(src, **kw))
    for key, v in dict(RANK=1, WORLD_SIZE=2).items():
        monkeypatch.setenv(key, str(v))
    assert own_items(range(6), Topology(1, 2), Worker()) == [1, 3, 5] and calls == [1]
    assert own_items(range(6), Topology(0, 3), Worker()) == [0, 3] and calls == [1]  # a simulated world: the rule
    monkeypatch.setattr(wds, "split_by_node", lambda src, **kw: iter(list(src)[:1]))  # an environment that disagrees
    with pytest.raises(RuntimeError, match="disagrees"):
        own_items(range(6), Topology(1, 2), Worker())


@pytest.mark.parametrize("rank, world, worker, workers", [(5, 4, 0, 0), (-1, 4, 0, 0), (0, 0, 0, 0), (0, 1, 3, 2),
                                                          (0, 1, 0, -2)])
def test_stride_refuses_ranks_and_workers_out_of_range(rank, world, worker, workers):
    with pytest.raises(ValueError, match="out of range"):
        stride(rank, world, worker, workers)
