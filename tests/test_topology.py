"""pipeline.topology: rank, world and worker read the way webdataset reads them, and handed
to webdataset's splitters unchanged."""
from types import SimpleNamespace

import pytest
import torch

from pipeline.data.topology import Topology, Worker, slot


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
def test_slot_is_where_webdatasets_splitters_put_a_process(world, workers, monkeypatch):
    import webdataset as wds

    urls = list(range(world * workers * 3))
    for r in range(world):
        for w in range(workers):
            k, n = slot(Topology(r, world), Worker(w, workers))
            for key, v in dict(RANK=r, WORLD_SIZE=world, WORKER=w, NUM_WORKERS=workers).items():
                monkeypatch.setenv(key, str(v))
            assert list(wds.split_by_worker(wds.split_by_node(urls))) == urls[k::n]
