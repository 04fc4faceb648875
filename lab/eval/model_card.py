"""A model folder's card: the YAML front matter of its ``README.md``, as mteb's ``ModelMeta`` fields.

Hugging Face model cards open with a ``---`` fenced YAML block (``language``, ``license``, ...). ``card_fields``
turns it into the fields mteb records in ``model_meta.json``: ``license`` (as written, lower-cased; ``other`` is no
license), ``languages`` (ISO 639-1 codes such as ``en`` converted to mteb's ``eng-Latn`` form by mteb's own
mapping; codes it cannot convert are left out) and ``release_date`` (a ``release_date`` or ``date`` entry, as
``YYYY-MM-DD``). A folder without a card, or a card without front matter, gives no fields.

    >>> card_fields(read_card("path/to/all-MiniLM-L6-v2"))
    {'license': 'apache-2.0', 'languages': ['eng-Latn']}
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

_FRONT_MATTER = re.compile(r"\A\ufeff?---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.DOTALL)


def front_matter(text: str) -> dict[str, Any]:
    """The YAML block between the opening ``---`` line and the next ``---`` line; ``{}`` without one, or when it
    is not a YAML mapping."""
    match = _FRONT_MATTER.match(text)
    if match is None:
        return {}
    import yaml

    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def read_card(folder: str | Path | None) -> dict[str, Any]:
    """The front matter of ``<folder>/README.md``; ``{}`` when ``folder`` is not a folder or has no card."""
    if folder is None:
        return {}
    path = Path(folder) / "README.md"
    try:
        return front_matter(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return {}


def card_fields(card: dict[str, Any]) -> dict[str, Any]:
    """``license``, ``languages`` and ``release_date`` from a card's front matter, each only where the card gives a
    usable value."""
    out: dict[str, Any] = {}
    license_ = card.get("license")
    if isinstance(license_, str) and license_.strip() and license_.strip().lower() != "other":
        out["license"] = license_.strip().lower()
    languages = iso_languages(card.get("language"))
    if languages:
        out["languages"] = languages
    date = card.get("release_date", card.get("date"))
    if isinstance(date, datetime.datetime):
        date = date.date()
    if isinstance(date, datetime.date):
        out["release_date"] = date.isoformat()
    elif isinstance(date, str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.strip()):
        out["release_date"] = date.strip()
    return out


def iso_languages(codes: Any) -> list[str] | None:
    """Card language codes (``en``, ``["en", "de"]``) as mteb's ``<ISO 639-3>-<script>`` codes, sorted; ``None``
    when none converts (or mteb lacks its mapping)."""
    if isinstance(codes, str):
        codes = [codes]
    if not isinstance(codes, list):
        return None
    codes = [c for c in codes if isinstance(c, str) and c.strip()]
    if not codes:
        return None
    try:
        from mteb.languages.iso_mappings import _hf_langs_to_iso_lang_scripts
    except ImportError:
        return None
    return _hf_langs_to_iso_lang_scripts(codes)
