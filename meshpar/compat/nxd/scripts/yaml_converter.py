"""``neuronx_distributed.scripts.yaml_converter``: the few model sizes the checkpoint converter reads, taken from an
NxD Training (NxDT) YAML config and written as a JSON config."""

from __future__ import annotations

import json
from typing import Any


def load_yaml_file(file_path: str) -> Any:
    """The parsed YAML file, or ``None`` (with the reason printed) when it is missing or does not parse."""
    import yaml

    try:
        with open(file_path) as file:
            return yaml.safe_load(file)
    except FileNotFoundError:
        print(f"Error: File '{file_path}' not found.")
    except yaml.YAMLError as error:
        print(f"Error parsing YAML file: {error}")
    return None


def convert_yaml_to_json(yaml_path: str, filename: str = "yaml_config.json") -> str:
    """Write ``filename`` with the layer count, head counts and hidden size of the YAML's ``model`` section (and the
    expert count of its ``moe`` section) under the names a HF config uses; returns ``filename``."""
    data = load_yaml_file(yaml_path)
    if data is None:
        raise ValueError(f"{yaml_path}: not a readable NxDT YAML config")
    model = data["model"]
    config = {
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_attention_heads"],
        "hidden_size": model["hidden_size"],
        "num_key_value_heads": model["num_kv_heads"],
    }
    if "moe" in model:
        config["num_local_experts"] = model["moe"]["num_experts"]
    with open(filename, "w") as file:
        json.dump(config, file)
    return filename
