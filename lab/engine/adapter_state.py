"""An engine's LoRA adapters: where each named adapter lives, which are merged into the live weights, and llm2vec's
reading of the model folder with each adapter list (``lab.engine.llm2vec.Layout``), each worked out once.

``Engine`` keeps one ``AdapterState``; ``configure(adapters=[...])`` merges a new list with ``merge`` (which changes
nothing) and swaps the result in with ``use`` only once every check passed.

    >>> state = AdapterState(folder, auto=(), repo_id=None, decoder=True, base=model_path)
    >>> adapters, merged = state.merge(("org/lora",), model, base_weights); state.use(adapters)
    >>> state.names, state.layout(("org/lora",)).recognized
"""

from __future__ import annotations

from lab.adapt.adapters import LoraAdapter, read_adapter
from lab.adapt.merge import merged_weights
from lab.engine import llm2vec
from lab.models import hub


class AdapterState:
    def __init__(
        self,
        folder: str,
        *,
        auto: tuple[str, ...],
        repo_id: str | None,
        decoder: bool,
        base: str,
        architecture: str | None = None,
    ):
        self.folder = folder  # the model folder as given: llm2vec's base argument (lab.engine.llm2vec)
        self.auto = auto  # the adapters that came with the folder (an adapter-only folder's own)
        self.repo_id, self.decoder, self.base, self.architecture = repo_id, decoder, base, architecture
        self.merged: list[LoraAdapter] = []  # merged into the live weights, in order
        self._folders: dict[str, str] = {}  # adapter name as given (a path or a hub id) -> its folder
        self._layouts: dict[tuple, llm2vec.Layout] = {}  # adapter list -> llm2vec's reading of the folders

    @property
    def names(self) -> list[str]:
        """The merged adapters, in order (folder names)."""
        return [a.name for a in self.merged]

    @property
    def ids(self) -> list[str]:
        """``name-<content hash>`` of each merged adapter."""
        return [a.id for a in self.merged]

    def folder_of(self, name: str) -> str:
        """The folder of an adapter named by path or hub id (``org/name[@revision]``, fetched into the Hugging Face
        cache when need be; ``lab.models.hub``), resolved once."""
        if name not in self._folders:
            self._folders[name] = str(hub.resolve(name, what="adapter").folder)
        return self._folders[name]

    def merge(self, paths: tuple[str, ...], model, base: dict) -> tuple[list[LoraAdapter], dict]:
        """Read and check ``paths`` and merge them over the ``base`` weights of ``model``: ``(adapters, {parameter:
        float32})``. Changes nothing: the caller swaps the weights in (``Weights.set_merged``), then calls ``use``."""
        if paths and not model.packed:
            raise ValueError(
                f"adapters need a packed model, but {self.architecture or 'this architecture'} runs through the "
                "transformers fallback (no packed implementation here). Merge the adapter with peft "
                "(PeftModel.from_pretrained(base, folder).merge_and_unload().save_pretrained(out)) and load that "
                "folder"
            )
        adapters = [read_adapter(self.folder_of(p)) for p in paths]
        return adapters, merged_weights(model, base, adapters)

    def use(self, adapters: list[LoraAdapter]) -> None:
        self.merged = adapters

    def layout(self, adapters: tuple[str, ...]) -> llm2vec.Layout:
        """llm2vec's reading of the model folder with ``adapters`` (``lab.engine.llm2vec.layout``), once per list."""
        if adapters not in self._layouts:
            auto = len(self.auto) if adapters[: len(self.auto)] == self.auto else 0
            self._layouts[adapters] = llm2vec.layout(
                self.folder,
                [self.folder_of(a) for a in adapters],
                auto=auto,
                base=self.base,
                repo_id=self.repo_id,
                decoder=self.decoder,
            )
        return self._layouts[adapters]
