"""A model folder's model, built and loaded: our packed class for its architecture (``lab.models.REGISTRY``), else
transformers' ``AutoModel`` with padded batches; never code from the folder.

    >>> model = build_model(read_folder(path), torch.device("cpu"), torch.float32, forced={})
"""

from __future__ import annotations

from lab._warn import warn
from lab.models import model_class
from lab.models.folder import read_state_dict
from lab.models.hf_fallback import HFFallbackModel


def build_model(spec, device, dtype, forced: dict[str, str]):
    """The model of the folder ``spec`` describes (``lab.models.spec.ModelSpec``), its weights loaded: our packed
    class for its architecture (on CPU with the weight layouts chosen for ``dtype`` and the forced CPU paths,
    ``forced``; fixed at load, a later dtype change keeps them), else transformers' ``AutoModel`` with padded batches
    (warned). A folder whose config asks for custom code is refused: no code runs from a model folder."""
    cls = model_class(spec.architecture)
    if cls is None and spec.config.get("auto_map"):
        raise ValueError(
            f"{spec.path} declares custom model code (config.json auto_map: {sorted(spec.config['auto_map'])}) for "
            f"{spec.architecture or 'an unknown architecture'}; prefill-lab never executes code from a model folder, "
            "and this architecture has no packed implementation. Use a folder of a supported architecture (BERT / "
            "RoBERTa / XLM-R, Llama / Mistral / Qwen2 / Qwen3) or one transformers implements itself"
        )
    if cls is None:
        warn(
            f"{spec.architecture or 'this architecture'} has no packed implementation here; using "
            "transformers AutoModel with padded batches (see stats.path / stats.padded_tokens)",
        )
        return HFFallbackModel(str(spec.path), spec.config)
    try:
        model = cls.from_hf_config(spec.config)
    except KeyError as e:
        raise ValueError(
            f"{spec.path / 'config.json'} lacks {e.args[0]!r}, which a {spec.architecture} needs; the "
            "config is incomplete"
        ) from None
    if device.type == "cpu":
        model.choose_layouts(dtype, forced)
    model.load_hf_state_dict(read_state_dict(spec))
    return model
