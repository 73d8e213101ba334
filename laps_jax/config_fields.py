"""Typed reads of a config.json object, one field at a time.

A config file is user input: a wrong type or range must come back as one line that names the
field and the file, not as a traceback from `int(None)` deep in model set-up or as a crash in
warm-up. Integers must be JSON integers (not 4.0, true or "4") and fit the int32 the
executables use; floats must be finite.
"""

from __future__ import annotations

import json
import math
from typing import Any

INT32_MAX = 2**31 - 1
_REQUIRED = object()


class ConfigError(ValueError):
    """A model directory or config.json that laps_jax cannot use."""


def parse_int(text: str) -> int:
    """json's parse_int: an integer too long for int() (over 4,300 digits) becomes one far out of
    every field's range, so the field check names it instead of json raising a bare error."""
    if len(text) <= 1000:
        return int(text)
    return -(10**1000) if text.startswith("-") else 10**1000


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def shown(value: Any) -> str:
    """A value as the message quotes it: short, one line, JSON's spelling of true/false/null."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int) and value.bit_length() > 128:  # repr refuses > 4300 digits
        return "an integer of over 38 digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Fields:
    """One JSON object read field by field; every error names the field and `where` (the file,
    plus the enclosing key for a nested object)."""

    def __init__(self, obj: Any, where: str, prefix: str = "") -> None:
        if not isinstance(obj, dict):
            what = f"{prefix.rstrip('.')} " if prefix else ""
            raise ConfigError(f"{where}: {what}must be a JSON object, got {json_type(obj)}")
        self.obj, self.where, self.prefix = obj, where, prefix

    def error(self, name: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.where}: {self.prefix}{name} {problem}")

    def present(self, name: str) -> bool:
        """True when the field is there and not null (HF writes null for 'unset')."""
        return self.obj.get(name) is not None

    def _get(self, name: str, default: Any) -> tuple[bool, Any]:
        """(found, value): found is False when the field is absent or null and has a default."""
        value = self.obj.get(name)
        if value is not None:
            return True, value
        if default is _REQUIRED:
            raise self.error(name, "is required" if name not in self.obj
                             else "is required (got null)")
        return False, default

    def integer(self, name: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        """An integer in [minimum, INT32_MAX]; `default` (returned as is) when absent or null."""
        found, value = self._get(name, default)
        if not found:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"must be an integer, got {json_type(value)} {shown(value)}")
        if not minimum <= value <= INT32_MAX:
            low = "positive" if minimum == 1 else f"at least {minimum}"
            raise self.error(name, f"must be {low} and at most {INT32_MAX}, got {shown(value)}")
        return value

    def number(self, name: str, default: Any = _REQUIRED, positive: bool = True) -> Any:
        """A finite number (an integer is fine), > 0 when `positive`; `default` when absent."""
        found, value = self._get(name, default)
        if not found:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(name, f"must be a number, got {json_type(value)} {shown(value)}")
        try:
            out = float(value)
        except OverflowError:  # a 400-digit integer
            out = math.inf
        if not math.isfinite(out) or (positive and not out > 0):
            raise self.error(name, f"must be a {'positive ' if positive else ''}finite number, "
                                   f"got {shown(value)}")
        return out

    def _of_type(self, name: str, default: Any, kind: type, what: str) -> Any:
        found, value = self._get(name, default)
        if found and not isinstance(value, kind):
            raise self.error(name, f"must be {what}, got {json_type(value)} {shown(value)}")
        return value

    def boolean(self, name: str, default: Any = _REQUIRED) -> Any:
        return self._of_type(name, default, bool, "true or false")

    def string(self, name: str, default: Any = _REQUIRED) -> Any:
        return self._of_type(name, default, str, "a string")

    def nested(self, name: str) -> "Fields | None":
        """The object under `name` (None when absent or null), its errors naming `name.key`."""
        if not self.present(name):
            return None
        return Fields(self.obj[name], self.where, f"{self.prefix}{name}.")
