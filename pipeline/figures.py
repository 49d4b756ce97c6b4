"""Drawing helpers shared by the pictures the writers and the trainer make (a shard set's
contact sheet, a run's report). matplotlib is imported only when a figure is made."""


def plain(text, limit=200):
    """Text from a run or a manifest, shown as it is: `$` would start matplotlib's math
    mode (and a stray one fails the whole drawing), and a long note would overflow."""
    text = str(text)
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return text.replace("$", r"\$")


def new_figure(width, height, dpi=100):
    """A figure on the Agg canvas without pyplot, so nothing global (backend, open
    figures) changes in the process that draws it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig
