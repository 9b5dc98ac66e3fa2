"""The `--registration FILE` of the `bsr` command: a JSON or YAML mapping, checked by one schema.

    {"chunk_tokens": 256,
     "tensors": [{"name": "k0", "dtype": "bfloat16", "entry_shape": [8, 128], "block_size": 64,
                  "token_ratio": 1, "group": 0, "sliding_window": null, "tail_tokens": null}, ...]}

Every field of every tensor is checked at once (strict types, ranges, unknown keys refused: one
error naming each bad key, e.g. `tensors.3.block_size`), then the registration's own rules
(groups numbered 0..G-1, tokens per block agreeing within a group, chunk and entry sizes) by
`Registration.from_dict`. The file is opened the filesystem tier's way (no symlink followed,
regular files only, never blocking) and read up to MAX_FILE_BYTES; a YAML file whose aliases expand
it past what any registration holds is refused (config_schema.load_yaml).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field

from bsr_kernels import Registration
from bsr_kernels.registration import (
    DEFAULT_CHUNK_TOKENS,
    MAX_BLOCK_SIZE,
    MAX_CHUNK_TOKENS,
    MAX_DIM,
    MAX_GROUPS,
    MAX_TENSORS,
    dtype_from_name,
)
from bsr_runtime.config_schema import Count, Name, Schema, load_yaml, one_line, problems
from bsr_runtime.tiers.fs_open import read_regular

MAX_FILE_BYTES = 64 << 20


def _dtype(name: str) -> str:
    # ValueError naming the known dtypes (all short): a longer name is quoted cut, never whole
    dtype_from_name(name if len(name) <= 32 else name[:32] + "...")
    return name


class TensorEntry(Schema):
    name: Name
    dtype: Annotated[str, AfterValidator(_dtype)]
    entry_shape: list[Annotated[int, Field(ge=1, le=MAX_DIM)]] = Field(min_length=1)
    block_size: Annotated[int, Field(ge=1, le=MAX_BLOCK_SIZE)]
    token_ratio: Annotated[int, Field(ge=1, le=MAX_CHUNK_TOKENS)] = 1
    group: Annotated[int, Field(ge=0, lt=MAX_GROUPS)] = 0
    sliding_window: Count | None = None
    tail_tokens: Count | None = None  # objects hold only each chunk's last tail_tokens tokens


class RegistrationFile(Schema):
    chunk_tokens: Annotated[int, Field(ge=1, le=MAX_CHUNK_TOKENS)] = DEFAULT_CHUNK_TOKENS
    tensors: list[TensorEntry] = Field(min_length=1, max_length=MAX_TENSORS)


class RegistrationFileError(ValueError):
    """A registration file that cannot be read, parsed or checked (one line)."""


def load_registration_file(path: str) -> Registration:
    """The registration in the JSON or YAML file `path` (.yaml/.yml: YAML); RegistrationFileError otherwise."""
    p = Path(path)
    try:
        text = read_regular(p, MAX_FILE_BYTES).decode("utf-8")
        if p.suffix in (".yaml", ".yml"):
            data = load_yaml(text)  # aliases that expand it past any registration's size are refused
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any read or parse error is the user's file
        raise RegistrationFileError(one_line(f"cannot parse registration file {path}: {e}")) from None
    bad = problems(RegistrationFile, data)
    if bad:
        many = f"{len(bad)} bad keys: " if len(bad) > 1 else ""
        raise RegistrationFileError(one_line(f"registration file {path}: {many}{'; '.join(bad)}"))
    try:
        return Registration.from_dict(data, name=p.stem)
    except (KeyError, TypeError, ValueError) as e:
        raise RegistrationFileError(one_line(f"registration file {path}: {e}")) from None
