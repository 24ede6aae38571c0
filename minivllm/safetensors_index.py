"""Find a checkpoint's safetensors files and the tensor names in them, without loading weights."""
import json
from pathlib import Path

from safetensors import safe_open


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint folder: those the shard index names, else every *.safetensors."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({path / name for name in weight_map.values()})
    return sorted(path.glob("*.safetensors"))


def tensor_names(path: str | Path) -> set[str]:
    names: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names
