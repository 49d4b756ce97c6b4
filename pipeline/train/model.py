"""The model (--model): the default small VGG-style CNN, a torchvision classification model
by name, or a function of the user's own; each built for the batch's image shape and one head
over the union of all sources' classes (MNIST 0-9, CIFAR10 10-19).

Every parameter of the CNN takes part in every step, so DDP never meets unused parameters,
even when a batch happens to hold only one source.
"""
import contextlib
import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import is_lazy

from pipeline.data.fields.spec import channels_last as is_channels_last  # a batch's layout (the flag shadows the name)
from pipeline.errors import InputError
from pipeline.train.options import DEFAULT_MODEL as DEFAULT
from pipeline.train.checkpoint import refused_at
from pipeline.train.modelnames import check_name
from pipeline.train.usercode import user_function

MIN_SIDE = 4  # two 2x2 max-pools: a smaller input has nothing left to pool
# Bytes a training step on the CPU holds for each pixel of each sample: for each unit of
# --width, what autograd keeps for the backward pass, the float outputs of two convolutions and
# two batch norms at full resolution (16 bytes), of twice the channels at a quarter of the
# pixels (8) and of four times at a sixteenth (4); and a fixed part, measured: the augmented
# float copies of the batch and their index tensors, the gradients in flight, fitted to the
# trainer's peak RSS at 512x512 and 1024x1024, widths 4 and 16, batches 1 and 8 (the estimate
# against measured runs: docs/benchmarks.md, "The batch memory estimate against measured RSS").
STEP_PIXEL_BYTES, STEP_WIDTH_BYTES = 128, 28


def step_bytes(batch_size, height, width, model_width):
    """About what one training step of Net holds on the CPU for a batch of height x width
    images: the memory budget (pipeline.data.handover.budget) counts it before the first read, since
    a manifest's shape alone can make a step of a few images need tens of GB."""
    return batch_size * max(height, MIN_SIDE) * max(width, MIN_SIDE) * (STEP_PIXEL_BYTES +
                                                                       STEP_WIDTH_BYTES * model_width)


def build_model(spec, num_classes, shape, width, channels_last=False):
    """The model --model names, on the CPU, for images of `shape` (C, H, W) and `num_classes`
    classes: the default CNN at --width; a torchvision model by name, untrained
    (`torchvision.models.get_model(name, weights=None, num_classes=num_classes)`); or
    MODULE:FUNCTION called as `FUNCTION(num_classes, shape)`, which returns an nn.Module.
    channels_last (--channels-last): its 4-d weights in torch.channels_last, so that its
    convolutions take the loader's channels-last batches as they are (NHWC), and checked on
    such a batch. InputError (one line) where the model cannot be had or cannot take the
    input (`check_fits`)."""
    if spec == DEFAULT:
        made = Net(num_classes, width, in_channels=shape[0])
        return to_channels_last(made) if channels_last else made
    if ":" in spec:
        make = user_function("--model", spec)
        try:
            made = make(num_classes, tuple(shape))
        except Exception as e:  # noqa: BLE001 - whatever the user's function raises, in one line
            why = (str(e).strip().splitlines() or [""])[0][:200]
            raise InputError(f"--model {spec}: raised {type(e).__name__}: {why} (it is called as "
                             f"{spec.partition(':')[2]}(num_classes, (C, H, W)))") from None
        if not isinstance(made, nn.Module):
            raise InputError(f"--model {spec}: returned {type(made).__name__}, not a torch.nn.Module")
        other = {k: v for k, v in made.state_dict().items() if not isinstance(v, torch.Tensor)}  # extra state
        where = refused_at(other)
        if where:  # found now, not when the first checkpoint is written
            raise InputError(f"--model {spec}: its state_dict's {where} is an object that torch.load(..., "
                             f"weights_only=True) refuses, so no checkpoint could hold it; keep tensors and plain "
                             f"types there")
    else:
        check_name(spec)
        import torchvision

        made = torchvision.models.get_model(spec, weights=None, num_classes=num_classes)
    if channels_last:
        made = to_channels_last(made)
    check_fits(made, spec, num_classes, shape, channels_last)
    return to_channels_last(made) if channels_last else made  # a lazy module's weights exist now


def to_channels_last(model):
    """The model's 4-d weights and buffers (2-d convolutions') in torch.channels_last, the others as
    they are: `Module.to(memory_format=...)` raises on any other (a Conv3d's 5-d weight) and on a
    lazy module's parameters before their first forward (they are laid out as they come)."""
    return _lay_out(model, torch.channels_last)


def _lay_out(model, memory_format):
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            if not is_lazy(t) and t.dim() == 4:
                t.data = t.data.contiguous(memory_format=memory_format)
    return model


