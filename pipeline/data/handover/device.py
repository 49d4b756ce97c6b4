"""Batches handed over on a device: the loader copies each batch out of its ring slot itself.

A user who copies a batch's page-locked views to the GPU is the one who knows which stream
reads the slot; when the loader makes the copy, it knows. So with make_loader's `device`
(FFCV's rule, docs/training.md "Handing batches over"): each batch's tensors are copied with
non_blocking=True on a CUDA stream of the loader's own, an event recorded on that stream
after the copy says when the slot may go back to its worker (`ring.Ring.hand`), and the
consumer's current stream waits on the copy stream before the batch is handed out. The
user's code never stands between the copy and the slot's reuse. Lists (keys, captions)
stay on the host. device="cpu" runs the same path without CUDA (the copy made at once, the
slot back right after it): the tests' stand-in where no GPU is.

With decode="device" the JPEGs of a batch cross the hand-over as bytes in their image rows
(pipeline.data.decoding.gpujpeg) and are decoded here, on the same copy stream, before the slot
goes back; the stream's normalisation, if it has one, follows on the device.
"""
import warnings

import torch

from pipeline.data.decoding import gpujpeg

REFUSED = "_refused"  # a batch's count of JPEGs neither decoder took, added to its `skipped` by the loader


def parse_device(device):
    """None, or a torch.device of type cuda (with its index) or cpu; ValueError (one line) for
    anything else, or a CUDA device where CUDA is not."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"make_loader's device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") \
            from e
    if parsed.type not in ("cpu", "cuda") or parsed.type == "cpu" and parsed.index not in (None, 0):
        raise ValueError(f"make_loader's device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"make_loader's device is {device!r} but CUDA is not available here: "
                             f"pass device=None (or 'cpu')")
        if parsed.index is None:
            parsed = torch.device("cuda", torch.cuda.current_device())
    return parsed


def decoding(stream, where, device):
    """(the stream's layout, told where its JPEGs are decoded, or None on the host; normalise the
    images after the decode): make_loader's decode=. ValueError (one line) for a bad value."""
    layout = getattr(stream, "layout", None)
    if where == "device" and (device is None or not hasattr(stream, "sample_stages")):
        raise ValueError(f"make_loader's decode='device' needs a device= ('cuda', 'cuda:N' or 'cpu') and a "
                         f"MixedStream, got device={device!r} and a {type(stream).__name__}: pass device='cuda'")
    if hasattr(layout, "decoded_on"):
        stream.layout = layout.decoded_on(where, getattr(stream, "sample_stages", ()))
    elif where != "host":
        raise ValueError(f"make_loader's decode must be 'host' or 'device', got {where!r}")
    if where == "device" and not any(stream.layout.encoded):
        warnings.warn("decode='device': no source's JPEGs can be decoded after the hand-over (it takes the "
                      "default schema's sources whose images are the canvas's size; a source with its own "
                      "fields, or of another size, decodes in the workers): every image is decoded on the host",
                      stacklevel=3)
    if where != "device" or not any(stream.layout.encoded):
        return None, False
    return stream.layout, bool(getattr(stream, "normalize", False))


class ToDevice:
    """Copies of a ring's slots on `device`, each slot given back once its copy is done; with a
    `layout` (decode="device"), the JPEG rows decoded, and the images normalised if `normalize`."""

    def __init__(self, device, ring, layout=None, normalize=False):
        self.device, self.ring, self.layout, self.normalize = device, ring, layout, normalize
        self.cuda = device.type == "cuda"
        self.stream = None  # made at the first batch: CUDA starts after the workers forked

    def slot(self, producer, k, n):
        """{name: tensor on the device} of the first n samples of slot k; the slot goes back
        once the copy is done."""
        out, event = self.copy(self.ring.view(producer, k, n))
        self.ring.hand(producer, k, event)
        return out

    def copy(self, tensors):
        """({name: copy on the device}, the CUDA event recorded after it, or None on the CPU)."""
        if not self.cuda:
            return self._moved(tensors, torch.Tensor.clone), None
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = self._moved(tensors, lambda t: t.to(self.device, non_blocking=True))
            event = torch.cuda.Event(blocking=True)  # its wait sleeps, never spins (Ring.wait)
            event.record(self.stream)
        consumer.wait_stream(self.stream)
        for t in out.values():  # made on the copy stream, read on the consumer's: freed only after that
            t.record_stream(consumer)
        return out, event

    def _moved(self, tensors, move):
        """{name: move(tensor)}; with decode="device" the JPEG rows of `image` decoded (reading the
        slot's bytes before it goes back) and the images normalised as the stream would have."""
        if gpujpeg.SIZES not in tensors:
            return {name: move(t) for name, t in tensors.items()}
        out = {name: move(t) for name, t in tensors.items() if name not in ("image", gpujpeg.SIZES)}
        out["image"], refused = gpujpeg.unpack(tensors["image"], tensors[gpujpeg.SIZES], self.device, move)
        if refused:  # zeros where neither decoder took a JPEG: the loader counts them in the batch's skipped
            out[REFUSED] = refused
        if self.normalize:
            out["image"] = self.layout.normalize(out["image"], out["source"])
        return out
