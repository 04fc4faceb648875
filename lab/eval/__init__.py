"""Studies on top of the Engine: the MTEB 2.x adapter (``mteb_adapter``), ``lab.evaluate`` sweeps (``sweeps``),
retrieval (``retrieval``), throughput helpers (``bench``), plots (``plots``) and the ipywidgets knob panel
(``panel``). Nothing below the engine imports this package."""