def check_fits(model, spec, num_classes, shape, channels_last=False):
    """One forward pass of two blank images in training mode, as the trainer runs it: a model
    that cannot take the input size (too small for its poolings, or fixed to another size) or
    whose output is not a (batch, classes) tensor of scores (torchvision's googlenet and
    inception_v3 return their auxiliary heads too while training) is refused in one line before
    the run starts, rather than in its first step. With channels_last the blank images have the
    batches' channels-last strides, so a model that `.view()`s its input is refused here too,
    named as such. Leaves no trace: its running statistics are put back and the global random
    state is untouched (every rank starts from the same)."""
    size = "x".join(map(str, shape))
    blank = torch.zeros(2, *shape)
    try:
        with leaving_no_trace(model), torch.no_grad():
            out = model(blank.contiguous(memory_format=torch.channels_last) if channels_last else blank)
    except Exception as e:  # noqa: BLE001 - whatever the model raises, in one line
        why = (str(e).strip().splitlines() or [""])[0][:200]
        if channels_last and _takes(model, blank):
            raise InputError(f"--model {spec} cannot take channels-last {size} images (--channels-last; "
                             f"{type(e).__name__}: {why}): .reshape its input rather than .view, or drop "
                             f"--channels-last") from None
        raise InputError(f"--model {spec} cannot take {size} images ({type(e).__name__}: {why}); pick a model "
                         f"for images of this size or resize the data when writing its shards") from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise InputError(f"--model {spec}: a batch of 2 {size} images gave {got}, not a (2, {num_classes}) "
                         f"tensor of class scores")


def _takes(model, blank):
    """Whether `model`, its weights contiguous as without the flag, takes the contiguous blank batch:
    the layout, not the size, is what it refused. Its weights are laid out contiguous for the try
    and channels-last again after (with them channels-last the convolutions' outputs came
    channels-last again, and a .view after one was blamed on the size; a copy of the model fails
    for a model holding a lock)."""
    _lay_out(model, torch.contiguous_format)
    try:
        with leaving_no_trace(model), torch.no_grad():  # the global random state untouched
            model(blank)
        return True
    except Exception:  # noqa: BLE001 - refused either way; check_fits says why
        return False
    finally:
        to_channels_last(model)


def unused_parameters(model, shape):
    """Names of the parameters one training step on two blank images leaves without a gradient:
    DDP on several ranks fails on them in the first step ("Expected to have finished reduction")
    unless told to look for them. Leaves no trace (as check_fits). InputError where the model
    has nothing to train."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise InputError("--model: the model has no parameters to train")
    try:
        with leaving_no_trace(model):
            model(torch.zeros(2, *shape)).float().sum().backward()
        return [n for n, p in params if p.grad is None]
    finally:
        for _, p in params:
            p.grad = None


@contextlib.contextmanager
def leaving_no_trace(model):
    """A trial pass of `model` that leaves it and the run as they were: its buffers (BatchNorm's
    running statistics) put back, the global random state untouched (every rank starts from the
    same)."""
    kept = [b.clone() for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for b, k in zip(model.buffers(), kept):
                b.copy_(k)


def input_shape(stream):
    """(C, H, W) of the batches' image field: what every model is built for."""
    return next(f.shape for f in stream.batch_spec().fields if f.name == "image")


def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Net(nn.Module):
    """Three stages of two 3x3 convolutions: the first two halve the resolution, the third
    ends in a global max-pool (one value a channel, whatever the input's size).

    width=64 (about 1.1M parameters) is the GPU recipe; width=16 trains at a few
    hundred samples/s per CPU core. Images with a side under MIN_SIDE (a data set of
    2x2 images) are resized up to it rather than fail in the pooling.
    """

    def __init__(self, num_classes, width=64, in_channels=3):
        super().__init__()
        w = width
        self.features = nn.Sequential(
            conv_bn(in_channels, w), conv_bn(w, w), nn.MaxPool2d(2),
            conv_bn(w, 2 * w), conv_bn(2 * w, 2 * w), nn.MaxPool2d(2),
            conv_bn(2 * w, 4 * w), conv_bn(4 * w, 4 * w), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(4 * w, num_classes)

    def forward(self, x):
        h, w = x.shape[-2:]
        if h < MIN_SIDE or w < MIN_SIDE:
            x = F.interpolate(x, size=(max(h, MIN_SIDE), max(w, MIN_SIDE)), mode="bilinear", align_corners=False)
        return self.head(self.features(x))


def augment(x, source, flip_sources, generator, pad=2):
    """Random translation by up to `pad` pixels for every source, horizontal flips only
    for `flip_sources` (a tensor of source ids on the batch's device: a flipped digit is
    another digit). The draws come from an explicit CPU generator, so a resumed run draws the
    same augmentations, and reach the device in one asynchronous copy from pinned memory: no
    step waits for the device here."""
    b, c, h, w = x.shape
    dev = x.device
    padded = F.pad(x, (pad, pad, pad, pad))
    draws = [torch.randint(0, 2 * pad + 1, (b,), generator=generator) for _ in range(2)]
    if len(flip_sources):
        draws.append((torch.rand(b, generator=generator) < 0.5).long())
    draws = _to_device(torch.stack(draws), dev)
    dy, dx = draws[0], draws[1]
    rows = (dy[:, None] + torch.arange(h, device=dev))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=dev))[:, None, None, :]
    batch, channels = torch.arange(b, device=dev)[:, None, None, None], torch.arange(c, device=dev)
    if is_channels_last(x):  # gathered as (B, H, W, C), so the batch keeps its layout (--channels-last)
        hwc = (0, 2, 3, 1)
        out = padded.permute(hwc)[batch, rows.permute(hwc), cols.permute(hwc), channels].permute(0, 3, 1, 2)
    else:
        out = padded[batch, channels[None, :, None, None], rows, cols]
    if len(flip_sources):
        flip = draws[2].bool() & torch.isin(source, flip_sources)
        out = torch.where(flip[:, None, None, None], out.flip(3), out)
    return out


def _to_device(t, device):
    """A small CPU tensor on `device` without waiting: copied from pinned memory, which torch's
    host allocator keeps until the copy is done."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
