"""``neuronx_distributed.utils.utils``: NxD's ``hardware`` and ``HloMetadataLevel`` enums and its JSON reader."""

from __future__ import annotations

import json
import os
from enum import Enum
from typing import Any


class hardware(Enum):  # noqa: N801 - NxD's name
    """Neuron platform generations (NxD reads them from the platform target; kept for code that names them)."""

    TRN1 = "trn1"
    TRN2 = "trn2"
    TRN3 = "trn3"
    CUSTOM = "custom"

    @classmethod
    def _missing_(cls, value: object) -> hardware | None:
        aliases = {"trn1": cls.TRN1, "trn1n": cls.TRN1, "inf2": cls.TRN1, "trn2": cls.TRN2, "trn3": cls.TRN3}
        if value in aliases:
            return aliases[value]
        if value is not None and value == os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE"):
            return cls.CUSTOM
        return None


class HloMetadataLevel(Enum):
    """How much metadata NxD's compiler output carries (``True`` reads as ``DEBUG``, ``False`` as ``INFO``)."""

    DEBUG = "debug"
    INFO = "info"
    NONE = "none"

    @classmethod
    def _missing_(cls, value: object) -> HloMetadataLevel | None:
        if value is True:
            return cls.DEBUG
        if value is False:
            return cls.INFO
        return None


def platform_hardware() -> hardware:
    """The Neuron generation whose layouts NxD's layers follow here: ``NEURON_PLATFORM_TARGET_OVERRIDE`` (the
    variable torch_neuronx reads, e.g. ``trn1`` to load a checkpoint trained on Trn1) when set, else Trn2, whose
    replicated key / value heads keep the dense model's grouping of query heads. An unknown value is refused."""
    value = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    if not value:
        return hardware.TRN2
    kind = hardware(value)
    if kind is hardware.CUSTOM:
        raise ValueError(f"NEURON_PLATFORM_TARGET_OVERRIDE={value!r}: expected trn1, trn1n, inf2, trn2 or trn3")
    return kind


def get_dict_from_json(json_file: str | os.PathLike) -> dict[Any, Any]:
    """The JSON file's contents; a missing or malformed file raises ``ValueError`` naming it."""
    try:
        with open(json_file, encoding="utf-8") as handle:
            return json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"Failed to parse JSON file '{json_file}': {error}") from error
    except FileNotFoundError as error:
        raise ValueError(f"JSON file not found at '{json_file}': {error}") from error


__all__ = ["HloMetadataLevel", "get_dict_from_json", "hardware"]
