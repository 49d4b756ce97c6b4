"""The data path, one folder a step, bottom to top: store (where bytes come from) < shards (tar
reading) < decoding < fields (schemas, values, the batch layout) < manifests (a data set's shards
and fields, resolved into a Source) < streams (a source's stages, the mix, the stream and its
state) < handover (loader, workers, ring, memory budget). A folder imports only those below it
(tests/test_layers.py); docs/layout.md draws it.

Three modules users' scripts import by their old flat paths still import under them (`mix`,
for RandomMix; `schema`; `augment`, each directly under this package, as MOVED lists): each
old name is the new module itself, loaded only when asked for."""
import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {"mix": "pipeline.data.streams.mix", "schema": "pipeline.data.fields.schema",
         "augment": "pipeline.data.fields.augment"}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `pipeline.data.<old name>` as the module it moved to (the same module object)."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, name = fullname.rpartition(".")
        if head == __name__ and name in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name.rpartition(".")[2]])

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.append(_Moved())
