"""Reading a model folder without trusting it (doctor's inputs).

Every reader returns a value or raises :class:`Problem`, whose message names the file (and the
field) and says what is wrong in the user's terms. Nothing reads more than a file holds: a
safetensors header length is checked against the file's size before it is read, and a JSON file
is refused above a size no config file reaches. No OSError, UnicodeError or JSON error escapes.
torch-free, so doctor stays fast.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 64 << 20  # tokenizer.json of a 250k vocabulary is ~20 MB; configs are KBs
MAX_HEADER_BYTES = 100 << 20  # the safetensors library refuses larger headers too
# safetensors dtype -> bytes per element (the format's own list)
SAFETENSORS_DTYPES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


# safetensors dtype -> the name tensor_storage gives it (str(torch dtype), as exllamav3 writes it)
TORCH_DTYPE_NAMES = {
    "BOOL": "torch.bool",
    "U8": "torch.uint8",
    "I8": "torch.int8",
    "F8_E5M2": "torch.float8_e5m2",
    "F8_E4M3": "torch.float8_e4m3fn",
    "I16": "torch.int16",
    "U16": "torch.uint16",
    "F16": "torch.float16",
    "BF16": "torch.bfloat16",
    "I32": "torch.int32",
    "U32": "torch.uint32",
    "F32": "torch.float32",
    "I64": "torch.int64",
    "U64": "torch.uint64",
    "F64": "torch.float64",
}


class Problem(Exception):
    """What is wrong with one input, in a sentence that names it."""


def _kind(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def describe(value: Any) -> str:
    """``5 (an integer)``, ``"x" (a string)``: how a wrong value is shown."""
    shown = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else _kind(value)
    return shown if shown == _kind(value) else f"{shown[:40]} ({_kind(value)})"


def _readable(path: Path, name: str) -> os.stat_result:
    """stat() of a regular file, or a Problem naming why it is not one."""
    try:
        st = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise Problem(f"{name} is a link to {os.readlink(path)}, which does not exist") from None
        raise Problem(f"{name} does not exist") from None
    except OSError as exc:  # a symlink loop, a permission problem on the way
        raise Problem(f"{name} cannot be opened: {exc.strerror or exc}") from None
    if path.is_dir():
        raise Problem(f"{name} is a folder, not a file")
    return st


def read_json(path: Path, name: str | None = None) -> Any:
    name = name or path.name
    st = _readable(path, name)
    if st.st_size > MAX_JSON_BYTES:
        raise Problem(f"{name} is {st.st_size:,} bytes, more than any JSON file of a model folder holds")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise Problem(f"{name} cannot be read: {exc.strerror or exc}") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise Problem(f"{name} is not UTF-8 text (byte {exc.start}): is it the right file?") from None
    except json.JSONDecodeError as exc:
        raise Problem(f"{name} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise Problem(f"{name} nests too deeply to be a config file") from None


def read_json_object(path: Path, name: str | None = None) -> dict:
    value = read_json(path, name)
    if not isinstance(value, dict):
        raise Problem(f"{name or path.name} holds {_kind(value)}, not a JSON object")
    return value


@dataclass
class Tensor:
    dtype: str
    shape: list[int]
    bytes: int
    file: str


def read_safetensors_header(path: Path) -> dict[str, Tensor]:
    """The tensors a safetensors file declares, checked against its size: a truncated or corrupt
    header, or a tensor whose data lies past the end of the file, is a Problem naming it."""
    name = path.name
    size = _readable(path, name).st_size
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise Problem(
                    f"{name} is {size} bytes: truncated (a safetensors file starts with an 8-byte header length)"
                )
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise Problem(
                    f"{name}: its header claims {length:,} bytes but the file holds {size - 8:,} after the length "
                    "field: truncated, or not a safetensors file"
                )
            if length > MAX_HEADER_BYTES:
                raise Problem(
                    f"{name}: a {length:,}-byte header is more than safetensors allows ({MAX_HEADER_BYTES:,})"
                )
            raw = f.read(length)
    except OSError as exc:
        raise Problem(f"{name} cannot be read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise Problem(f"{name}: the header is not valid JSON (corrupt or not a safetensors file)") from None
    if not isinstance(header, dict):
        raise Problem(f"{name}: the header holds {_kind(header)}, not an object of tensors")
    data = size - 8 - length
    tensors, bad = {}, []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        problem = _tensor_problem(info, data)
        if problem:
            bad.append(f"{key} {problem}")
            continue
        start, end = info["data_offsets"]
        tensors[key] = Tensor(info["dtype"], list(info["shape"]), end - start, name)
    if bad:
        past = sum("past the end" in b for b in bad)
        lead = (
            f"{past} of {len(header)} tensors lie past the end of the file (truncated at {size:,} bytes?); "
            if past
            else f"{len(bad)} tensor entries are invalid; "
        )
        raise Problem(f"{name}: {lead}first: {bad[0]}")
    return tensors


def _tensor_problem(info: Any, data: int) -> str | None:
    if not isinstance(info, dict):
        return f"is {_kind(info)}, not a tensor entry"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        return f"has dtype {describe(dtype)}, not a safetensors dtype"
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        return f"has shape {describe(shape)}, not a list of sizes"
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(is_int(o) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        return f"has data_offsets {describe(offsets)}, not [start, end]"
    if offsets[1] > data:
        return f"ends at byte {offsets[1]:,} of the data, past the end of the file ({data:,} bytes of data)"
    want = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
    if offsets[1] - offsets[0] != want:
        return f"holds {offsets[1] - offsets[0]:,} bytes, but {dtype} {shape} needs {want:,}"
    return None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Fields:
    """Typed reads from one JSON object, collecting what is missing or of the wrong type.

    ``where`` is how the problems name the object (``config.json text_config``)."""

    data: dict
    where: str
    problems: list[str] = field(default_factory=list)

    def _get(self, name: str, required: bool, hint: str):
        if name not in self.data or self.data[name] is None:
            if required:
                self.problems.append(f"{self.where}: {name} is missing{hint}")
            return None, False
        return self.data[name], True

    def positive_int(self, name: str, required: bool = True, hint: str = "") -> int | None:
        value, present = self._get(name, required, hint)
        if present and not (is_int(value) and value > 0):
            self.problems.append(f"{self.where}: {name} is {describe(value)}, expected a positive integer{hint}")
            return None
        return value

    def number(self, name: str, required: bool = True, hint: str = "") -> float | None:
        value, present = self._get(name, required, hint)
        if present and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
            self.problems.append(f"{self.where}: {name} is {describe(value)}, expected a number{hint}")
            return None
        return value

    def string(self, name: str, required: bool = True, hint: str = "") -> str | None:
        value, present = self._get(name, required, hint)
        if present and not isinstance(value, str):
            self.problems.append(f"{self.where}: {name} is {describe(value)}, expected a string{hint}")
            return None
        return value

    def strings(self, name: str, required: bool = True, hint: str = "") -> list[str] | None:
        value, present = self._get(name, required, hint)
        if present and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            self.problems.append(f"{self.where}: {name} is {describe(value)}, expected a list of strings{hint}")
            return None
        return value

    def object(self, name: str, required: bool = False, hint: str = "") -> dict | None:
        value, present = self._get(name, required, hint)
        if present and not isinstance(value, dict):
            self.problems.append(f"{self.where}: {name} is {describe(value)}, expected an object{hint}")
            return None
        return value
