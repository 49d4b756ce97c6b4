"""The public imports users' scripts rely on (README, docs/, examples/) keep working after the
data path moved into folders: pipeline.stream and pipeline.topology as the API modules, and
the three old flat paths the docs named, each the moved module itself."""
import subprocess
import sys

import pytest

import pipeline.stream
import pipeline.topology
from pipeline.data.fields import augment, schema
from pipeline.data.handover.loader import make_loader
from pipeline.data.streams import mix, stream
from pipeline.ordering import topology


def test_the_api_modules_export_what_the_docs_import():
    assert pipeline.stream.MixedStream is stream.MixedStream and pipeline.stream.make_loader is make_loader
    assert pipeline.stream.RandomMix is mix.RandomMix and pipeline.stream.Schema is schema.Schema
    assert all(hasattr(pipeline.stream, n) for n in pipeline.stream.__all__)
    assert pipeline.topology.Topology is topology.Topology
    assert all(hasattr(pipeline.topology, n) for n in pipeline.topology.__all__)


def test_the_old_flat_paths_are_the_moved_modules():
    from pipeline.data import augment as old_augment
    from pipeline.data.mix import RandomMix
    from pipeline.data.schema import Column, Schema
    import pipeline.data.mix

    assert old_augment is augment and pipeline.data.mix is mix and RandomMix is mix.RandomMix
    assert (Schema, Column) == (schema.Schema, schema.Column)


@pytest.mark.slow
def test_the_stream_imports_no_loader():
    """Importing the stream (as a DataLoader worker of the user's own does) loads no hand-over."""
    code = ("import sys; import pipeline.data.streams.stream; "
            "print(sorted(m for m in sys.modules if m.startswith('pipeline.data.handover')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
