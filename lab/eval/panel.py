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

from lab.engine.knobs import DTYPES
from lab.outputs.pooling import knob_values as pooling_values

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
    """The panel widget. Attributes: ``pooling``, ``bidirectional``, ``chunked_prefill``, ``max_batch_tokens``,
    ``dtype``, ``instruction``, ``sentences``, ``run_button`` (inputs); ``error``, ``stats_view``, ``resolved_view``,
    ``plot`` (outputs); ``engine``, ``embeddings``, ``similarity``, ``figure`` (the last run's results)."""

    def __init__(self, engine):
        self.engine = engine
        self.embeddings: np.ndarray | None = None
        self.similarity: np.ndarray | None = None
        self.figure = None
        k = engine.knobs
        self._default_causal = bool(engine.model.default_causal)

        self.pooling = widgets.Dropdown(
            options=[(f"model default ({engine.resolved.pooling})" if k["pooling"] is None else "model default", None)]
            + [(p, p) for p in pooling_values()],
            value=k["pooling"], description="pooling", style=_STYLE, layout=_LAYOUT,
        )
        self.bidirectional = widgets.Checkbox(value=not engine.resolved.causal, description="bidirectional attention",
                                              style=_STYLE, layout=_LAYOUT, indent=True)
        self.chunked_prefill = widgets.BoundedIntText(
            value=k["chunked_prefill"] or 0, min=0, max=1 << 20, step=64,
            description="chunked prefill", tooltip="tokens per chunk, 0 = off (causal only)", style=_STYLE,
            layout=_LAYOUT,
        )
        self.max_batch_tokens = widgets.BoundedIntText(
            value=k["max_batch_tokens"], min=1, max=1 << 24, step=1024, description="batch token budget",
            style=_STYLE, layout=_LAYOUT,
        )
        self.dtype = widgets.Dropdown(options=["auto", *DTYPES], value=k["dtype"], description="dtype",
                                      style=_STYLE, layout=_LAYOUT)
        self.instruction = widgets.Text(value=k["instruction"] or "", placeholder="none (attended, not pooled)",
                                        description="instruction", style=_STYLE, layout=_LAYOUT)
        self.sentences = widgets.Textarea(value=DEFAULT_SENTENCES, description="sentences (one a line)",
                                          style=_STYLE, layout=widgets.Layout(width="620px", height="140px"))
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.error = widgets.HTML(value="")
        self.stats_view = widgets.HTML(value="")
        self.resolved_view = widgets.HTML(value=_resolved_html(engine))
        self.plot = widgets.Output()

        for name in ("pooling", "bidirectional", "chunked_prefill", "max_batch_tokens", "dtype", "instruction",
                     "sentences", "run_button", "error", "stats_view", "resolved_view", "plot"):
            getattr(self, name).add_class(f"lab-panel-{name.replace('_', '-')}")  # stable selectors in a browser
        self._knob_widgets = (self.pooling, self.bidirectional, self.chunked_prefill, self.max_batch_tokens,
                              self.dtype, self.instruction)
        for w in self._knob_widgets:
            w.observe(self._on_knob_change, names="value")
        self.run_button.on_click(self._on_run)

        title = widgets.HTML(f"<b>{html.escape(engine.model_name)}</b> @ <code>{html.escape(engine.revision[:12])}"
                             f"</code> &nbsp; <code>{html.escape(engine.spec.architecture or '')}</code>")
        knobs = widgets.VBox(list(self._knob_widgets))
        super().__init__([
            title,
            widgets.HBox([knobs, self.resolved_view]),
            self.sentences,
            self.run_button,
            self.error,
            self.stats_view,
            self.plot,
        ])

    # --------------------------------------------------------------------------------------------- knobs
    def knob_values(self) -> dict:
        """The knobs the widgets ask for, in ``configure``'s terms (model defaults stay ``None``)."""
        bidirectional = bool(self.bidirectional.value)
        return {
            "pooling": self.pooling.value,
            # the model's own attention stays None (the default), so the knob table still says "model default"
            "bidirectional": None if bidirectional == (not self._default_causal) else bidirectional,
            "chunked_prefill": int(self.chunked_prefill.value) or None,
            "max_batch_tokens": int(self.max_batch_tokens.value),
            "dtype": self.dtype.value,
            "instruction": self.instruction.value.strip() or None,
        }

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
        self.figure = similarity_heatmap(sim, texts, title=f"Cosine similarity ({r.pooling} pooling, "
                                         f"{'causal' if r.causal else 'bidirectional'})")
        self.stats_view.value = _stats_html(self.engine.stats, emb.shape)
        self.plot.clear_output(wait=True)
        with self.plot:
            from IPython.display import display

            display(self.figure)

    def _on_run(self, _button) -> None:
        self.run()

    def _show_error(self, e: Exception) -> None:
        self.error.value = (f"<div style='color:#b00020;white-space:pre-wrap'><b>{type(e).__name__}:</b> "
                            f"{html.escape(str(e))}</div>")


def build_panel(engine) -> KnobPanel:
    """The knob panel over ``engine`` (what ``Engine.panel()`` returns)."""
    return KnobPanel(engine)


def _table(rows: dict) -> str:
    cells = "".join(f"<tr><td style='text-align:left'>{html.escape(str(k))}</td>"
                    f"<td style='text-align:left'><code>{html.escape(str(v))}</code></td></tr>"
                    for k, v in rows.items())
    return f"<table>{cells}</table>"


def _resolved_html(engine) -> str:
    """The values that run, each the model decides followed by where it came from (``Engine.resolved``)."""
    r = engine.resolved
    sources = getattr(r, "sources", {})
    return "<b>what runs</b>" + _table({k: f"{v}  ({sources[k]})" if k in sources else v for k, v in r.items()})


def _stats_html(stats, shape) -> str:
    s = stats.to_dict()
    rows = {"embeddings": f"{shape[0]} x {shape[1]}", **{k: s[k] for k in ("sequences", "tokens", "batches",
            "padded_tokens", "truncated", "chunks", "path", "backend")},
            "seconds": f"{s['seconds']:.4f}", "tokens/s": f"{s['tokens_per_s']:,.0f}"}
    return "<b>stats of the last call</b>" + _table(rows)
