"""The knob panel: an ipywidgets front end over ``Engine.configure`` for trying knobs on a few sentences.

Every widget change is applied at once through ``engine.configure`` (live, no weight reload; on error nothing
changes and the panel shows the message instead of a traceback). "Run" embeds the sentences (one per line) and shows
the cosine-similarity heatmap and the call's stats. Child widgets are attributes, so a test or a notebook cell can
drive the panel without a browser: set ``.value`` and call ``.click()``; in a browser each carries the CSS class
``lab-panel-<name>`` (``lab-panel-run-button``, ``lab-panel-stats-view``, ...), which ``tests/test_browser.py`` uses.

    >>> p = build_panel(engine)                    # or engine.panel()
    >>> p.pooling.value = "cls"; p.run_button.click()
    >>> p.error.value, p.stats_view.value, p.similarity    # message ('' if none), stats HTML, last matrix
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np

from lab.engine import knob_registry
from lab.engine.knob_registry import Knob

DEFAULT_SENTENCES = (
    "A man is playing a guitar.\n"
    "Someone plays an acoustic guitar on stage.\n"
    "A woman is slicing an onion.\n"
    "A cook chops vegetables in the kitchen.\n"
    "Stocks fell sharply after the central bank raised rates.\n"
    "Markets dropped when interest rates went up."
)
_STYLE = {"description_width": "150px"}
_LAYOUT = widgets.Layout(width="420px")


class KnobPanel(widgets.VBox):
    """The panel widget. Attributes: one widget per knob the registry gives a panel widget
    (``lab.engine.knob_registry.KNOBS``: ``pooling``, ``bidirectional``, ``chunked_prefill``, ``max_batch_tokens``,
    ``dtype``, ``instruction``, and any knob ``register`` added with one), ``sentences``, ``run_button`` (inputs);
    ``error``, ``stats_view``, ``resolved_view``, ``plot`` (outputs); ``engine``, ``embeddings``, ``similarity``,
    ``figure`` (the last run's results)."""

    def __init__(self, engine):
        self.engine = engine
        self.embeddings: np.ndarray | None = None
        self.similarity: np.ndarray | None = None
        self.figure = None
        self._knobs = [k for k in knob_registry.KNOBS.values() if k.widget is not None]
        for knob in self._knobs:
            setattr(self, knob.name, _knob_widget(knob, engine))
        self.sentences = widgets.Textarea(
            value=DEFAULT_SENTENCES,
            description="sentences (one a line)",
            style=_STYLE,
            layout=widgets.Layout(width="620px", height="140px"),
        )
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.error = widgets.HTML(value="")
        self.stats_view = widgets.HTML(value="")
        self.resolved_view = widgets.HTML(value=_resolved_html(engine))
        self.plot = widgets.Output()

        for name in (
            *(k.name for k in self._knobs),
            "sentences",
            "run_button",
            "error",
            "stats_view",
            "resolved_view",
            "plot",
        ):
            getattr(self, name).add_class(f"lab-panel-{name.replace('_', '-')}")  # stable selectors in a browser
        self._knob_widgets = tuple(getattr(self, k.name) for k in self._knobs)
        for w in self._knob_widgets:
            w.observe(self._on_knob_change, names="value")
        self.run_button.on_click(self._on_run)

        title = widgets.HTML(
            f"<b>{html.escape(engine.model_name)}</b> @ <code>{html.escape(engine.revision[:12])}"
            f"</code> &nbsp; <code>{html.escape(engine.spec.architecture or '')}</code>"
        )
        knobs = widgets.VBox(list(self._knob_widgets))
        super().__init__(
            [
                title,
                widgets.HBox([knobs, self.resolved_view]),
                self.sentences,
                self.run_button,
                self.error,
                self.stats_view,
                self.plot,
            ]
        )

    # --------------------------------------------------------------------------------------------- knobs
    def knob_values(self) -> dict:
        """The knobs the widgets ask for, in ``configure``'s terms (model defaults stay ``None``)."""
        return {k.name: _knob_value(k, getattr(self, k.name).value, self.engine) for k in self._knobs}

    def apply(self) -> bool:
        """Configure the engine from the widgets; on error show the message (nothing changes) and return False."""
        wanted = self.knob_values()
        current = self.engine.knobs
        changes = {k: v for k, v in wanted.items() if current.get(k) != v}
        try:
            if changes:
                self.engine.configure(**changes)
        except (ValueError, TypeError) as e:
            self._show_error(e)
            return False
        self.error.value = ""
        self.resolved_view.value = _resolved_html(self.engine)
        return True

    def _on_knob_change(self, change) -> None:
        self.apply()

    # ----------------------------------------------------------------------------------------------- run
    def run(self) -> None:
        """Apply the knobs, embed the sentences, show the heatmap and the stats (errors go to ``self.error``)."""
        if not self.apply():
            return
        texts = [line.strip() for line in self.sentences.value.splitlines() if line.strip()]
        if not texts:
            self._show_error(ValueError("enter at least one sentence (one per line)"))
            return
        self.run_button.disabled = True
        try:
            emb = self.engine.embed(texts)
            sim = self.engine.similarity(emb)
        except Exception as e:  # noqa: BLE001 -- a callback traceback goes to a log nobody sees: show the message
            self._show_error(e)
            return
        finally:
            self.run_button.disabled = False
        from lab.eval.plots import similarity_heatmap

        self.embeddings, self.similarity = emb, sim
        r = self.engine.resolved
        self.figure = similarity_heatmap(
            sim, texts, title=f"Cosine similarity ({r.pooling} pooling, {'causal' if r.causal else 'bidirectional'})"
        )
        self.stats_view.value = _stats_html(self.engine.stats, emb.shape)
        self.plot.clear_output(wait=True)
        with self.plot:
            from IPython.display import display

            display(self.figure)

    def _on_run(self, _button) -> None:
        self.run()

    def _show_error(self, e: Exception) -> None:
        self.error.value = (
            f"<div style='color:#b00020;white-space:pre-wrap'><b>{type(e).__name__}:</b> {html.escape(str(e))}</div>"
        )


def build_panel(engine) -> KnobPanel:
    """The knob panel over ``engine`` (what ``Engine.panel()`` returns)."""
    return KnobPanel(engine)


def _shown_default(knob: Knob, engine):
    """What a knob left at ``None`` runs as, in its widget's terms (``Widget.shows``, negated when ``invert``)."""
    w = knob.widget
    value = engine.resolved.defaults.get(w.shows, engine.resolved[w.shows]) if w.shows else None
    return (not value) if w.invert else value


def _knob_widget(knob: Knob, engine) -> widgets.Widget:
    """The widget of ``knob`` (its ``lab.engine.knob_registry.Widget``), showing the engine's value."""
    w, value = knob.widget, engine.knobs.get(knob.name, knob.default)
    common = {"description": w.label, "style": _STYLE, "layout": _LAYOUT}
    if w.kind == "dropdown":
        options = [(str(v), v) for v in w.options()]
        if knob.default is None:  # the model's own value first, named with what it resolves to
            shown = f"model default ({engine.resolved[w.shows]})" if value is None and w.shows else "model default"
            options.insert(0, (shown, None))
        return widgets.Dropdown(options=options, value=value, **common)
    if w.kind == "checkbox":
        if value is None:
            value = (not engine.resolved[w.shows]) if w.invert else engine.resolved[w.shows]
        return widgets.Checkbox(value=bool(value), indent=True, **common)
    if w.kind == "int":
        return widgets.BoundedIntText(
            value=(value or 0) if w.zero_is_none else value,
            min=w.minimum,
            max=w.maximum,
            step=w.step,
            tooltip=w.tooltip,
            **common,
        )
    return widgets.Text(value=value or "", placeholder=w.placeholder, **common)


def _knob_value(knob: Knob, shown, engine):
    """The knob value a widget showing ``shown`` asks for (``None`` where it shows the model's own)."""
    w = knob.widget
    if w.kind == "checkbox":
        shown = bool(shown)
        # the model's own value stays None (the default), so the resolved view still says "model default"
        return None if knob.default is None and shown == _shown_default(knob, engine) else shown
    if w.kind == "int":
        return (int(shown) or None) if w.zero_is_none else int(shown)
    if w.kind == "text":
        return shown.strip() or None
    return shown


def _table(rows: dict) -> str:
    cells = "".join(
        f"<tr><td style='text-align:left'>{html.escape(str(k))}</td>"
        f"<td style='text-align:left'><code>{html.escape(str(v))}</code></td></tr>"
        for k, v in rows.items()
    )
    return f"<table>{cells}</table>"


def _resolved_html(engine) -> str:
    """The values that run, each the model decides followed by where it came from (``Engine.resolved``)."""
    r = engine.resolved
    sources = getattr(r, "sources", {})
    return "<b>what runs</b>" + _table({k: f"{v}  ({sources[k]})" if k in sources else v for k, v in r.items()})


def _stats_html(stats, shape) -> str:
    s = stats.to_dict()
    rows = {
        "embeddings": f"{shape[0]} x {shape[1]}",
        **{
            k: s[k]
            for k in ("sequences", "tokens", "batches", "padded_tokens", "truncated", "chunks", "path", "backend")
        },
        "seconds": f"{s['seconds']:.4f}",
        "tokens/s": f"{s['tokens_per_s']:,.0f}",
    }
    return "<b>stats of the last call</b>" + _table(rows)
