"""A small offline text dataset for torchtitan: JSON lines with a "text" field, read into memory.

Registered in torchtitan's dataset table as ``cp_dtensor_tiny``; ``[training] dataset_path`` may
point at a ``.jsonl`` file or a folder of them (default: the repository's ``assets/tiny_text``).
Nothing is downloaded and nothing is written to the Hugging Face cache.
"""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

__all__ = ["DATASET_NAME", "register_dataset"]

DATASET_NAME = "cp_dtensor_tiny"
_DEFAULT_PATH = Path(__file__).resolve().parents[3] / "assets" / "tiny_text"  # the repository's assets/


def _load_jsonl(path: str) -> Dataset:
    p = Path(path)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(
            f"{DATASET_NAME}: no .jsonl file at {p}. Set [training] dataset_path to a .jsonl file or a folder "
            "of them (regenerate the default with `python assets/build_assets.py`)."
        )
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    return Dataset.from_list(rows)


def register_dataset() -> None:
    DATASETS.setdefault(
        DATASET_NAME,
        DatasetConfig(path=str(_DEFAULT_PATH), loader=_load_jsonl, sample_processor=lambda sample: sample["text"]),
    )
