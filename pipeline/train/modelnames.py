"""The names --model takes, known without importing torch: the command line refuses a misspelt
name at once (`options.check`), not after the seconds that importing torchvision costs.

torchvision's classification models are the functions its `torchvision/models/*.py` files
decorate with `@register_model()` (`torchvision.models.list_models(module=torchvision.models)`
lists exactly those); reading those files' syntax trees finds the same names without running
them. Where the files hold none (another layout), or a name they do not register still stands in
them as a word (a later torchvision registering some other way), torchvision itself is asked:
the files' reading may refuse a misspelt name quickly, never a name torchvision builds.
"""
import ast
import difflib
import functools
import importlib.util
import os
import re

from pipeline.errors import InputError

DEFAULT = "cnn"  # --model's default: pipeline.train.model.Net (options.DEFAULT_MODEL)
EXAMPLES = ("resnet18", "resnet50", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny")


def check_name(spec):
    """InputError (one line with a few valid names, and the closest one) unless `spec` is the
    default, MODULE:FUNCTION or a torchvision classification model."""
    if spec == DEFAULT or ":" in spec:
        return
    names = torchvision_names()
    if spec not in names and _mentioned(spec):
        import torchvision

        names = torchvision.models.list_models(module=torchvision.models)
    if spec not in names:
        some = [n for n in EXAMPLES if n in names]
        close = difflib.get_close_matches(spec, names, n=1, cutoff=0.75)
        raise InputError(f"--model {spec}: not a torchvision classification model; e.g. {', '.join(some)} "
                         f"({len(names)} in all: torchvision.models.list_models(module=torchvision.models)), "
                         f"{DEFAULT} (the default) or MODULE:FUNCTION of your own"
                         + (f"; did you mean {close[0]}?" if close else ""))


def _mentioned(name):
    """Whether `name` stands as a word in torchvision's model files (or they cannot be read)."""
    folder = _models_folder()
    if folder is None:
        return True
    word = re.compile(rf"\b{re.escape(name)}\b")
    for entry in os.listdir(folder):
        if entry.endswith(".py"):
            with open(os.path.join(folder, entry), encoding="utf-8") as f:
                if word.search(f.read()):
                    return True
    return False


def _models_folder():
    """torchvision/models, found without importing torchvision; None where it is not a folder."""
    found = importlib.util.find_spec("torchvision")
    folder = os.path.join(os.path.dirname(found.origin), "models") if found and found.origin else None
    return folder if folder and os.path.isdir(folder) else None


@functools.lru_cache(maxsize=None)
def torchvision_names():
    """torchvision's classification model names, sorted as list_models gives them."""
    folder = _models_folder()
    names = registered(folder) if folder else []
    if names:
        return names
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def registered(folder):
    """The names that the .py files directly in `folder` register with `@register_model(...)`:
    the function's name, or the decorator's name="...". Sorted."""
    names = []
    for entry in sorted(os.listdir(folder)):
        if not entry.endswith(".py"):
            continue
        with open(os.path.join(folder, entry), encoding="utf-8") as f:
            text = f.read()
        if "register_model" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names += [_registered_as(d, node.name) for d in node.decorator_list if _registers(d)]
    return sorted(names)


def _registers(decorator):
    func = decorator.func if isinstance(decorator, ast.Call) else None
    return getattr(func, "id", getattr(func, "attr", None)) == "register_model"


def _registered_as(decorator, name):
    given = decorator.args[0] if decorator.args else {k.arg: k.value for k in decorator.keywords}.get("name")
    return given.value if isinstance(given, ast.Constant) and isinstance(given.value, str) else name
