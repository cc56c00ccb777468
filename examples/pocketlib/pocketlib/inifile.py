"""A strict INI parser: sections, key = value pairs, comments, and typed getters."""

from __future__ import annotations


class IniError(ValueError):
    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}")
        self.line = line


class IniFile:
    def __init__(self, sections: dict[str, dict[str, str]]):
        self.sections = sections

    def get(self, section: str, key: str, default: str | None = None) -> str | None:
        return self.sections.get(section, {}).get(key, default)

    def get_int(self, section: str, key: str, default: int | None = None) -> int | None:
        value = self.get(section, key)
        return default if value is None else int(value)

    def get_bool(self, section: str, key: str, default: bool | None = None) -> bool | None:
        value = self.get(section, key)
        if value is None:
            return default
        lowered = value.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"[{section}] {key} = {value!r} is not a boolean")

    def get_list(self, section: str, key: str) -> list[str]:
        value = self.get(section, key)
        return [] if value is None else [item.strip() for item in value.split(",") if item.strip()]


def parse_ini(text: str) -> IniFile:
    """Parse INI text. Keys before any section header go to the section ''."""
    sections: dict[str, dict[str, str]] = {"": {}}
    current = ""
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise IniError(number, f"malformed section header {line!r}")
            current = line[1:-1].strip()
            if sections.get(current):
                raise IniError(number, f"duplicate section [{current}]")
            sections.setdefault(current, {})
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise IniError(number, f"expected 'key = value', got {line!r}")
        key = key.strip()
        if not key:
            raise IniError(number, "empty key")
        if key in sections[current]:
            raise IniError(number, f"duplicate key {key!r} in [{current}]")
        sections[current][key] = value.strip()
    return IniFile(sections)
